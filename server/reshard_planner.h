// PlanReshard: how an array's blocks become another layout's. Every target
// block is cut from the source blocks it overlaps. A piece already on the
// target's device is copied there; the others cross devices, each from one
// holder of its source block (the target's own device, else one on the same
// worker, else the holder with the fewest bytes to send so far), and are
// grouped into rounds in which a device sends at most one region and
// receives at most one, all of one size (one Permute each on the workers).
// Pure; any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "server/array_registry.h"
#include "tessel/v1/worker.pb.h"

namespace tessel::server {

struct ReshardPlan {
  struct Step {
    int device = 0;  // global id
    bool reads_source = false, makes_target = false;
    v1::Transfer transfer;  // this device's copy of the plan
  };
  std::vector<Step> steps;                     // by device id
  int64_t bytes_moved = 0;                     // crossing devices
  int64_t bytes_copied = 0;                    // within a device
  absl::flat_hash_map<int, int64_t> received;  // target device -> bytes from other devices
  std::vector<std::string> pieces;  // "device 0 -> device 2: [0:4, 0:8] of f32[8,8] (128 bytes)"
  // Pieces cross devices, and no device both sends and receives: every
  // step's transfer is marked one_way, its senders' steps may go ahead of
  // its receivers' (Transfer.one_way).
  bool one_way = false;
};

// `from` and `to`: records of the same global type (devices, and mesh,
// sharding and block type when sharded; neither partial). `worker_of`: the
// address of the worker holding a device.
absl::StatusOr<ReshardPlan> PlanReshard(const ArrayRecord& from, const ArrayRecord& to,
                                        const std::function<std::string(int device)>& worker_of);

}  // namespace tessel::server
