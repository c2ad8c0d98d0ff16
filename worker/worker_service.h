// WorkerService: tessel.v1.Worker over gRPC, a thin shell over
// WorkerRuntime. Run and Free use the callback API so that a queued step
// holds no thread while it waits its turn.
//
// Only the coordinator may call: every call but GetVersion must present the
// worker's secret (bearer metadata), which the worker gave the coordinator
// alone when it registered; others are refused UNAUTHENTICATED.
#pragma once

#include "absl/time/time.h"
#include "core/metrics.h"
#include "tessel/v1/worker.grpc.pb.h"
#include "worker/step_queue.h"
#include "worker/worker_runtime.h"

namespace tessel::worker {

class WorkerService final
    : public v1::Worker::WithCallbackMethod_Run<v1::Worker::WithCallbackMethod_Free<
          v1::Worker::WithCallbackMethod_Steps<v1::Worker::Service>>> {
 public:
  // `steps` (optional, borrowed) records each step's latency from its
  // arrival to its answer.
  WorkerService(WorkerRuntime* runtime, std::string secret, StepMetrics* steps = nullptr)
      : runtime_(runtime), secret_(std::move(secret)), steps_(steps) {}

  grpc::Status GetVersion(grpc::ServerContext*, const v1::GetVersionRequest*,
                          v1::GetVersionResponse*) override;
  grpc::Status LoadProgram(grpc::ServerContext*, const v1::LoadProgramRequest*,
                           v1::LoadProgramResponse*) override;
  grpc::ServerUnaryReactor* Run(grpc::CallbackServerContext*, const v1::RunRequest*,
                                v1::RunResponse*) override;
  grpc::ServerUnaryReactor* Free(grpc::CallbackServerContext*, const v1::FreeRequest*,
                                 v1::FreeResponse*) override;
  grpc::ServerBidiReactor<v1::StepBatch, v1::StepResults>* Steps(
      grpc::CallbackServerContext*) override;
  grpc::Status PutShard(grpc::ServerContext*, grpc::ServerReader<v1::PutShardRequest>*,
                        v1::PutShardResponse*) override;
  grpc::Status FetchShard(grpc::ServerContext*, const v1::FetchShardRequest*,
                          grpc::ServerWriter<v1::FetchShardResponse>*) override;
  grpc::Status GetStats(grpc::ServerContext*, const v1::WorkerStatsRequest*,
                        v1::WorkerStatsResponse*) override;
  grpc::Status OpenWrites(grpc::ServerContext*, const v1::OpenWritesRequest*,
                          v1::OpenWritesResponse*) override;
  grpc::Status CheckpointFiles(grpc::ServerContext*, const v1::CheckpointFilesRequest*,
                               v1::CheckpointFilesResponse*) override;
  grpc::Status Trace(grpc::ServerContext*, const v1::TraceRequest*, v1::TraceResponse*) override;

  // How long a put's receipt (PutShardResponse.receipt) stays good: the
  // client hands it over once every block of the array is written.
  static constexpr absl::Duration kReceiptLifetime = absl::Hours(1);

 private:
  grpc::Status CheckCaller(const grpc::ServerContextBase& ctx) const;
  WorkerRuntime* const runtime_;
  const std::string secret_;
  StepMetrics* const steps_;
  // Starts the Steps streams' writes while more steps are queued, so that
  // a device's step thread goes on to its next step rather than spending
  // the send (on loopback, the receiver's TCP work too) itself.
  CompletionQueue writes_{"step-writes"};
};

}  // namespace tessel::worker
