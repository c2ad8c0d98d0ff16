#include "worker/worker_service.h"

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/rpc_status.h"
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

grpc::Status WorkerService::LoadProgram(grpc::ServerContext*, const v1::LoadProgramRequest* req,
                                        v1::LoadProgramResponse*) {
  return ToGrpc(runtime_->LoadProgram(req->program()));
}

grpc::ServerUnaryReactor* WorkerService::Run(grpc::CallbackServerContext* ctx, const v1::RunRequest* req,
                                             v1::RunResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  runtime_->Run(*req, [reactor, resp](absl::StatusOr<v1::RunResponse> r) {
    if (r.ok()) *resp = std::move(*r);
    reactor->Finish(ToGrpc(r.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::Free(grpc::CallbackServerContext* ctx, const v1::FreeRequest* req,
                                              v1::FreeResponse*) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  runtime_->Free(*req, [reactor](absl::Status s) { reactor->Finish(ToGrpc(s)); });
  return reactor;
}

grpc::Status WorkerService::PutShard(grpc::ServerContext*, grpc::ServerReader<v1::PutShardRequest>* reader,
                                     v1::PutShardResponse*) {
  v1::PutShardRequest msg;
  if (!reader->Read(&msg) || !msg.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "PutShard: the first message must be a header");
  }
  auto writer = runtime_->BeginPut(msg.header());
  if (!writer.ok()) return ToGrpc(writer.status());
  while (reader->Read(&msg)) {
    if (!msg.has_data()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "PutShard: a second header in one stream");
    }
    if (auto s = (*writer)->Write(msg.data()); !s.ok()) return ToGrpc(s);
  }
  return ToGrpc((*writer)->Finish());
}

grpc::Status WorkerService::FetchShard(grpc::ServerContext* ctx, const v1::FetchShardRequest* req,
                                       grpc::ServerWriter<v1::FetchShardResponse>* writer) {
  auto a = runtime_->GetForFetch(req->device(), req->buffer());
  if (!a.ok()) return ToGrpc(a.status());
  const int64_t chunk = req->chunk_bytes() > 0 ? std::min<int64_t>(req->chunk_bytes(), 16 << 20) : (1 << 20);
  const int64_t total = ByteSizeUnchecked(a->type);
  Device& dev = runtime_->device(req->device());
  v1::FetchShardResponse msg;
  for (int64_t off = 0; off < total; off += chunk) {
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "fetch cancelled");
    const int64_t n = std::min(chunk, total - off);
    std::string* data = msg.mutable_data();
    data->resize(n);
    if (auto s = dev.CopyToHost(*a->buffer, off, data->data(), n); !s.ok()) {
      return ToGrpc(s);
    }
    if (!writer->Write(msg)) return grpc::Status(grpc::StatusCode::CANCELLED, "fetch stream closed by the reader");
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::GetStats(grpc::ServerContext*, const v1::WorkerStatsRequest*,
                                     v1::WorkerStatsResponse* resp) {
  *resp = runtime_->Stats();
  return grpc::Status::OK;
}

}  // namespace tessel::worker
