#include "server/services.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/rpc_status.h"
#include "core/version.h"

namespace tessel::server {
namespace {

template <typename Resp>
grpc::Status Reply(absl::StatusOr<Resp> r, Resp* out) {
  if (!r.ok()) return ToGrpc(r.status());
  *out = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status Version(const v1::GetVersionRequest* req, v1::GetVersionResponse* resp) {
  auto v = NegotiateVersion(req->min_version(), req->max_version());
  if (!v.ok()) return ToGrpc(v.status());
  resp->set_version(*v);
  resp->set_server(absl::StrCat("tessel-coordinator ", kTesselVersion));
  return grpc::Status::OK;
}

}  // namespace

grpc::Status SessionService::GetVersion(grpc::ServerContext*, const v1::GetVersionRequest* req,
                                        v1::GetVersionResponse* resp) {
  return Version(req, resp);
}
grpc::Status SessionService::OpenSession(grpc::ServerContext*, const v1::OpenSessionRequest* req,
                                         v1::OpenSessionResponse* resp) {
  *resp = c_->OpenSession(*req);
  return grpc::Status::OK;
}
grpc::Status SessionService::CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest* req,
                                          v1::CloseSessionResponse* resp) {
  return Reply(c_->CloseSession(*req), resp);
}
grpc::Status SessionService::KeepAlive(grpc::ServerContext*, const v1::KeepAliveRequest* req,
                                       v1::KeepAliveResponse* resp) {
  return Reply(c_->KeepAlive(*req), resp);
}
grpc::Status SessionService::Compile(grpc::ServerContext*, const v1::CompileRequest* req, v1::CompileResponse* resp) {
  return Reply(c_->Compile(*req), resp);
}
grpc::Status SessionService::Put(grpc::ServerContext*, grpc::ServerReader<v1::PutRequest>* reader,
                                 v1::PutResponse* resp) {
  v1::PutRequest msg;
  if (!reader->Read(&msg) || !msg.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "Put: the first message must be a header");
  }
  auto sink = c_->BeginPut(msg.header());
  if (!sink.ok()) return ToGrpc(sink.status());
  while (reader->Read(&msg)) {
    if (!msg.has_data()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "Put: a second header in one stream");
    }
    if (auto s = (*sink)->Write(msg.data()); !s.ok()) return ToGrpc(s);
  }
  auto bytes = (*sink)->Finish();
  if (!bytes.ok()) return ToGrpc(bytes.status());
  resp->set_bytes(*bytes);
  return grpc::Status::OK;
}
grpc::Status SessionService::SetSessionOptions(grpc::ServerContext*, const v1::SetSessionOptionsRequest* req,
                                               v1::SetSessionOptionsResponse*) {
  return ToGrpc(c_->SetSessionOptions(*req));
}
grpc::Status SessionService::Dispatch(grpc::ServerContext*,
                                      grpc::ServerReaderWriter<v1::DispatchReplies, v1::DispatchBatch>* stream) {
  v1::DispatchBatch batch;
  v1::DispatchReplies replies;
  while (stream->Read(&batch)) {
    replies.Clear();
    for (v1::ExecuteRequest& req : *batch.mutable_calls()) {
      const bool client_reads_reply = req.wait();
      req.set_wait(false);
      auto r = c_->Execute(req);
      v1::DispatchReply* reply = replies.add_replies();
      if (r.ok()) {
        *reply->mutable_response() = std::move(*r);
      } else {
        reply->set_code(static_cast<int>(r.status().code()));
        reply->set_error(BoundedMessage(r.status().message()));
        if (!client_reads_reply) c_->MarkRejectedOutputs(req, r.status());
      }
    }
    if (!stream->Write(replies)) break;
  }
  return grpc::Status::OK;
}
grpc::Status SessionService::Execute(grpc::ServerContext*, const v1::ExecuteRequest* req, v1::ExecuteResponse* resp) {
  return Reply(c_->Execute(*req), resp);
}
grpc::Status SessionService::Await(grpc::ServerContext*, const v1::AwaitRequest* req, v1::AwaitResponse* resp) {
  return Reply(c_->Await(*req), resp);
}
grpc::Status SessionService::Fetch(grpc::ServerContext* ctx, const v1::FetchRequest* req,
                                   grpc::ServerWriter<v1::FetchResponse>* writer) {
  auto src = c_->BeginFetch(*req);
  if (!src.ok()) return ToGrpc(src.status());
  v1::FetchResponse msg;
  *msg.mutable_type() = (*src)->type();
  bool first = true;
  std::string chunk;
  while ((*src)->Read(&chunk)) {
    msg.mutable_data()->swap(chunk);
    if (!writer->Write(msg)) {
      ctx->TryCancel();
      (void)(*src)->Finish();
      return grpc::Status(grpc::StatusCode::CANCELLED, "fetch stream closed by the client");
    }
    if (first) {
      msg.clear_type();
      first = false;
    }
  }
  if (auto s = (*src)->Finish(); !s.ok()) return ToGrpc(s);
  if (first) {
    // An empty array still tells the client its type.
    msg.clear_data();
    writer->Write(msg);
  }
  return grpc::Status::OK;
}
grpc::Status SessionService::Delete(grpc::ServerContext*, const v1::DeleteRequest* req, v1::DeleteResponse*) {
  return ToGrpc(c_->Delete(*req));
}
grpc::Status SessionService::ArrayInfo(grpc::ServerContext*, const v1::ArrayInfoRequest* req,
                                       v1::ArrayInfoResponse* resp) {
  return Reply(c_->ArrayInfo(*req), resp);
}
grpc::Status SessionService::Stats(grpc::ServerContext*, const v1::StatsRequest* req, v1::StatsResponse* resp) {
  return Reply(c_->Stats(*req), resp);
}

grpc::Status AdminService::GetVersion(grpc::ServerContext*, const v1::GetVersionRequest* req,
                                      v1::GetVersionResponse* resp) {
  return Version(req, resp);
}
grpc::Status AdminService::GetCluster(grpc::ServerContext*, const v1::GetClusterRequest* req,
                                      v1::GetClusterResponse* resp) {
  *resp = c_->GetCluster(*req);
  return grpc::Status::OK;
}
grpc::Status AdminService::ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*,
                                        v1::ListSessionsResponse* resp) {
  *resp = c_->ListSessions();
  return grpc::Status::OK;
}
grpc::Status AdminService::CloseSession(grpc::ServerContext*, const v1::AdminCloseSessionRequest* req,
                                        v1::AdminCloseSessionResponse* resp) {
  return Reply(c_->AdminCloseSession(*req), resp);
}

grpc::Status RegistryService::RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest* req,
                                             v1::RegisterWorkerResponse* resp) {
  return Reply(c_->RegisterWorker(*req), resp);
}
grpc::Status RegistryService::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                                        v1::HeartbeatResponse* resp) {
  resp->set_known(c_->Heartbeat(req->worker_id()));
  return grpc::Status::OK;
}
grpc::Status RegistryService::KvSet(grpc::ServerContext*, const v1::KvSetRequest* req, v1::KvSetResponse*) {
  return ToGrpc(kv_->Set(req->key(), req->value()));
}
grpc::Status RegistryService::KvGet(grpc::ServerContext* ctx, const v1::KvGetRequest* req, v1::KvGetResponse* resp) {
  // A waiting KvGet holds a server thread: bound the wait by a cap and by the
  // caller's own deadline.
  constexpr absl::Duration kMaxWait = absl::Minutes(10);
  absl::Duration wait = std::min(absl::Milliseconds(req->timeout_ms()), kMaxWait);
  wait = std::min(wait, absl::FromChrono(ctx->deadline()) - absl::Now());
  auto value = kv_->Get(req->key(), wait);
  if (!value.ok()) return ToGrpc(value.status());
  resp->set_value(std::move(*value));
  return grpc::Status::OK;
}

}  // namespace tessel::server
