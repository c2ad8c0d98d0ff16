#include "worker/cpu/parallel.h"

#include <pthread.h>

#include <algorithm>
#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tessel::cpu {
namespace {

// One ParallelFor call: its pieces are claimed one at a time, by the caller
// and by helpers, under the pool's lock (a call has a few pieces per
// thread, so the lock is taken a few times per call, not per element).
struct Job {
  absl::FunctionRef<void(int)> fn;
  int n;
  int next = 0;      // the next piece to claim
  int finished = 0;  // pieces that have returned
};

class Pool {
 public:
  explicit Pool(int helpers) {
    for (int i = 0; i < helpers; ++i) {
      std::thread t([this] { Serve(); });
      pthread_setname_np(t.native_handle(), "tessel-kernels");
      t.detach();
    }
  }

  void Run(Job& job, int helpers) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock l(&mu_);
      jobs_.push_back(&job);
      for (int i = 0; i < helpers; ++i) work_.Signal();
    }
    for (;;) {
      int piece;
      {
        absl::MutexLock l(&mu_);
        if (!ClaimLocked(job, piece)) break;
      }
      job.fn(piece);
      absl::MutexLock l(&mu_);
      ++job.finished;
    }
    absl::MutexLock l(&mu_);
    while (job.finished < job.n) done_.Wait(&mu_);
  }

 private:
  // Takes job's next piece; false once every piece is taken (the job then
  // leaves the queue).
  bool ClaimLocked(Job& job, int& piece) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (job.next < job.n) {
      piece = job.next++;
      if (job.next == job.n) Unqueue(job);
      return true;
    }
    return false;
  }

  void Unqueue(Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = std::find(jobs_.begin(), jobs_.end(), &job);
    if (it != jobs_.end()) jobs_.erase(it);
  }

  void Serve() ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.Lock();
    for (;;) {
      while (jobs_.empty()) work_.Wait(&mu_);
      Job& job = *jobs_.front();
      int piece;
      if (!ClaimLocked(job, piece)) continue;
      mu_.Unlock();
      job.fn(piece);
      mu_.Lock();
      // The caller returns (and its Job goes) only after this, under the
      // lock: the job is not touched once the count is in.
      if (++job.finished == job.n) done_.SignalAll();
    }
  }

  absl::Mutex mu_;
  absl::CondVar work_;
  absl::CondVar done_;
  std::deque<Job*> jobs_ ABSL_GUARDED_BY(mu_);
};

Pool& ThePool() {
  // Never destroyed: its threads wait for work until the process ends.
  static Pool* pool = new Pool(std::max(1, int(std::thread::hardware_concurrency()) - 1));
  return *pool;
}

}  // namespace

void ParallelFor(int pieces, int threads, absl::FunctionRef<void(int)> fn) {
  if (pieces <= 0) return;
  threads = std::min(threads, pieces);
  if (threads <= 1) {
    for (int i = 0; i < pieces; ++i) fn(i);
    return;
  }
  Job job{fn, pieces};
  ThePool().Run(job, threads - 1);
}

}  // namespace tessel::cpu
