#include "worker/buffer_store.h"

#include "absl/strings/str_format.h"

namespace tessel::worker {

absl::Status BufferStore::Insert(int device, uint64_t handle, StoredArray a) {
  absl::MutexLock l(&mu_);
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

int64_t BufferStore::size() const {
  absl::MutexLock l(&mu_);
  return arrays_.size();
}

}  // namespace tessel::worker
