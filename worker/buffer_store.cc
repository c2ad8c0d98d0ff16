#include "worker/buffer_store.h"

#include "absl/strings/str_format.h"

namespace tessel::worker {

absl::Status BufferStore::Insert(int device, uint64_t handle, StoredArray a) {
  absl::MutexLock l(&mu_);
  if (retired_.contains(std::make_pair(device, handle))) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "array %#x on device %d was freed before it was written (its put was abandoned, or its array deleted)",
        handle, device));
  }
  if (!arrays_.emplace(std::make_pair(device, handle), std::move(a)).second) {
    return absl::AlreadyExistsError(
        absl::StrFormat("array %#x already exists on device %d", handle, device));
  }
  return absl::OkStatus();
}

absl::StatusOr<StoredArray> BufferStore::Get(int device, uint64_t handle) const {
  absl::MutexLock l(&mu_);
  auto it = arrays_.find(std::make_pair(device, handle));
  if (it == arrays_.end()) {
    return absl::NotFoundError(absl::StrFormat("array %#x is not on local device %d", handle, device));
  }
  return it->second;
}

bool BufferStore::Erase(int device, uint64_t handle) {
  absl::MutexLock l(&mu_);
  return arrays_.erase(std::make_pair(device, handle)) > 0;
}

void BufferStore::Retire(int device, uint64_t handle) {
  StoredArray gone;  // its buffer goes back to the device outside the lock
  absl::MutexLock l(&mu_);
  const auto key = std::make_pair(device, handle);
  if (auto it = arrays_.find(key); it != arrays_.end()) {
    gone = std::move(it->second);
    arrays_.erase(it);
  }
  if (!retired_.insert(key).second) return;
  retired_order_.push_back(key);
  if (retired_order_.size() > kRememberedRetirements) {
    retired_.erase(retired_order_.front());
    retired_order_.pop_front();
  }
}

std::pair<int64_t, int64_t> BufferStore::Clear() {
  absl::flat_hash_map<std::pair<int, uint64_t>, StoredArray> gone;
  {
    absl::MutexLock l(&mu_);
    gone.swap(arrays_);
  }
  int64_t bytes = 0;
  for (const auto& [key, a] : gone) bytes += a.buffer ? a.buffer->size() : 0;
  return {static_cast<int64_t>(gone.size()), bytes};  // the buffers go back to their devices here
}

int64_t BufferStore::size() const {
  absl::MutexLock l(&mu_);
  return arrays_.size();
}

}  // namespace tessel::worker
