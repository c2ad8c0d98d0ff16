// HostAllocator: the caching allocator behind a CPU device. Freed blocks are
// kept, by size class, and handed out again, so a steady-state step loop
// neither maps fresh pages (first touch costs ~25x a reused page here) nor
// returns memory to the OS. Large blocks are mapped with MADV_HUGEPAGE.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/device.h"

namespace tessel::cpu {

class HostAllocator {
 public:
  struct Options {
    std::string device_name;        // for error messages
    int64_t limit_bytes = 0;        // Default: 0, no limit
    int64_t max_cached_bytes = int64_t{4} << 30;  // Default: 4 GiB kept for reuse
  };
  explicit HostAllocator(Options options) : options_(std::move(options)) {}
  ~HostAllocator();
  HostAllocator(const HostAllocator&) = delete;
  HostAllocator& operator=(const HostAllocator&) = delete;

  // RESOURCE_EXHAUSTED naming the device, the bytes asked and the bytes in
  // use when over the limit or out of memory. Returns 64-byte aligned memory.
  absl::StatusOr<void*> Allocate(int64_t bytes);
  void Free(void* p, int64_t bytes);
  worker::MemoryStats stats() const;

  // Size class a request of `bytes` is served from.
  static int64_t RoundUp(int64_t bytes);

 private:
  static void* MapBlock(int64_t size);
  static void UnmapBlock(void* p, int64_t size);

  const Options options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int64_t, std::vector<void*>> cache_ ABSL_GUARDED_BY(mu_);
  int64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t buffers_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t cached_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessel::cpu
