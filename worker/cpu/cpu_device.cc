#include "worker/cpu/cpu_device.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "worker/cpu/cpu_executable.h"

namespace tessel::cpu {
namespace {

class CpuBuffer final : public worker::Buffer {
 public:
  CpuBuffer(std::shared_ptr<worker::CachingAllocator> alloc, void* data, int64_t size)
      : alloc_(std::move(alloc)), data_(data), size_(size) {}
  ~CpuBuffer() override { alloc_->Free(data_, size_); }
  int64_t size() const override { return size_; }
  void* opaque() const override { return data_; }

 private:
  const std::shared_ptr<worker::CachingAllocator> alloc_;
  void* const data_;
  const int64_t size_;
};

absl::Status CheckRange(const worker::Buffer& b, int64_t offset, int64_t n) {
  if (offset < 0 || n < 0 || offset + n > b.size()) {
    return absl::OutOfRangeError(absl::StrCat("copy of ", n, " bytes at offset ", offset,
                                              " exceeds buffer of ", b.size(), " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

CpuDevice::CpuDevice(Options options)
    : options_(options),
      allocator_(std::make_shared<worker::CachingAllocator>(
          worker::CachingAllocator::Options{absl::StrCat("cpu:", options.local_index), options.memory_limit_bytes},
          std::make_unique<worker::HostMemory>())) {}

absl::StatusOr<worker::BufferPtr> CpuDevice::Allocate(int64_t bytes) {
  auto p = allocator_->Allocate(bytes);
  if (!p.ok()) return p.status();
  return std::make_shared<CpuBuffer>(allocator_, *p, bytes);
}

absl::Status CpuDevice::CopyFromHost(worker::Buffer& dst, int64_t offset, const void* src, int64_t n) {
  if (auto s = CheckRange(dst, offset, n); !s.ok()) return s;
  std::memcpy(static_cast<char*>(dst.opaque()) + offset, src, n);
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyToHost(const worker::Buffer& src, int64_t offset, void* dst, int64_t n) {
  if (auto s = CheckRange(src, offset, n); !s.ok()) return s;
  std::memcpy(dst, static_cast<const char*>(src.opaque()) + offset, n);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<worker::Executable>> CpuDevice::Load(const v1::Program& program) {
  return CpuExecutable::Load(program, this);
}

}  // namespace tessel::cpu
