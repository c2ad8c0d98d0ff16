#include "server/services.h"

#include "absl/strings/str_format.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/rpc_status.h"
#include "core/security.h"
#include "core/trace.h"
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

grpc::Status SessionService::Authorize(const grpc::ServerContext* ctx, const std::string& session) {
  const std::shared_ptr<const Tenants> tenants = c_->tenants();
  if (!tenants->authenticating()) return grpc::Status::OK;
  auto who = tenants->Authenticate(BearerToken(*ctx));
  if (!who.ok()) return ToGrpc(who.status());
  {
    absl::ReaderMutexLock l(&tenants_mu_);
    if (auto it = tenant_of_.find(session); it != tenant_of_.end()) {
      if (it->second == who->tenant) return grpc::Status::OK;
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          absl::StrCat("session ", session, " belongs to another tenant"));
    }
  }
  // Not seen yet: the coordinator says whose it is (or that it is gone).
  if (absl::Status s = c_->CheckTenant(session, who->tenant); !s.ok()) return ToGrpc(s);
  absl::MutexLock l(&tenants_mu_);
  constexpr size_t kMaxRemembered = 1 << 16;
  if (tenant_of_.size() >= kMaxRemembered) tenant_of_.clear();
  tenant_of_.emplace(session, who->tenant);
  return grpc::Status::OK;
}

grpc::Status AdminService::Authorize(const grpc::ServerContext* ctx) const {
  auto who = c_->tenants()->Authenticate(BearerToken(*ctx));
  if (!who.ok()) return ToGrpc(who.status());
  if (!who->admin) {
    return grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        "tessel.v1.Admin: tenant " + who->tenant + "'s token is not an admin token");
  }
  return grpc::Status::OK;
}

grpc::Status RegistryService::CheckJoinToken(const grpc::ServerContext* ctx) const {
  if (join_token_.empty() || SecretEquals(BearerToken(*ctx), join_token_)) return grpc::Status::OK;
  return grpc::Status(
      grpc::StatusCode::UNAUTHENTICATED,
      "tessel.v1.Registry: workers join with the cluster's join token (--join_token_file)");
}

grpc::Status SessionService::GetVersion(grpc::ServerContext*, const v1::GetVersionRequest* req,
                                        v1::GetVersionResponse* resp) {
  return Version(req, resp);
}
grpc::Status SessionService::OpenSession(grpc::ServerContext* ctx,
                                         const v1::OpenSessionRequest* req,
                                         v1::OpenSessionResponse* resp) {
  auto who = c_->tenants()->Authenticate(BearerToken(*ctx));
  if (!who.ok()) return ToGrpc(who.status());
  return Reply(c_->OpenSession(*req, who->tenant), resp);
}
grpc::Status SessionService::CloseSession(grpc::ServerContext* ctx,
                                          const v1::CloseSessionRequest* req,
                                          v1::CloseSessionResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->CloseSession(*req), resp);
}
grpc::Status SessionService::KeepAlive(grpc::ServerContext* ctx, const v1::KeepAliveRequest* req,
                                       v1::KeepAliveResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->KeepAlive(*req), resp);
}
grpc::Status SessionService::Compile(grpc::ServerContext* ctx, const v1::CompileRequest* req,
                                     v1::CompileResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->Compile(*req), resp);
}
grpc::Status SessionService::Put(grpc::ServerContext* ctx,
                                 grpc::ServerReader<v1::PutRequest>* reader,
                                 v1::PutResponse* resp) {
  v1::PutRequest msg;
  if (!reader->Read(&msg) || !msg.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "Put: the first message must be a header");
  }
  if (grpc::Status a = Authorize(ctx, msg.header().session_id()); !a.ok()) return a;
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
grpc::Status SessionService::PutDirect(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::PutDirectResponse, v1::PutDirectRequest>* stream) {
  v1::PutDirectRequest msg;
  if (!stream->Read(&msg) || !msg.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "PutDirect: the first message must be a header");
  }
  if (grpc::Status a = Authorize(ctx, msg.header().session_id()); !a.ok()) return a;
  const uint64_t handle = msg.header().handle();
  auto put = c_->BeginDirectPut(msg.header());
  if (!put.ok()) return ToGrpc(put.status());
  v1::PutDirectResponse resp;
  if (*put == nullptr) {
    resp.set_relay(true);
    stream->Write(resp);
    return grpc::Status::OK;
  }
  resp.mutable_blocks()->Add((*put)->blocks().begin(), (*put)->blocks().end());
  if (!stream->Write(resp))
    return grpc::Status(grpc::StatusCode::CANCELLED, "PutDirect: the client went away");
  // The client writes the blocks to the workers, then says it is done; a
  // stream that ends first abandons the put (the array is freed).
  if (!stream->Read(&msg) || !msg.has_done()) {
    return grpc::Status(
        grpc::StatusCode::ABORTED,
        absl::StrFormat("put of array %#x: the stream ended before the client said every block was "
                        "written; the array is freed",
                        handle));
  }
  const std::vector<std::string> receipts(msg.done().receipts().begin(),
                                          msg.done().receipts().end());
  auto bytes = (*put)->Commit(msg.done().error(), receipts);
  if (!bytes.ok()) return ToGrpc(bytes.status());
  resp.Clear();
  resp.set_bytes(*bytes);
  stream->Write(resp);
  return grpc::Status::OK;
}
grpc::Status SessionService::SetSessionOptions(grpc::ServerContext* ctx,
                                               const v1::SetSessionOptionsRequest* req,
                                               v1::SetSessionOptionsResponse*) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return ToGrpc(c_->SetSessionOptions(*req));
}
grpc::Status SessionService::Dispatch(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::DispatchReplies, v1::DispatchBatch>* stream) {
  v1::DispatchBatch batch;
  v1::DispatchReplies replies;
  std::string authorized;                          // the session last checked on this stream
  std::shared_ptr<const Tenants> checked_against;  // and the tokens it was checked against
  while (stream->Read(&batch)) {
    replies.Clear();
    // A reloaded tokens file (a revoked token) applies to open streams too.
    if (std::shared_ptr<const Tenants> now = c_->tenants(); now != checked_against) {
      checked_against = std::move(now);
      authorized.clear();
    }
    std::vector<int> awaited;  // replies that wait for their outputs, once the batch is dispatched
    {  // the batch's steps go to each worker in a few writes, when it is dispatched
      HeldSteps hold;
      for (v1::ExecuteRequest& req : *batch.mutable_calls()) {
        const bool client_reads_reply = req.wait() || req.await_outputs();
        req.set_wait(false);
        absl::Status denied;
        if (req.session_id() != authorized) {
          denied = FromGrpc(Authorize(ctx, req.session_id()));
          if (denied.ok()) authorized = req.session_id();
        }
        if (req.executable_id().empty() && req.await_outputs()) {
          // An Await of `outputs` in stream order: after every call before
          // it, with no flush and no second round trip.
          v1::DispatchReply* reply = replies.add_replies();
          if (denied.ok()) {
            awaited.push_back(replies.replies_size() - 1);
          } else {
            reply->set_code(static_cast<int>(denied.code()));
            reply->set_error(BoundedMessage(denied.message()));
          }
          continue;
        }
        auto r = denied.ok() ? c_->Execute(req) : absl::StatusOr<v1::ExecuteResponse>(denied);
        v1::DispatchReply* reply = replies.add_replies();
        if (r.ok()) {
          *reply->mutable_response() = std::move(*r);
          if (req.await_outputs()) awaited.push_back(replies.replies_size() - 1);
        } else {
          reply->set_code(static_cast<int>(r.status().code()));
          reply->set_error(BoundedMessage(r.status().message()));
          // A refused caller's handles are not its own to mark.
          if (!client_reads_reply && denied.ok()) c_->MarkRejectedOutputs(req, r.status());
        }
      }
    }
    for (int i : awaited) {
      const v1::ExecuteRequest& req = batch.calls(i);
      v1::AwaitRequest await;
      await.set_session_id(req.session_id());
      *await.mutable_handles() = req.outputs();
      v1::DispatchReply* reply = replies.mutable_replies(i);
      auto done = c_->Await(await);
      if (done.ok()) {
        *reply->mutable_outputs() = std::move(*done);
      } else {
        reply->set_code(static_cast<int>(done.status().code()));
        reply->set_error(BoundedMessage(done.status().message()));
      }
    }
    if (!stream->Write(replies)) break;
  }
  return grpc::Status::OK;
}
grpc::Status SessionService::Execute(grpc::ServerContext* ctx, const v1::ExecuteRequest* req,
                                     v1::ExecuteResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->Execute(*req), resp);
}
grpc::Status SessionService::Await(grpc::ServerContext* ctx, const v1::AwaitRequest* req,
                                   v1::AwaitResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->Await(*req), resp);
}
grpc::Status SessionService::Fetch(grpc::ServerContext* ctx, const v1::FetchRequest* req,
                                   grpc::ServerWriter<v1::FetchResponse>* writer) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  auto src = c_->BeginFetch(*req);
  if (!src.ok()) return ToGrpc(src.status());
  v1::FetchResponse msg;
  *msg.mutable_type() = (*src)->type();
  if (const std::vector<v1::DirectBlock>* plan = (*src)->direct(); plan != nullptr) {
    msg.mutable_direct_blocks()->Add(plan->begin(), plan->end());
    writer->Write(msg);
    return grpc::Status::OK;
  }
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
grpc::Status SessionService::Delete(grpc::ServerContext* ctx, const v1::DeleteRequest* req,
                                    v1::DeleteResponse*) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return ToGrpc(c_->Delete(*req));
}
grpc::Status SessionService::Reshard(grpc::ServerContext* ctx, const v1::ReshardRequest* req,
                                     v1::ReshardResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->Reshard(*req), resp);
}
grpc::Status SessionService::ArrayInfo(grpc::ServerContext* ctx, const v1::ArrayInfoRequest* req,
                                       v1::ArrayInfoResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->ArrayInfo(*req), resp);
}
grpc::Status SessionService::Stats(grpc::ServerContext* ctx, const v1::StatsRequest* req,
                                   v1::StatsResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  // Each device's own figures cover every tenant's arrays: an admin's only.
  auto who = c_->tenants()->Authenticate(BearerToken(*ctx));
  return Reply(c_->Stats(*req, /*tenant_view=*/!who.ok() || !who->admin), resp);
}
grpc::Status SessionService::ListDevices(grpc::ServerContext* ctx,
                                         const v1::ListDevicesRequest* req,
                                         v1::ListDevicesResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->ListDevices(*req), resp);
}
grpc::Status SessionService::SaveCheckpoint(grpc::ServerContext* ctx,
                                            const v1::SaveCheckpointRequest* req,
                                            v1::SaveCheckpointResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->SaveCheckpoint(*req), resp);
}
grpc::Status SessionService::CommitCheckpoint(grpc::ServerContext* ctx,
                                              const v1::CommitCheckpointRequest* req,
                                              v1::CommitCheckpointResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->CommitCheckpoint(*req), resp);
}
grpc::Status SessionService::ReadCheckpoint(grpc::ServerContext* ctx,
                                            const v1::ReadCheckpointRequest* req,
                                            v1::ReadCheckpointResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->ReadCheckpoint(*req), resp);
}
grpc::Status SessionService::RestoreCheckpoint(grpc::ServerContext* ctx,
                                               const v1::RestoreCheckpointRequest* req,
                                               v1::RestoreCheckpointResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->RestoreCheckpoint(*req), resp);
}
grpc::Status SessionService::ListCheckpoints(grpc::ServerContext* ctx,
                                             const v1::ListCheckpointsRequest* req,
                                             v1::ListCheckpointsResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->ListCheckpoints(*req), resp);
}
grpc::Status SessionService::RemoveCheckpoint(grpc::ServerContext* ctx,
                                              const v1::RemoveCheckpointRequest* req,
                                              v1::RemoveCheckpointResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return ToGrpc(c_->RemoveCheckpoint(*req));
}
grpc::Status SessionService::HoldCheckpoints(grpc::ServerContext* ctx,
                                             const v1::HoldCheckpointsRequest* req,
                                             v1::HoldCheckpointsResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return ToGrpc(c_->HoldCheckpoints(*req));
}
grpc::Status SessionService::PlanDot(grpc::ServerContext* ctx, const v1::PlanDotRequest* req,
                                     v1::PlanDotResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->PlanDot(*req), resp);
}
grpc::Status SessionService::ClusterEvents(grpc::ServerContext* ctx,
                                           const v1::ClusterEventsRequest* req,
                                           v1::ClusterEventsResponse* resp) {
  if (grpc::Status a = Authorize(ctx, req->session_id()); !a.ok()) return a;
  return Reply(c_->ClusterEvents(*req), resp);
}

grpc::Status AdminService::GetVersion(grpc::ServerContext*, const v1::GetVersionRequest* req,
                                      v1::GetVersionResponse* resp) {
  return Version(req, resp);
}
grpc::Status AdminService::GetCluster(grpc::ServerContext* ctx, const v1::GetClusterRequest* req,
                                      v1::GetClusterResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  *resp = c_->GetCluster(*req);
  return grpc::Status::OK;
}
grpc::Status AdminService::ListSessions(grpc::ServerContext* ctx, const v1::ListSessionsRequest*,
                                        v1::ListSessionsResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  *resp = c_->ListSessions();
  return grpc::Status::OK;
}
grpc::Status AdminService::CloseSession(grpc::ServerContext* ctx,
                                        const v1::AdminCloseSessionRequest* req,
                                        v1::AdminCloseSessionResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  return Reply(c_->AdminCloseSession(*req), resp);
}

grpc::Status AdminService::CordonWorker(grpc::ServerContext* ctx,
                                        const v1::CordonWorkerRequest* req,
                                        v1::CordonWorkerResponse*) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  return ToGrpc(c_->CordonWorker(*req));
}
grpc::Status AdminService::DrainWorker(grpc::ServerContext* ctx, const v1::DrainWorkerRequest* req,
                                       v1::DrainWorkerResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  return Reply(c_->DrainWorker(*req), resp);
}
grpc::Status AdminService::Reconcile(grpc::ServerContext* ctx, const v1::ReconcileRequest*,
                                     v1::ReconcileResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  *resp = c_->Reconcile();
  return grpc::Status::OK;
}

grpc::Status AdminService::StartTrace(grpc::ServerContext* ctx, const v1::StartTraceRequest* req,
                                      v1::StartTraceResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  return Reply(c_->StartTrace(*req), resp);
}
grpc::Status AdminService::StopTrace(grpc::ServerContext* ctx, const v1::StopTraceRequest*,
                                     grpc::ServerWriter<v1::TraceChunk>* writer) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  auto json = c_->StopTrace();
  if (!json.ok()) return ToGrpc(json.status());
  constexpr size_t kChunk = 1 << 20;
  v1::TraceChunk chunk;
  chunk.set_coordinator_unix_ns(trace::NowNs());
  for (size_t off = 0; off < json->size(); off += kChunk) {
    chunk.set_json(json->substr(off, kChunk));
    if (!writer->Write(chunk))
      return grpc::Status(grpc::StatusCode::CANCELLED, "StopTrace: the client went away");
    chunk.clear_coordinator_unix_ns();
  }
  return grpc::Status::OK;
}

grpc::Status RegistryService::RegisterWorker(grpc::ServerContext* ctx,
                                             const v1::RegisterWorkerRequest* req,
                                             v1::RegisterWorkerResponse* resp) {
  if (grpc::Status a = CheckJoinToken(ctx); !a.ok()) return a;
  grpc::Status s = Reply(c_->RegisterWorker(*req), resp);
  resp->set_coordinator_unix_ns(trace::NowNs());
  return s;
}
grpc::Status RegistryService::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                                        v1::HeartbeatResponse* resp) {
  if (grpc::Status a = CheckJoinToken(ctx); !a.ok()) return a;
  auto known = c_->Heartbeat(req->worker_id(), req->worker_secret(), req->draining(),
                             absl::Milliseconds(req->drain_ms()));
  if (!known.ok()) return ToGrpc(known.status());
  resp->set_known(*known);
  resp->set_coordinator_unix_ns(trace::NowNs());
  return grpc::Status::OK;
}
grpc::Status RegistryService::KvSet(grpc::ServerContext* ctx, const v1::KvSetRequest* req,
                                    v1::KvSetResponse*) {
  if (grpc::Status a = CheckJoinToken(ctx); !a.ok()) return a;
  if (auto s = c_->CheckKvCaller(req->worker_id(), req->worker_secret(), req->key()); !s.ok())
    return ToGrpc(s);
  return ToGrpc(kv_->Set(req->key(), req->value(), req->worker_id()));
}
grpc::Status RegistryService::KvGet(grpc::ServerContext* ctx, const v1::KvGetRequest* req,
                                    v1::KvGetResponse* resp) {
  if (grpc::Status a = CheckJoinToken(ctx); !a.ok()) return a;
  if (auto s = c_->CheckKvCaller(req->worker_id(), req->worker_secret(), req->key()); !s.ok())
    return ToGrpc(s);
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
