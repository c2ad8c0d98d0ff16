#include "worker/cpu/cpu_device.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "worker/cpu/cpu_executable.h"

namespace tessel::cpu {

CpuDevice::CpuDevice(Options options)
    : options_(options),
      allocator_(std::make_shared<worker::CachingAllocator>(
          worker::CachingAllocator::Options{absl::StrCat("cpu:", options.local_index), options.memory_limit_bytes},
          std::make_unique<worker::HostMemory>())) {}

absl::StatusOr<worker::BufferPtr> CpuDevice::Allocate(int64_t bytes) {
  return worker::AllocateBuffer(allocator_, bytes);
}

absl::Status CpuDevice::CopyFromHost(worker::Buffer& dst, int64_t offset, const void* src, int64_t n) {
  if (auto s = worker::CheckCopyRange(dst, offset, n); !s.ok()) return s;
  std::memcpy(static_cast<char*>(dst.opaque()) + offset, src, n);
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyToHost(const worker::Buffer& src, int64_t offset, void* dst, int64_t n) {
  if (auto s = worker::CheckCopyRange(src, offset, n); !s.ok()) return s;
  std::memcpy(dst, static_cast<const char*>(src.opaque()) + offset, n);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<worker::Executable>> CpuDevice::Load(const v1::Program& program) {
  return CpuExecutable::Load(program, this);
}

}  // namespace tessel::cpu
