// dot_general on the CPU: f32 and f64 through OpenBLAS (batched GEMM over a
// canonical [batch, M, K] x [batch, K, N] view, transposing only operands
// whose layout GEMM cannot read directly); other dtypes by a plain loop
// (f16/bf16 accumulate in f32, integers wrap). Stateless; any thread.
#pragma once

#include <cstdint>
#include <vector>

#include "tessel/v1/ir.pb.h"

namespace tessel::cpu {

// An operand of dot_general seen as [batch, rows, cols] after permuting its
// dimensions (also how the CUDA backend plans its GEMMs).
struct DotOperandLayout {
  std::vector<int64_t> perm;  // batch dims, then row dims, then col dims
  int64_t batch = 1, rows = 1, cols = 1;
};
// lhs (free_first): rows = free dims, cols = contracting. rhs: rows = contracting, cols = free.
DotOperandLayout CanonicalizeDotOperand(const v1::TensorType& t,
                                        const google::protobuf::RepeatedField<int64_t>& batch,
                                        const google::protobuf::RepeatedField<int64_t>& contracting,
                                        bool free_first);
bool IsIdentityPermutation(const std::vector<int64_t>& p);
// Whether the operand is [batch, cols, rows] in memory: GEMM can read it
// transposed without a copy.
bool IsTransposedLayout(const DotOperandLayout& c, size_t nbatch, size_t nrow_dims);

// Threads each CPU device's kernels may use: its GEMMs (OpenBLAS's
// threads) and its large fused loops. A worker sets it once at start-up to
// its share of the cores, so that its devices running at once do not
// oversubscribe them (OpenBLAS's idle threads spin). Default: every core.
void SetKernelThreads(int n);
int KernelThreads();

void DotGeneral(const v1::TensorType& lhs_type, const void* lhs, const v1::TensorType& rhs_type,
                const void* rhs, const v1::DotGeneralAttrs& a, const v1::TensorType& out_type,
                void* out);

}  // namespace tessel::cpu
