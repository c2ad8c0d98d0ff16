// The collective seam: how the devices of a mesh exchange data. A Gloo
// implementation (CPU, TCP) and an NCCL one (GPU) sit behind it; programs
// call collectives as steps ordered with their kernels. Instances are bound
// to one group of devices and are used by one thread at a time.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::worker {

enum class ReduceOp { kSum, kProd, kMax, kMin };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place over `count` elements of `dtype` at `data`.
  virtual absl::Status AllReduce(void* data, int64_t count, v1::DType dtype, ReduceOp op) = 0;
  // `out` holds size() * count elements, rank-major.
  virtual absl::Status AllGather(const void* in, void* out, int64_t count, v1::DType dtype) = 0;
};

}  // namespace tessel::worker
