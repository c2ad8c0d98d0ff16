// CudaExecutable: a Program prepared for a CudaDevice. Load generates one
// CUDA C++ module for all of the program's kernels (fusions, layout ops,
// reductions, ...), compiles it with NVRTC (cached), loads it, and plans
// every dot_general as a cuBLASLt matmul (f32, f64, and f16/bf16 with f32
// accumulation; batch dimensions as strided batches; operands transposed
// by a kernel only when cuBLASLt cannot read their layout). Integer dots run
// as generated kernels. Literal constants are copied to the device once.
//
// Run queues every step on the device's stream and returns; nothing in the
// step loop allocates outside the caching allocator or touches the host.
// One Run at a time per instance.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <optional>
#include <vector>

#include "worker/cuda/cuda_device.h"
#include "worker/cuda/kernel_source.h"
#include "worker/slot_program.h"

namespace tessel::cuda {

class CudaExecutable final : public worker::Executable {
 public:
  static absl::StatusOr<std::unique_ptr<worker::Executable>> Load(const v1::Program& program,
                                                                  CudaDevice* device);
  ~CudaExecutable() override;
  absl::StatusOr<std::vector<worker::BufferPtr>> Run(absl::Span<const worker::BufferPtr> args,
                                                     absl::Span<const worker::BufferPtr> into,
                                                     const worker::StepContext& ctx) override;

 private:
  // A dot_general: optional operand transposes, then one (batched) GEMM.
  struct DotPlan {
    std::optional<KernelLaunch> lhs_transpose, rhs_transpose;
    int64_t lhs_bytes = 0, rhs_bytes = 0;  // of the transposed copies
    int64_t batch = 0, m = 0, n = 0, k = 0;
    std::optional<KernelLaunch> gemm_kernel;  // integer dtypes
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool f64 = false;
  };
  // A collective over several devices: rank-major copies around the NCCL
  // call where the collective's dimension is not the leading one.
  struct CollectivePlan {
    std::optional<KernelLaunch> before, after;
    int64_t staged_bytes = 0;  // of each rank-major copy
  };
  struct Prepared {
    std::vector<KernelLaunch>
        kernels;  // fusion / layout / arg reduce / shard slice / axis index: one
    std::optional<ReducePlan> reduce;
    std::unique_ptr<DotPlan> dot;
    std::optional<CollectivePlan> collective;
    std::unique_ptr<v1::Fusion> constant;  // fill / iota as a one-node fusion
    worker::BufferPtr literal;
  };

  CudaExecutable(worker::SlotProgram slots, CudaDevice* device)
      : slots_(std::move(slots)), device_(device) {}
  absl::Status Prepare();
  absl::Status PlanDot(const worker::SlotProgram::Instr& in, ModuleSource& module, Prepared& prep);
  absl::Status Execute(int i, std::vector<worker::BufferPtr>& values,
                       const std::vector<worker::BufferPtr>& preset,
                       const worker::StepContext& ctx);
  absl::Status Launch(const KernelLaunch& l, const KernelParams& params);
  absl::Status RunDot(const DotPlan& d, const void* lhs, const void* rhs, void* out);
  static std::optional<CollectivePlan> PlanCollective(const v1::Node& n,
                                                      const v1::TensorType& in_type, int64_t k,
                                                      ModuleSource& module);
  absl::Status RunCollective(int i, const v1::Node& n, const v1::TensorType& in_type,
                             const void* in, void* out, const worker::StepContext& ctx);

  worker::SlotProgram slots_;
  CudaDevice* device_;
  std::vector<Prepared> prepared_;
  cudaLibrary_t library_ = nullptr;
  std::vector<cudaKernel_t> kernels_;  // by index in the module
  cublasLtHandle_t blas_ = nullptr;
  worker::BufferPtr workspace_;
};

}  // namespace tessel::cuda
