// The worker's collectives: a CommunicatorRegistry whose groups meet in
// memory between the devices of this process and through Gloo over TCP
// between worker processes.
//
// Algorithm (hierarchical): the local ranks of a group arrive at an
// in-memory barrier; the last to arrive runs the round: it combines the
// local contributions, exchanges the combined buffer with the other workers
// through one Gloo context per group (ranks of that context are the group's
// distinct workers in order of first appearance in GroupSpec::rank_workers),
// and then every local rank copies its own result out. A group held entirely
// by this process never touches Gloo. The Gloo context is connected on the
// group's first collective, through the rendezvous store, under keys
// prefixed by GroupSpec::key; the store never forgets them, so a key names
// one group for the life of the store. Each cross-worker collective uses
// the next Gloo tag of its group, so a worker may start one while a peer is
// still finishing the previous one.
//
// Failures: a Gloo error (peer gone, IO, timeout) or a local rank missing
// the barrier breaks the group: the call that saw it and every later call of
// that group return the same status (UNAVAILABLE, DEADLINE_EXCEEDED, ...).
// Use a new group key to start over.
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
  // Bound on each wait: local ranks at the barrier, connecting to the other
  // workers, and each Gloo operation. Default: 30 s.
  absl::Duration timeout = absl::Seconds(30);
  // Default: none (nothing is logged).
  std::shared_ptr<spdlog::logger> logger;
};

absl::StatusOr<std::unique_ptr<CommunicatorRegistry>> NewCommunicatorRegistry(CollectivesOptions options);

}  // namespace tessel::worker
