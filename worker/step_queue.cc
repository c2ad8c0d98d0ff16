#include "worker/step_queue.h"

#include "absl/strings/str_cat.h"

namespace tessel::worker {

StepQueue::StepQueue(std::string name) : name_(std::move(name)), thread_([this] { Loop(); }) {}

StepQueue::~StepQueue() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void StepQueue::SwitchEpoch(uint64_t epoch, const std::string& why) {
  left_.insert(epoch_);
  epoch_ = epoch;
  next_ = 0;
  const absl::Status gone = absl::UnavailableError(absl::StrCat(
      name_, ": the queue started over in a new epoch (", why, ") before this step ran"));
  for (auto& [s, item] : pending_) refusals_.emplace_back(std::move(item.rejected), gone);
  pending_.clear();
}

void StepQueue::Submit(uint64_t epoch, uint64_t seq, std::function<void()> work,
                       Rejected rejected) {
  absl::MutexLock l(&mu_);
  if (epoch != epoch_) {
    if (left_.contains(epoch)) {
      refusals_.emplace_back(std::move(rejected),
                             absl::FailedPreconditionError(absl::StrCat(
                                 name_, ": step ", seq, " belongs to queue epoch ", epoch,
                                 ", which the queue has left for epoch ", epoch_,
                                 " (the worker registered again, or steps were lost in transit): "
                                 "it started over in a new epoch")));
      return;
    }
    SwitchEpoch(epoch, "the worker registered again, or steps were lost in transit");
  }
  if (seq >= next_ && !pending_.contains(seq)) {
    pending_.emplace(seq, Item{std::move(work), std::move(rejected)});
  } else {
    refusals_.emplace_back(
        std::move(rejected),
        absl::InvalidArgumentError(absl::StrCat(name_, ": step sequence number ", seq,
                                                " was already used (queue epoch ", epoch_, ")")));
  }
}

void StepQueue::StartEpoch(uint64_t epoch) {
  absl::MutexLock l(&mu_);
  if (epoch == epoch_ || left_.contains(epoch)) return;
  SwitchEpoch(epoch, "the worker registered again");
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
  return stop_ || !refusals_.empty() || (!pending_.empty() && pending_.begin()->first == next_);
}

void StepQueue::Loop() {
  while (true) {
    std::function<void()> work;
    uint64_t epoch;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(this, &StepQueue::Runnable));
      if (stop_) return;
      if (!refusals_.empty()) {
        auto [rejected, why] = std::move(refusals_.front());
        refusals_.pop_front();
        mu_.Unlock();
        if (rejected) rejected(why);
        rejected = nullptr;  // what it held goes outside the lock
        mu_.Lock();
        continue;
      }
      work = std::move(pending_.begin()->second.work);
      pending_.erase(pending_.begin());
      epoch = epoch_;
    }
    work();
    absl::MutexLock l(&mu_);
    if (epoch_ == epoch) ++next_;  // a new epoch started while it ran: numbering is already at 0
  }
}

CompletionQueue::CompletionQueue(std::string name)
    : name_(std::move(name)), thread_([this] { Loop(); }) {}

CompletionQueue::~CompletionQueue() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void CompletionQueue::Push(std::function<void()> f) {
  absl::MutexLock l(&mu_);
  pending_.push_back(std::move(f));
}

bool CompletionQueue::idle() const {
  absl::MutexLock l(&mu_);
  return pending_.empty() && !running_;
}

void CompletionQueue::Loop() {
  while (true) {
    std::function<void()> f;
    {
      absl::MutexLock l(&mu_);
      running_ = false;
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !pending_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (pending_.empty()) return;  // stopping, and nothing left
      f = std::move(pending_.front());
      pending_.pop_front();
      running_ = true;
    }
    f();
    f = nullptr;  // what it held goes before the queue reads as idle
  }
}

}  // namespace tessel::worker
