#include "worker/buffer_store.h"

#include "absl/strings/str_format.h"

namespace tessel::worker {

absl::Status BufferStore::Insert(int device, uint64_t handle, StoredArray a) {
  absl::MutexLock l(&mu_);
  return InsertLocked(device, handle, std::move(a));
}

absl::Status BufferStore::InsertLocked(int device, uint64_t handle, StoredArray a) {
  if (retired_.contains(std::make_pair(device, handle))) {
    return absl::FailedPreconditionError(
        absl::StrFormat("array %#x on device %d was freed before it was written (its put was "
                        "abandoned, or its array deleted)",
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
    return absl::NotFoundError(
        absl::StrFormat("array %#x is not on local device %d", handle, device));
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
  grants_.erase(key);
  if (!retired_.insert(key).second) return;
  retired_order_.push_back(key);
  if (retired_order_.size() > kRememberedRetirements) {
    retired_.erase(retired_order_.front());
    retired_order_.pop_front();
  }
}

void BufferStore::OpenWrite(int device, uint64_t handle, absl::Time expiry) {
  const auto key = std::make_pair(device, handle);
  const absl::Time now = absl::Now();
  absl::MutexLock l(&mu_);
  // Grants open in order of expiry (one lifetime for all): the expired
  // ones are at the front.
  while (!grant_order_.empty() && grant_order_.front().first <= now) {
    auto it = grants_.find(grant_order_.front().second);
    if (it != grants_.end() && it->second.expiry <= now) grants_.erase(it);
    grant_order_.pop_front();
  }
  if (retired_.contains(key) || arrays_.contains(key)) return;  // nothing more may land there
  grants_[key] = Grant{expiry, false};
  grant_order_.emplace_back(expiry, key);
}

absl::Status BufferStore::BeginGrantedWrite(int device, uint64_t handle, absl::Time now) {
  absl::MutexLock l(&mu_);
  auto it = grants_.find(std::make_pair(device, handle));
  if (it == grants_.end() || it->second.expiry <= now) {
    return absl::FailedPreconditionError(
        absl::StrFormat("array %#x on device %d has no open write: its put was written, abandoned "
                        "or freed, or its ticket expired",
                        handle, device));
  }
  if (it->second.writing) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "array %#x on device %d is being written by another stream", handle, device));
  }
  it->second.writing = true;
  return absl::OkStatus();
}

absl::Status BufferStore::InsertGranted(int device, uint64_t handle, StoredArray a) {
  absl::MutexLock l(&mu_);
  auto it = grants_.find(std::make_pair(device, handle));
  if (it == grants_.end()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("array %#x on device %d was freed while it was written (its put was "
                        "abandoned or its session ended)",
                        handle, device));
  }
  grants_.erase(it);
  return InsertLocked(device, handle, std::move(a));
}

int64_t BufferStore::open_writes() const {
  absl::MutexLock l(&mu_);
  return grants_.size();
}

std::vector<BufferStore::Held> BufferStore::List() const {
  absl::MutexLock l(&mu_);
  std::vector<Held> out;
  out.reserve(arrays_.size());
  for (const auto& [key, a] : arrays_) {
    if (a.buffer != nullptr) out.push_back(Held{key.first, key.second, int64_t(a.buffer->size())});
  }
  return out;
}

std::pair<int64_t, int64_t> BufferStore::Clear() {
  absl::flat_hash_map<std::pair<int, uint64_t>, StoredArray> gone;
  {
    absl::MutexLock l(&mu_);
    gone.swap(arrays_);
    grants_.clear();
    grant_order_.clear();
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
