// ExecutePlanner: turns one Execute request into per-device steps, pure:
// it reads a snapshot (the executable, the argument arrays, the device
// routes) and touches no state, takes no lock and sends nothing. The
// Coordinator checks what the plan needs (transfer guard, quota), then
// commits it (retires donated arrays, registers the outputs, numbers the
// steps) and sends it.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/array_registry.h"
#include "server/compile_cache.h"
#include "server/worker_registry.h"
#include "tessel/v1/session.pb.h"
#include "tessel/v1/worker.pb.h"

namespace tessel::server {

// An implicit device->device copy of an argument, for one step: the step
// reads `temp_handle` on `to_device`, a copy of `handle` from `from_device`.
struct PlannedMove {
  int argument = 0;
  uint64_t handle = 0, temp_handle = 0;
  v1::TensorType type;
  int from_device = -1, to_device = -1;
  std::string
      what;  // "argument 0 'x' (array 0x.., f32[4]) from device 1 to device 0", for the guard
};

// One device's step. The Coordinator fills in, at commit, the device's
// local index, sequence numbers and queue epoch, the execution id and the
// collective epoch.
struct PlannedStep {
  int device = 0;  // global id
  v1::RunRequest run;
  std::optional<v1::FreeRequest> free_after;  // the moved copies, once the step ran
};

struct ExecutePlan {
  std::vector<int> devices;  // where the step runs; the mesh's, in mesh order, when partitioned
  std::vector<int> donated;  // argument indices, ascending
  std::vector<scheduler::AliasDecision> aliases;
  std::vector<PlannedMove> moves;
  // An argument failed earlier: the step still runs (it consumes donated
  // buffers) and its outputs take this error.
  absl::Status upstream_error;
  int64_t output_bytes = 0, donated_bytes = 0;  // over all devices
  std::vector<ArrayRecord> outputs;             // to register, by output index
  std::vector<PlannedStep> steps;               // by position in `devices`
};

struct ExecuteInput {
  const v1::ExecuteRequest* request = nullptr;
  const CachedExecutable* executable = nullptr;
  // Where a step not partitioned runs (ResolvePlacement); ignored when partitioned.
  std::vector<int> placement;
  // The argument arrays, by index, owned by the request's session.
  std::vector<const ArrayRecord*> arguments;
  const std::vector<DeviceRoute>* routes = nullptr;  // by global id
  bool strict_donation = false;                      // the call's or the session's
  // True for a handle already in use (an output handle must be new).
  std::function<bool(uint64_t)> handle_in_use;
  // A fresh nonzero handle for a moved copy.
  std::function<uint64_t()> fresh_handle;
};

// INVALID_ARGUMENT, ALREADY_EXISTS or UNAVAILABLE naming the argument,
// output or device at fault, with what was expected and what was given.
absl::StatusOr<ExecutePlan> PlanExecute(const ExecuteInput& in);

}  // namespace tessel::server
