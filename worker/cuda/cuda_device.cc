#include "worker/cuda/cuda_device.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "worker/cuda/cuda_executable.h"

namespace tessel::cuda {
namespace {

using absl::StrCat;

// Device memory for the caching allocator.
class CudaMemory final : public worker::MemorySource {
 public:
  explicit CudaMemory(int ordinal) : ordinal_(ordinal) {}
  void* Map(int64_t size) override {
    void* p = nullptr;
    if (cudaSetDevice(ordinal_) != cudaSuccess || cudaMalloc(&p, size) != cudaSuccess) {
      cudaGetLastError();  // out of memory is not sticky: clear it
      return nullptr;
    }
    return p;
  }
  void Unmap(void* p, int64_t size) override {
    cudaSetDevice(ordinal_);
    cudaFree(p);
  }

 private:
  const int ordinal_;
};

}  // namespace

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = StrCat("CUDA error ", int(e), " (", cudaGetErrorString(e), ") in ", what);
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

CudaProbe ProbeCuda() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return {0, StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e))};
  }
  if (n == 0) return {0, "the CUDA runtime reports no devices"};
  return {n, ""};
}

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Create(const Options& options) {
  auto d = std::unique_ptr<CudaDevice>(new CudaDevice(options));
  const std::string name = StrCat("cuda:", options.local_index);
  TESSEL_RETURN_IF_ERROR(d->Activate());
  int major = 0, minor = 0;
  TESSEL_RETURN_IF_ERROR(
      CudaStatus(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, options.ordinal),
                 "cudaDeviceGetAttribute"));
  TESSEL_RETURN_IF_ERROR(
      CudaStatus(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, options.ordinal),
                 "cudaDeviceGetAttribute"));
  TESSEL_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&d->multiprocessors_, cudaDevAttrMultiProcessorCount, options.ordinal),
      "cudaDeviceGetAttribute"));
  d->arch_ = StrCat("sm_", major, minor);
  cudaDeviceProp prop{};
  TESSEL_RETURN_IF_ERROR(
      CudaStatus(cudaGetDeviceProperties(&prop, options.ordinal), "cudaGetDeviceProperties"));
  std::memcpy(d->uuid_.data(), prop.uuid.bytes, d->uuid_.size());
  TESSEL_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&d->stream_, cudaStreamNonBlocking),
                                    "cudaStreamCreate"));
  int64_t limit = options.memory_limit_bytes;
  if (limit <= 0) {
    size_t free = 0, total = 0;
    TESSEL_RETURN_IF_ERROR(CudaStatus(cudaMemGetInfo(&free, &total), "cudaMemGetInfo"));
    limit = int64_t(free) / 10 * 9;
  }
  d->allocator_ = std::make_shared<worker::CachingAllocator>(
      worker::CachingAllocator::Options{name, limit, /*max_cached_bytes=*/limit,
                                        /*trace_device=*/options.local_index},
      std::make_unique<CudaMemory>(options.ordinal));
  d->compiler_ =
      std::make_unique<KernelCompiler>(KernelCompiler::Options{d->arch_, options.kernel_cache_dir});
  for (int i = 0; i < 2; ++i) {
    TESSEL_RETURN_IF_ERROR(
        CudaStatus(cudaHostAlloc(&d->staging_[i], kStagingChunk, cudaHostAllocDefault),
                   "cudaHostAlloc (staging)"));
    TESSEL_RETURN_IF_ERROR(CudaStatus(
        cudaEventCreateWithFlags(&d->staged_[i], cudaEventDisableTiming), "cudaEventCreate"));
  }
  return d;
}

CudaDevice::~CudaDevice() {
  if (Activate().ok()) {
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (int i = 0; i < 2; ++i) {
      if (staging_[i] != nullptr) cudaFreeHost(staging_[i]);
      if (staged_[i] != nullptr) cudaEventDestroy(staged_[i]);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
}

absl::Status CudaDevice::Activate() const {
  return CudaStatus(cudaSetDevice(options_.ordinal), "cudaSetDevice");
}

std::function<absl::Status()> CudaDevice::Fence() {
  cudaEvent_t e = nullptr;
  absl::Status s = Activate();
  if (s.ok()) {
    s = CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync),
                   "cudaEventCreate");
  }
  if (s.ok()) {
    s = CudaStatus(cudaEventRecord(e, stream_), "cudaEventRecord");
    if (!s.ok()) cudaEventDestroy(e);
  }
  std::vector<std::function<absl::Status()>> checks;
  {
    absl::MutexLock l(&checks_mu_);
    checks.swap(checks_);
  }
  if (!s.ok()) return [s] { return s; };
  return [this, e, checks = std::move(checks)] {
    absl::Status done = Activate();
    if (done.ok()) done = CudaStatus(cudaEventSynchronize(e), "cudaEventSynchronize");
    cudaEventDestroy(e);
    for (const auto& check : checks) {
      if (!done.ok()) break;
      done = check();
    }
    return done;
  };
}

void CudaDevice::AddFenceCheck(std::function<absl::Status()> check) {
  absl::MutexLock l(&checks_mu_);
  checks_.push_back(std::move(check));
}

absl::Status CudaDevice::Synchronize() const {
  TESSEL_RETURN_IF_ERROR(Activate());
  return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

absl::StatusOr<worker::BufferPtr> CudaDevice::Allocate(int64_t bytes) {
  return worker::AllocateBuffer(allocator_, bytes);
}

absl::Status CudaDevice::Copy(void* dev, const void* host_src, void* host_dst, int64_t n) {
  TESSEL_RETURN_IF_ERROR(Activate());
  absl::MutexLock l(&staging_mu_);
  const bool to_device = host_src != nullptr;
  const int64_t chunks = (n + kStagingChunk - 1) / kStagingChunk;
  auto chunk_len = [&](int64_t k) { return std::min(kStagingChunk, n - k * kStagingChunk); };
  char* d = static_cast<char*>(dev);
  for (int64_t k = 0; k < chunks; ++k) {
    const int b = int(k % 2);
    const int64_t off = k * kStagingChunk, len = chunk_len(k);
    // The staging chunk is free once its previous copy has finished.
    TESSEL_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(staged_[b]), "cudaEventSynchronize"));
    if (!to_device && k >= 2) {
      std::memcpy(static_cast<char*>(host_dst) + off - 2 * kStagingChunk, staging_[b],
                  chunk_len(k - 2));
    }
    if (to_device) {
      std::memcpy(staging_[b], static_cast<const char*>(host_src) + off, len);
      TESSEL_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(d + off, staging_[b], len, cudaMemcpyHostToDevice, stream_),
                     "cudaMemcpyAsync (to device)"));
    } else {
      TESSEL_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(staging_[b], d + off, len, cudaMemcpyDeviceToHost, stream_),
                     "cudaMemcpyAsync (to host)"));
    }
    TESSEL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(staged_[b], stream_), "cudaEventRecord"));
  }
  // Drain: the last (up to two) chunks.
  for (int64_t k = std::max<int64_t>(0, chunks - 2); k < chunks; ++k) {
    const int b = int(k % 2);
    TESSEL_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(staged_[b]), "cudaEventSynchronize"));
    if (!to_device)
      std::memcpy(static_cast<char*>(host_dst) + k * kStagingChunk, staging_[b], chunk_len(k));
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::CopyFromHost(worker::Buffer& dst, int64_t offset, const void* src,
                                      int64_t n) {
  TESSEL_RETURN_IF_ERROR(worker::CheckCopyRange(dst, offset, n));
  if (n == 0) return absl::OkStatus();
  return Copy(static_cast<char*>(dst.opaque()) + offset, src, nullptr, n);
}

absl::Status CudaDevice::CopyToHost(const worker::Buffer& src, int64_t offset, void* dst,
                                    int64_t n) {
  TESSEL_RETURN_IF_ERROR(worker::CheckCopyRange(src, offset, n));
  if (n == 0) return absl::OkStatus();
  return Copy(static_cast<char*>(src.opaque()) + offset, nullptr, dst, n);
}

absl::Status CudaDevice::CopyWithin(const worker::Buffer& src, int64_t src_offset,
                                    worker::Buffer& dst, int64_t dst_offset, int64_t n) {
  TESSEL_RETURN_IF_ERROR(worker::CheckCopyRange(src, src_offset, n));
  TESSEL_RETURN_IF_ERROR(worker::CheckCopyRange(dst, dst_offset, n));
  if (n == 0) return absl::OkStatus();
  TESSEL_RETURN_IF_ERROR(Activate());
  return CudaStatus(cudaMemcpyAsync(static_cast<char*>(dst.opaque()) + dst_offset,
                                    static_cast<const char*>(src.opaque()) + src_offset, n,
                                    cudaMemcpyDeviceToDevice, stream_),
                    "cudaMemcpyAsync (device to device)");
}

absl::StatusOr<std::unique_ptr<worker::Executable>> CudaDevice::Load(const v1::Program& program) {
  TESSEL_RETURN_IF_ERROR(Activate());
  return CudaExecutable::Load(program, this);
}

}  // namespace tessel::cuda
