// CudaDevice: one NVIDIA GPU behind the Device seam.
//
// Everything a device does runs on its one stream: kernel launches, cuBLASLt
// calls, and the copies of Put and Fetch. Stream order is what makes the
// caching allocator safe: a block freed while kernels still use it is handed
// out again only to work queued after them. Run returns once its work is
// queued; a copy to or from the host returns once the copy (and so every
// kernel queued before it) is done.
//
// Memory: a CachingAllocator over cudaMalloc, so a steady-state step loop
// never calls cudaMalloc or cudaFree; its stats are the device's memory
// stats. Out of device memory is RESOURCE_EXHAUSTED naming the device.
// Host copies are staged through pinned buffers, double-buffered so that
// the host-side memcpy of one chunk overlaps the DMA of the previous one.
//
// Thread-safe as the Device seam requires.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/caching_allocator.h"
#include "worker/cuda/kernel_compiler.h"
#include "worker/cuda/nccl_communicator.h"
#include "worker/device.h"

namespace tessel::cuda {

// How many GPUs the CUDA runtime sees. With none (no driver, no GPU),
// `reason` says why in the runtime's words.
struct CudaProbe {
  int count = 0;
  std::string reason;
};
CudaProbe ProbeCuda();

// "CUDA error 2 (out of memory) in cudaMalloc": OK for cudaSuccess.
absl::Status CudaStatus(cudaError_t e, const char* what);

class CudaDevice final : public worker::Device {
 public:
  struct Options {
    int local_index = 0;             // the device's index within its worker
    int ordinal = 0;                 // CUDA device ordinal
    int64_t memory_limit_bytes = 0;  // Default: 0, 90% of the memory free at start
    std::string kernel_cache_dir;    // NVRTC code cache on disk; empty: memory only
    // The worker's NCCL communicators, shared by its CUDA devices. Default:
    // none (a collective over several devices fails, saying so).
    std::shared_ptr<NcclGroups> nccl;
  };
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Create(const Options& options);
  ~CudaDevice() override;

  std::string kind() const override { return "cuda"; }
  int local_index() const override { return options_.local_index; }
  absl::StatusOr<worker::BufferPtr> Allocate(int64_t bytes) override;
  absl::Status CopyFromHost(worker::Buffer& dst, int64_t offset, const void* src,
                            int64_t n) override;
  absl::Status CopyToHost(const worker::Buffer& src, int64_t offset, void* dst, int64_t n) override;
  absl::Status CopyWithin(const worker::Buffer& src, int64_t src_offset, worker::Buffer& dst,
                          int64_t dst_offset, int64_t n) override;
  absl::StatusOr<std::unique_ptr<worker::Executable>> Load(const v1::Program& program) override;
  worker::MemoryStats memory_stats() const override { return allocator_->stats(); }
  bool asynchronous() const override { return true; }
  // An event recorded on the stream; the wait blocks (without spinning)
  // until it has passed, then runs the checks added since the last Fence.
  std::function<absl::Status()> Fence() override;
  // A verdict on work queued so far (an NCCL call's), taken by the next
  // Fence and run once the stream has passed it. Called on the step's thread.
  void AddFenceCheck(std::function<absl::Status()> check);

  // For executables: the stream, the compiler, the device's properties.
  cudaStream_t stream() const { return stream_; }
  KernelCompiler& compiler() { return *compiler_; }
  int ordinal() const { return options_.ordinal; }
  int multiprocessors() const { return multiprocessors_; }
  const std::string& arch() const { return arch_; }
  // The GPU as NCCL sees it: ordinal, stream and UUID.
  NcclDevice nccl_device() const { return {options_.ordinal, stream_, uuid_}; }
  NcclGroups* nccl() const { return options_.nccl.get(); }
  // Makes this device current on the calling thread.
  absl::Status Activate() const;
  // Waits for everything queued on the stream; the first asynchronous error, if any.
  absl::Status Synchronize() const;

 private:
  explicit CudaDevice(const Options& options) : options_(options) {}
  absl::Status Copy(void* device_ptr, const void* host_src, void* host_dst, int64_t n);

  const Options options_;
  std::string arch_;
  int multiprocessors_ = 0;
  std::array<uint8_t, 16> uuid_{};
  absl::Mutex checks_mu_;
  std::vector<std::function<absl::Status()>> checks_ ABSL_GUARDED_BY(checks_mu_);
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<KernelCompiler> compiler_;
  std::shared_ptr<worker::CachingAllocator> allocator_;
  // Pinned staging for host copies: two chunks, used in turn.
  static constexpr int64_t kStagingChunk = int64_t{8} << 20;
  absl::Mutex staging_mu_;
  void* staging_[2] = {nullptr, nullptr};
  cudaEvent_t staged_[2] = {nullptr, nullptr};
};

}  // namespace tessel::cuda
