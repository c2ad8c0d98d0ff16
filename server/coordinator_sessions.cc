// Sessions and their arrays: open, close, keep alive, the transfer guard,
// await, delete and array info.
#include "server/coordinator.h"

#include <algorithm>
#include <optional>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "core/status.h"
#include "server/ids.h"

namespace tessel::server {

using absl::StrCat;
using absl::StrFormat;

namespace {

const char* DirectionName(int dir) {
  static const char* const kNames[] = {"host->device", "device->host", "device->device"};
  return kNames[dir];
}

const char* LevelName(v1::TransferLevel l) {
  switch (l) {
    case v1::TRANSFER_LOG: return "log";
    case v1::TRANSFER_DISALLOW: return "disallow";
    case v1::TRANSFER_LOG_EXPLICIT: return "log_explicit";
    case v1::TRANSFER_DISALLOW_EXPLICIT: return "disallow_explicit";
    default: return "allow";
  }
}

v1::TransferLevel LevelFor(const v1::TransferGuard& g, int dir) {
  switch (dir) {
    case 0: return g.host_to_device();
    case 1: return g.device_to_host();
    default: return g.device_to_device();
  }
}

}  // namespace

// ---------------------------------------------------------------- sessions

absl::StatusOr<v1::OpenSessionResponse> Coordinator::OpenSession(const v1::OpenSessionRequest& req,
                                                                 const std::string& tenant) {
  v1::OpenSessionResponse resp;
  resp.set_session_id(StrFormat("s%016x.%s", RandomU64(), incarnation_));
  resp.set_lease_ms(absl::ToInt64Milliseconds(options_.session_lease));
  TESSEL_RETURN_IF_ERROR(arrays_.OpenSession(resp.session_id(), req.client(), req.options(), tenant,
                                             tenants()->LimitsOf(tenant)));
  log_->info("session {} opened by '{}' (tenant {})", resp.session_id(), req.client(), tenant);
  return resp;
}

absl::Status Coordinator::CheckTenant(const std::string& session, const std::string& tenant) const {
  TESSEL_ASSIGN_OR_RETURN(const ArrayRegistry::SessionView s, arrays_.ViewSession(session));
  if (s.tenant != tenant) {
    return absl::PermissionDeniedError(StrCat("session ", session, " belongs to another tenant"));
  }
  return absl::OkStatus();
}

absl::Status Coordinator::SetSessionOptions(const v1::SetSessionOptionsRequest& req) {
  TESSEL_RETURN_IF_ERROR(arrays_.ViewSession(req.session_id()).status());
  if (req.options().memory_quota_bytes() < 0) {
    return absl::InvalidArgumentError(
        StrCat("memory_quota_bytes: expected >= 0, got ", req.options().memory_quota_bytes()));
  }
  return arrays_.SetSessionOptions(req.session_id(), req.options());
}

absl::StatusOr<int64_t> Coordinator::EndSession(const std::string& id, const std::string& why,
                                                absl::Duration idle_for) {
  std::vector<PendingFree> frees;
  int64_t freed = 0;
  {
    ArrayRegistry::Transaction l(arrays_);
    if (idle_for > absl::ZeroDuration()) {
      // A call may have renewed the lease since the session was found idle.
      const SessionRecord* s = arrays_.FindSessionLocked(id);
      if (s == nullptr || absl::Now() - s->last_seen < idle_for) return 0;
    }
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(id));
    SessionRecord& s = arrays_.SessionLocked(id);
    std::vector<uint64_t> handles(s.arrays.begin(), s.arrays.end());
    const int64_t bytes = s.live_bytes;
    frees = FreeArraysLocked(handles);
    arrays_.EraseSessionLocked(id, why);
    freed = handles.size();
    log_->info("session {} {}; {} arrays ({} bytes) freed", id, why.empty() ? "closed" : why, freed,
               bytes);
  }
  SendFrees(std::move(frees));
  return freed;
}

absl::StatusOr<v1::CloseSessionResponse> Coordinator::CloseSession(
    const v1::CloseSessionRequest& req) {
  v1::CloseSessionResponse resp;
  TESSEL_ASSIGN_OR_RETURN(int64_t freed, EndSession(req.session_id(), ""));
  resp.set_arrays_freed(freed);
  return resp;
}

absl::StatusOr<v1::KeepAliveResponse> Coordinator::KeepAlive(const v1::KeepAliveRequest& req) {
  TESSEL_RETURN_IF_ERROR(arrays_.ViewSession(req.session_id()).status());  // renews the lease
  v1::KeepAliveResponse resp;
  resp.set_lease_ms(absl::ToInt64Milliseconds(options_.session_lease));
  return resp;
}

v1::ListSessionsResponse Coordinator::ListSessions() {
  v1::ListSessionsResponse resp;
  const absl::Time now = absl::Now();
  const int64_t lease_ms = absl::ToInt64Milliseconds(options_.session_lease);
  ArrayRegistry::Transaction l(arrays_);
  arrays_.ForEachSessionLocked([&](const std::string& id, const SessionRecord& s) {
    v1::SessionInfo* info = resp.add_sessions();
    info->set_session_id(id);
    info->set_client(s.client);
    info->set_tenant(s.tenant);
    info->set_arrays(s.arrays.size());
    info->set_live_bytes(s.live_bytes);
    info->set_executions(s.executions);
    info->set_age_ms(absl::ToInt64Milliseconds(now - s.opened));
    info->set_idle_ms(absl::ToInt64Milliseconds(now - s.last_seen));
    info->set_lease_ms(lease_ms);
  });
  std::sort(
      resp.mutable_sessions()->begin(), resp.mutable_sessions()->end(),
      [](const v1::SessionInfo& a, const v1::SessionInfo& b) { return a.age_ms() > b.age_ms(); });
  return resp;
}

absl::StatusOr<v1::AdminCloseSessionResponse> Coordinator::AdminCloseSession(
    const v1::AdminCloseSessionRequest& req) {
  const std::string why =
      StrCat("was closed by an operator (Admin.CloseSession)",
             req.reason().empty() ? "" : StrCat(": ", req.reason().substr(0, 512)));
  TESSEL_ASSIGN_OR_RETURN(int64_t freed, EndSession(req.session_id(), why));
  v1::AdminCloseSessionResponse resp;
  resp.set_arrays_freed(freed);
  return resp;
}

absl::Status Coordinator::GuardTransferLocked(const std::string& session,
                                              const v1::TransferGuard& call, Direction dir,
                                              bool implicit, absl::string_view what,
                                              int64_t bytes) const {
  const int d = static_cast<int>(dir);
  v1::TransferLevel level = LevelFor(call, d);
  const bool from_call = level != v1::TRANSFER_UNSET;
  if (!from_call) {
    const SessionRecord* s = arrays_.FindSessionLocked(session);
    if (s != nullptr) level = LevelFor(s->options.transfer_guard(), d);
  }
  const bool covers =
      implicit || level == v1::TRANSFER_LOG_EXPLICIT || level == v1::TRANSFER_DISALLOW_EXPLICIT;
  if (!covers) return absl::OkStatus();
  const std::string text =
      StrFormat("%s %s transfer of %s (%d bytes)", implicit ? "implicit" : "explicit",
                DirectionName(d), what, bytes);
  if (level == v1::TRANSFER_DISALLOW || level == v1::TRANSFER_DISALLOW_EXPLICIT) {
    return absl::FailedPreconditionError(StrCat("transfer guard: ", text, " is disallowed (",
                                                LevelName(level), " set by the ",
                                                from_call ? "call" : "session", ")"));
  }
  if (level == v1::TRANSFER_LOG || level == v1::TRANSFER_LOG_EXPLICIT) {
    log_->warn("session {}: transfer guard: {}", session, text);
  }
  return absl::OkStatus();
}

uint64_t Coordinator::FreshHandleLocked() const {
  uint64_t h = 0;
  while (h == 0 || arrays_.ContainsLocked(h)) h = RandomU64();
  return h;
}

absl::Status Coordinator::AwaitAll(const std::string& session, absl::Span<const uint64_t> handles,
                                   absl::string_view what) {
  v1::AwaitRequest await;
  await.set_session_id(session);
  await.mutable_handles()->Add(handles.begin(), handles.end());
  TESSEL_ASSIGN_OR_RETURN(v1::AwaitResponse done, Await(await));
  for (int i = 0; i < done.errors_size(); ++i) {
    if (!done.errors(i).empty()) {
      return absl::Status(static_cast<absl::StatusCode>(done.codes(i)),
                          StrCat(what, " failed: ", done.errors(i)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::AwaitResponse> Coordinator::Await(const v1::AwaitRequest& req) {
  std::vector<uint64_t> handles(req.handles().begin(), req.handles().end());
  ArrayRegistry::Transaction l(arrays_);
  TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
  for (uint64_t h : handles)
    TESSEL_RETURN_IF_ERROR(arrays_.OwnedLocked(req.session_id(), h).status());
  const absl::Duration timeout =
      req.timeout_ms() > 0 ? absl::Milliseconds(req.timeout_ms()) : absl::InfiniteDuration();
  if (!arrays_.AwaitNotPendingLocked(handles, timeout)) {
    return absl::DeadlineExceededError(
        StrCat("arrays still pending after ", req.timeout_ms(), " ms"));
  }
  v1::AwaitResponse resp;
  for (uint64_t h : handles) {
    const ArrayRecord* a = arrays_.FindLocked(h);
    if (a == nullptr) {
      resp.add_states(v1::DELETED);
      resp.add_errors(StrFormat("array %#x was deleted while awaited", h));
      resp.add_codes(int(absl::StatusCode::kNotFound));
      continue;
    }
    resp.add_states(a->state);
    resp.add_errors(a->error.ok() ? "" : std::string(a->error.message()));
    resp.add_codes(int(a->error.code()));
  }
  return resp;
}

// ---------------------------------------------------------------- delete / info

std::vector<PendingFree> Coordinator::FreeArraysLocked(const std::vector<uint64_t>& handles) {
  // One sequenced free per device, numbered after every step sent there.
  return workers_.SequenceFrees(arrays_.RetireDeletedLocked(handles));
}

void Coordinator::SendFrees(std::vector<PendingFree> frees) {
  for (PendingFree& f : frees) {
    f.client->Free(f.request, [log = log_, d = f.device](absl::Status s) {
      if (!s.ok()) log->warn("free on device {} failed: {}", d, s.ToString());
    });
  }
}

absl::Status Coordinator::Delete(const v1::DeleteRequest& req) {
  std::vector<PendingFree> frees;
  {
    ArrayRegistry::Transaction l(arrays_);
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
    for (uint64_t h : req.handles())
      TESSEL_RETURN_IF_ERROR(arrays_.OwnedLocked(req.session_id(), h).status());
    frees = FreeArraysLocked(std::vector<uint64_t>(req.handles().begin(), req.handles().end()));
  }
  SendFrees(std::move(frees));
  return absl::OkStatus();
}

void Coordinator::Release(const std::string& session,
                          const google::protobuf::RepeatedField<uint64_t>& handles) {
  std::vector<PendingFree> frees;
  {
    ArrayRegistry::Transaction l(arrays_);
    if (!arrays_.CheckSessionLocked(session).ok()) return;
    std::vector<uint64_t> owned;
    owned.reserve(handles.size());
    for (uint64_t h : handles) {
      if (arrays_.OwnedLocked(session, h).ok()) owned.push_back(h);
    }
    frees = FreeArraysLocked(owned);
  }
  SendFrees(std::move(frees));
}

absl::StatusOr<v1::ArrayInfoResponse> Coordinator::ArrayInfo(const v1::ArrayInfoRequest& req) {
  ArrayRegistry::Transaction l(arrays_);
  TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
  v1::ArrayInfoResponse resp;
  auto a_or = arrays_.OwnedLocked(req.session_id(), req.handle());
  if (!a_or.ok()) {
    // A retired array still answers what became of it.
    const Tombstone* t = arrays_.FindTombstoneLocked(req.session_id(), req.handle());
    if (t == nullptr) return a_or.status();
    resp.set_state(t->state);
    resp.set_error(BoundedMessage(a_or.status().message()));
    resp.set_producer_execution(t->execution);
    return resp;
  }
  const ArrayRecord* a = *a_or;
  *resp.mutable_type() = a->type;
  resp.set_state(a->state);
  for (int d : a->devices) resp.add_devices(d);
  resp.set_bytes_per_device(a->device_bytes());
  for (size_t i = 0; i < a->devices.size(); ++i) resp.add_device_bytes(a->device_bytes());
  if (a->sharded) {
    *resp.mutable_sharding()->mutable_mesh() = a->mesh;
    *resp.mutable_sharding()->mutable_sharding() = a->sharding;
  }
  if (!a->error.ok()) resp.set_error(BoundedMessage(a->error.message()));
  resp.set_producer_execution(a->producer);
  resp.set_producer(a->producer_name);
  return resp;
}

}  // namespace tessel::server
