// A rendezvous of the threads of one process: `n` participants meet under a
// key, each bringing a value; the last to arrive runs the meeting over all
// the values, every participant gets its result, then each takes its own
// part of it in parallel, and none leaves before all have taken theirs (a
// part may read the other participants' values until then).
//
// A participant missing the meeting fails it after the timeout, on every
// participant that came; the late one gets the same result when it comes
// (the results of the last meetings are remembered for it). A participant
// that arrives twice under one key is refused.
//
// This is the in-memory half of a collective (the local ranks of a group
// meet under its CollectiveId); it knows nothing of collectives. Locking is
// scoped: the meeting and the parts run outside the lock.
#pragma once

#include <cstddef>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace tessel::worker {

template <typename Key, typename Value>
class LocalRendezvous {
 public:
  // `remembered`: how many ended meetings' results a late participant can
  // still find.
  LocalRendezvous(int n, absl::Duration timeout, size_t remembered = 256)
      : n_(n), timeout_(timeout), remembered_(remembered) {}

  int size() const { return n_; }

  // Participant `index` (0..n-1) meets under `key` with `value`.
  // - run(absl::Span<const Value> values) -> absl::Status: by the last to
  //   arrive; its status is every participant's result.
  // - timed_out(const std::vector<int>& missing, const Value& arrived) ->
  //   absl::Status: the result when participants `missing` did not arrive
  //   within the timeout (`arrived`: a value of one that did).
  // - twice() -> absl::Status: the result for a participant that arrived twice.
  // - part(absl::Span<const Value> values): each participant, after a
  //   meeting that ran and succeeded.
  template <typename Run, typename TimedOut, typename Twice, typename Part>
  absl::Status Meet(const Key& key, int index, Value value, Run&& run, TimedOut&& timed_out,
                    Twice&& twice, Part&& part) {
    std::shared_ptr<Meeting> meeting;
    bool runner = false;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [ended_key, status] : ended_) {
        if (ended_key == key) return status;
      }
      auto [it, created] = meetings_.try_emplace(key, nullptr);
      if (created) it->second = std::make_shared<Meeting>(n_);
      meeting = it->second;  // keeps it alive for this call
      Meeting& m = *meeting;
      if (m.here[index]) return twice();
      m.values[index] = std::move(value);
      m.here[index] = true;
      if (++m.arrived == n_) {
        m.running = runner = true;
      } else {
        AwaitStartOrTimeout(key, m, timed_out);
        auto finished = [&m]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return m.done; };
        mu_.Await(absl::Condition(&finished));
      }
    }
    Meeting& m = *meeting;
    if (runner) {
      // Every value was written before `running` was set, under the lock.
      absl::Status s = run(absl::Span<const Value>(m.values));
      absl::MutexLock lock(&mu_);
      m.result = std::move(s);
      m.done = true;
    }
    // `result` is final once `done`: read without the lock from here on.
    if (m.result.ok() && m.running) part(absl::Span<const Value>(m.values));
    const absl::Status result = m.result;
    Leave(key, meeting);
    return result;
  }

  // Meetings some participant is still in, for tests.
  size_t meetings() const {
    absl::MutexLock lock(&mu_);
    return meetings_.size();
  }

 private:
  struct Meeting {
    explicit Meeting(int n) : values(n), here(n) {}
    std::vector<Value> values;  // by participant; written on arrival only
    std::vector<bool> here;
    int arrived = 0;
    int departed = 0;
    bool running = false;  // every participant arrived; the last runs the meeting
    bool done = false;     // `result` is final
    absl::Status result;
  };

  template <typename TimedOut>
  void AwaitStartOrTimeout(const Key& key, Meeting& m, TimedOut& timed_out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto started = [&m]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return m.running || m.done; };
    if (mu_.AwaitWithTimeout(absl::Condition(&started), timeout_)) return;
    std::vector<int> missing;
    const Value* arrived = nullptr;
    for (int i = 0; i < n_; ++i) {
      if (!m.here[i]) {
        missing.push_back(i);
      } else if (arrived == nullptr) {
        arrived = &m.values[i];
      }
    }
    m.result = timed_out(missing, *arrived);
    m.done = true;
    ended_.emplace_back(key, m.result);
    if (ended_.size() > remembered_) ended_.pop_front();
  }

  // Leave together: a meeting that ran is read from other participants'
  // values until every participant has taken its part.
  void Leave(const Key& key, const std::shared_ptr<Meeting>& meeting) {
    absl::MutexLock lock(&mu_);
    Meeting& m = *meeting;
    ++m.departed;
    if (m.departed == m.arrived) {
      if (auto found = meetings_.find(key); found != meetings_.end() && found->second == meeting)
        meetings_.erase(found);
    } else if (m.running) {
      auto all_left = [&m]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return m.departed == m.arrived; };
      mu_.Await(absl::Condition(&all_left));
    }
  }

  const int n_;
  const absl::Duration timeout_;
  const size_t remembered_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<Key, std::shared_ptr<Meeting>> meetings_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<Key, absl::Status>> ended_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessel::worker
