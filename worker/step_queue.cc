#include "worker/step_queue.h"

namespace tessel::worker {

StepQueue::StepQueue(std::string name) : name_(std::move(name)), thread_([this] { Loop(); }) {}

StepQueue::~StepQueue() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void StepQueue::Submit(uint64_t seq, std::function<void()> work, std::function<void()> rejected) {
  {
    absl::MutexLock l(&mu_);
    if (seq >= next_ && !pending_.contains(seq)) {
      pending_.emplace(seq, std::move(work));
      return;
    }
  }
  rejected();
}

uint64_t StepQueue::completed() const {
  absl::MutexLock l(&mu_);
  return next_;
}

bool StepQueue::AwaitCompleted(uint64_t n, absl::Duration timeout) const {
  absl::MutexLock l(&mu_);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return next_ >= n || stop_; };
  return mu_.AwaitWithTimeout(absl::Condition(&done), timeout) && next_ >= n;
}

bool StepQueue::Runnable() const {
  return stop_ || (!pending_.empty() && pending_.begin()->first == next_);
}

void StepQueue::Loop() {
  while (true) {
    std::function<void()> work;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(this, &StepQueue::Runnable));
      if (stop_) return;
      work = std::move(pending_.begin()->second);
      pending_.erase(pending_.begin());
    }
    work();
    absl::MutexLock l(&mu_);
    ++next_;
  }
}

}  // namespace tessel::worker
