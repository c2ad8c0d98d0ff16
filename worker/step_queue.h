// StepQueue: one thread per device that runs work items in sequence-number
// order (0, 1, 2, ...), whatever order they are submitted in. The
// coordinator numbers the steps and frees of each device, so concurrent RPCs
// cannot reorder a device's program. Submit is thread-safe; the destructor
// drops items that never became runnable and joins the thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"

namespace tessel::worker {

class StepQueue {
 public:
  explicit StepQueue(std::string name);
  ~StepQueue();
  StepQueue(const StepQueue&) = delete;
  StepQueue& operator=(const StepQueue&) = delete;

  // `work` runs on the queue's thread once every lower sequence number has.
  // A duplicate or already-run `seq` runs `rejected` instead, at once.
  void Submit(uint64_t seq, std::function<void()> work, std::function<void()> rejected);
  uint64_t completed() const;
  // Waits until completed() >= n; false after `timeout` (or once stopping).
  bool AwaitCompleted(uint64_t n, absl::Duration timeout) const;

 private:
  void Loop();
  bool Runnable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string name_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, std::function<void()>> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tessel::worker
