// ScalarExpr: each elementwise op's scalar meaning, written once, as a C
// expression template per dtype class (float, signed or unsigned integer,
// pred). Both code generators read it: the CPU's native loops
// (cpu/native_loop.cc) and the CUDA kernel source (cuda/kernel_source.cc),
// which also builds as host C++. A ScalarDialect says how the generated code
// spells the compute types, the libm functions and the helpers
// (NaN-propagating max and min, XLA's integer power), which each prelude
// defines. The interpreted CPU kernels (cpu/elementwise.cc) stay the
// independent reference: scalar_expr_test.cc compiles every row for every
// dtype and compares it with them.
//
// The semantics are XLA's: integer arithmetic wraps (computed unsigned),
// x / 0 is -1 and x % 0 is x for integers, MIN / -1 wraps, float max and min
// propagate NaN, sign(NaN) is NaN.
//
// Thread-safety: stateless; the table is constant.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::worker {

struct ScalarDialect {
  // The C type a value of `dt` is computed in ("float", "i32", "int32_t").
  std::function<std::string(v1::DType)> compute_type;
  // The unsigned type integer arithmetic of `dt` wraps in.
  std::function<std::string(v1::DType)> unsigned_type;
  // The libm function `name` ("exp", "fmod") for `dt` ("expf" for f32).
  std::function<std::string(v1::DType, absl::string_view name)> math;
  // The prelude's helper "max", "min" or "ipow" for `dt`.
  std::function<std::string(v1::DType, absl::string_view name)> helper;
};

enum class ScalarClass { kFloat, kSigned, kUnsigned, kPred };
ScalarClass ClassOf(v1::DType dt);

// One row: `op` on values of `cls` with `arity` operands is `pattern`, where
// $0..$2 are the operands, $T the compute type, $U the unsigned type,
// @name( a libm function and #name( a helper.
struct ScalarRule {
  v1::Op op;
  ScalarClass cls;
  int arity;
  const char* pattern;
};
// The C function a generated kernel calls for libm's `name` on values
// computed as `dt` (F32 or F64): "expf", "log", or, for exp, log and tanh
// in float, vector_math.inc's "tm_expf", "tm_logf", "tm_tanhf", which every
// backend shares.
std::string MathFunction(v1::DType dt, absl::string_view name);

// Every row, in table order.
absl::Span<const ScalarRule> ScalarRules();

// The expression of `op` over `args` (C expressions of dtype `dt`), or
// UNIMPLEMENTED naming the op and dtype when no row has it.
absl::StatusOr<std::string> ScalarExpr(v1::Op op, v1::DType dt, absl::Span<const std::string> args,
                                       const ScalarDialect& dialect);

}  // namespace tessel::worker
