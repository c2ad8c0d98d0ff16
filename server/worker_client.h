// WorkerClient: how the coordinator talks to one worker daemon. An interface
// so the coordinator's logic can be tested against a fake; GrpcWorkerClient
// is the real one. All methods are thread-safe. Callbacks run on gRPC's
// threads and must not block.
#pragma once

#include <grpcpp/security/credentials.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "tessel/v1/worker.pb.h"

namespace tessel::server {

class WorkerClient {
 public:
  virtual ~WorkerClient() = default;
  using Done = std::function<void(absl::Status)>;
  using RunDone = std::function<void(absl::StatusOr<v1::RunResponse>)>;

  // `generation`: the coordinator's number for this load (LoadProgramRequest).
  virtual absl::Status LoadProgram(const v1::Program& program, uint64_t generation) = 0;
  // Asynchronous: `done` runs when the worker has run the step.
  virtual void Run(const v1::RunRequest& request, RunDone done) = 0;
  virtual void Free(const v1::FreeRequest& request, Done done) = 0;

  class PutStream {
   public:
    virtual ~PutStream() = default;
    virtual absl::Status Write(const std::string& bytes) = 0;
    virtual absl::Status Finish() = 0;
  };
  virtual absl::StatusOr<std::unique_ptr<PutStream>> BeginPut(
      const v1::PutShardRequest::Header& header) = 0;

  class FetchStream {
   public:
    virtual ~FetchStream() = default;
    // False at the end of the stream or on error; then call Finish.
    virtual bool Read(std::string* bytes) = 0;
    virtual absl::Status Finish() = 0;
  };
  virtual std::unique_ptr<FetchStream> BeginFetch(const v1::FetchShardRequest& request) = 0;

  // `request.sequenced`: see WorkerStatsRequest.
  virtual absl::StatusOr<v1::WorkerStatsResponse> GetStats(
      const v1::WorkerStatsRequest& request) = 0;

  // Opens the writes of a client's direct put (the worker then accepts its
  // tickets, and nothing else). Default: OK, for fakes that hold no
  // client's bytes.
  virtual absl::Status OpenWrites(const v1::OpenWritesRequest& request) { return absl::OkStatus(); }

  // A checkpoint's files on the worker's path (CheckpointFilesRequest).
  // Default: UNIMPLEMENTED, for fakes that hold no files.
  virtual absl::StatusOr<v1::CheckpointFilesResponse> CheckpointFiles(
      const v1::CheckpointFilesRequest& request) {
    return absl::UnimplementedError("this worker client has no checkpoint files");
  }

  // Starts or stops the worker's profiler recorder (TraceRequest).
  // Default: UNIMPLEMENTED, for fakes that record nothing.
  virtual absl::StatusOr<v1::TraceResponse> Trace(const v1::TraceRequest& request) {
    return absl::UnimplementedError("this worker client records no trace");
  }

  // Fails every call in flight, and every later one (the worker was
  // declared dead).
  virtual void CancelAll() = 0;

  // `on_lost` runs (on a client thread, never under a lock of the client's)
  // when steps were lost in transit: the worker may have missed some, so
  // the sequence numbers of its devices must start over in a new queue
  // epoch. Default: never called.
  virtual void SetStepsLostCallback(std::function<void()> on_lost) {}
};

// While one lives on a thread, the steps that thread sends over a worker's
// step stream wait, unsent, until it ends, or until kMaxHeld of them wait
// for one worker: a batch of calls then crosses to each worker in a few
// writes, rather than in one write for each call that found the stream
// idle (each write wakes a thread on both sides). Scopes nest; the
// outermost sends. A thread about to wait for a step must Release() first,
// or it could wait for itself: ArrayRegistry's wait for pending arrays does.
// Only the gRPC client holds steps; others send at once.
class HeldSteps {
 public:
  static constexpr int kMaxHeld = 128;
  HeldSteps();
  ~HeldSteps();
  HeldSteps(const HeldSteps&) = delete;
  HeldSteps& operator=(const HeldSteps&) = delete;
  // Sends what the calling thread holds (steps it sends later are held
  // again while a scope lives). Cheap when it holds nothing.
  static void Release();
  // Whether the calling thread holds steps now.
  static bool AnyHeld();
};

// A WorkerClient over a gRPC channel to `address` (plaintext when `creds`
// is null), presenting the worker's `secret` on every call. With TLS,
// `tls_name` (when set) is the name checked in the worker's certificate.
std::unique_ptr<WorkerClient> NewGrpcWorkerClient(
    const std::string& address, const std::string& secret,
    std::shared_ptr<grpc::ChannelCredentials> creds = nullptr, const std::string& tls_name = "");

}  // namespace tessel::server
