// BufferStore: the arrays a worker holds, by (local device, handle). A handle
// is chosen by the client and unique in the cluster. An entry holds either a
// buffer or the error of the step that should have produced it, so errors
// travel to every step that reads it. Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "tessel/v1/ir.pb.h"
#include "worker/device.h"

namespace tessel::worker {

// Whether the step that made an array computed it. On an asynchronous
// device a step's outputs are stored once its Run has queued its work, and
// the verdict comes later, from its fence: whoever reads the array before
// then (a later step, a fetch) waits on it. Set exactly once. Thread-safe.
class Verdict {
 public:
  void Set(absl::Status s) {
    absl::MutexLock l(&mu_);
    status_ = std::move(s);
    set_ = true;
  }
  absl::Status Wait() const {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(&set_));
    return status_;
  }

 private:
  mutable absl::Mutex mu_;
  bool set_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

struct StoredArray {
  BufferPtr buffer;  // null when `error` is set
  v1::TensorType type;
  absl::Status error;
  // The producing step's verdict, where it may still be pending (an
  // asynchronous device's step); null once known good.
  std::shared_ptr<const Verdict> verdict;
};

class BufferStore {
 public:
  // ALREADY_EXISTS if the handle is taken on that device; FAILED_PRECONDITION
  // if it was retired there before it arrived.
  absl::Status Insert(int device, uint64_t handle, StoredArray a);
  // NOT_FOUND naming the handle and device.
  absl::StatusOr<StoredArray> Get(int device, uint64_t handle) const;
  // Returns whether it was there.
  bool Erase(int device, uint64_t handle);
  // The coordinator let go of the array: erases it, and remembers that it
  // was retired, so a put still being written (its put abandoned, or a
  // client writing again on a ticket still good) cannot leave a buffer
  // nobody will free. The last kRememberedRetirements handles are kept.
  void Retire(int device, uint64_t handle);
  static constexpr size_t kRememberedRetirements = size_t{1} << 14;

  // Writes by clients (tickets the coordinator signed) need an open grant:
  // the coordinator opens one for a buffer on a device (OpenWrite) before
  // it hands out the ticket; it closes when the write lands, when the
  // buffer is retired (the put abandoned, its session ended), or at
  // `expiry`. So a client can only ever write a buffer the coordinator
  // holds a pending array for, and no byte outlives its owner.
  void OpenWrite(int device, uint64_t handle, absl::Time expiry);
  // A client's write of `handle` on `device` starts: FAILED_PRECONDITION
  // unless its grant is open at `now` and no other write holds it.
  absl::Status BeginGrantedWrite(int device, uint64_t handle, absl::Time now);
  // Stores a client's finished write and closes its grant;
  // FAILED_PRECONDITION when the grant closed while it was written.
  absl::Status InsertGranted(int device, uint64_t handle, StoredArray a);
  // Grants open now (expired ones are dropped as new ones open).
  int64_t open_writes() const;

  int64_t size() const;
  // Every stored buffer: (device, handle, bytes).
  struct Held {
    int device = 0;
    uint64_t handle = 0;
    int64_t bytes = 0;
  };
  std::vector<Held> List() const;
  // Drops every array and grant; returns how many arrays and their bytes.
  std::pair<int64_t, int64_t> Clear();

 private:
  struct Grant {
    absl::Time expiry;
    bool writing = false;
  };
  absl::Status InsertLocked(int device, uint64_t handle, StoredArray a)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::pair<int, uint64_t>, StoredArray> arrays_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::pair<int, uint64_t>> retired_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<int, uint64_t>> retired_order_ ABSL_GUARDED_BY(mu_);  // oldest first
  absl::flat_hash_map<std::pair<int, uint64_t>, Grant> grants_ ABSL_GUARDED_BY(mu_);
  // Grants by when they opened: expired ones are dropped from the front.
  std::deque<std::pair<absl::Time, std::pair<int, uint64_t>>> grant_order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessel::worker
