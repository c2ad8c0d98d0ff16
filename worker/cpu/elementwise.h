// Elementwise CPU kernels over contiguous blocks of `n` elements. Operands
// and results are storage-typed arrays (pred is one byte, 0 or 1). Callers
// have validated op/dtype combinations; anything else leaves `out` alone.
// Stateless; any thread.
#pragma once

#include <cstdint>

#include "tessel/v1/ir.pb.h"

namespace tessel::cpu {

void UnaryKernel(v1::Op op, v1::DType dt, const void* in, void* out, int64_t n);
// The same kernels with the op and dtype resolved once, at build time: a
// fused loop calls these per block without switching on either. nullptr for
// an op outside the range (the caller keeps the switching form).
using UnaryFn = void (*)(const void* in, void* out, int64_t n);
using BinaryFn = void (*)(const void* a, const void* b, void* out, int64_t n);
UnaryFn UnaryKernelFor(v1::Op op, v1::DType dt);
BinaryFn BinaryKernelFor(v1::Op op, v1::DType dt);
BinaryFn CompareKernelFor(v1::CompareDirection dir, v1::DType dt);

void BinaryKernel(v1::Op op, v1::DType dt, const void* a, const void* b, void* out, int64_t n);
void CompareKernel(v1::CompareDirection dir, v1::DType dt, const void* a, const void* b, void* out,
                   int64_t n);
void SelectKernel(v1::DType dt, const void* pred, const void* a, const void* b, void* out,
                  int64_t n);
void ClampKernel(v1::DType dt, const void* lo, const void* x, const void* hi, void* out, int64_t n);
void ConvertKernel(v1::DType from, v1::DType to, const void* in, void* out, int64_t n);

// Writes `n` copies of `value` (given as f64 or s64) in dtype `dt`.
void FillKernel(v1::DType dt, const v1::Fill& value, void* out, int64_t n);
// Elements [start, start+n) of an iota over `dims` along `dimension`.
void IotaKernel(v1::DType dt, const google::protobuf::RepeatedField<int64_t>& dims,
                int64_t dimension, int64_t start, void* out, int64_t n);
// Writes `n` copies of the one element at `src` (element size `esize`).
void SplatKernel(int esize, const void* src, void* out, int64_t n);

}  // namespace tessel::cpu
