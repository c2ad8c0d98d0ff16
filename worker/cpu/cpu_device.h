// CpuDevice: a Device whose memory is host memory from a caching
// CachingAllocator over host memory and whose kernels run on the calling thread. A worker may
// expose several, so meshes can be exercised on one machine.
#pragma once

#include <memory>

#include "worker/caching_allocator.h"
#include "worker/device.h"

namespace tessel::cpu {

class CpuDevice final : public worker::Device {
 public:
  struct Options {
    int local_index = 0;
    int64_t memory_limit_bytes = 0;  // Default: 0, no limit
  };
  explicit CpuDevice(Options options);

  std::string kind() const override { return "cpu"; }
  int local_index() const override { return options_.local_index; }
  absl::StatusOr<worker::BufferPtr> Allocate(int64_t bytes) override;
  absl::Status CopyFromHost(worker::Buffer& dst, int64_t offset, const void* src,
                            int64_t n) override;
  absl::Status CopyToHost(const worker::Buffer& src, int64_t offset, void* dst, int64_t n) override;
  absl::Status CopyWithin(const worker::Buffer& src, int64_t src_offset, worker::Buffer& dst,
                          int64_t dst_offset, int64_t n) override;
  absl::StatusOr<std::unique_ptr<worker::Executable>> Load(const v1::Program& program) override;
  worker::MemoryStats memory_stats() const override { return allocator_->stats(); }

 private:
  const Options options_;
  // shared so that buffers outliving a device still free into a live allocator
  std::shared_ptr<worker::CachingAllocator> allocator_;
};

}  // namespace tessel::cpu
