#include "worker/cpu/cpu_device.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "worker/cpu/cpu_executable.h"

namespace tessel::cpu {

CpuDevice::CpuDevice(Options options)
    : options_(options),
      allocator_(std::make_shared<worker::CachingAllocator>(
          worker::CachingAllocator::Options{absl::StrCat("cpu:", options.local_index),
                                            options.memory_limit_bytes,
                                            /*max_cached_bytes=*/int64_t{4} << 30,
                                            /*trace_device=*/options.local_index},
          std::make_unique<worker::HostMemory>())) {}

absl::StatusOr<worker::BufferPtr> CpuDevice::Allocate(int64_t bytes) {
  return worker::AllocateBuffer(allocator_, bytes);
}

absl::Status CpuDevice::CopyFromHost(worker::Buffer& dst, int64_t offset, const void* src,
                                     int64_t n) {
  if (auto s = worker::CheckCopyRange(dst, offset, n); !s.ok()) return s;
  std::memcpy(static_cast<char*>(dst.opaque()) + offset, src, n);
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyToHost(const worker::Buffer& src, int64_t offset, void* dst,
                                   int64_t n) {
  if (auto s = worker::CheckCopyRange(src, offset, n); !s.ok()) return s;
  std::memcpy(dst, static_cast<const char*>(src.opaque()) + offset, n);
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyWithin(const worker::Buffer& src, int64_t src_offset,
                                   worker::Buffer& dst, int64_t dst_offset, int64_t n) {
  TESSEL_RETURN_IF_ERROR(worker::CheckCopyRange(src, src_offset, n));
  TESSEL_RETURN_IF_ERROR(worker::CheckCopyRange(dst, dst_offset, n));
  if (n > 0)
    std::memcpy(static_cast<char*>(dst.opaque()) + dst_offset,
                static_cast<const char*>(src.opaque()) + src_offset, n);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<worker::Executable>> CpuDevice::Load(const v1::Program& program) {
  return CpuExecutable::Load(program, this);
}

}  // namespace tessel::cpu
