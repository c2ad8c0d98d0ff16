// A device's part of a reshard (RunRequest.transfer): the pieces of its
// target block that its own source block holds are copied in place; the
// rest arrive in rounds, each one Permute over the transfer group, in
// which every rank sends at most one region and receives at most one.
// Pieces that are one contiguous run of their block are sent from and
// received into the blocks themselves; the others go through a packed
// staging buffer.
//
// Host-memory devices only: the transfer reads and writes the blocks by
// address, and the group is the worker's collective transport.
//
// Thread-safety: free functions, called on the device's step thread (a
// detached send: on its lane's).
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "tessel/v1/worker.pb.h"
#include "worker/communicator.h"
#include "worker/device.h"

namespace tessel::worker {

// Calls f(byte offset, byte length) for each contiguous run of `region`
// in a row-major block of `block` (element size `esize`), in row-major
// order of the region. Regions must lie inside the block.
void ForEachRun(const v1::TensorType& block, const v1::Region& region,
                const std::function<void(int64_t offset, int64_t length)>& f);
int64_t RegionBytes(const v1::TensorType& block, const v1::Region& region);
// INVALID_ARGUMENT naming `what` unless `region` has the block's rank and lies inside it.
absl::Status CheckRegion(const v1::TensorType& block, const v1::Region& region,
                         const std::string& what);

// The group a transfer's ranks meet in: the one every program over the same
// devices shares, or for a one-way transfer one of its own, named by its
// senders too (so a device sending there never meets its own receives).
GroupSpec TransferGroup(const v1::RunRequest& request);

// Whether this device only sends, in a one-way transfer: its sends may run
// behind its step (WorkerRuntime's send lanes), the step done at once.
bool IsDetachedSend(const v1::RunRequest& request);

// This device's bytes in transfer `t`: sent to other ranks, received from
// them, and copied between its own blocks.
struct TransferBytes {
  int64_t sent = 0, received = 0, copied = 0;
};
TransferBytes BytesOf(const v1::Transfer& t);

// INVALID_ARGUMENT or UNIMPLEMENTED naming the execution unless this
// device's part of the plan is well formed for `source` (RunTransfer checks
// it first; nothing has moved when it fails).
absl::Status CheckTransfer(const v1::RunRequest& request, const Device& device,
                           const BufferPtr& source);

// Runs this device's part. `source`: the block held here (null when the
// request has no argument). Returns the target block (null when the
// request has no output). `last_round` is set to each round as it starts.
absl::StatusOr<BufferPtr> RunTransfer(const v1::RunRequest& request, Device& device,
                                      const BufferPtr& source, CommunicatorRegistry* collectives,
                                      int* last_round);

// After this device's transfer failed with `cause`: abandons every round
// after `last_round`, so the peers fail at once instead of waiting.
void AbandonTransfer(const v1::RunRequest& request, CommunicatorRegistry* collectives,
                     int last_round, const absl::Status& cause);

}  // namespace tessel::worker
