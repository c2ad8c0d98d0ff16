// The collective seam: how the devices of a mesh exchange data. Programs call
// collectives as steps ordered with their kernels.
//
// A Communicator serves one group of devices, ranks 0..size()-1. Several
// ranks may live in this process (devices of one worker exchange through
// memory); the rest are reached through a backend (Gloo over TCP between
// worker processes; NCCL on GPUs). Each local rank calls every collective
// once, from its own device's thread, and all ranks of the group call the
// same collectives in the same order. A call returns when this rank's
// result is complete. A peer that never arrives is an error after the
// group's timeout (DEADLINE_EXCEEDED), never a hang.
//
// Layouts: `count` is elements per rank-block; blocks are rank-major.
// Apart from AllReduce (in place), `in` and `out` must not overlap.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::worker {

enum class ReduceOp { kSum, kProd, kMax, kMin };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int size() const = 0;
  // Ranks of this group that live in this process, ascending.
  virtual const std::vector<int>& local_ranks() const = 0;

  // In place over `count` elements.
  virtual absl::Status AllReduce(int rank, void* data, int64_t count, v1::DType dtype, ReduceOp op) = 0;
  // `in`: count elements; `out`: size()*count, block r from rank r.
  virtual absl::Status AllGather(int rank, const void* in, void* out, int64_t count, v1::DType dtype) = 0;
  // `in`: size()*count; `out`: count, the reduction of block `rank` over all ranks.
  virtual absl::Status ReduceScatter(int rank, const void* in, void* out, int64_t count, v1::DType dtype,
                                     ReduceOp op) = 0;
  // `in`: size()*count, block j goes to rank j; `out`: size()*count, block i came from rank i.
  virtual absl::Status AllToAll(int rank, const void* in, void* out, int64_t count, v1::DType dtype) = 0;
  // Each (source, target) pair sends source's `in` (count elements) to target's `out`.
  // Targets appear at most once; a rank no pair targets gets zeros.
  virtual absl::Status Permute(int rank, const void* in, void* out, int64_t count, v1::DType dtype,
                               const std::vector<std::pair<int, int>>& pairs) = 0;
};

// A group: for each rank, the address of the worker process that holds it.
// `key` names the group uniquely in the cluster (the same on every worker);
// it scopes the rendezvous keys.
struct GroupSpec {
  std::string key;
  std::vector<std::string> rank_workers;
};

// Communicators of one worker process, created on first use and kept.
// Thread-safe: local ranks of a new group may ask for it at the same time.
class CommunicatorRegistry {
 public:
  virtual ~CommunicatorRegistry() = default;
  virtual absl::StatusOr<Communicator*> Get(const GroupSpec& spec) = 0;
};

}  // namespace tessel::worker
