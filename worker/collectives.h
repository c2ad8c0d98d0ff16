// The worker's collectives: a CommunicatorRegistry whose groups meet in
// memory between the devices of this process and through Gloo over TCP
// between worker processes.
//
// Algorithm (hierarchical): the local ranks of a group meet in memory under
// the collective's CollectiveId; the last to arrive runs the round. Across
// workers it first exchanges a small header with every other worker of the
// group (the id, the call's arguments, and whether a local rank abandoned
// it), so every worker decides alike whether the round runs; then it
// combines the local contributions, exchanges the combined buffer with the
// other workers through one Gloo context per group (ranks of that context
// are the group's distinct workers in order of first appearance in
// GroupSpec::rank_workers), and every local rank copies its own result out.
// A group held entirely by this process never touches Gloo. The Gloo context
// is connected on the group's first collective, through the rendezvous
// store, under keys prefixed by GroupSpec::key; the store never forgets
// them, so a key (which carries the group's epoch) names one group for the
// life of the store.
//
// Failures: a rank that abandons a collective (Abandon) fails that round on
// every rank with ABORTED, naming its device and the cause; the group goes
// on. Local ranks that disagree on the call fail the round (INVALID_ARGUMENT).
// A local rank missing the meeting fails it after the timeout
// (DEADLINE_EXCEEDED, naming the missing devices); the rank that comes late
// gets the same error. Across workers, a Gloo error (peer gone, IO,
// timeout) or a peer at another collective breaks the group: that call and
// every later one return the error, marked with kGroupBrokenPayload, and the
// connections close so the peers fail at once too. The next steps use a
// group of a new epoch (a new key).
//
// The parts live in worker/collectives/, one job each: reduce.h (the
// element-wise reductions), call.h and agreement.h (what a call is, and the
// header exchange every backend judges alike; NCCL's too), rendezvous.h
// (the in-memory meeting of local ranks), layout.h (a group's ranks as this
// worker sees them), gloo_endpoint.h (the TCP device and the store),
// exchange.h (the data moved between workers), group.h (one group: all of
// the above) and registry.cc (the groups by key, with their epochs).
//
// Ownership and threads: the registry owns its communicators; a
// Communicator* stays valid as long as the registry. Get may be called from
// any thread. A Communicator's collectives are called by its local ranks,
// each from its own thread, as described in worker/communicator.h.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "spdlog/logger.h"
#include "worker/communicator.h"

namespace gloo::rendezvous {
class Store;
}

namespace tessel::worker {

struct CollectivesOptions {
  // This worker's address, as it appears in GroupSpec::rank_workers. Required.
  std::string self;
  // Where the workers of a group meet: shared by every worker of the cluster
  // (the coordinator's key-value store; a gloo::rendezvous::HashStore inside
  // one process). Needed only by groups that span workers. Default: none.
  std::shared_ptr<gloo::rendezvous::Store> store;
  // Interface the Gloo TCP device listens on and advertises. Default: 127.0.0.1.
  std::string hostname = "127.0.0.1";
  // Bound on each wait: local ranks at the barrier and each exchange with
  // the other workers; connecting a group to them may take three times as
  // long. Default: 30 s.
  absl::Duration timeout = absl::Seconds(30);
  // Default: none (nothing is logged).
  std::shared_ptr<spdlog::logger> logger;
};

absl::StatusOr<std::unique_ptr<CommunicatorRegistry>> NewCommunicatorRegistry(
    CollectivesOptions options);

}  // namespace tessel::worker
