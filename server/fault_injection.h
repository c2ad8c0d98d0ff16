// FaultInjectingWorkerClient: a WorkerClient that wraps another and, by a
// seeded plan, loses steps in transit (as a broken step stream does: the step
// fails UNAVAILABLE, the worker never sees it, and the steps-lost callback
// runs), holds steps back so they reach the worker out of order, and fails
// program loads. LevelDB's fault-injection environment is the model: the
// coordinator's logic runs unchanged over a transport that misbehaves.
//
// For tests: tessel-coordinator --inject_faults=SPEC wraps every worker
// client. Thread-safe like the client it wraps; held-back steps are sent by
// one thread of the wrapper's, which the destructor joins.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/worker_client.h"

namespace tessel::server {

struct FaultPlan {
  double drop_step = 0;   // probability that a Run or Free is lost in transit. Default: 0
  double delay_step = 0;  // probability that one is held back up to `max_delay`. Default: 0
  double fail_load = 0;   // probability that LoadProgram fails UNAVAILABLE. Default: 0
  absl::Duration max_delay = absl::Milliseconds(20);
  uint64_t seed = 1;

  // "drop_step=0.01,delay_step=0.05,fail_load=0.1,max_delay_ms=20,seed=7";
  // an unknown key or a probability outside [0, 1] is INVALID_ARGUMENT naming it.
  static absl::StatusOr<FaultPlan> Parse(absl::string_view spec);
  bool empty() const { return drop_step == 0 && delay_step == 0 && fail_load == 0; }
};

// `name` (the worker's address) appears in the injected errors.
std::shared_ptr<WorkerClient> WithFaults(std::shared_ptr<WorkerClient> inner, FaultPlan plan,
                                         std::string name);

}  // namespace tessel::server
