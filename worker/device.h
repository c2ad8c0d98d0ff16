// The device seam: what a worker needs from a backend (CPU today, CUDA
// later). Code above this interface never names an implementation.
//
// Ownership: buffers are shared_ptr so that several array handles (an output
// that is a parameter, a reshape) can name the same immutable bytes; the last
// owner returns the memory to its device's allocator. A Device outlives every
// Buffer and Executable it creates.
//
// Threading: Allocate, the copies and memory_stats are thread-safe. An
// Executable's Run is called by one thread at a time per device (the device's
// step queue).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tessel/v1/program.pb.h"
#include "worker/communicator.h"

namespace tessel::worker {

class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual int64_t size() const = 0;
  // Device address of the first byte. Host-addressable only for CPU devices.
  virtual void* opaque() const = 0;
};

using BufferPtr = std::shared_ptr<Buffer>;

struct MemoryStats {
  int64_t bytes_in_use = 0;
  int64_t peak_bytes_in_use = 0;
  int64_t num_buffers = 0;
  int64_t bytes_cached = 0;
  int64_t bytes_limit = 0;
  int64_t largest_free_block = 0;  // largest cached block, reusable without a new mapping
};

// Where a step runs: for partitioned programs, the device's position in the
// program's mesh and the worker's collectives, and the step's identity.
struct StepContext {
  int mesh_position = 0;
  CommunicatorRegistry* collectives = nullptr;  // null: a collective fails, saying so
  int64_t execution_id = 0;                     // with the op index, names each collective
  uint64_t scope = 0;            // 0, or the function call and iteration (SlotProgram::Run)
  std::string collective_epoch;  // scopes the groups' keys
  // Where set, the backend records the instruction index of each collective
  // as it starts one, so a failed step can abandon the rest
  // (AbandonCollectives in worker/collective_group.h).
  int* last_collective = nullptr;
};

// A program loaded onto one device.
class Executable {
 public:
  virtual ~Executable() = default;
  // Runs the program on `args` (one per parameter, types already checked)
  // and returns one buffer per program output. `into` is empty or has one
  // entry per output: where set, a buffer nothing else holds (a donated
  // argument's) that the output is written into instead of a new one; the
  // plan guarantees no later read of it sees the overwrite.
  virtual absl::StatusOr<std::vector<BufferPtr>> Run(absl::Span<const BufferPtr> args,
                                                     absl::Span<const BufferPtr> into,
                                                     const StepContext& ctx) = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string kind() const = 0;  // "cpu"
  virtual int local_index() const = 0;
  std::string name() const { return kind() + ":" + std::to_string(local_index()); }

  // RESOURCE_EXHAUSTED naming the device and the bytes when over its limit.
  virtual absl::StatusOr<BufferPtr> Allocate(int64_t bytes) = 0;
  virtual absl::Status CopyFromHost(Buffer& dst, int64_t offset, const void* src, int64_t n) = 0;
  virtual absl::Status CopyToHost(const Buffer& src, int64_t offset, void* dst, int64_t n) = 0;
  // `n` bytes from `src` at `src_offset` to `dst` at `dst_offset`, ordered
  // with the device's other work.
  virtual absl::Status CopyWithin(const Buffer& src, int64_t src_offset, Buffer& dst,
                                  int64_t dst_offset, int64_t n) = 0;
  virtual absl::StatusOr<std::unique_ptr<Executable>> Load(const v1::Program& program) = 0;
  virtual MemoryStats memory_stats() const = 0;

  // Whether a step's work may still be running when its Run returns (a GPU
  // stream: Run queues kernels). Such a device's steps are reported
  // complete only once Fence's wait for them has returned, so READY means
  // computed, and an error the kernels hit fails their own step.
  virtual bool asynchronous() const { return false; }
  // A wait for everything queued on the device so far; called on the step's
  // thread right after Run, waited on elsewhere. Only asynchronous devices
  // are asked.
  virtual std::function<absl::Status()> Fence() {
    return [] { return absl::OkStatus(); };
  }
};

}  // namespace tessel::worker
