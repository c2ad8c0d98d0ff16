// NCCL collectives for the CUDA devices of one worker process.
//
// NcclGroups holds one ncclComm_t per (group, local rank) and queues every
// collective the IR has on the calling rank's stream: all_reduce,
// all_gather and reduce_scatter as NCCL's own; all_to_all and
// collective_permute as grouped ncclSend/ncclRecv.
//
// Identity before launch. A mismatched NCCL call hangs inside the GPU, so
// no NCCL call is queued until every rank of the group has agreed on it.
// Each rank first exchanges a small header (the call's kind, count, dtype,
// reduction, a digest of the permutation's pairs, and its GPU's UUID)
// through the group's host communicator (worker/collectives.h) under the
// collective's CollectiveId. That exchange pairs ranks by identity, applies
// Abandon (ABORTED, naming the device and the cause) and times out a
// missing peer (DEADLINE_EXCEEDED); headers that disagree fail the call on
// every rank alike (INVALID_ARGUMENT, naming both calls), and two ranks on
// one GPU fail it (FAILED_PRECONDITION: NCCL needs a GPU per rank) before
// NCCL is asked for a communicator it cannot build.
//
// Bootstrap. On a group's first collective the worker holding rank 0 draws
// an ncclUniqueId and publishes it in the coordinator's key-value store
// under "<group key>/nccl-unique-id"; every rank reads it from there
// (waiting at most the timeout) and joins with ncclCommInitRank. The key
// carries the group's epoch: a key of a new epoch for the same devices
// aborts and drops the communicators of the earlier one.
//
// Completion and failure. Each launched call is bracketed by two markers
// (CUDA events) on the stream, and a watchdog thread polls them with the
// communicator's asynchronous error. A call that started (its first marker
// passed) but has not finished within the timeout, or whose communicator
// reports an error, aborts every communicator of its group on this worker
// (ncclCommAbort, which makes the waiting kernels return). The call's
// check (Launched::check, run by the step's fence) then fails its step with
// DEADLINE_EXCEEDED or the NCCL error, naming the rank and the group; the
// group is broken (kGroupBrokenPayload), later calls on it fail at once, and
// the cluster moves on to a group of a new epoch.
//
// Thread-safety: thread-safe; each local rank calls from its own device
// thread. Lifetime: the devices that use it hold it (shared_ptr); its
// destructor aborts what is still in flight and joins the watchdog.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/collective_group.h"
#include "worker/collectives/call.h"
#include "worker/communicator.h"

namespace gloo::rendezvous {
class Store;
}

namespace tessel::cuda {

// The NCCL and CUDA runtime calls NcclGroups makes: the libraries' own by
// default. Tests of the bookkeeping, which must run without a GPU,
// substitute recording fakes.
struct NcclApi {
  ncclResult_t (*get_unique_id)(ncclUniqueId*) = ncclGetUniqueId;
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int) = ncclCommInitRank;
  ncclResult_t (*comm_abort)(ncclComm_t) = ncclCommAbort;
  ncclResult_t (*comm_destroy)(ncclComm_t) = ncclCommDestroy;
  ncclResult_t (*comm_get_async_error)(ncclComm_t, ncclResult_t*) = ncclCommGetAsyncError;
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                             cudaStream_t) = ncclAllReduce;
  ncclResult_t (*all_gather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                             cudaStream_t) = ncclAllGather;
  ncclResult_t (*reduce_scatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                 ncclComm_t, cudaStream_t) = ncclReduceScatter;
  ncclResult_t (*send)(const void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = ncclSend;
  ncclResult_t (*recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = ncclRecv;
  ncclResult_t (*group_start)() = ncclGroupStart;
  ncclResult_t (*group_end)() = ncclGroupEnd;
  const char* (*error_string)(ncclResult_t) = ncclGetErrorString;
  cudaError_t (*set_device)(int) = cudaSetDevice;
  cudaError_t (*memset_async)(void*, int, size_t, cudaStream_t) = cudaMemsetAsync;
  cudaError_t (*memcpy_async)(void*, const void*, size_t, cudaMemcpyKind,
                              cudaStream_t) = cudaMemcpyAsync;
  cudaError_t (*event_create)(cudaEvent_t*, unsigned int) = cudaEventCreateWithFlags;
  cudaError_t (*event_record)(cudaEvent_t, cudaStream_t) = cudaEventRecord;
  cudaError_t (*event_query)(cudaEvent_t) = cudaEventQuery;  // cudaSuccess once passed
  cudaError_t (*event_destroy)(cudaEvent_t) = cudaEventDestroy;
};

// The calling rank's device.
struct NcclDevice {
  int ordinal = 0;
  cudaStream_t stream = nullptr;
  std::array<uint8_t, 16> uuid{};  // the GPU's UUID: two ranks on one GPU are refused
};

// One collective call. Pointers are device addresses; `count` as in
// worker/communicator.h (elements per rank-block).
struct NcclCall {
  using Kind = worker::CollectiveKind;  // all but kAbandoned
  Kind kind = Kind::kAllReduce;
  const void* in = nullptr;
  void* out = nullptr;
  int64_t count = 0;
  v1::DType dtype = v1::F32;
  worker::ReduceOp op = worker::ReduceOp::kSum;
  std::vector<std::pair<int, int>> pairs;  // kPermute: (source, target)
};

// The NCCL type for `dtype` under `reduce` (PRED reduces as max or min:
// or, and), or UNIMPLEMENTED naming the dtype (NCCL has no 16-bit
// integers: they move as bytes but do not reduce).
absl::StatusOr<std::pair<ncclDataType_t, int64_t>> NcclType(v1::DType dtype, bool reduce,
                                                            int64_t count);

class NcclGroups {
 public:
  struct Options {
    NcclApi api;
    // Bound on reading the unique id and on a started call's completion.
    // Default: 30 s.
    absl::Duration timeout = absl::Seconds(30);
    // How often the watchdog looks at calls in flight. Default: 2 ms.
    absl::Duration poll = absl::Milliseconds(2);
  };
  explicit NcclGroups(Options options);
  ~NcclGroups();
  NcclGroups(const NcclGroups&) = delete;
  NcclGroups& operator=(const NcclGroups&) = delete;

  // What a queued call leaves for its step's fence: OK once it finished,
  // else why it did not (run only after the stream has passed the call).
  using Check = std::function<absl::Status()>;

  // Agrees `call` with the group's other ranks (g.comm, the host
  // communicator), joins the group's NCCL communicator on first use
  // (`store`: where the unique id is published), and queues the call on
  // dev.stream. `store` may be null only for a group already joined. A
  // group of one (g.comm null), which programs never send here (they
  // copy), runs too: it lets one GPU check the NCCL calls end to end.
  absl::StatusOr<Check> Run(const worker::ResolvedGroup& g, const worker::CollectiveId& id,
                            const NcclCall& call, const NcclDevice& dev,
                            gloo::rendezvous::Store* store);

  int num_groups() const;

 private:
  struct Group;
  struct InFlight;
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace tessel::cuda
