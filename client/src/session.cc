#include "tessel/session.h"

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "client/src/convert_internal.h"
#include "client/src/graph_internal.h"
#include "core/rpc_status.h"
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
  if (const char* env = std::getenv("TESSEL_COORDINATOR"); env != nullptr && *env != '\0') return std::string(env);
  return absl::InvalidArgumentError("no coordinator address: pass --coordinator=HOST:PORT or set TESSEL_COORDINATOR");
}

class Session::Impl {
 public:
  Impl(std::shared_ptr<grpc::Channel> channel, ConnectOptions options)
      : options(std::move(options)), session(v1::Session::NewStub(channel)), admin(v1::Admin::NewStub(channel)),
        rng(std::random_device{}()) {}

  uint64_t NewHandle() {
    absl::MutexLock l(&mu);
    uint64_t h;
    do {
      h = rng();
    } while (h == 0);
    return h;
  }

  ConnectOptions options;
  std::unique_ptr<v1::Session::Stub> session;
  std::unique_ptr<v1::Admin::Stub> admin;
  std::string id;
  int version = 0;
  absl::Mutex mu;
  std::mt19937_64 rng ABSL_GUARDED_BY(mu);
};

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Session::~Session() {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::CloseSessionRequest req;
  req.set_session_id(impl_->id);
  v1::CloseSessionResponse resp;
  (void)impl_->session->CloseSession(&ctx, req, &resp);
}

absl::StatusOr<std::unique_ptr<Session>> Session::Connect(const std::string& address, ConnectOptions options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  const int timeout = options.connect_timeout_ms;
  auto impl = std::make_unique<Impl>(channel, std::move(options));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout));
    ctx.set_wait_for_ready(true);
    v1::GetVersionRequest req;
    req.set_min_version(kProtocolVersionMin);
    req.set_max_version(kProtocolVersionMax);
    v1::GetVersionResponse resp;
    grpc::Status s = impl->session->GetVersion(&ctx, req, &resp);
    if (!s.ok()) {
      return absl::Status(FromGrpc(s).code(), absl::StrCat("connecting to coordinator ", address, ": ", s.error_message()));
    }
    impl->version = resp.version();
  }
  grpc::ClientContext ctx;
  v1::OpenSessionRequest req;
  req.set_client(impl->options.client_name);
  v1::OpenSessionResponse resp;
  if (auto s = impl->session->OpenSession(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  impl->id = resp.session_id();
  return std::unique_ptr<Session>(new Session(std::move(impl)));
}

const std::string& Session::id() const { return impl_->id; }
int Session::protocol_version() const { return impl_->version; }

absl::StatusOr<Executable> Session::Compile(const Graph& graph) {
  grpc::ClientContext ctx;
  v1::CompileRequest req;
  req.set_session_id(impl_->id);
  *req.mutable_graph() = graph.impl().proto;
  v1::CompileResponse resp;
  if (auto s = impl_->session->Compile(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  Executable e;
  e.id_ = resp.executable_id();
  e.cache_hit_ = resp.cache_hit();
  for (const auto& t : resp.parameter_types()) e.parameter_types_.push_back(FromProto(t));
  for (const auto& t : resp.output_types()) e.output_types_.push_back(FromProto(t));
  e.plan_ = resp.plan();
  e.diagnostics_.assign(resp.diagnostics().begin(), resp.diagnostics().end());
  e.estimated_bytes_ = resp.estimated_bytes();
  return e;
}

namespace {
v1::Placement ToProto(const Placement& p) {
  v1::Placement out;
  if (p.replicated) {
    out.set_replicated(true);
  } else {
    out.set_device(p.device);
  }
  return out;
}
}  // namespace

absl::StatusOr<Array> Session::Put(const HostArray& array, Placement placement) {
  if (array.size_bytes() != array.type().bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("put: host array of type ", array.type().ToString(), " holds ",
                                                   array.size_bytes(), " bytes, expected ", array.type().bytes()));
  }
  const uint64_t handle = impl_->NewHandle();
  grpc::ClientContext ctx;
  v1::PutResponse resp;
  auto writer = impl_->session->Put(&ctx, &resp);
  v1::PutRequest msg;
  auto* h = msg.mutable_header();
  h->set_session_id(impl_->id);
  h->set_handle(handle);
  *h->mutable_type() = tessel::ToProto(array.type());
  *h->mutable_placement() = ToProto(placement);
  bool ok = writer->Write(msg);
  const int64_t chunk = impl_->options.chunk_bytes;
  for (int64_t off = 0; ok && off < array.size_bytes(); off += chunk) {
    msg.set_data(array.data() + off, std::min(chunk, array.size_bytes() - off));
    ok = writer->Write(msg);
  }
  writer->WritesDone();
  if (auto s = writer->Finish(); !s.ok()) return FromGrpc(s);
  return Array(handle, array.type());
}

absl::StatusOr<std::vector<Array>> Session::Execute(const Executable& exe, absl::Span<const Array> args,
                                                    ExecuteOptions options) {
  grpc::ClientContext ctx;
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
  req.set_wait(options.wait);
  v1::ExecuteResponse resp;
  if (auto s = impl_->session->Execute(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  return outs;
}

absl::Status Session::Await(absl::Span<const Array> arrays) {
  grpc::ClientContext ctx;
  v1::AwaitRequest req;
  req.set_session_id(impl_->id);
  for (const Array& a : arrays) req.add_handles(a.handle());
  v1::AwaitResponse resp;
  if (auto s = impl_->session->Await(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  for (int i = 0; i < resp.errors_size(); ++i) {
    if (!resp.errors(i).empty()) {
      auto code = static_cast<absl::StatusCode>(i < resp.codes_size() ? resp.codes(i) : int(absl::StatusCode::kUnknown));
      return absl::Status(code, absl::StrFormat("array %#x: %s", arrays[i].handle(), resp.errors(i)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<HostArray> Session::Fetch(const Array& array) {
  grpc::ClientContext ctx;
  v1::FetchRequest req;
  req.set_session_id(impl_->id);
  req.set_handle(array.handle());
  auto reader = impl_->session->Fetch(&ctx, req);
  v1::FetchResponse msg;
  HostArray out;
  int64_t offset = 0;
  bool first = true;
  while (reader->Read(&msg)) {
    if (first) {
      out = HostArray(FromProto(msg.type()));
      first = false;
    }
    const std::string& d = msg.data();
    if (offset + int64_t(d.size()) > out.size_bytes()) {
      ctx.TryCancel();
      return absl::DataLossError(absl::StrFormat("fetch of array %#x: more bytes than its type %s holds", array.handle(),
                                                 out.type().ToString()));
    }
    std::memcpy(out.mutable_data() + offset, d.data(), d.size());
    offset += d.size();
  }
  if (auto s = reader->Finish(); !s.ok()) return FromGrpc(s);
  if (first || offset != out.size_bytes()) {
    return absl::DataLossError(absl::StrFormat("fetch of array %#x: expected %d bytes, got %d", array.handle(),
                                               out.size_bytes(), offset));
  }
  return out;
}

absl::Status Session::Delete(absl::Span<const Array> arrays) {
  grpc::ClientContext ctx;
  v1::DeleteRequest req;
  req.set_session_id(impl_->id);
  for (const Array& a : arrays) req.add_handles(a.handle());
  v1::DeleteResponse resp;
  return FromGrpc(impl_->session->Delete(&ctx, req, &resp));
}

absl::StatusOr<ArrayInfo> Session::Info(const Array& array) {
  grpc::ClientContext ctx;
  v1::ArrayInfoRequest req;
  req.set_session_id(impl_->id);
  req.set_handle(array.handle());
  v1::ArrayInfoResponse resp;
  if (auto s = impl_->session->ArrayInfo(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  ArrayInfo info;
  info.type = FromProto(resp.type());
  info.state = static_cast<ArrayState>(static_cast<int>(resp.state()) - 1);
  info.devices.assign(resp.devices().begin(), resp.devices().end());
  info.bytes_per_device = resp.bytes_per_device();
  info.error = resp.error();
  return info;
}

namespace {
DeviceMemory FromProto(const v1::DeviceMemoryStats& m) {
  return DeviceMemory{m.device(), m.bytes_in_use(), m.peak_bytes_in_use(), m.num_buffers(), m.bytes_cached(),
                      m.bytes_limit()};
}
}  // namespace

absl::StatusOr<SessionStats> Session::Stats() {
  grpc::ClientContext ctx;
  v1::StatsRequest req;
  req.set_session_id(impl_->id);
  v1::StatsResponse resp;
  if (auto s = impl_->session->Stats(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  SessionStats st{resp.live_arrays(), resp.live_bytes(), resp.compiles(), resp.compile_cache_hits(),
                  resp.executions(), resp.bytes_host_to_device(), resp.bytes_device_to_host(), {}};
  for (const auto& m : resp.devices()) st.devices.push_back(FromProto(m));
  return st;
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
    for (const auto& d : w.devices()) ws.devices.push_back(d.id());
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
