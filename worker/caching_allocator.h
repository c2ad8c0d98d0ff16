// CachingAllocator: the allocator behind every device. Freed blocks are
// kept, by size class, and handed out again, so a steady-state step loop
// never goes back to the memory source: no fresh pages on a CPU (first touch
// costs ~25x a reused page here), no cudaMalloc/cudaFree on a GPU. When the
// source is out of memory, the cache is returned to it and the request tried
// once more before it fails.
//
// While the profiler records, each allocation and free is an instant event
// on the device's track and moves its "memory in use (bytes)" counter.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/device.h"

namespace tessel::worker {

// Where a CachingAllocator's blocks come from. Called with the allocator's
// lock held, one call at a time.
class MemorySource {
 public:
  virtual ~MemorySource() = default;
  // A block of `size` bytes (a size class), 64-byte aligned; null when out of memory.
  virtual void* Map(int64_t size) = 0;
  virtual void Unmap(void* p, int64_t size) = 0;
};

// Host memory: blocks of 2 MiB and more are mmap'ed with MADV_HUGEPAGE.
class HostMemory final : public MemorySource {
 public:
  void* Map(int64_t size) override;
  void Unmap(void* p, int64_t size) override;
};

class CachingAllocator {
 public:
  struct Options {
    std::string device_name;                      // for error messages
    int64_t limit_bytes = 0;                      // Default: 0, no limit
    int64_t max_cached_bytes = int64_t{4} << 30;  // Default: 4 GiB kept for reuse
    // The device's index within its worker, the track of its events in a
    // trace (each allocation and free, and the bytes in use after it);
    // -1: none recorded.
    int trace_device = -1;
  };
  CachingAllocator(Options options, std::unique_ptr<MemorySource> source)
      : options_(std::move(options)), source_(std::move(source)) {}
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // RESOURCE_EXHAUSTED naming the device, the bytes asked and the bytes in
  // use when over the limit or out of memory. Returns 64-byte aligned memory.
  absl::StatusOr<void*> Allocate(int64_t bytes);
  void Free(void* p, int64_t bytes);
  MemoryStats stats() const;

  // Size class a request of `bytes` is served from.
  static int64_t RoundUp(int64_t bytes);

 private:
  // An allocation's or a free's event (`cached`: taken from, or kept in,
  // the cache), while the profiler records.
  void Trace(const char* what, int64_t size, bool cached) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Options options_;
  const std::unique_ptr<MemorySource> source_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int64_t, std::vector<void*>> cache_ ABSL_GUARDED_BY(mu_);
  int64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t buffers_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t cached_ ABSL_GUARDED_BY(mu_) = 0;
};

// Device memory from a CachingAllocator: the block goes back to the
// allocator when the last owner lets go (the allocator outlives it).
absl::StatusOr<BufferPtr> AllocateBuffer(const std::shared_ptr<CachingAllocator>& allocator,
                                         int64_t bytes);

// OUT_OF_RANGE unless bytes [offset, offset + n) lie within `b`.
absl::Status CheckCopyRange(const Buffer& b, int64_t offset, int64_t n);

}  // namespace tessel::worker
