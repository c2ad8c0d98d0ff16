#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/rpc_status.h"
#include "server/worker_client.h"
#include "tessel/v1/worker.grpc.pb.h"

namespace tessel::server {
namespace {

class GrpcWorkerClient final : public WorkerClient {
 public:
  explicit GrpcWorkerClient(const std::string& address) : address_(address) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    stub_ = v1::Worker::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }

  absl::Status LoadProgram(const v1::Program& program) override {
    grpc::ClientContext ctx;
    v1::LoadProgramRequest req;
    *req.mutable_program() = program;
    v1::LoadProgramResponse resp;
    return Annotated(stub_->LoadProgram(&ctx, req, &resp));
  }

  void Run(const v1::RunRequest& request, RunDone done) override {
    auto on_done = [done = std::move(done)](absl::Status s, v1::RunResponse* resp) {
      if (s.ok()) return done(std::move(*resp));
      done(s);
    };
    Async<v1::RunRequest, v1::RunResponse>(request, std::move(on_done), [this](auto* ctx, auto* req, auto* resp, auto cb) {
      stub_->async()->Run(ctx, req, resp, std::move(cb));
    });
  }

  void Free(const v1::FreeRequest& request, Done done) override {
    auto on_done = [done = std::move(done)](absl::Status s, v1::FreeResponse*) { done(s); };
    Async<v1::FreeRequest, v1::FreeResponse>(request, std::move(on_done), [this](auto* ctx, auto* req, auto* resp, auto cb) {
      stub_->async()->Free(ctx, req, resp, std::move(cb));
    });
  }

  absl::StatusOr<std::unique_ptr<PutStream>> BeginPut(const v1::PutShardRequest::Header& header) override {
    auto s = std::make_unique<GrpcPutStream>(this);
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
    s->reader = stub_->FetchShard(&s->ctx, request);
    return s;
  }

  absl::StatusOr<v1::WorkerStatsResponse> GetStats() override {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::WorkerStatsResponse resp;
    auto s = Annotated(stub_->GetStats(&ctx, v1::WorkerStatsRequest(), &resp));
    if (!s.ok()) return s;
    return resp;
  }

  void CancelAll() override {
    absl::MutexLock l(&mu_);
    for (grpc::ClientContext* c : in_flight_) c->TryCancel();
  }

 private:
  struct GrpcPutStream final : PutStream {
    explicit GrpcPutStream(GrpcWorkerClient* c) : client(c) {}
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
    v1::PutShardResponse resp;
    v1::PutShardRequest msg;
    std::unique_ptr<grpc::ClientWriter<v1::PutShardRequest>> writer;
    bool finished = false;
    absl::Status final_status;
  };

  struct GrpcFetchStream final : FetchStream {
    explicit GrpcFetchStream(GrpcWorkerClient* c) : client(c) {}
    bool Read(std::string* bytes) override {
      if (!reader->Read(&msg)) return false;
      bytes->swap(*msg.mutable_data());
      return true;
    }
    absl::Status Finish() override { return client->Annotated(reader->Finish()); }
    GrpcWorkerClient* client;
    grpc::ClientContext ctx;
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

  template <typename Req, typename Resp, typename Call>
  void Async(const Req& request, std::function<void(absl::Status, Resp*)> done, Call call) {
    struct State {
      grpc::ClientContext ctx;
      Req req;
      Resp resp;
    };
    auto* st = new State;
    st->req = request;
    {
      absl::MutexLock l(&mu_);
      in_flight_.insert(&st->ctx);
    }
    call(&st->ctx, &st->req, &st->resp, [this, st, done = std::move(done)](grpc::Status s) {
      {
        absl::MutexLock l(&mu_);
        in_flight_.erase(&st->ctx);
      }
      absl::Status status = Annotated(s);
      done(status, &st->resp);
      delete st;
    });
  }

  const std::string address_;
  std::unique_ptr<v1::Worker::Stub> stub_;
  absl::Mutex mu_;
  absl::flat_hash_set<grpc::ClientContext*> in_flight_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<WorkerClient> NewGrpcWorkerClient(const std::string& address) {
  return std::make_unique<GrpcWorkerClient>(address);
}

}  // namespace tessel::server
