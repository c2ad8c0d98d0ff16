#include "worker/caching_allocator.h"

#include <sys/mman.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "core/trace.h"

namespace tessel::worker {
namespace {
constexpr int64_t kHugePage = 2 << 20;
constexpr int64_t kMapThreshold = kHugePage;  // smaller blocks keep their quarter-step classes
}  // namespace

int64_t CachingAllocator::RoundUp(int64_t bytes) {
  if (bytes <= 0) return 64;
  if (bytes >= kMapThreshold) return (bytes + kHugePage - 1) / kHugePage * kHugePage;
  // Below 2 MiB: powers of two from 64 bytes, then quarter steps.
  int64_t p = 64;
  while (p < bytes) p <<= 1;
  int64_t q = p / 4;
  if (p >= 1024 && p - q >= bytes) {
    int64_t r = p - q;
    while (r - q >= bytes) r -= q;
    return r;
  }
  return p;
}

void* HostMemory::Map(int64_t size) {
  if (size >= kMapThreshold) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    madvise(p, size, MADV_HUGEPAGE);
    return p;
  }
  return std::aligned_alloc(64, size);
}

void HostMemory::Unmap(void* p, int64_t size) {
  if (size >= kMapThreshold) {
    munmap(p, size);
  } else {
    std::free(p);
  }
}

CachingAllocator::~CachingAllocator() {
  absl::MutexLock l(&mu_);
  for (auto& [size, blocks] : cache_) {
    for (void* p : blocks) source_->Unmap(p, size);
  }
}

absl::StatusOr<void*> CachingAllocator::Allocate(int64_t bytes) {
  const int64_t size = RoundUp(bytes);
  absl::MutexLock l(&mu_);
  if (options_.limit_bytes > 0 && in_use_ + size > options_.limit_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("device ", options_.device_name, " out of memory: allocating ", bytes,
                     " bytes with ", in_use_, " of ", options_.limit_bytes, " bytes in use"));
  }
  void* p = nullptr;
  auto it = cache_.find(size);
  const bool from_cache = it != cache_.end() && !it->second.empty();
  if (from_cache) {
    p = it->second.back();
    it->second.pop_back();
    cached_ -= size;
  } else {
    p = source_->Map(size);
    if (p == nullptr) {
      // Give the cache back to the OS and try once more.
      for (auto& [s, blocks] : cache_) {
        for (void* b : blocks) source_->Unmap(b, s);
      }
      cache_.clear();
      cached_ = 0;
      p = source_->Map(size);
    }
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("device ", options_.device_name,
                                                       " out of memory: allocating ", bytes,
                                                       " bytes with ", in_use_, " bytes in use"));
    }
  }
  in_use_ += size;
  peak_ = std::max(peak_, in_use_);
  ++buffers_;
  Trace("alloc", size, from_cache);
  return p;
}

void CachingAllocator::Trace(const char* what, int64_t size, bool cached) const {
  if (options_.trace_device < 0 || !trace::Enabled()) return;
  trace::Instant("memory", what, options_.trace_device,
                 {{"bytes", size}, {"cached", cached ? 1 : 0}, {"in use", in_use_}});
  trace::Counter("memory in use (bytes)", options_.trace_device, double(in_use_));
}

void CachingAllocator::Free(void* p, int64_t bytes) {
  const int64_t size = RoundUp(bytes);
  absl::MutexLock l(&mu_);
  in_use_ -= size;
  --buffers_;
  const bool keep = cached_ + size <= options_.max_cached_bytes;
  if (keep) {
    cache_[size].push_back(p);
    cached_ += size;
  } else {
    source_->Unmap(p, size);
  }
  Trace("free", size, keep);
}

MemoryStats CachingAllocator::stats() const {
  absl::MutexLock l(&mu_);
  MemoryStats s;
  s.bytes_in_use = in_use_;
  s.peak_bytes_in_use = peak_;
  s.num_buffers = buffers_;
  s.bytes_cached = cached_;
  s.bytes_limit = options_.limit_bytes;
  for (const auto& [size, blocks] : cache_) {
    if (!blocks.empty()) s.largest_free_block = std::max(s.largest_free_block, size);
  }
  return s;
}

namespace {

class AllocatedBuffer final : public Buffer {
 public:
  AllocatedBuffer(std::shared_ptr<CachingAllocator> alloc, void* data, int64_t size)
      : alloc_(std::move(alloc)), data_(data), size_(size) {}
  ~AllocatedBuffer() override { alloc_->Free(data_, size_); }
  int64_t size() const override { return size_; }
  void* opaque() const override { return data_; }

 private:
  const std::shared_ptr<CachingAllocator> alloc_;
  void* const data_;
  const int64_t size_;
};

}  // namespace

absl::StatusOr<BufferPtr> AllocateBuffer(const std::shared_ptr<CachingAllocator>& allocator,
                                         int64_t bytes) {
  auto p = allocator->Allocate(bytes);
  if (!p.ok()) return p.status();
  return std::make_shared<AllocatedBuffer>(allocator, *p, bytes);
}

absl::Status CheckCopyRange(const Buffer& b, int64_t offset, int64_t n) {
  if (offset < 0 || n < 0 || offset + n > b.size()) {
    return absl::OutOfRangeError(absl::StrCat("copy of ", n, " bytes at offset ", offset,
                                              " exceeds buffer of ", b.size(), " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace tessel::worker
