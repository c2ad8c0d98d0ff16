// Session's checkpoints (docs/checkpoints.md; the coordinator plans them,
// the workers write and read the bytes, this client names the arrays) and
// its plan diagrams (PlanDot).
#include "absl/strings/str_cat.h"
#include "client/src/convert_internal.h"
#include "client/src/session_impl_internal.h"
#include "core/rpc_status.h"
#include "core/status.h"

namespace tessel {

absl::StatusOr<PendingCheckpoint> Session::SaveCheckpoint(
    const std::string& path, const std::vector<std::pair<std::string, Array>>& arrays,
    const std::string& metadata_json) {
  TESSEL_RETURN_IF_ERROR(impl_->Flush());
  v1::SaveCheckpointRequest req;
  req.set_session_id(impl_->id);
  req.set_path(path);
  req.set_metadata(metadata_json);
  for (const auto& [name, array] : arrays) {
    v1::CheckpointArray* a = req.add_arrays();
    a->set_name(name);
    a->set_handle(array.handle());
  }
  grpc::ClientContext ctx;
  v1::SaveCheckpointResponse resp;
  TESSEL_RETURN_IF_ERROR(FromGrpc(impl_->session->SaveCheckpoint(&ctx, req, &resp)));
  return PendingCheckpoint{resp.checkpoint(), path, resp.bytes(), resp.chunks()};
}

absl::Status Session::CommitCheckpoint(const PendingCheckpoint& save) {
  v1::CommitCheckpointRequest req;
  req.set_session_id(impl_->id);
  req.set_checkpoint(save.checkpoint);
  grpc::ClientContext ctx;
  v1::CommitCheckpointResponse resp;
  return FromGrpc(impl_->session->CommitCheckpoint(&ctx, req, &resp));
}

absl::StatusOr<std::vector<Array>> Session::RestoreCheckpoint(
    const std::string& path, const std::vector<CheckpointTarget>& arrays) {
  TESSEL_RETURN_IF_ERROR(impl_->Flush());
  v1::RestoreCheckpointRequest req;
  req.set_session_id(impl_->id);
  req.set_path(path);
  std::vector<Array> out;
  for (const CheckpointTarget& t : arrays) {
    v1::CheckpointArray* a = req.add_arrays();
    a->set_name(t.name);
    a->set_handle(impl_->NewHandle());
    *a->mutable_type() = ToProto(t.type);
    *a->mutable_placement() = ToProto(t.placement);
    out.push_back(Array(a->handle(), t.type));
  }
  grpc::ClientContext ctx;
  v1::RestoreCheckpointResponse resp;
  TESSEL_RETURN_IF_ERROR(FromGrpc(impl_->session->RestoreCheckpoint(&ctx, req, &resp)));
  return out;
}

absl::StatusOr<std::vector<std::string>> Session::ListCheckpoints(const std::string& directory) {
  v1::ListCheckpointsRequest req;
  req.set_session_id(impl_->id);
  req.set_directory(directory);
  grpc::ClientContext ctx;
  v1::ListCheckpointsResponse resp;
  TESSEL_RETURN_IF_ERROR(FromGrpc(impl_->session->ListCheckpoints(&ctx, req, &resp)));
  return std::vector<std::string>(resp.committed().begin(), resp.committed().end());
}

absl::Status Session::RemoveCheckpoint(const std::string& path) {
  v1::RemoveCheckpointRequest req;
  req.set_session_id(impl_->id);
  req.set_path(path);
  grpc::ClientContext ctx;
  v1::RemoveCheckpointResponse resp;
  return FromGrpc(impl_->session->RemoveCheckpoint(&ctx, req, &resp));
}

absl::Status Session::HoldCheckpoints(const std::string& directory, bool release) {
  v1::HoldCheckpointsRequest req;
  req.set_session_id(impl_->id);
  req.set_directory(directory);
  req.set_release(release);
  grpc::ClientContext ctx;
  v1::HoldCheckpointsResponse resp;
  return FromGrpc(impl_->session->HoldCheckpoints(&ctx, req, &resp));
}

absl::StatusOr<std::string> Session::PlanDot(const Executable& exe) {
  v1::PlanDotRequest req;
  req.set_session_id(impl_->id);
  req.set_executable_id(exe.id());
  grpc::ClientContext ctx;
  v1::PlanDotResponse resp;
  TESSEL_RETURN_IF_ERROR(FromGrpc(impl_->session->PlanDot(&ctx, req, &resp)));
  return resp.dot();
}

}  // namespace tessel
