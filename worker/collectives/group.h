// One collective group as seen from one worker: a Communicator whose local
// ranks meet in memory (collectives/rendezvous.h) under each collective's
// CollectiveId, and whose workers agree on each call (agreement.h) and
// exchange data (exchange.h) through Gloo. The algorithm and the failure
// semantics are in worker/collectives.h.
//
// Threads: each local rank calls from its own thread; the last to arrive
// runs the round; the Gloo exchange belongs to whichever thread runs the
// current round (rounds of one group never run at once: each needs every
// local rank, and a rank is in one call at a time).
#pragma once

#include <atomic>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "spdlog/logger.h"
#include "worker/collectives/call.h"
#include "worker/collectives/exchange.h"
#include "worker/collectives/gloo_endpoint.h"
#include "worker/collectives/layout.h"
#include "worker/collectives/rendezvous.h"
#include "worker/communicator.h"

namespace tessel::worker {

// The process's collective rounds across workers (Gloo groups), and their
// time: waiting for the peers (the header exchange) and moving data.
struct CollectiveTimes {
  std::atomic<int64_t> rounds{0}, wait_ns{0}, data_ns{0};
};
CollectiveTimes& ProcessCollectiveTimes();

class GroupCommunicator final : public Communicator {
 public:
  GroupCommunicator(GroupLayout layout, std::shared_ptr<const GlooEndpoint> gloo,
                    absl::Duration timeout, std::shared_ptr<spdlog::logger> log);

  const std::vector<std::string>& rank_workers() const { return l_.rank_workers; }

  int size() const override { return l_.size(); }
  const std::vector<int>& local_ranks() const override { return l_.local_ranks; }

  absl::Status AllReduce(int rank, const CollectiveId& id, void* data, int64_t count,
                         v1::DType dtype, ReduceOp op) override;
  absl::Status AllGather(int rank, const CollectiveId& id, const void* in, void* out, int64_t count,
                         v1::DType dtype) override;
  absl::Status ReduceScatter(int rank, const CollectiveId& id, const void* in, void* out,
                             int64_t count, v1::DType dtype, ReduceOp op) override;
  absl::Status AllToAll(int rank, const CollectiveId& id, const void* in, void* out, int64_t count,
                        v1::DType dtype) override;
  absl::Status Permute(int rank, const CollectiveId& id, const void* in, void* out, int64_t count,
                       v1::DType dtype, const std::vector<std::pair<int, int>>& pairs) override;
  absl::Status Abandon(int rank, const CollectiveId& id, const absl::Status& cause) override;

 private:
  // What one local rank brings to a round.
  struct Slot {
    CollectiveCall call;
    const void* in = nullptr;
    void* out = nullptr;
    absl::Status abandoned;  // not OK: the rank's step failed before this collective
  };
  using Slots = absl::Span<const Slot>;

  absl::Status Validate(int rank, const CollectiveCall& call, const void* in, void* out) const;
  absl::Status Collective(int rank, const CollectiveId& id, Slot slot);
  static CollectiveCall RoundCall(Slots slots);
  absl::Status LocalFailure(Slots slots) const;

  // The round, run by the last local rank to arrive.
  absl::Status RunRound(const CollectiveId& id, Slots slots);
  absl::Status AgreeAndRun(const CollectiveId& id, Slots slots, const CollectiveCall& c,
                           const absl::Status& local_failure);
  absl::Status RunData(Slots slots, const CollectiveCall& c);
  absl::Status MidExchange(absl::Status s) const;
  absl::Status RunAllReduce(Slots slots, const CollectiveCall& c);
  absl::Status RunAllGather(Slots slots, const CollectiveCall& c);
  absl::Status RunReduceScatter(Slots slots, const CollectiveCall& c);
  absl::Status RunAllToAll(Slots slots, const CollectiveCall& c);
  absl::Status RunPermute(Slots slots, const CollectiveCall& c);
  // Each local rank takes its result, in parallel.
  void CopyOut(Slots slots, const CollectiveCall& c, int li) const;

  const GroupLayout l_;
  const absl::Duration timeout_;
  const std::shared_ptr<spdlog::logger> log_;
  LocalRendezvous<CollectiveId, Slot> meet_;

  absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);

  // Owned by the thread running the current round.
  GlooExchange exchange_;
  const char* copy_src_ = nullptr;  // where CopyOut reads the round's result (published by meet_)
};

}  // namespace tessel::worker
