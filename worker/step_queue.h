// StepQueue: one thread per device that runs work items in sequence-number
// order (0, 1, 2, ...), whatever order they are submitted in. The
// coordinator numbers the steps and frees of each device, so concurrent RPCs
// cannot reorder a device's program. Numbering lives in an epoch (one per
// registration of the worker, or restart after a lost step): an item of a
// new epoch refuses what waits from the old one and starts again at 0; an
// item of an epoch the queue has left is refused. Submit is thread-safe and
// never blocks on a refusal: refusals run on the queue's thread, in the
// order they were made, ahead of the next item (a refused step abandons its
// collectives, which can wait out a peer; the submitter is an RPC thread
// that must go on reading). The destructor drops items that never became
// runnable and refusals not yet run, and joins the thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace tessel::worker {

class StepQueue {
 public:
  explicit StepQueue(std::string name);
  ~StepQueue();
  StepQueue(const StepQueue&) = delete;
  StepQueue& operator=(const StepQueue&) = delete;

  using Rejected = std::function<void(absl::Status)>;
  // `work` runs on the queue's thread once every lower sequence number of
  // `epoch` has. A duplicate or already-run `seq`, or an epoch left behind,
  // runs `rejected` instead, with the reason; so do the items waiting in an
  // epoch a new one replaces. Rejections run on the queue's thread, before
  // any later item.
  void Submit(uint64_t epoch, uint64_t seq, std::function<void()> work, Rejected rejected);
  void Submit(uint64_t seq, std::function<void()> work, Rejected rejected) {
    Submit(0, seq, std::move(work), std::move(rejected));
  }
  // Moves to `epoch` now (as its first item would), unless already there or it was left.
  void StartEpoch(uint64_t epoch);
  uint64_t completed() const;
  // Waits until completed() >= n; false after `timeout` (or once stopping).
  bool AwaitCompleted(uint64_t n, absl::Duration timeout) const;

 private:
  struct Item {
    std::function<void()> work;
    Rejected rejected;
  };
  void Loop();
  bool Runnable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Switches to `epoch`, refusing the items of the old one with `why`.
  void SwitchEpoch(uint64_t epoch, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string name_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Item> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<Rejected, absl::Status>> refusals_
      ABSL_GUARDED_BY(mu_);  // run before pending_
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<uint64_t> left_ ABSL_GUARDED_BY(mu_);  // epochs this queue has left
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// CompletionQueue: one thread that runs closures in the order they were
// pushed. A device whose work finishes after its step returns (a GPU
// stream) hands each step's report here, behind a wait for that work, so
// the device's step thread goes on queueing the next step meanwhile and
// the reports leave in step order. The destructor runs what is pending,
// then joins.
class CompletionQueue {
 public:
  explicit CompletionQueue(std::string name);
  ~CompletionQueue();
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;

  void Push(std::function<void()> f);
  // Nothing pending and nothing running: destroying it now joins at once.
  bool idle() const;

 private:
  void Loop();

  const std::string name_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> pending_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tessel::worker
