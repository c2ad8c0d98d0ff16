// WorkerRuntime: everything a worker daemon does, without the RPC: its
// devices, the arrays they hold, the programs loaded on them, and one
// StepQueue per device that runs steps and frees in the coordinator's order.
// A one-way transfer's sender step hands its sends to a lane (one thread per
// group and sending rank) and is done; the lane holds the source buffer
// until it is sent. The gRPC service is a thin shell over this class.
//
// Thread-safety: every public method may be called from any thread.
// Completion callbacks run on a device's queue thread. The destructor waits
// for the lanes' sends (each at most the group's timeout).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "spdlog/logger.h"
#include "tessel/v1/worker.pb.h"
#include "worker/buffer_store.h"
#include "worker/checkpoint_io.h"
#include "worker/communicator.h"
#include "worker/device.h"
#include "worker/step_queue.h"

namespace tessel::worker {

class WorkerRuntime {
 public:
  struct Options {
    std::vector<std::unique_ptr<Device>> devices;
    std::shared_ptr<spdlog::logger> logger;
    // Groups for the programs' collectives. Default: none (a program with a
    // collective then fails to run, saying so).
    std::shared_ptr<CommunicatorRegistry> collectives;
    // Checkpoints (CheckpointIO): the directory every path must lie under,
    // and the bound on the bytes held for writing.
    std::string checkpoint_root = "/";
    int64_t checkpoint_staging_bytes = int64_t{1} << 30;
  };
  static absl::StatusOr<std::unique_ptr<WorkerRuntime>> Create(Options options);
  ~WorkerRuntime();

  int num_devices() const { return devices_.size(); }
  Device& device(int i) const { return *devices_[i]; }

  // Loads on every device; loading an id already loaded is a no-op.
  // `generation`: the coordinator's number for this load; a device whose
  // copy was dropped loads it again.
  absl::Status LoadProgram(const v1::Program& program, uint64_t generation = 0);
  // Programs loaded now (on any device), for tests.
  int64_t num_programs() const ABSL_LOCKS_EXCLUDED(mu_);

  using Done = std::function<void(absl::Status)>;
  using RunDone = std::function<void(absl::StatusOr<v1::RunResponse>)>;
  // Queued by request.seq on request.device; `done` runs when the step has
  // run (or failed: its outputs then hold the error). Donated arguments
  // leave the device's store when the step starts; an aliased one whose
  // buffer nothing else holds becomes its output's buffer, and the reply
  // lists it.
  void Run(v1::RunRequest request, RunDone done);
  void Free(const v1::FreeRequest& request, Done done);

  // A Put in progress: bytes arrive in order; Finish stores the array.
  class PutWriter {
   public:
    virtual ~PutWriter() = default;
    virtual absl::Status Write(const std::string& bytes) = 0;
    virtual absl::Status Finish() = 0;
  };
  // `granted`: a client's write by ticket, which needs the write the
  // coordinator opened for it (OpenWrites; BufferStore::OpenWrite).
  absl::StatusOr<std::unique_ptr<PutWriter>> BeginPut(const v1::PutShardRequest::Header& header,
                                                      bool granted = false);
  // The coordinator grants a client the write of a buffer (PutDirect).
  absl::Status OpenWrites(const v1::OpenWritesRequest& request);

  // The array to stream back; its error if the step that made it failed.
  absl::StatusOr<StoredArray> GetForFetch(int device, uint64_t handle) const;

  // Memory and step figures, once each device has run `sequenced[d]`
  // sequenced operations (waiting at most `wait`; then as they stand).
  // With `with_buffers`, every stored buffer is listed too.
  v1::WorkerStatsResponse Stats(absl::Span<const uint64_t> sequenced = {},
                                absl::Duration wait = absl::Seconds(2),
                                bool with_buffers = false) const;

  // Every device's queue moves to `epoch` (the worker registered again):
  // steps still waiting from before are refused.
  void StartQueueEpoch(uint64_t epoch);
  // A new coordinator: every stored array belonged to the old one, which
  // alone could name them. Drops them all; returns how many and their bytes.
  std::pair<int64_t, int64_t> ForgetAllArrays() { return store_.Clear(); }
  // A new coordinator numbers its loads afresh: the old one's programs go
  // (a running step keeps what it holds). Returns how many.
  int64_t ForgetPrograms() ABSL_LOCKS_EXCLUDED(mu_);
  // Send lanes held (current, and retired ones not yet idle), for tests.
  int num_send_lanes() const ABSL_LOCKS_EXCLUDED(mu_);

  // Installs the collectives after construction (a worker knows its own
  // address only once it serves); replaces Options::collectives.
  void SetCollectives(std::shared_ptr<CommunicatorRegistry> collectives);

  // A checkpoint's files (CheckpointFilesRequest).
  absl::StatusOr<v1::CheckpointFilesResponse> CheckpointFiles(const v1::CheckpointFilesRequest& r) {
    return checkpoints_->Files(r);
  }
  const CheckpointIO& checkpoints() const { return *checkpoints_; }

 private:
  explicit WorkerRuntime(Options options);
  absl::Status CheckDevice(int device) const;
  // `last_collective`: the instruction index of the last collective the step started.
  // `verdict` (asynchronous devices, else null): stored with the outputs;
  // `inputs` gets the pending verdicts of the arguments' producers.
  absl::StatusOr<v1::RunResponse> RunStep(const v1::RunRequest& request, int* last_collective,
                                          const std::shared_ptr<Verdict>& verdict,
                                          std::vector<std::shared_ptr<const Verdict>>& inputs);
  // A reshard's part on this device (request.transfer); `last_round` as `last_collective`.
  absl::StatusOr<v1::RunResponse> RunTransferStep(
      const v1::RunRequest& request, int* last_round, const std::shared_ptr<Verdict>& verdict,
      std::vector<std::shared_ptr<const Verdict>>& inputs);
  // A checkpoint's part on this device (request.checkpoint): a chunk saved
  // from arguments[0], or outputs[0] restored.
  absl::StatusOr<v1::RunResponse> RunCheckpointStep(const v1::RunRequest& request,
                                                    const std::shared_ptr<Verdict>& verdict);
  // After a failed step: lets the peers of every collective it did not reach know.
  void AbandonRest(const v1::RunRequest& request, int last_collective, const absl::Status& cause);
  // Queues `task` on the lane of a detached send (IsDetachedSend): one per
  // one-way group and sending rank, so a rank's sends meet the receivers in
  // step order, each from one thread, while the device's queue goes on.
  void QueueSend(const v1::RunRequest& request, std::function<void()> task)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops a program from `device` (a free's unload), unless loaded again
  // since; the last device's drop forgets it.
  void Unload(int device, const v1::ProgramUnload& unload) ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<std::unique_ptr<Device>> devices_;
  const std::shared_ptr<spdlog::logger> log_;
  BufferStore store_;
  mutable absl::Mutex mu_;
  // A program loaded on the worker's devices. Shared: a step holds what it
  // runs while the program is loaded again or dropped from a device.
  struct LoadedProgram {
    uint64_t generation = 0;  // of the latest load (LoadProgramRequest.generation)
    std::shared_ptr<const v1::Program> proto;
    std::vector<std::shared_ptr<Executable>> on_device;  // by local index; null once dropped there
  };
  absl::flat_hash_map<std::string, LoadedProgram> programs_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<CommunicatorRegistry> collectives_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> steps_run_{0};
  // Per asynchronous device (else null): its steps' reports, each behind a
  // wait for the step's work. Joined after the step queues that feed them.
  std::vector<std::unique_ptr<CompletionQueue>> completions_;
  // "<one-way group key>#<rank>" -> its lane, until a lane of the same
  // group and rank in a later epoch retires it. Retired lanes are joined
  // once idle. All are joined after the step queues that feed them, before
  // the devices whose buffers they hold.
  absl::flat_hash_map<std::string, std::unique_ptr<CompletionQueue>> send_lanes_
      ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<CompletionQueue>> retired_lanes_ ABSL_GUARDED_BY(mu_);
  // Holds buffers while it writes them: joined after the step queues, before the devices.
  std::unique_ptr<CheckpointIO> checkpoints_;
  std::vector<std::unique_ptr<StepQueue>> queues_;  // last: joined first
};

}  // namespace tessel::worker
