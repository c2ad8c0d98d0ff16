#include <grpcpp/grpcpp.h>

#include <thread>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/rpc_status.h"
#include "core/security.h"
#include "core/status.h"
#include "server/worker_client.h"
#include "tessel/v1/worker.grpc.pb.h"

namespace tessel::server {
namespace {

using StepDone = std::function<void(absl::Status, v1::RunResponse*)>;
// Which step a result answers: (device, queue epoch, seq). Numbering starts
// over in each epoch, so the seq alone names two steps.
using StepKey = std::tuple<int, uint64_t, uint64_t>;

// Runs and frees over one Steps stream to a worker. Send queues and never
// blocks; a writer thread sends what has queued as one batch. Results come
// back by (device, seq) on a reader thread; when the stream ends, every step
// still waiting fails with UNAVAILABLE.
class StepStream {
 public:
  StepStream(v1::Worker::Stub* stub, std::string address, std::function<void()> on_lost)
      : address_(std::move(address)), on_lost_(std::move(on_lost)) {
    stream_ = stub->Steps(&ctx_);
    writer_ = std::thread([this] { WriteLoop(); });
    reader_ = std::thread([this] { ReadLoop(); });
  }
  ~StepStream() {
    {
      absl::MutexLock l(&mu_);
      closing_ = true;
    }
    writer_.join();
    ctx_.TryCancel();
    // The last owner may be a callback running on the reader thread itself
    // (a step's completion that sends the next one on a fresh stream).
    if (std::this_thread::get_id() == reader_.get_id()) {
      reader_.detach();
    } else {
      reader_.join();
    }
  }

  // False when the stream has ended (`done` is then not called).
  bool Send(v1::StepRequest req, const StepKey& key, StepDone done) {
    absl::MutexLock l(&mu_);
    if (ended_) return false;
    if (!waiting_.try_emplace(key, done).second) {
      // The coordinator never numbers two steps alike; answering one with
      // the other's result would be worse than failing it.
      done(absl::InternalError(absl::StrCat("worker ", address_, ": a step for device ", std::get<0>(key),
                                            ", queue epoch ", std::get<1>(key), ", seq ", std::get<2>(key),
                                            " is already in flight")),
           nullptr);
      return true;
    }
    *queue_.add_steps() = std::move(req);
    return true;
  }

  void Cancel() { ctx_.TryCancel(); }

 private:
  void WriteLoop() {
    v1::StepBatch batch;
    while (true) {
      {
        absl::MutexLock l(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.steps_size() > 0 || closing_ || ended_; };
        mu_.Await(absl::Condition(&ready));
        if (queue_.steps_size() == 0 || ended_) break;
        batch.Clear();
        batch.Swap(&queue_);
      }
      if (!stream_->Write(batch)) break;  // the reader fails what waits
    }
    stream_->WritesDone();
  }

  void ReadLoop() {
    v1::StepResults batch;
    while (stream_->Read(&batch)) {
      for (v1::StepResult& r : *batch.mutable_results()) {
        StepDone done;
        {
          absl::MutexLock l(&mu_);
          auto it = waiting_.find(StepKey{r.device(), r.queue_epoch(), r.seq()});
          if (it == waiting_.end()) continue;
          done = std::move(it->second);
          waiting_.erase(it);
        }
        absl::Status status(static_cast<absl::StatusCode>(r.code()), r.error());
        if (r.group_broken()) status.SetPayload(kGroupBrokenPayload, absl::Cord("1"));
        done(std::move(status), r.mutable_run());
      }
    }
    grpc::Status s = stream_->Finish();
    absl::flat_hash_map<StepKey, StepDone> orphans;
    {
      absl::MutexLock l(&mu_);
      ended_ = true;
      orphans.swap(waiting_);
    }
    const absl::Status why = absl::UnavailableError(absl::StrCat(
        "worker ", address_, " unavailable: step stream ended", s.ok() ? "" : ": ", s.error_message()));
    // The callbacks may drop the last reference to this stream (its
    // destructor then detaches this thread): nothing of `this` is touched
    // after the first one runs.
    const std::function<void()> on_lost = orphans.empty() ? nullptr : on_lost_;
    for (auto& [key, done] : orphans) done(why, nullptr);
    if (on_lost) on_lost();
  }

  const std::string address_;
  const std::function<void()> on_lost_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepBatch, v1::StepResults>> stream_;
  absl::Mutex mu_;
  v1::StepBatch queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<StepKey, StepDone> waiting_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  std::thread writer_;
  std::thread reader_;  // last: joined before the rest goes
};

class GrpcWorkerClient final : public WorkerClient {
 public:
  GrpcWorkerClient(const std::string& address, const std::string& secret,
                   std::shared_ptr<grpc::ChannelCredentials> creds, const std::string& tls_name)
      : address_(address) {
    grpc::ChannelArguments args;
    if (!tls_name.empty()) args.SetSslTargetNameOverride(tls_name);
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    if (creds == nullptr) creds = grpc::InsecureChannelCredentials();
    stub_ = v1::Worker::NewStub(CreateChannelWithToken(address, std::move(creds), args, secret));
  }

  absl::Status LoadProgram(const v1::Program& program) override {
    grpc::ClientContext ctx;
    // Bounded, and cancelled at once if the worker is declared dead.
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(kLoadDeadlineSeconds));
    CallGuard guard(this, &ctx);
    if (!guard.ok()) return Dead();
    v1::LoadProgramRequest req;
    *req.mutable_program() = program;
    v1::LoadProgramResponse resp;
    return Annotated(stub_->LoadProgram(&ctx, req, &resp));
  }

  void Run(const v1::RunRequest& request, RunDone done) override {
    v1::StepRequest req;
    *req.mutable_run() = request;
    SendStep(req, StepKey{request.device(), request.queue_epoch(), request.seq()},
             [done = std::move(done)](absl::Status s, v1::RunResponse* resp) {
      if (s.ok()) return done(std::move(*resp));
      done(s);
    });
  }

  void Free(const v1::FreeRequest& request, Done done) override {
    v1::StepRequest req;
    *req.mutable_free() = request;
    SendStep(req, StepKey{request.device(), request.queue_epoch(), request.seq()},
             [done = std::move(done)](absl::Status s, v1::RunResponse*) { done(s); });
  }

  absl::StatusOr<std::unique_ptr<PutStream>> BeginPut(const v1::PutShardRequest::Header& header) override {
    auto s = std::make_unique<GrpcPutStream>(this);
    if (!s->guard.ok()) return Dead();
    s->writer = stub_->PutShard(&s->ctx, &s->resp);
    v1::PutShardRequest msg;
    *msg.mutable_header() = header;
    if (!s->writer->Write(msg)) {
      auto st = s->Finish();
      return st.ok() ? absl::UnavailableError(absl::StrCat("worker ", address_, " closed the put stream")) : st;
    }
    return std::unique_ptr<PutStream>(std::move(s));
  }

  std::unique_ptr<FetchStream> BeginFetch(const v1::FetchShardRequest& request) override {
    auto s = std::make_unique<GrpcFetchStream>(this);
    if (!s->guard.ok()) s->ctx.TryCancel();  // its Read fails at once; Finish says the worker is gone
    s->reader = stub_->FetchShard(&s->ctx, request);
    return s;
  }

  absl::StatusOr<v1::WorkerStatsResponse> GetStats(const v1::WorkerStatsRequest& request) override {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::WorkerStatsResponse resp;
    auto s = Annotated(stub_->GetStats(&ctx, request, &resp));
    if (!s.ok()) return s;
    return resp;
  }

  void SetStepsLostCallback(std::function<void()> on_lost) override {
    absl::MutexLock l(&mu_);
    on_lost_ = std::move(on_lost);
  }

  void CancelAll() override {
    absl::MutexLock l(&mu_);
    dead_ = true;
    if (steps_) steps_->Cancel();
    for (grpc::ClientContext* ctx : calls_) ctx->TryCancel();
  }

 private:
  // Sends on the current step stream, opening a new one if it ended.
  void SendStep(const v1::StepRequest& req, const StepKey& key, StepDone done) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::shared_ptr<StepStream> stream, ended;  // `ended` is torn down outside the lock
      {
        absl::MutexLock l(&mu_);
        if (dead_) break;
        if (!steps_ || attempt > 0) {
          ended = std::move(steps_);
          steps_ = std::make_shared<StepStream>(stub_.get(), address_, on_lost_);
        }
        stream = steps_;
      }
      ended.reset();
      if (stream->Send(req, key, done)) return;
    }
    done(absl::UnavailableError(absl::StrCat("worker ", address_, " unavailable: cannot open a step stream")),
         nullptr);
  }

  static constexpr int kLoadDeadlineSeconds = 120;

  absl::Status Dead() const {
    return absl::UnavailableError(absl::StrCat("worker ", address_, " was declared dead; its calls are cancelled"));
  }

  // Registers a call in flight, so CancelAll can cancel it: every worker RPC
  // ends when the worker is declared dead, however long it would have run.
  class CallGuard {
   public:
    CallGuard(GrpcWorkerClient* c, grpc::ClientContext* ctx) : c_(c), ctx_(ctx) {
      absl::MutexLock l(&c_->mu_);
      ok_ = !c_->dead_;
      if (ok_) c_->calls_.insert(ctx_);
    }
    ~CallGuard() {
      absl::MutexLock l(&c_->mu_);
      c_->calls_.erase(ctx_);
    }
    bool ok() const { return ok_; }

   private:
    GrpcWorkerClient* const c_;
    grpc::ClientContext* const ctx_;
    bool ok_ = false;
  };

  struct GrpcPutStream final : PutStream {
    explicit GrpcPutStream(GrpcWorkerClient* c) : client(c), guard(c, &ctx) {}
    absl::Status Write(const std::string& bytes) override {
      msg.set_data(bytes);
      if (!writer->Write(msg)) return Finish();
      return absl::OkStatus();
    }
    absl::Status Finish() override {
      if (finished) return final_status;
      finished = true;
      writer->WritesDone();
      final_status = client->Annotated(writer->Finish());
      return final_status;
    }
    GrpcWorkerClient* client;
    grpc::ClientContext ctx;
    CallGuard guard;
    v1::PutShardResponse resp;
    v1::PutShardRequest msg;
    std::unique_ptr<grpc::ClientWriter<v1::PutShardRequest>> writer;
    bool finished = false;
    absl::Status final_status;
  };

  struct GrpcFetchStream final : FetchStream {
    explicit GrpcFetchStream(GrpcWorkerClient* c) : client(c), guard(c, &ctx) {}
    bool Read(std::string* bytes) override {
      if (!reader->Read(&msg)) return false;
      bytes->swap(*msg.mutable_data());
      return true;
    }
    absl::Status Finish() override {
      if (!guard.ok()) return client->Dead();
      return client->Annotated(reader->Finish());
    }
    GrpcWorkerClient* client;
    grpc::ClientContext ctx;
    CallGuard guard;
    v1::FetchShardResponse msg;
    std::unique_ptr<grpc::ClientReader<v1::FetchShardResponse>> reader;
  };

  absl::Status Annotated(const grpc::Status& s) const {
    if (s.ok()) return absl::OkStatus();
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE || s.error_code() == grpc::StatusCode::CANCELLED) {
      return absl::UnavailableError(absl::StrCat("worker ", address_, " unavailable: ", s.error_message()));
    }
    return FromGrpc(s);
  }

  const std::string address_;
  std::unique_ptr<v1::Worker::Stub> stub_;
  absl::Mutex mu_;
  std::shared_ptr<StepStream> steps_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);  // in flight
  bool dead_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> on_lost_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<WorkerClient> NewGrpcWorkerClient(const std::string& address, const std::string& secret,
                                                  std::shared_ptr<grpc::ChannelCredentials> creds,
                                                  const std::string& tls_name) {
  return std::make_unique<GrpcWorkerClient>(address, secret, std::move(creds), tls_name);
}

}  // namespace tessel::server
