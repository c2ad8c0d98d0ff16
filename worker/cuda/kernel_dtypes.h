// How generated CUDA C spells each dtype: storage and compute types, loads
// and stores of halves, rounding, conversions with C++'s saturation, and
// literals. Used by the kernel source generator (kernel_source.cc).
#pragma once

#include <string>
#include <utility>

#include "tessel/v1/ir.pb.h"

namespace tessel::cuda {

bool IsHalf(v1::DType dt);

// The C name of an integer dtype.
std::string IntName(v1::DType dt);
std::string Storage(v1::DType dt);
std::string Compute(v1::DType dt);

// The unsigned type integer arithmetic on `dt` wraps in: at least 32 bits,
// since narrower unsigned operands are promoted to int and could overflow.
std::string UnsignedOf(v1::DType dt);

// Raw bytes of one element, for data movement.
std::string Bits(int esize);
std::string HalfName(v1::DType dt);
std::string Load(v1::DType dt, const std::string& e);
std::string Store(v1::DType dt, const std::string& e);

// A computed value as its storage would hold it (f16/bf16 round after every op).
std::string Round(v1::DType dt, const std::string& e);

// A float math function for the compute type: expf for float, exp for double.
std::string Fn(v1::DType dt, const std::string& name);

// The lowest and highest value of an integer dtype, as literals.
std::pair<std::string, std::string> IntRange(v1::DType dt);

// A compute value of `from` as a compute value of `to`, rounding as the CPU backend does.
std::string Convert(v1::DType from, v1::DType to, const std::string& e);

// A compute value of `from` with its storage bits read as `to`, as wide.
std::string Bitcast(v1::DType from, v1::DType to, const std::string& e);

// One element of storage bytes as a compute-typed literal.
std::string Literal(v1::DType dt, const void* bytes);

}  // namespace tessel::cuda
