#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <tuple>
#include <vector>

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

// Runs and frees over one Steps stream to a worker, on gRPC's callback API:
// no thread of its own. Send queues and never blocks; while a batch is on
// the wire, what queues behind it goes as the next batch. Results come back
// by (device, queue epoch, seq) in OnReadDone; when the stream ends, every
// step still waiting fails with UNAVAILABLE.
//
// Lifetime: the stream owns itself until gRPC calls OnDone (its last
// callback), so a completion that drops the client's reference (a step's
// callback that sends the next one on a fresh stream) cannot free it
// under a callback. A hold keeps the call open while writes may still be
// started from Send; it is released once no more can be (the read side
// ended, a write failed) and none is in flight.
class StepStream final : public grpc::ClientBidiReactor<v1::StepBatch, v1::StepResults> {
 public:
  static std::shared_ptr<StepStream> Open(v1::Worker::Stub* stub, std::string address,
                                          std::function<void()> on_lost) {
    std::shared_ptr<StepStream> s(new StepStream(std::move(address), std::move(on_lost)));
    s->self_ = s;
    stub->async()->Steps(&s->ctx_, s.get());
    s->AddHold();
    s->StartRead(&s->in_);
    s->StartCall();
    return s;
  }

  // False when the stream no longer takes steps: `req` and `done` are then
  // left as they were, for another stream. Otherwise both are taken.
  // `held`: the sending thread holds its steps and will call SendQueued.
  bool Send(v1::StepRequest&& req, const StepKey& key, StepDone&& done, bool held) {
    {
      absl::MutexLock l(&mu_);
      if (stopped_) return false;
      // try_emplace moves `done` only when it inserts.
      if (!waiting_.try_emplace(key, std::move(done)).second) {
        // The coordinator never numbers two steps alike; answering one with
        // the other's result would be worse than failing it.
        done(absl::InternalError(absl::StrCat("worker ", address_, ": a step for device ",
                                              std::get<0>(key), ", queue epoch ", std::get<1>(key),
                                              ", seq ", std::get<2>(key), " is already in flight")),
             nullptr);
        return true;
      }
      *queue_.add_steps() = std::move(req);
      if (writing_) return true;  // goes with the next batch, from OnWriteDone
      // Held: the sending thread's HeldSteps sends it (SendQueued).
      if (held && queue_.steps_size() < HeldSteps::kMaxHeld) return true;
      writing_ = true;
      TakeQueueLocked();
    }
    StartWrite(&out_);
    return true;
  }

  // Writes what was held, unless a write is in flight (its completion
  // takes it) or the stream has stopped (OnDone fails it).
  void SendQueued() {
    {
      absl::MutexLock l(&mu_);
      if (stopped_ || writing_ || queue_.steps_size() == 0) return;
      writing_ = true;
      TakeQueueLocked();
    }
    StartWrite(&out_);
  }

  void Cancel() { ctx_.TryCancel(); }

  // Cancels the call and returns once OnDone has failed what was waiting;
  // from inside one of this stream's own callbacks (a completion that let
  // go of the last client), at once: OnDone comes after that callback.
  void Close() {
    ctx_.TryCancel();
    if (in_callback == this) return;
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(&finished_));
  }

  void OnWriteDone(bool ok) override {
    bool next = false, release = false;
    {
      absl::MutexLock l(&mu_);
      next = ok && !stopped_ && queue_.steps_size() > 0;
      if (next) {
        TakeQueueLocked();
      } else {
        writing_ = false;
        if (!ok) stopped_ = true;  // the read fails too, and OnDone fails what waits
        release = ReleaseHoldLocked();
      }
    }
    if (!ok) ctx_.TryCancel();
    if (next) StartWrite(&out_);
    if (release) RemoveHold();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      bool release = false;
      {
        absl::MutexLock l(&mu_);
        stopped_ = true;
        release = ReleaseHoldLocked();
      }
      if (release) RemoveHold();
      return;
    }
    CallbackScope scope(this);
    for (v1::StepResult& r : *in_.mutable_results()) {
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
    StartRead(&in_);
  }

  void OnDone(const grpc::Status& s) override {
    absl::flat_hash_map<StepKey, StepDone> orphans;
    {
      absl::MutexLock l(&mu_);
      stopped_ = true;
      orphans.swap(waiting_);
    }
    const absl::Status why =
        absl::UnavailableError(absl::StrCat("worker ", address_, " unavailable: step stream ended",
                                            s.ok() ? "" : ": ", s.error_message()));
    {
      CallbackScope scope(this);
      for (auto& [key, done] : orphans) done(why, nullptr);
      if (!orphans.empty() && on_lost_) on_lost_();
    }
    std::shared_ptr<StepStream> last = std::move(self_);  // may free this on return
    absl::MutexLock l(&mu_);
    finished_ = true;
  }

 private:
  StepStream(std::string address, std::function<void()> on_lost)
      : address_(std::move(address)), on_lost_(std::move(on_lost)) {}

  // The stream whose callback this thread is running, if any.
  static thread_local const StepStream* in_callback;
  struct CallbackScope {
    explicit CallbackScope(const StepStream* s) : outer(in_callback) { in_callback = s; }
    ~CallbackScope() { in_callback = outer; }
    const StepStream* const outer;
  };
  // The queued steps become the next write (the caller owns writing_).
  void TakeQueueLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    out_.Clear();
    out_.Swap(&queue_);
  }
  // True once, when no write is in flight and none can start.
  bool ReleaseHoldLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!stopped_ || writing_ || hold_released_) return false;
    hold_released_ = true;
    return true;
  }

  const std::string address_;
  const std::function<void()> on_lost_;
  grpc::ClientContext ctx_;
  v1::StepResults in_;                // the read in flight
  v1::StepBatch out_;                 // the write in flight (owned by whoever set writing_)
  std::shared_ptr<StepStream> self_;  // until OnDone
  absl::Mutex mu_;
  v1::StepBatch queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<StepKey, StepDone> waiting_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_released_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

thread_local const StepStream* StepStream::in_callback = nullptr;

// The calling thread's HeldSteps: how deep its scopes nest, and the
// streams with steps it holds.
struct ThreadHold {
  int depth = 0;
  std::vector<std::shared_ptr<StepStream>> streams;

  // Whether steps sent on `s` now are held; if so, `s` is sent at release.
  bool Hold(const std::shared_ptr<StepStream>& s) {
    if (depth == 0) return false;
    if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
    return true;
  }
};
thread_local ThreadHold this_thread_hold;

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

  ~GrpcWorkerClient() override {
    std::shared_ptr<StepStream> steps;
    {
      absl::MutexLock l(&mu_);
      steps = std::move(steps_);
    }
    if (steps) steps->Close();
  }

  absl::Status LoadProgram(const v1::Program& program, uint64_t generation) override {
    grpc::ClientContext ctx;
    // Bounded, and cancelled at once if the worker is declared dead.
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(kLoadDeadlineSeconds));
    CallGuard guard(this, &ctx);
    if (!guard.ok()) return Dead();
    v1::LoadProgramRequest req;
    *req.mutable_program() = program;
    req.set_generation(generation);
    v1::LoadProgramResponse resp;
    return Annotated(stub_->LoadProgram(&ctx, req, &resp));
  }

  void Run(const v1::RunRequest& request, RunDone done) override {
    v1::StepRequest req;
    *req.mutable_run() = request;
    SendStep(std::move(req), StepKey{request.device(), request.queue_epoch(), request.seq()},
             [done = std::move(done)](absl::Status s, v1::RunResponse* resp) {
               if (s.ok()) return done(std::move(*resp));
               done(s);
             });
  }

  void Free(const v1::FreeRequest& request, Done done) override {
    v1::StepRequest req;
    *req.mutable_free() = request;
    SendStep(std::move(req), StepKey{request.device(), request.queue_epoch(), request.seq()},
             [done = std::move(done)](absl::Status s, v1::RunResponse*) { done(s); });
  }

  absl::StatusOr<std::unique_ptr<PutStream>> BeginPut(
      const v1::PutShardRequest::Header& header) override {
    auto s = std::make_unique<GrpcPutStream>(this);
    if (!s->guard.ok()) return Dead();
    s->writer = stub_->PutShard(&s->ctx, &s->resp);
    v1::PutShardRequest msg;
    *msg.mutable_header() = header;
    if (!s->writer->Write(msg)) {
      auto st = s->Finish();
      return st.ok() ? absl::UnavailableError(
                           absl::StrCat("worker ", address_, " closed the put stream"))
                     : st;
    }
    return std::unique_ptr<PutStream>(std::move(s));
  }

  std::unique_ptr<FetchStream> BeginFetch(const v1::FetchShardRequest& request) override {
    auto s = std::make_unique<GrpcFetchStream>(this);
    if (!s->guard.ok())
      s->ctx.TryCancel();  // its Read fails at once; Finish says the worker is gone
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

  absl::Status OpenWrites(const v1::OpenWritesRequest& request) override {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::OpenWritesResponse resp;
    return Annotated(stub_->OpenWrites(&ctx, request, &resp));
  }

  absl::StatusOr<v1::CheckpointFilesResponse> CheckpointFiles(
      const v1::CheckpointFilesRequest& request) override {
    grpc::ClientContext ctx;
    // A finish waits for the worker's writes of the checkpoint.
    const bool waits = request.action() == v1::CheckpointFilesRequest::FINISH ||
                       request.action() == v1::CheckpointFilesRequest::ABANDON;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     (waits ? std::chrono::seconds(3600) : std::chrono::seconds(60)));
    v1::CheckpointFilesResponse resp;
    auto s = Annotated(stub_->CheckpointFiles(&ctx, request, &resp));
    if (!s.ok()) return s;
    return resp;
  }

  absl::StatusOr<v1::TraceResponse> Trace(const v1::TraceRequest& request) override {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::TraceResponse resp;
    auto s = Annotated(stub_->Trace(&ctx, request, &resp));
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
  void SendStep(v1::StepRequest&& req, const StepKey& key, StepDone&& done) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::shared_ptr<StepStream> stream, ended;  // `ended` is torn down outside the lock
      {
        absl::MutexLock l(&mu_);
        if (dead_) break;
        if (!steps_ || attempt > 0) {
          ended = std::move(steps_);
          steps_ = StepStream::Open(stub_.get(), address_, on_lost_);
        }
        stream = steps_;
      }
      ended.reset();
      const bool held = this_thread_hold.Hold(stream);
      if (stream->Send(std::move(req), key, std::move(done), held)) return;
    }
    done(absl::UnavailableError(
             absl::StrCat("worker ", address_, " unavailable: cannot open a step stream")),
         nullptr);
  }

  static constexpr int kLoadDeadlineSeconds = 120;

  absl::Status Dead() const {
    return absl::UnavailableError(
        absl::StrCat("worker ", address_, " was declared dead; its calls are cancelled"));
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
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
        s.error_code() == grpc::StatusCode::CANCELLED) {
      return absl::UnavailableError(
          absl::StrCat("worker ", address_, " unavailable: ", s.error_message()));
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

HeldSteps::HeldSteps() { ++this_thread_hold.depth; }

HeldSteps::~HeldSteps() {
  if (--this_thread_hold.depth == 0) Release();
}

void HeldSteps::Release() {
  if (this_thread_hold.streams.empty()) return;
  std::vector<std::shared_ptr<StepStream>> streams;
  streams.swap(this_thread_hold.streams);
  for (const std::shared_ptr<StepStream>& s : streams) s->SendQueued();
}

bool HeldSteps::AnyHeld() { return !this_thread_hold.streams.empty(); }

std::unique_ptr<WorkerClient> NewGrpcWorkerClient(const std::string& address,
                                                  const std::string& secret,
                                                  std::shared_ptr<grpc::ChannelCredentials> creds,
                                                  const std::string& tls_name) {
  return std::make_unique<GrpcWorkerClient>(address, secret, std::move(creds), tls_name);
}

}  // namespace tessel::server
