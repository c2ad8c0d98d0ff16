// Kernel source generation for the CUDA backend: each op (or fusion) of a
// program becomes a CUDA C++ kernel specialized to its shapes and dtypes,
// and the kernels of one program are gathered into one module that NVRTC
// compiles once (see KernelCompiler).
//
// The kernels compute exactly what the CPU backend computes: the same
// compute type per dtype (f16/bf16 in float, rounded back after every op),
// the same conversions (one rounding to f16/bf16 from wide sources,
// saturating float->int), NaN-propagating max/min, XLA's integer division
// and power. Their source is also valid host C++: compiled with a host
// compiler, each kernel runs its whole grid-stride loop on the calling
// thread. That is how the generated code is checked against the CPU kernels
// on machines without a GPU.
//
// Calling convention: every kernel takes one KernelParams by value: the
// device addresses of its buffers (inputs first, then outputs, then
// scratch) and runtime scalars. Each kernel is a grid-stride loop over
// `elements` work items; any grid shape is correct.
//
// Pure functions of their arguments; no CUDA dependency; any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tessel/v1/program.pb.h"

namespace tessel::cuda {

inline constexpr int kMaxKernelPointers = 64;
inline constexpr int kMaxKernelScalars = 4;

// Mirrors the `TesselParams` struct of the generated source.
struct KernelParams {
  void* p[kMaxKernelPointers] = {};
  int64_t s[kMaxKernelScalars] = {};
};

// One kernel launch of an op: which kernel, over how many work items, and
// which of the op's buffers go where in KernelParams.
struct KernelLaunch {
  std::string kernel;    // entry point in the module: KernelName(index)
  int index = 0;         // the kernel's position in the module
  int64_t elements = 0;  // work items of the grid-stride loop (0: nothing to launch)
};
// Entry point of a module's kernel `index`: "k<index>".
std::string KernelName(int index);

// A reduction runs as passes: the first reads the input and writes
// `partial_elements[0]` accumulators (or the output, if it is the only
// pass); each further pass reduces the previous accumulators; the last
// writes the output. Pass k reads p[0] and writes p[1].
struct ReducePlan {
  std::vector<KernelLaunch> passes;
  std::vector<int64_t> partial_elements;  // per pass but the last: accumulators written
  int accumulator_bytes = 0;              // size of one accumulator
};

// Gathers the kernels of one program; identical kernels are emitted once.
class ModuleSource {
 public:
  // Fused elementwise chain (the nodes of fusion.nodes(): elementwise ops,
  // fill and iota constants, broadcasts of one-element values).
  // p[0..inputs) = fusion.inputs() (one-element inputs are splatted),
  // p[inputs..) = fusion.outputs(). s[0]: value offset of iotas (0 unless
  // the iota is split over the mesh).
  absl::StatusOr<KernelLaunch> AddFusion(const v1::Fusion& fusion,
                                         const std::vector<v1::TensorType>& input_types);
  // BROADCAST_IN_DIM, TRANSPOSE, SLICE, REVERSE, CONCATENATE, PAD: p[0..operands) the
  // operands (PAD: operand, padding value), p[operands] the result.
  absl::StatusOr<KernelLaunch> AddLayout(const v1::Node& node,
                                         const std::vector<v1::TensorType>& operand_types);
  // REDUCE: see ReducePlan.
  absl::StatusOr<ReducePlan> AddReduce(const v1::Node& node, const v1::TensorType& operand_type);
  // ARGMAX / ARGMIN: p[0] operand, p[1] indices.
  absl::StatusOr<KernelLaunch> AddArgReduce(const v1::Node& node,
                                            const v1::TensorType& operand_type);
  // SORT: p[0] the keys, p[1] the operand moved (result_operand; p[0]
  // again when it is the keys), p[2] the result. One thread per element
  // counts the keys ahead of it: quadratic in the sorted extent.
  absl::StatusOr<KernelLaunch> AddSort(const v1::Node& node, const v1::TensorType& keys,
                                       const v1::TensorType& moved);
  // GATHER: p[0] operand, p[1] indices, p[2] the result.
  absl::StatusOr<KernelLaunch> AddGather(const v1::Node& node, const v1::TensorType& operand,
                                         const v1::TensorType& indices);
  // SCATTER: p[0] operand, p[1] indices, p[2] updates, p[3] the result.
  // One thread per result element scans every index: linear in the number
  // of indices per element.
  absl::StatusOr<KernelLaunch> AddScatter(const v1::Node& node, const v1::TensorType& operand,
                                          const v1::TensorType& indices);
  // CONVOLUTION: p[0] lhs, p[1] rhs, p[2] the result. One thread per
  // result element walks its window and input features in the CPU's
  // direct loop's order (f16/bf16 accumulate in float, integers wrap); a
  // direct convolution, not cuDNN's.
  absl::StatusOr<KernelLaunch> AddConvolution(const v1::Node& node, const v1::TensorType& lhs,
                                              const v1::TensorType& rhs);
  // SHARD_SLICE: p[0] operand, p[1] this device's block; s[0] the block index.
  absl::StatusOr<KernelLaunch> AddShardSlice(const v1::Node& node,
                                             const v1::TensorType& operand_type, int64_t blocks);
  // [outer, k, piece] <-> [k, outer, piece] for collectives whose dimension
  // is not the leading one: p[0] in, p[1] out; piece counted in elements.
  KernelLaunch AddSwapMajor(v1::DType dtype, int64_t outer, int64_t k, int64_t piece,
                            bool to_rank_major);
  // Batched [batch, m, k] x [batch, k, n] for dtypes cuBLASLt does not
  // multiply (integers wrap, as on the CPU): p[0] lhs, p[1] rhs, p[2] out.
  KernelLaunch AddGemm(v1::DType dtype, int64_t batch, int64_t m, int64_t n, int64_t k);
  // One s32 from s[0] (axis_index): p[0] the result.
  KernelLaunch AddScalarS32();

  // The whole module: prelude and every kernel added.
  std::string source() const;
  int num_kernels() const { return int(bodies_.size()); }

 private:
  KernelLaunch Add(const std::string& body, int64_t elements);
  std::vector<std::string> bodies_;  // kernel i's body, its entry point KernelName(i)
};

// The shared definitions every module starts with (types, f16/bf16
// conversions, NaN-aware max/min, the grid-stride loop).
const std::string& KernelPrelude();

}  // namespace tessel::cuda
