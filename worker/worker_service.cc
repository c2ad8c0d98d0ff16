#include "worker/worker_service.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "core/dtype.h"
#include "core/rpc_status.h"
#include "core/security.h"
#include "core/trace.h"
#include "core/version.h"

namespace tessel::worker {

grpc::Status WorkerService::GetVersion(grpc::ServerContext*, const v1::GetVersionRequest* req,
                                       v1::GetVersionResponse* resp) {
  auto v = NegotiateVersion(req->min_version(), req->max_version());
  if (!v.ok()) return ToGrpc(v.status());
  resp->set_version(*v);
  resp->set_server(absl::StrCat("tessel-worker ", kTesselVersion));
  return grpc::Status::OK;
}

grpc::Status WorkerService::CheckCaller(const grpc::ServerContextBase& ctx) const {
  if (SecretEquals(BearerToken(ctx), secret_)) return grpc::Status::OK;
  return grpc::Status(
      grpc::StatusCode::UNAUTHENTICATED,
      "tessel.v1.Worker: only the coordinator this worker registered with may call it");
}

grpc::Status WorkerService::LoadProgram(grpc::ServerContext* ctx, const v1::LoadProgramRequest* req,
                                        v1::LoadProgramResponse*) {
  if (grpc::Status a = CheckCaller(*ctx); !a.ok()) return a;
  return ToGrpc(runtime_->LoadProgram(req->program(), req->generation()));
}

grpc::ServerUnaryReactor* WorkerService::Run(grpc::CallbackServerContext* ctx,
                                             const v1::RunRequest* req, v1::RunResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (grpc::Status a = CheckCaller(*ctx); !a.ok()) {
    reactor->Finish(a);
    return reactor;
  }
  runtime_->Run(*req, [reactor, resp](absl::StatusOr<v1::RunResponse> r) {
    if (r.ok()) *resp = std::move(*r);
    reactor->Finish(ToGrpc(r.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::Free(grpc::CallbackServerContext* ctx,
                                              const v1::FreeRequest* req, v1::FreeResponse*) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (grpc::Status a = CheckCaller(*ctx); !a.ok()) {
    reactor->Finish(a);
    return reactor;
  }
  runtime_->Free(*req, [reactor](absl::Status s) { reactor->Finish(ToGrpc(s)); });
  return reactor;
}

namespace {

// One Steps stream: reads requests and queues them on the runtime; writes
// results as steps complete, batching those that complete while a write is
// in flight. Finishes once the client is done sending and every step has
// answered, so no completion outlives the reactor.
class StepsReactor final : public grpc::ServerBidiReactor<v1::StepBatch, v1::StepResults> {
 public:
  StepsReactor(WorkerRuntime* runtime, StepMetrics* steps, CompletionQueue* writes)
      : runtime_(runtime), steps_(steps), writes_(writes) {
    StartRead(&batch_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      absl::MutexLock l(&mu_);
      reading_done_ = true;
      MaybeFinishLocked();
      return;
    }
    {
      absl::MutexLock l(&mu_);
      in_flight_ += batch_.steps_size();
    }
    for (v1::StepRequest& step : *batch_.mutable_steps()) Submit(step);
    StartRead(&batch_);
  }

  // Moves the step's request out of the batch (read again into next).
  void Submit(v1::StepRequest& request) {
    if (request.has_run()) {
      const int device = request.run().device();
      const uint64_t seq = request.run().seq(), epoch = request.run().queue_epoch();
      runtime_->Run(
          std::move(*request.mutable_run()),
          [this, device, seq, epoch, arrived = absl::Now()](absl::StatusOr<v1::RunResponse> r) {
            if (steps_ != nullptr) steps_->Observe(device, absl::Now() - arrived, r.ok());
            v1::StepResult res;
            res.set_device(device);
            res.set_seq(seq);
            res.set_queue_epoch(epoch);
            if (r.ok()) {
              *res.mutable_run() = std::move(*r);
            } else {
              res.set_code(static_cast<int>(r.status().code()));
              res.set_error(BoundedMessage(r.status().message()));
              res.set_group_broken(r.status().GetPayload(kGroupBrokenPayload).has_value());
            }
            Complete(std::move(res));
          });
    } else {
      const int device = request.free().device();
      const uint64_t seq = request.free().seq(), epoch = request.free().queue_epoch();
      runtime_->Free(request.free(), [this, device, seq, epoch](absl::Status s) {
        v1::StepResult res;
        res.set_device(device);
        res.set_seq(seq);
        res.set_queue_epoch(epoch);
        res.set_code(static_cast<int>(s.code()));
        res.set_error(BoundedMessage(s.message()));
        Complete(std::move(res));
      });
    }
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock l(&mu_);
      in_flight_ -= writing_.results_size();
      writing_.Clear();
      if (!ok || pending_.results_size() == 0) {
        if (!ok) {  // the client is gone: drop what is queued
          in_flight_ -= pending_.results_size();
          pending_.Clear();
          broken_ = true;
        }
        write_busy_ = false;
        MaybeFinishLocked();
        return;
      }
      writing_.Swap(&pending_);
    }
    StartWrite(&writing_);
  }

  void OnDone() override { delete this; }

 private:
  // The write starts outside the lock: gRPC may run OnWriteDone on its own
  // thread before StartWrite returns, and that would wait for the lock.
  // While other steps are still to answer, the write starts on the
  // service's writer thread and this (step) thread goes back to its queue;
  // the last one's starts here, at once. The reactor stays until the
  // write is done (no Finish while write_busy_), so the closure may use it.
  void Complete(v1::StepResult res) {
    bool more_to_come;
    {
      absl::MutexLock l(&mu_);
      if (broken_) {
        --in_flight_;
        MaybeFinishLocked();
        return;
      }
      *pending_.add_results() = std::move(res);
      if (write_busy_) return;  // goes with the next write, from OnWriteDone
      write_busy_ = true;
      writing_.Swap(&pending_);
      more_to_come = in_flight_ > writing_.results_size();
    }
    if (more_to_come) {
      writes_->Push([this] { StartWrite(&writing_); });
    } else {
      StartWrite(&writing_);
    }
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (reading_done_ && in_flight_ == 0 && !write_busy_ && !finished_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  WorkerRuntime* const runtime_;
  StepMetrics* const steps_;
  CompletionQueue* const writes_;
  v1::StepBatch batch_;  // only touched by the read chain
  absl::Mutex mu_;
  v1::StepResults pending_ ABSL_GUARDED_BY(mu_);
  // The write in flight: filled under mu_ by whoever set write_busy_, read
  // by gRPC until OnWriteDone, which clears it under mu_.
  v1::StepResults writing_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // requests read, results not yet written
  bool reading_done_ ABSL_GUARDED_BY(mu_) = false;
  bool write_busy_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// A Steps stream refused before it reads anything.
class RefusedSteps final : public grpc::ServerBidiReactor<v1::StepBatch, v1::StepResults> {
 public:
  explicit RefusedSteps(const grpc::Status& why) { Finish(why); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerBidiReactor<v1::StepBatch, v1::StepResults>* WorkerService::Steps(
    grpc::CallbackServerContext* ctx) {
  if (grpc::Status a = CheckCaller(*ctx); !a.ok()) return new RefusedSteps(a);
  return new StepsReactor(runtime_, steps_, &writes_);
}

grpc::Status WorkerService::PutShard(grpc::ServerContext* ctx,
                                     grpc::ServerReader<v1::PutShardRequest>* reader,
                                     v1::PutShardResponse* resp) {
  v1::PutShardRequest msg;
  if (!reader->Read(&msg) || !msg.has_header()) {
    if (grpc::Status a = CheckCaller(*ctx); !a.ok()) return a;
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "PutShard: the first message must be a header");
  }
  // The coordinator presents the secret; a client writing directly, a
  // ticket the coordinator signed with it for this buffer, type and devices.
  if (const v1::PutShardRequest::Header& h = msg.header(); h.ticket().empty()) {
    if (grpc::Status a = CheckCaller(*ctx); !a.ok()) return a;
  } else if (absl::Status t = CheckTicket(secret_, h.ticket(), WriteGrant(h), absl::Now());
             !t.ok()) {
    return ToGrpc(t);
  }
  // A client's write is answered with a receipt the coordinator checks
  // before the array is ready (the header goes as the data comes).
  const std::string receipt_for = msg.header().ticket().empty() ? "" : WrittenGrant(msg.header());
  trace::Span span("transfer", "put", "transfers");
  if (span.active()) {
    span.Text("devices", absl::StrJoin(msg.header().devices(), ","));
    span.Arg("buffer", int64_t(msg.header().buffer()));
    span.Text("path",
              receipt_for.empty() ? "relayed by the coordinator" : "direct from the client");
  }
  int64_t bytes = 0;
  auto writer = runtime_->BeginPut(msg.header(), /*granted=*/!receipt_for.empty());
  if (!writer.ok()) return ToGrpc(writer.status());
  while (reader->Read(&msg)) {
    if (!msg.has_data()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "PutShard: a second header in one stream");
    }
    bytes += int64_t(msg.data().size());
    if (auto s = (*writer)->Write(msg.data()); !s.ok()) return ToGrpc(s);
  }
  span.Arg("bytes", bytes);
  if (absl::Status s = (*writer)->Finish(); !s.ok()) return ToGrpc(s);
  if (!receipt_for.empty())
    resp->set_receipt(SignTicket(secret_, receipt_for, absl::Now() + kReceiptLifetime));
  return grpc::Status::OK;
}

grpc::Status WorkerService::FetchShard(grpc::ServerContext* ctx, const v1::FetchShardRequest* req,
                                       grpc::ServerWriter<v1::FetchShardResponse>* writer) {
  // The coordinator presents the secret; a client reading directly, a
  // ticket the coordinator signed with it for this buffer.
  if (req->ticket().empty()) {
    if (grpc::Status a = CheckCaller(*ctx); !a.ok()) return a;
  } else if (absl::Status t = CheckTicket(secret_, req->ticket(),
                                          ReadGrant(req->device(), req->buffer()), absl::Now());
             !t.ok()) {
    return ToGrpc(t);
  }
  auto a = runtime_->GetForFetch(req->device(), req->buffer());
  if (!a.ok()) return ToGrpc(a.status());
  const int64_t chunk =
      req->chunk_bytes() > 0 ? std::min<int64_t>(req->chunk_bytes(), 16 << 20) : (1 << 20);
  const int64_t total = ByteSizeUnchecked(a->type);
  Device& dev = runtime_->device(req->device());
  trace::Span span("transfer", "fetch", "transfers");
  if (span.active()) {
    span.Arg("device", req->device());
    span.Arg("buffer", int64_t(req->buffer()));
    span.Arg("bytes", total);
    span.Text("path",
              req->ticket().empty() ? "relayed by the coordinator" : "direct to the client");
  }
  v1::FetchShardResponse msg;
  for (int64_t off = 0; off < total; off += chunk) {
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "fetch cancelled");
    const int64_t n = std::min(chunk, total - off);
    std::string* data = msg.mutable_data();
    data->resize(n);
    if (auto s = dev.CopyToHost(*a->buffer, off, data->data(), n); !s.ok()) {
      return ToGrpc(s);
    }
    if (!writer->Write(msg))
      return grpc::Status(grpc::StatusCode::CANCELLED, "fetch stream closed by the reader");
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::GetStats(grpc::ServerContext* ctx, const v1::WorkerStatsRequest* req,
                                     v1::WorkerStatsResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx); !a.ok()) return a;
  *resp = runtime_->Stats(req->sequenced(), absl::Seconds(2), req->with_buffers());
  return grpc::Status::OK;
}

grpc::Status WorkerService::OpenWrites(grpc::ServerContext* ctx, const v1::OpenWritesRequest* req,
                                       v1::OpenWritesResponse*) {
  if (grpc::Status a = CheckCaller(*ctx); !a.ok()) return a;
  return ToGrpc(runtime_->OpenWrites(*req));
}

grpc::Status WorkerService::CheckpointFiles(grpc::ServerContext* ctx,
                                            const v1::CheckpointFilesRequest* req,
                                            v1::CheckpointFilesResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx); !a.ok()) return a;
  auto r = runtime_->CheckpointFiles(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Trace(grpc::ServerContext* ctx, const v1::TraceRequest* req,
                                  v1::TraceResponse* resp) {
  if (grpc::Status a = CheckCaller(*ctx); !a.ok()) return a;
  trace::Recorder& r = trace::Recorder::Get();
  if (req->start()) {
    if (req->capacity() <= 0 || req->duration_ms() <= 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("Trace: capacity and duration_ms must be positive; got ",
                                       req->capacity(), " and ", req->duration_ms()));
    }
    r.Start(req->capacity(), absl::Now() + absl::Milliseconds(req->duration_ms()));
    return grpc::Status::OK;
  }
  r.Stop(resp->mutable_events());
  return grpc::Status::OK;
}

}  // namespace tessel::worker
