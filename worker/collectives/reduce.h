// Element-wise reductions, as Gloo calls them and as the local ranks of a
// group combine their blocks: out[i] = a[i] op b[i] for n elements; `out`
// may alias `a`. One function per (dtype, op), so every dtype reduces with
// the same code in memory and across workers (and so gives the same bits).
//
// Integer sums and products wrap (two's complement), as in the kernels;
// floating max and min propagate NaN; pred's sum and max are a logical or,
// its prod and min a logical and; f16 and bf16 compute in float and round
// back to nearest even.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tessel/v1/ir.pb.h"
#include "worker/communicator.h"

namespace tessel::worker {

using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t n);

// The reduction of `dtype` under `op`, or null when there is none (a dtype
// without arithmetic).
ReduceFn GetReduceFn(v1::DType dtype, ReduceOp op);

// Gloo's typed option setters only use sizeof(T): an unsigned type of the
// element's size stands for any dtype. Calls f(T{}) for that type.
template <typename F>
void WithElementType(int element_size, F&& f) {
  switch (element_size) {
    case 1: f(uint8_t{}); break;
    case 2: f(uint16_t{}); break;
    case 4: f(uint32_t{}); break;
    case 8: f(uint64_t{}); break;
  }
}

}  // namespace tessel::worker
