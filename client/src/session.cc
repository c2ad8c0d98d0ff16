#include "tessel/session.h"

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <random>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/src/convert_internal.h"
#include "client/src/direct_transfer_internal.h"
#include "client/src/dispatcher_internal.h"
#include "client/src/graph_internal.h"
#include "client/src/session_impl_internal.h"
#include "core/rpc_status.h"
#include "core/security.h"
#include "core/status.h"
#include "core/version.h"
#include "tessel/v1/admin.grpc.pb.h"
#include "tessel/v1/session.grpc.pb.h"

namespace tessel {

int ClusterStatus::num_devices() const {
  int n = 0;
  for (const WorkerStatus& w : workers) n += w.alive ? w.devices.size() : 0;
  return n;
}

absl::StatusOr<std::string> ResolveCoordinatorAddress(const std::string& flag_value) {
  if (!flag_value.empty()) return flag_value;
  if (const char* env = std::getenv("TESSEL_COORDINATOR"); env != nullptr && *env != '\0')
    return std::string(env);
  return absl::InvalidArgumentError(
      "no coordinator address: pass --coordinator=HOST:PORT or set TESSEL_COORDINATOR");
}

namespace {

v1::TransferLevel ToProto(TransferLevel l) {
  return static_cast<v1::TransferLevel>(static_cast<int>(l));
}

v1::TransferGuard ToProto(const TransferGuard& g) {
  v1::TransferGuard out;
  out.set_host_to_device(ToProto(g.host_to_device));
  out.set_device_to_host(ToProto(g.device_to_host));
  out.set_device_to_device(ToProto(g.device_to_device));
  return out;
}

v1::SessionOptions ToProto(const SessionOptions& o) {
  v1::SessionOptions out;
  *out.mutable_transfer_guard() = ToProto(o.transfer_guard);
  out.set_strict_donation(o.strict_donation);
  out.set_forbid_compiles(o.forbid_compiles);
  out.set_memory_quota_bytes(o.memory_quota_bytes);
  return out;
}

ArrayState FromProto(v1::ArrayState s) { return static_cast<ArrayState>(static_cast<int>(s) - 1); }

DonationReceipt FromProto(const v1::DonationReceipt& r) {
  return DonationReceipt{r.argument(), r.handle(),        r.reused(),
                         r.output(),   r.output_handle(), r.reason()};
}

}  // namespace

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Session::~Session() {
  impl_->StopKeepAlive();
  {
    absl::MutexLock l(&impl_->mu);
    impl_->dispatch.reset();
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::CloseSessionRequest req;
  req.set_session_id(impl_->id);
  v1::CloseSessionResponse resp;
  (void)impl_->session->CloseSession(&ctx, req, &resp);
}

absl::StatusOr<std::unique_ptr<Session>> Session::Connect(const std::string& address,
                                                          ConnectOptions options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  auto from_env = [](std::string& field, const char* var) {
    if (const char* v = std::getenv(var); field.empty() && v != nullptr) field = v;
  };
  from_env(options.token, "TESSEL_TOKEN");
  from_env(options.tls_ca_file, "TESSEL_TLS_CA");
  const TlsFiles tls{options.tls_cert_file, options.tls_key_file, options.tls_ca_file};
  if (absl::Status s = CheckTlsFiles(tls, /*server=*/false); !s.ok()) return s;
  const grpc::ChannelArguments worker_args = args;  // workers are checked against their own names
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  auto channel = CreateChannelWithToken(address, ChannelCredentials(tls), args, options.token);
  const int timeout = options.connect_timeout_ms;
  auto impl = std::make_unique<Impl>(
      channel, std::move(options),
      std::make_unique<WorkerChannels>(ChannelCredentials(tls), worker_args));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout));
    // Fail fast: a refused port answers at once; the deadline bounds an
    // address that does not answer at all.
    ctx.set_wait_for_ready(false);
    v1::GetVersionRequest req;
    req.set_min_version(kProtocolVersionMin);
    req.set_max_version(kProtocolVersionMax);
    v1::GetVersionResponse resp;
    grpc::Status s = impl->session->GetVersion(&ctx, req, &resp);
    if (!s.ok()) {
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
          s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        return absl::UnavailableError(
            absl::StrCat("no coordinator at ", address, ": ",
                         s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                             ? absl::StrCat("no answer within ", timeout, " ms")
                             : s.error_message()));
      }
      return absl::Status(FromGrpc(s).code(), absl::StrCat("connecting to coordinator ", address,
                                                           ": ", s.error_message()));
    }
    impl->version = resp.version();
  }
  grpc::ClientContext ctx;
  v1::OpenSessionRequest req;
  req.set_client(impl->options.client_name);
  *req.mutable_options() = ToProto(impl->options.session);
  impl->session_options = impl->options.session;
  v1::OpenSessionResponse resp;
  if (auto s = impl->session->OpenSession(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  impl->id = resp.session_id();
  impl->StartKeepAlive(absl::Milliseconds(resp.lease_ms()));
  return std::unique_ptr<Session>(new Session(std::move(impl)));
}

const std::string& Session::id() const { return impl_->id; }
int Session::protocol_version() const { return impl_->version; }

const SessionOptions& Session::options() const { return impl_->session_options; }

absl::Status Session::SetOptions(const SessionOptions& options) {
  grpc::ClientContext ctx;
  v1::SetSessionOptionsRequest req;
  req.set_session_id(impl_->id);
  *req.mutable_options() = ToProto(options);
  v1::SetSessionOptionsResponse resp;
  if (auto s = impl_->session->SetSessionOptions(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  impl_->session_options = options;
  return absl::OkStatus();
}

absl::StatusOr<Executable> Session::Compile(const Graph& graph, const CompileOptions& options) {
  grpc::ClientContext ctx;
  v1::CompileRequest req;
  req.set_session_id(impl_->id);
  *req.mutable_graph() = graph.impl().proto;
  for (int p : options.donate) req.add_donated_parameters(p);
  req.set_strict_donation(options.strict_donation);
  if (options.mesh) {
    *req.mutable_mesh() = ToProto(*options.mesh);
    for (const Sharding& sh : options.parameter_shardings)
      *req.add_parameter_shardings() = ToProto(sh);
    for (const Sharding& sh : options.output_shardings) *req.add_output_shardings() = ToProto(sh);
  } else if (!options.parameter_shardings.empty() || !options.output_shardings.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("compile of '", graph.name(), "': shardings were given without a mesh"));
  }
  v1::CompileResponse resp;
  if (auto s = impl_->session->Compile(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  Executable e;
  e.id_ = resp.executable_id();
  e.name_ = req.graph().name();
  e.donated_ = options.donate;
  for (const v1::Alias& a : resp.aliases()) {
    e.aliases_.push_back(
        DonationReceipt{a.parameter(), 0, a.output() >= 0, a.output(), 0, a.reason()});
  }
  e.cache_miss_reason_ = resp.cache_miss_reason();
  e.cache_hit_ = resp.cache_hit();
  for (const auto& t : resp.parameter_types()) e.parameter_types_.push_back(FromProto(t));
  for (const auto& t : resp.output_types()) e.output_types_.push_back(FromProto(t));
  e.plan_ = resp.plan();
  e.diagnostics_.assign(resp.diagnostics().begin(), resp.diagnostics().end());
  e.estimated_bytes_ = resp.estimated_bytes();
  if (resp.has_mesh()) {
    e.mesh_ = FromProto(resp.mesh());
    for (const auto& sh : resp.parameter_shardings())
      e.parameter_shardings_.push_back(FromProto(sh));
    for (const auto& sh : resp.output_shardings()) e.output_shardings_.push_back(FromProto(sh));
    for (const v1::CollectiveInfo& c : resp.collectives()) {
      e.collectives_.push_back(PlannedCollective{
          c.value(), c.op(), {c.axes().begin(), c.axes().end()}, c.bytes_per_device(), c.reason()});
    }
  }
  return e;
}

namespace {

// The first failed array of an Await's answer, named by its handle; OK when
// none failed.
absl::Status FirstAwaitError(absl::Span<const Array> arrays, const v1::AwaitResponse& resp) {
  for (int i = 0; i < resp.errors_size() && i < static_cast<int>(arrays.size()); ++i) {
    if (!resp.errors(i).empty()) {
      auto code = static_cast<absl::StatusCode>(
          i < resp.codes_size() ? resp.codes(i) : int(absl::StatusCode::kUnknown));
      return absl::Status(code,
                          absl::StrFormat("array %#x: %s", arrays[i].handle(), resp.errors(i)));
    }
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<Array> Session::Put(const HostArray& array, Placement placement,
                                   const TransferOptions& transfer) {
  if (array.size_bytes() != array.type().bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("put: host array of type ", array.type().ToString(), " holds ",
                     array.size_bytes(), " bytes, expected ", array.type().bytes()));
  }
  TransferReceipt unused;
  TransferReceipt& receipt = transfer.receipt != nullptr ? *transfer.receipt : unused;
  receipt = TransferReceipt{};
  v1::PutRequest::Header h;
  h.set_session_id(impl_->id);
  h.set_handle(impl_->NewHandle());
  *h.mutable_type() = tessel::ToProto(array.type());
  *h.mutable_placement() = ToProto(placement);
  h.set_implicit(transfer.implicit);
  if (transfer.transfer_guard) *h.mutable_transfer_guard() = ToProto(*transfer.transfer_guard);
  if (transfer.direct.value_or(impl_->options.direct_transfers &&
                               array.size_bytes() >= impl_->options.direct_min_bytes)) {
    TESSEL_ASSIGN_OR_RETURN(const bool put, impl_->PutDirect(h, array, &receipt));
    if (put) return Array(h.handle(), array.type());
    // Through the coordinator, under a handle no worker has seen (a write
    // that failed may have left part of the old one behind until its free).
    h.set_handle(impl_->NewHandle());
  }
  grpc::ClientContext ctx;
  v1::PutResponse resp;
  auto writer = impl_->session->Put(&ctx, &resp);
  v1::PutRequest msg;
  *msg.mutable_header() = h;
  bool ok = writer->Write(msg);
  const int64_t chunk = impl_->options.chunk_bytes;
  for (int64_t off = 0; ok && off < array.size_bytes(); off += chunk) {
    msg.set_data(array.data() + off, std::min(chunk, array.size_bytes() - off));
    ok = writer->Write(msg);
  }
  writer->WritesDone();
  if (auto s = writer->Finish(); !s.ok()) return FromGrpc(s);
  return Array(h.handle(), array.type());
}

absl::StatusOr<std::vector<Array>> Session::Execute(const Executable& exe,
                                                    absl::Span<const Array> args,
                                                    ExecuteOptions options) {
  v1::ExecuteRequest req;
  req.set_session_id(impl_->id);
  req.set_executable_id(exe.id());
  for (const Array& a : args) req.add_arguments(a.handle());
  std::vector<Array> outs;
  for (const ArrayType& t : exe.output_types()) {
    outs.push_back(Array(impl_->NewHandle(), t));
    req.add_outputs(outs.back().handle());
  }
  *req.mutable_placement() = ToProto(options.placement);
  for (int i : options.donate) req.add_donate(i);
  req.set_strict_donation(options.strict_donation);
  if (options.transfer_guard) *req.mutable_transfer_guard() = ToProto(*options.transfer_guard);
  const bool want_reply = options.wait || options.receipt != nullptr;
  req.set_wait(want_reply);             // on the stream: "I read the reply"
  req.set_await_outputs(options.wait);  // and it comes once the outputs are done
  Dispatcher& d = impl_->dispatcher();
  TESSEL_ASSIGN_OR_RETURN(int64_t seq, d.Send(std::move(req), want_reply));
  if (!want_reply) return outs;
  TESSEL_ASSIGN_OR_RETURN(v1::DispatchReply reply, d.Reply(seq));
  if (reply.code() != 0)
    return absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.error());
  if (options.receipt != nullptr) {
    options.receipt->execution_id = reply.response().execution_id();
    options.receipt->donations.clear();
    for (const auto& r : reply.response().donations())
      options.receipt->donations.push_back(FromProto(r));
  }
  if (options.wait) {
    // A coordinator that predates await_outputs answers without them.
    absl::Status s = reply.has_outputs() ? FirstAwaitError(outs, reply.outputs()) : Await(outs);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("execution ", reply.response().execution_id(),
                                                 " failed: ", s.message()));
    }
  }
  return outs;
}

absl::Status Session::Await(absl::Span<const Array> arrays) {
  TESSEL_RETURN_IF_ERROR(impl_->Flush());
  grpc::ClientContext ctx;
  v1::AwaitRequest req;
  req.set_session_id(impl_->id);
  for (const Array& a : arrays) req.add_handles(a.handle());
  v1::AwaitResponse resp;
  if (auto s = impl_->session->Await(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  return FirstAwaitError(arrays, resp);
}

absl::StatusOr<HostArray> Session::Fetch(const Array& array, const TransferOptions& transfer) {
  TESSEL_RETURN_IF_ERROR(impl_->Flush());
  TransferReceipt unused;
  TransferReceipt& receipt = transfer.receipt != nullptr ? *transfer.receipt : unused;
  receipt = TransferReceipt{};
  v1::FetchRequest req;
  req.set_session_id(impl_->id);
  req.set_handle(array.handle());
  req.set_implicit(transfer.implicit);
  req.set_direct(transfer.direct.value_or(impl_->options.direct_transfers));
  if (!transfer.direct.has_value()) req.set_direct_min_bytes(impl_->options.direct_min_bytes);
  if (transfer.transfer_guard) *req.mutable_transfer_guard() = ToProto(*transfer.transfer_guard);
  TESSEL_ASSIGN_OR_RETURN(Impl::Fetched got, impl_->FetchOnce(req));
  if (got.direct.empty()) return std::move(got.array);
  const absl::Status direct =
      ReadDirectBlocks(*impl_->workers, got.direct, impl_->options.chunk_bytes,
                       absl::Milliseconds(impl_->options.direct_connect_timeout_ms), &got.array);
  if (direct.ok()) {
    receipt.direct = true;
    receipt.blocks = int(got.direct.size());
    return std::move(got.array);
  }
  // A worker this client cannot reach (or a read that failed): the
  // coordinator relays the bytes, and the receipt says why.
  receipt.relayed_because = direct.ToString();
  req.set_direct(false);
  TESSEL_ASSIGN_OR_RETURN(got, impl_->FetchOnce(req));
  return std::move(got.array);
}

absl::Status Session::Delete(absl::Span<const Array> arrays) {
  TESSEL_RETURN_IF_ERROR(impl_->Flush());
  grpc::ClientContext ctx;
  v1::DeleteRequest req;
  req.set_session_id(impl_->id);
  for (const Array& a : arrays) req.add_handles(a.handle());
  v1::DeleteResponse resp;
  return FromGrpc(impl_->session->Delete(&ctx, req, &resp));
}

absl::StatusOr<Array> Session::Reshard(const Array& array, const Placement& placement,
                                       const TransferOptions& transfer, ReshardReceipt* receipt) {
  TESSEL_RETURN_IF_ERROR(impl_->Flush());
  grpc::ClientContext ctx;
  v1::ReshardRequest req;
  req.set_session_id(impl_->id);
  req.set_handle(array.handle());
  req.set_output(impl_->NewHandle());
  *req.mutable_placement() = ToProto(placement);
  if (transfer.transfer_guard) *req.mutable_transfer_guard() = ToProto(*transfer.transfer_guard);
  v1::ReshardResponse resp;
  TESSEL_RETURN_IF_ERROR(FromGrpc(impl_->session->Reshard(&ctx, req, &resp)));
  if (receipt != nullptr) {
    receipt->execution_id = resp.execution_id();
    receipt->bytes_moved = resp.bytes_moved();
    receipt->bytes_copied = resp.bytes_copied();
    receipt->pieces.assign(resp.pieces().begin(), resp.pieces().end());
  }
  return Array(req.output(), array.type());
}

absl::StatusOr<ArrayInfo> Session::Info(const Array& array) {
  TESSEL_RETURN_IF_ERROR(impl_->Flush());
  grpc::ClientContext ctx;
  v1::ArrayInfoRequest req;
  req.set_session_id(impl_->id);
  req.set_handle(array.handle());
  v1::ArrayInfoResponse resp;
  if (auto s = impl_->session->ArrayInfo(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  ArrayInfo info;
  info.type = FromProto(resp.type());
  info.state = FromProto(resp.state());
  info.devices.assign(resp.devices().begin(), resp.devices().end());
  info.bytes_per_device = resp.bytes_per_device();
  info.device_bytes.assign(resp.device_bytes().begin(), resp.device_bytes().end());
  if (resp.has_sharding()) {
    info.sharding =
        NamedSharding{FromProto(resp.sharding().mesh()), FromProto(resp.sharding().sharding())};
  }
  info.error = resp.error();
  info.producer_execution = resp.producer_execution();
  info.producer = resp.producer();
  return info;
}

namespace {
DeviceMemory FromProto(const v1::DeviceMemoryStats& m) {
  return DeviceMemory{m.device(),       m.bytes_in_use(), m.peak_bytes_in_use(), m.num_buffers(),
                      m.bytes_cached(), m.bytes_limit(),  m.largest_free_block()};
}
}  // namespace

absl::StatusOr<SessionStats> Session::Stats(bool with_arrays) {
  TESSEL_RETURN_IF_ERROR(impl_->Flush());
  grpc::ClientContext ctx;
  v1::StatsRequest req;
  req.set_session_id(impl_->id);
  req.set_with_arrays(with_arrays);
  v1::StatsResponse resp;
  if (auto s = impl_->session->Stats(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  SessionStats st;
  st.live_arrays = resp.live_arrays();
  st.live_bytes = resp.live_bytes();
  st.compiles = resp.compiles();
  st.compile_cache_hits = resp.compile_cache_hits();
  st.executions = resp.executions();
  st.bytes_host_to_device = resp.bytes_host_to_device();
  st.bytes_device_to_host = resp.bytes_device_to_host();
  st.bytes_device_to_device = resp.bytes_device_to_device();
  for (const auto& m : resp.devices()) st.devices.push_back(FromProto(m));
  for (const auto& t : resp.device_transfers()) {
    st.device_transfers.push_back(
        DeviceTransfers{t.device(), t.host_to_device(), t.device_to_host(), t.device_to_device()});
  }
  st.session_cache_hits = resp.session_cache_hits();
  st.session_cache_misses = resp.compile_cache_misses();
  st.session_compiles = resp.session_compiles();
  st.donations = resp.donations();
  st.donations_reused = resp.donations_reused();
  st.memory_quota_bytes = resp.memory_quota_bytes();
  st.tenant_view = resp.tenant_view();
  for (const auto& a : resp.arrays()) {
    st.arrays.push_back(LiveArray{a.handle(), tessel::FromProto(a.type()), FromProto(a.state()),
                                  a.bytes(),
                                  std::vector<int>(a.devices().begin(), a.devices().end()),
                                  a.producer_execution(), a.producer()});
  }
  return st;
}

absl::StatusOr<MemoryCheck> MemoryCheck::Begin(Session& session) {
  TESSEL_ASSIGN_OR_RETURN(SessionStats before, session.Stats(/*with_arrays=*/true));
  return MemoryCheck(&session, std::move(before));
}

absl::Status MemoryCheck::Verify() const {
  TESSEL_ASSIGN_OR_RETURN(SessionStats now, session_->Stats(/*with_arrays=*/true));
  std::vector<std::string> grew;
  absl::flat_hash_map<uint64_t, bool> had;
  for (const LiveArray& a : before_.arrays) had[a.handle] = true;
  std::vector<std::string> fresh;
  int64_t fresh_bytes = 0;
  for (const LiveArray& a : now.arrays) {
    if (had.contains(a.handle)) continue;
    fresh_bytes += a.bytes;
    if (fresh.size() < 8) {
      fresh.push_back(absl::StrFormat(
          "%#x %s (%d bytes, made by %s%s)", a.handle, a.type.ToString(), a.bytes,
          a.producer.empty() ? "?" : a.producer,
          a.producer_execution ? absl::StrCat(" in execution ", a.producer_execution)
                               : std::string()));
    }
  }
  if (now.live_arrays > before_.live_arrays || now.live_bytes > before_.live_bytes) {
    grew.push_back(absl::StrFormat(
        "session: %d live arrays (%d bytes) -> %d (%d bytes); new: %s%s", before_.live_arrays,
        before_.live_bytes, now.live_arrays, now.live_bytes, absl::StrJoin(fresh, ", "),
        now.live_arrays - before_.live_arrays > int64_t(fresh.size()) ? ", ..." : ""));
  }
  for (const DeviceMemory& m : now.devices) {
    for (const DeviceMemory& b : before_.devices) {
      if (b.device != m.device) continue;
      if (m.bytes_in_use > b.bytes_in_use || m.num_buffers > b.num_buffers) {
        grew.push_back(
            absl::StrFormat("device %d: %d bytes in %d buffers -> %d bytes in %d buffers", m.device,
                            b.bytes_in_use, b.num_buffers, m.bytes_in_use, m.num_buffers));
      }
    }
  }
  if (grew.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("memory grew: ", absl::StrJoin(grew, "; ")));
}

absl::StatusOr<std::vector<DeviceView>> Session::Devices() {
  grpc::ClientContext ctx;
  v1::ListDevicesRequest req;
  req.set_session_id(impl_->id);
  v1::ListDevicesResponse resp;
  if (auto s = impl_->session->ListDevices(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  std::vector<DeviceView> out;
  for (const v1::DeviceInfo& d : resp.devices()) {
    DeviceView v{d.id(), d.kind(), d.worker_id(), d.local_index(), 0, 0};
    for (const v1::DeviceMemoryStats& m : resp.usage()) {
      if (m.device() != d.id()) continue;
      v.bytes_in_use = m.bytes_in_use();
      v.num_buffers = m.num_buffers();
    }
    out.push_back(std::move(v));
  }
  return out;
}

absl::StatusOr<Reconciliation> Session::Reconcile() {
  grpc::ClientContext ctx;
  v1::ReconcileResponse resp;
  if (auto s = impl_->admin->Reconcile(&ctx, v1::ReconcileRequest(), &resp); !s.ok())
    return FromGrpc(s);
  Reconciliation r;
  for (const v1::UnownedBuffer& u : resp.unowned())
    r.unowned.push_back(UnownedBuffer{u.device(), u.handle(), u.bytes()});
  r.freed = resp.freed();
  r.buffers_checked = resp.buffers_checked();
  return r;
}

absl::StatusOr<ClusterStatus> Session::Cluster(bool with_memory) {
  grpc::ClientContext ctx;
  v1::GetClusterRequest req;
  req.set_with_memory(with_memory);
  v1::GetClusterResponse resp;
  if (auto s = impl_->admin->GetCluster(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  ClusterStatus c;
  for (const v1::WorkerInfo& w : resp.workers()) {
    WorkerStatus ws{w.worker_id(), w.address(), w.alive(), w.ms_since_heartbeat(), {}, {}};
    for (const auto& d : w.devices()) {
      ws.devices.push_back(d.id());
      ws.device_kinds.push_back(d.kind());
    }
    for (const auto& m : w.memory()) ws.memory.push_back(FromProto(m));
    c.workers.push_back(std::move(ws));
  }
  c.sessions = resp.sessions();
  c.live_arrays = resp.live_arrays();
  c.compiles = resp.compiles();
  c.compile_cache_hits = resp.compile_cache_hits();
  c.executions = resp.executions();
  return c;
}

}  // namespace tessel
