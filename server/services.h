// The coordinator's gRPC services: thin shells that check the caller, unpack
// a request, call the Coordinator, and pack the reply.
//
// Callers: Session calls present a client token (bearer metadata) when the
// coordinator has an --auth_tokens_file, and may name only their tenant's
// sessions (PERMISSION_DENIED otherwise); Admin calls need an admin token;
// Registry calls present the cluster's join token when one is set, and
// heartbeats and rendezvous calls the worker's own id and secret.
#pragma once

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "server/coordinator.h"
#include "server/kv_store.h"
#include "tessel/v1/admin.grpc.pb.h"
#include "tessel/v1/session.grpc.pb.h"

namespace tessel::server {

class SessionService final : public v1::Session::Service {
 public:
  explicit SessionService(Coordinator* c) : c_(c) {}
  grpc::Status GetVersion(grpc::ServerContext*, const v1::GetVersionRequest*,
                          v1::GetVersionResponse*) override;
  grpc::Status OpenSession(grpc::ServerContext*, const v1::OpenSessionRequest*,
                           v1::OpenSessionResponse*) override;
  grpc::Status CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest*,
                            v1::CloseSessionResponse*) override;
  grpc::Status KeepAlive(grpc::ServerContext*, const v1::KeepAliveRequest*,
                         v1::KeepAliveResponse*) override;
  grpc::Status Compile(grpc::ServerContext*, const v1::CompileRequest*,
                       v1::CompileResponse*) override;
  grpc::Status Put(grpc::ServerContext*, grpc::ServerReader<v1::PutRequest>*,
                   v1::PutResponse*) override;
  grpc::Status PutDirect(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::PutDirectResponse, v1::PutDirectRequest>*) override;
  grpc::Status SetSessionOptions(grpc::ServerContext*, const v1::SetSessionOptionsRequest* req,
                                 v1::SetSessionOptionsResponse* resp) override;
  grpc::Status Dispatch(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::DispatchReplies, v1::DispatchBatch>* stream) override;
  grpc::Status Execute(grpc::ServerContext*, const v1::ExecuteRequest*,
                       v1::ExecuteResponse*) override;
  grpc::Status Await(grpc::ServerContext*, const v1::AwaitRequest*, v1::AwaitResponse*) override;
  grpc::Status Fetch(grpc::ServerContext*, const v1::FetchRequest*,
                     grpc::ServerWriter<v1::FetchResponse>*) override;
  grpc::Status Delete(grpc::ServerContext*, const v1::DeleteRequest*, v1::DeleteResponse*) override;
  grpc::Status Reshard(grpc::ServerContext*, const v1::ReshardRequest*,
                       v1::ReshardResponse*) override;
  grpc::Status ArrayInfo(grpc::ServerContext*, const v1::ArrayInfoRequest*,
                         v1::ArrayInfoResponse*) override;
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*, v1::StatsResponse*) override;
  grpc::Status ListDevices(grpc::ServerContext*, const v1::ListDevicesRequest*,
                           v1::ListDevicesResponse*) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext*, const v1::SaveCheckpointRequest*,
                              v1::SaveCheckpointResponse*) override;
  grpc::Status CommitCheckpoint(grpc::ServerContext*, const v1::CommitCheckpointRequest*,
                                v1::CommitCheckpointResponse*) override;
  grpc::Status ReadCheckpoint(grpc::ServerContext*, const v1::ReadCheckpointRequest*,
                              v1::ReadCheckpointResponse*) override;
  grpc::Status RestoreCheckpoint(grpc::ServerContext*, const v1::RestoreCheckpointRequest*,
                                 v1::RestoreCheckpointResponse*) override;
  grpc::Status ListCheckpoints(grpc::ServerContext*, const v1::ListCheckpointsRequest*,
                               v1::ListCheckpointsResponse*) override;
  grpc::Status RemoveCheckpoint(grpc::ServerContext*, const v1::RemoveCheckpointRequest*,
                                v1::RemoveCheckpointResponse*) override;
  grpc::Status PlanDot(grpc::ServerContext*, const v1::PlanDotRequest*,
                       v1::PlanDotResponse*) override;
  grpc::Status ClusterEvents(grpc::ServerContext*, const v1::ClusterEventsRequest*,
                             v1::ClusterEventsResponse*) override;
  grpc::Status HoldCheckpoints(grpc::ServerContext*, const v1::HoldCheckpointsRequest*,
                               v1::HoldCheckpointsResponse*) override;

 private:
  // UNAUTHENTICATED without a known token; PERMISSION_DENIED when `session`
  // is another tenant's. OK at once without authentication.
  grpc::Status Authorize(const grpc::ServerContext* ctx, const std::string& session);
  Coordinator* const c_;
  // The tenant of each session already checked (a session id is never
  // reused, so its tenant never changes); bounded, cleared when full.
  absl::Mutex tenants_mu_;
  absl::flat_hash_map<std::string, std::string> tenant_of_ ABSL_GUARDED_BY(tenants_mu_);
};

class AdminService final : public v1::Admin::Service {
 public:
  explicit AdminService(Coordinator* c) : c_(c) {}
  grpc::Status GetVersion(grpc::ServerContext*, const v1::GetVersionRequest*,
                          v1::GetVersionResponse*) override;
  grpc::Status GetCluster(grpc::ServerContext*, const v1::GetClusterRequest*,
                          v1::GetClusterResponse*) override;
  grpc::Status ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*,
                            v1::ListSessionsResponse*) override;
  grpc::Status CloseSession(grpc::ServerContext*, const v1::AdminCloseSessionRequest*,
                            v1::AdminCloseSessionResponse*) override;
  grpc::Status CordonWorker(grpc::ServerContext*, const v1::CordonWorkerRequest*,
                            v1::CordonWorkerResponse*) override;
  grpc::Status DrainWorker(grpc::ServerContext*, const v1::DrainWorkerRequest*,
                           v1::DrainWorkerResponse*) override;
  grpc::Status Reconcile(grpc::ServerContext*, const v1::ReconcileRequest*,
                         v1::ReconcileResponse*) override;
  grpc::Status StartTrace(grpc::ServerContext*, const v1::StartTraceRequest*,
                          v1::StartTraceResponse*) override;
  grpc::Status StopTrace(grpc::ServerContext*, const v1::StopTraceRequest*,
                         grpc::ServerWriter<v1::TraceChunk>*) override;

 private:
  grpc::Status Authorize(const grpc::ServerContext* ctx) const;
  Coordinator* const c_;
};

// `kv` serves KvSet/KvGet; both pointers are borrowed and must outlive the
// service. An empty `join_token` lets any caller register (loopback only).
class RegistryService final : public v1::Registry::Service {
 public:
  RegistryService(Coordinator* c, KvStore* kv, std::string join_token = "")
      : c_(c), kv_(kv), join_token_(std::move(join_token)) {}
  grpc::Status RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest*,
                              v1::RegisterWorkerResponse*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse*) override;
  grpc::Status KvSet(grpc::ServerContext*, const v1::KvSetRequest*, v1::KvSetResponse*) override;
  grpc::Status KvGet(grpc::ServerContext*, const v1::KvGetRequest*, v1::KvGetResponse*) override;

 private:
  grpc::Status CheckJoinToken(const grpc::ServerContext* ctx) const;
  Coordinator* const c_;
  KvStore* const kv_;
  const std::string join_token_;
};

}  // namespace tessel::server
