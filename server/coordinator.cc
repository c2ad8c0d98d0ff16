#include "server/coordinator.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/version.h"

namespace tessel::server {

using absl::StrCat;
using absl::StrFormat;

namespace {
std::string RandomId(absl::string_view prefix) {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  return StrFormat("%s%016x", prefix, rng());
}
}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(Options options) {
  if (!options.logger) return absl::InvalidArgumentError("Coordinator needs a logger");
  if (!options.connect) return absl::InvalidArgumentError("Coordinator needs a connect function");
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(options)));
}

Coordinator::Coordinator(Options options)
    : options_(std::move(options)), log_(options_.logger), monitor_([this] { MonitorLoop(); }) {}

Coordinator::~Coordinator() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  monitor_.join();
}

// ---------------------------------------------------------------- workers

absl::StatusOr<v1::RegisterWorkerResponse> Coordinator::RegisterWorker(const v1::RegisterWorkerRequest& req) {
  if (req.protocol_version() < kProtocolVersionMin || req.protocol_version() > kProtocolVersionMax) {
    return absl::FailedPreconditionError(StrCat("worker at ", req.address(), " speaks protocol ",
                                                req.protocol_version(), "; coordinator speaks [",
                                                kProtocolVersionMin, ", ", kProtocolVersionMax, "]"));
  }
  if (req.num_devices() < 1 || req.num_devices() > 1024) {
    return absl::InvalidArgumentError(StrCat("worker at ", req.address(), ": num_devices expected 1..1024, got ",
                                             req.num_devices()));
  }
  if (req.address().empty()) return absl::InvalidArgumentError("worker registered without an address");
  std::shared_ptr<WorkerClient> client = options_.connect(req.address());
  absl::MutexLock l(&mu_);
  WorkerRecord w;
  w.id = StrCat("w", next_worker_++);
  w.address = req.address();
  w.last_heartbeat = absl::Now();
  w.client = std::move(client);
  for (int i = 0; i < req.num_devices(); ++i) {
    w.devices.push_back(devices_.size());
    devices_.push_back(DeviceRecord{w.id, i, 0});
  }
  log_->info("worker {} registered from {} with {} {} devices (global ids {}..{})", w.id, w.address,
             req.num_devices(), req.device_kind(), w.devices.front(), w.devices.back());
  v1::RegisterWorkerResponse resp;
  resp.set_worker_id(w.id);
  resp.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
  workers_.emplace(w.id, std::move(w));
  return resp;
}

bool Coordinator::Heartbeat(const std::string& worker_id) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || !it->second.alive) return false;
  it->second.last_heartbeat = absl::Now();
  return true;
}

void Coordinator::MonitorLoop() {
  absl::MutexLock l(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.heartbeat_interval);
    if (stop_) break;
    const absl::Time now = absl::Now();
    for (auto& [id, w] : workers_) {
      if (!w.alive || now - w.last_heartbeat < options_.heartbeat_timeout) continue;
      w.alive = false;
      w.client->CancelAll();
      int lost = 0;
      absl::flat_hash_set<int> devs(w.devices.begin(), w.devices.end());
      for (auto& [h, a] : arrays_) {
        bool touches = false;
        for (int d : a.devices) touches |= devs.contains(d);
        if (touches && a.state != v1::ERROR) {
          a.state = v1::LOST;
          a.error = absl::UnavailableError(StrFormat("array %#x was on worker %s (%s), which stopped heartbeating",
                                                     h, id, w.address));
          a.pending = 0;
          ++lost;
        }
      }
      log_->warn("worker {} ({}) missed heartbeats for {}; marked dead, {} arrays lost", id, w.address,
                 absl::FormatDuration(now - w.last_heartbeat), lost);
    }
  }
}

// ---------------------------------------------------------------- sessions

v1::OpenSessionResponse Coordinator::OpenSession(const v1::OpenSessionRequest& req) {
  v1::OpenSessionResponse resp;
  resp.set_session_id(RandomId("s"));
  absl::MutexLock l(&mu_);
  sessions_[resp.session_id()].client = req.client();
  log_->info("session {} opened by '{}'", resp.session_id(), req.client());
  return resp;
}

absl::Status Coordinator::CheckSession(const std::string& id) const {
  if (!sessions_.contains(id)) {
    return absl::NotFoundError(StrCat("session '", id, "' does not exist (closed, or never opened)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CloseSessionResponse> Coordinator::CloseSession(const v1::CloseSessionRequest& req) {
  absl::MutexLock l(&mu_);
  TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
  SessionRecord& s = sessions_[req.session_id()];
  std::vector<uint64_t> handles(s.arrays.begin(), s.arrays.end());
  FreeArraysLocked(handles);
  sessions_.erase(req.session_id());
  log_->info("session {} closed; {} arrays freed", req.session_id(), handles.size());
  v1::CloseSessionResponse resp;
  resp.set_arrays_freed(handles.size());
  return resp;
}

absl::StatusOr<Coordinator::ArrayRecord*> Coordinator::OwnedArray(const std::string& session, uint64_t handle) {
  auto it = arrays_.find(handle);
  if (it == arrays_.end()) {
    return absl::NotFoundError(StrFormat("array %#x does not exist (deleted, or never created)", handle));
  }
  if (it->second.session != session) {
    return absl::PermissionDeniedError(StrFormat("array %#x belongs to another session", handle));
  }
  return &it->second;
}

absl::StatusOr<std::vector<int>> Coordinator::ResolvePlacement(const v1::Placement& p) const {
  std::vector<int> out;
  if (p.kind_case() == v1::Placement::kReplicated && p.replicated()) {
    for (int d = 0; d < int(devices_.size()); ++d) {
      if (workers_.at(devices_[d].worker_id).alive) out.push_back(d);
    }
    if (out.empty()) return absl::UnavailableError("no live devices in the cluster");
    return out;
  }
  int d = p.device();
  if (d < 0 || d >= int(devices_.size())) {
    return absl::InvalidArgumentError(StrCat("device ", d, " does not exist: the cluster has devices 0..",
                                             int(devices_.size()) - 1));
  }
  const WorkerRecord& w = workers_.at(devices_[d].worker_id);
  if (!w.alive) {
    return absl::UnavailableError(StrCat("device ", d, " is on worker ", w.id, " (", w.address, "), which is dead"));
  }
  return std::vector<int>{d};
}

// ---------------------------------------------------------------- compile

absl::StatusOr<v1::CompileResponse> Coordinator::Compile(const v1::CompileRequest& req) {
  {
    absl::MutexLock l(&mu_);
    TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
  }
  const std::string fp = scheduler::Fingerprint(req.graph());
  v1::CompileResponse resp;
  const scheduler::CompiledProgram* compiled = nullptr;
  {
    absl::MutexLock l(&mu_);
    auto it = executables_.find(fp);
    if (it != executables_.end()) {
      ++cache_hits_;
      compiled = &it->second.compiled;
      resp.set_cache_hit(true);
    }
  }
  if (compiled == nullptr) {
    auto c = scheduler::Compile(req.graph());
    if (!c.ok()) {
      log_->info("session {}: compile of '{}' failed: {}", req.session_id(), req.graph().name(), c.status().ToString());
      return Annotate(c.status(), StrCat("graph '", req.graph().name(), "': "));
    }
    absl::MutexLock l(&mu_);
    ++compiles_;
    auto [it, inserted] = executables_.try_emplace(fp, ExecutableRecord{std::move(*c)});
    compiled = &it->second.compiled;
    log_->info("session {}: compiled '{}' as {}", req.session_id(), req.graph().name(), fp);
  }
  // Records are never erased, so `compiled` stays valid without the lock.
  resp.set_executable_id(compiled->fingerprint);
  for (const auto& t : compiled->parameter_types) *resp.add_parameter_types() = t;
  for (const auto& t : compiled->output_types) *resp.add_output_types() = t;
  resp.set_plan(compiled->plan_text);
  for (const auto& d : compiled->diagnostics) resp.add_diagnostics(d);
  resp.set_estimated_bytes(compiled->estimated_peak_bytes);
  return resp;
}

// ---------------------------------------------------------------- execute

absl::StatusOr<v1::ExecuteResponse> Coordinator::Execute(const v1::ExecuteRequest& req) {
  struct Launch {
    std::shared_ptr<WorkerClient> client;
    v1::RunRequest run;
    bool needs_load;
  };
  std::vector<Launch> launches;
  std::vector<uint64_t> outputs(req.outputs().begin(), req.outputs().end());
  const v1::Program* program = nullptr;
  int64_t execution_id = 0;
  {
    absl::MutexLock l(&mu_);
    TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
    auto exe = executables_.find(req.executable_id());
    if (exe == executables_.end()) {
      return absl::NotFoundError(StrCat("executable '", req.executable_id(), "' was never compiled here"));
    }
    const scheduler::CompiledProgram& c = exe->second.compiled;
    program = &c.program;
    TESSEL_ASSIGN_OR_RETURN(std::vector<int> devices, ResolvePlacement(req.placement()));
    if (req.arguments_size() != int(c.parameter_types.size())) {
      return absl::InvalidArgumentError(StrCat("executable ", req.executable_id(), " takes ",
                                               c.parameter_types.size(), " arguments, got ", req.arguments_size()));
    }
    if (req.outputs_size() != int(c.output_types.size())) {
      return absl::InvalidArgumentError(StrCat("executable ", req.executable_id(), " has ", c.output_types.size(),
                                               " outputs; the request names ", req.outputs_size(), " output handles"));
    }
    absl::Status upstream_error;
    for (int i = 0; i < req.arguments_size(); ++i) {
      const std::string& pname = c.program.parameters(i).name();
      auto a = OwnedArray(req.session_id(), req.arguments(i));
      if (!a.ok()) return Annotate(a.status(), StrCat("argument ", i, " '", pname, "': "));
      const ArrayRecord& rec = **a;
      if (!SameType(rec.type, c.parameter_types[i])) {
        return absl::InvalidArgumentError(StrFormat("argument %d '%s' (array %#x): expected %s, got %s", i, pname,
                                                    req.arguments(i), TypeString(c.parameter_types[i]),
                                                    TypeString(rec.type)));
      }
      if (rec.state == v1::LOST) return Annotate(rec.error, StrCat("argument ", i, " '", pname, "': "));
      if (rec.state == v1::ERROR && upstream_error.ok()) {
        upstream_error = Annotate(rec.error, StrFormat("argument %d '%s' (array %#x) failed earlier: ", i, pname,
                                                       req.arguments(i)));
      }
      for (int d : devices) {
        if (std::find(rec.devices.begin(), rec.devices.end(), d) == rec.devices.end()) {
          return absl::InvalidArgumentError(StrFormat(
              "argument %d '%s' (array %#x) is not on device %d, where the step runs (it is on %s); "
              "put it there or run the step where it lives",
              i, pname, req.arguments(i), d, absl::StrJoin(rec.devices, ",")));
        }
      }
    }
    absl::flat_hash_set<uint64_t> seen;
    for (int i = 0; i < req.outputs_size(); ++i) {
      uint64_t h = req.outputs(i);
      if (h == 0) return absl::InvalidArgumentError(StrCat("output handle ", i, " is 0; handles must be nonzero"));
      if (!seen.insert(h).second || arrays_.contains(h)) {
        return absl::AlreadyExistsError(StrFormat("output handle %d (%#x) is already in use", i, h));
      }
    }
    execution_id = ++next_execution_;
    ++executions_;
    SessionRecord& session = sessions_[req.session_id()];
    ++session.executions;
    for (int i = 0; i < req.outputs_size(); ++i) {
      ArrayRecord& a = arrays_[req.outputs(i)];
      a.session = req.session_id();
      a.type = c.output_types[i];
      a.devices = devices;
      a.producer = execution_id;
      session.arrays.insert(req.outputs(i));
      if (!upstream_error.ok()) {
        a.state = v1::ERROR;
        a.error = upstream_error;
      } else {
        a.state = v1::PENDING;
        a.pending = devices.size();
      }
    }
    if (!upstream_error.ok()) {
      if (req.wait()) return upstream_error;
      v1::ExecuteResponse resp;
      resp.set_execution_id(execution_id);
      return resp;
    }
    for (int d : devices) {
      DeviceRecord& dev = devices_[d];
      WorkerRecord& w = workers_.at(dev.worker_id);
      Launch launch{w.client, {}, !w.loaded.contains(req.executable_id())};
      w.loaded.insert(req.executable_id());
      launch.run.set_device(dev.local_index);
      launch.run.set_seq(dev.next_seq++);
      launch.run.set_executable_id(req.executable_id());
      *launch.run.mutable_arguments() = req.arguments();
      *launch.run.mutable_outputs() = req.outputs();
      launch.run.set_execution_id(execution_id);
      launches.push_back(std::move(launch));
    }
  }
  for (Launch& launch : launches) {
    if (launch.needs_load) {
      absl::Status s = launch.client->LoadProgram(*program);
      if (!s.ok()) {
        // The sequence number must still be consumed; the step fails on the worker.
        log_->error("execution {}: loading {} failed: {}", execution_id, req.executable_id(), s.ToString());
      }
    }
    launch.client->Run(launch.run, [this, outputs](absl::Status s) { OnStepDone(outputs, std::move(s)); });
  }
  v1::ExecuteResponse resp;
  resp.set_execution_id(execution_id);
  if (req.wait()) {
    v1::AwaitRequest await;
    await.set_session_id(req.session_id());
    *await.mutable_handles() = req.outputs();
    TESSEL_ASSIGN_OR_RETURN(v1::AwaitResponse done, Await(await));
    for (int i = 0; i < done.errors_size(); ++i) {
      if (!done.errors(i).empty()) {
        return absl::Status(static_cast<absl::StatusCode>(done.codes(i)),
                            StrCat("execution ", execution_id, " failed: ", done.errors(i)));
      }
    }
  }
  return resp;
}

void Coordinator::OnStepDone(std::vector<uint64_t> outputs, absl::Status s) {
  absl::MutexLock l(&mu_);
  for (uint64_t h : outputs) {
    auto it = arrays_.find(h);
    if (it == arrays_.end()) continue;  // deleted meanwhile
    ArrayRecord& a = it->second;
    if (a.state != v1::PENDING) continue;
    if (!s.ok()) {
      a.state = v1::ERROR;
      a.error = s;
      a.pending = 0;
      log_->warn("session {} execution {}: array {:#x} failed: {}", a.session, a.producer, h, s.ToString());
    } else if (--a.pending == 0) {
      a.state = v1::READY;
    }
  }
}

bool Coordinator::NotPending(const std::vector<uint64_t>& handles) const {
  for (uint64_t h : handles) {
    auto it = arrays_.find(h);
    if (it != arrays_.end() && it->second.state == v1::PENDING) return false;
  }
  return true;
}

bool Coordinator::AwaitNotPending(const std::vector<uint64_t>& handles, absl::Duration timeout) {
  struct Check {
    const Coordinator* c;
    const std::vector<uint64_t>* handles;
  } check{this, &handles};
  absl::Condition cond(
      +[](Check* k) { return k->c->NotPending(*k->handles); }, &check);
  return mu_.AwaitWithTimeout(cond, timeout);
}

absl::StatusOr<v1::AwaitResponse> Coordinator::Await(const v1::AwaitRequest& req) {
  std::vector<uint64_t> handles(req.handles().begin(), req.handles().end());
  absl::MutexLock l(&mu_);
  TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
  for (uint64_t h : handles) TESSEL_RETURN_IF_ERROR(OwnedArray(req.session_id(), h).status());
  const absl::Duration timeout =
      req.timeout_ms() > 0 ? absl::Milliseconds(req.timeout_ms()) : absl::InfiniteDuration();
  if (!AwaitNotPending(handles, timeout)) {
    return absl::DeadlineExceededError(StrCat("arrays still pending after ", req.timeout_ms(), " ms"));
  }
  v1::AwaitResponse resp;
  for (uint64_t h : handles) {
    auto it = arrays_.find(h);
    if (it == arrays_.end()) {
      resp.add_states(v1::DELETED);
      resp.add_errors(StrFormat("array %#x was deleted while awaited", h));
      resp.add_codes(int(absl::StatusCode::kNotFound));
      continue;
    }
    resp.add_states(it->second.state);
    resp.add_errors(it->second.error.ok() ? "" : std::string(it->second.error.message()));
    resp.add_codes(int(it->second.error.code()));
  }
  return resp;
}

// ---------------------------------------------------------------- delete / info

void Coordinator::FreeArraysLocked(const std::vector<uint64_t>& handles) {
  // Group per device so each device gets one sequenced free.
  absl::flat_hash_map<int, v1::FreeRequest> frees;
  for (uint64_t h : handles) {
    auto it = arrays_.find(h);
    if (it == arrays_.end()) continue;
    for (int d : it->second.devices) frees[d].add_buffers(h);
    auto s = sessions_.find(it->second.session);
    if (s != sessions_.end()) s->second.arrays.erase(h);
    arrays_.erase(it);
  }
  for (auto& [d, req] : frees) {
    DeviceRecord& dev = devices_[d];
    WorkerRecord& w = workers_.at(dev.worker_id);
    if (!w.alive) continue;
    req.set_device(dev.local_index);
    req.set_seq(dev.next_seq++);
    auto log = log_;
    w.client->Free(req, [log, d](absl::Status s) {
      if (!s.ok()) log->warn("free on device {} failed: {}", d, s.ToString());
    });
  }
}

absl::Status Coordinator::Delete(const v1::DeleteRequest& req) {
  absl::MutexLock l(&mu_);
  TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
  for (uint64_t h : req.handles()) TESSEL_RETURN_IF_ERROR(OwnedArray(req.session_id(), h).status());
  FreeArraysLocked(std::vector<uint64_t>(req.handles().begin(), req.handles().end()));
  return absl::OkStatus();
}

absl::StatusOr<v1::ArrayInfoResponse> Coordinator::ArrayInfo(const v1::ArrayInfoRequest& req) {
  absl::MutexLock l(&mu_);
  TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
  TESSEL_ASSIGN_OR_RETURN(ArrayRecord * a, OwnedArray(req.session_id(), req.handle()));
  v1::ArrayInfoResponse resp;
  *resp.mutable_type() = a->type;
  resp.set_state(a->state);
  for (int d : a->devices) resp.add_devices(d);
  resp.set_bytes_per_device(ByteSizeUnchecked(a->type));
  if (!a->error.ok()) resp.set_error(std::string(a->error.message()));
  resp.set_producer_execution(a->producer);
  return resp;
}

absl::StatusOr<v1::StatsResponse> Coordinator::Stats(const v1::StatsRequest& req) {
  std::vector<std::pair<std::vector<int>, std::shared_ptr<WorkerClient>>> live;
  v1::StatsResponse resp;
  {
    absl::MutexLock l(&mu_);
    TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
    const SessionRecord& s = sessions_.at(req.session_id());
    resp.set_live_arrays(s.arrays.size());
    int64_t bytes = 0;
    for (uint64_t h : s.arrays) {
      const ArrayRecord& a = arrays_.at(h);
      bytes += ByteSizeUnchecked(a.type) * a.devices.size();
    }
    resp.set_live_bytes(bytes);
    resp.set_compiles(compiles_);
    resp.set_compile_cache_hits(cache_hits_);
    resp.set_executions(s.executions);
    resp.set_bytes_host_to_device(s.bytes_h2d);
    resp.set_bytes_device_to_host(s.bytes_d2h);
    for (const auto& [id, w] : workers_) {
      if (w.alive) live.emplace_back(w.devices, w.client);
    }
  }
  for (auto& [devices, client] : live) {
    auto st = client->GetStats();
    if (!st.ok()) continue;
    for (const v1::DeviceMemoryStats& m : st->devices()) {
      v1::DeviceMemoryStats* out = resp.add_devices();
      *out = m;
      out->set_device(devices.at(m.device()));
    }
  }
  std::sort(resp.mutable_devices()->begin(), resp.mutable_devices()->end(),
            [](const auto& a, const auto& b) { return a.device() < b.device(); });
  return resp;
}

v1::GetClusterResponse Coordinator::GetCluster(const v1::GetClusterRequest& req) {
  v1::GetClusterResponse resp;
  std::vector<std::pair<int, std::shared_ptr<WorkerClient>>> live;  // index in resp.workers
  {
    absl::MutexLock l(&mu_);
    std::vector<const WorkerRecord*> ordered;
    for (const auto& [id, w] : workers_) ordered.push_back(&w);
    std::sort(ordered.begin(), ordered.end(),
              [](auto* a, auto* b) { return a->devices.front() < b->devices.front(); });
    const absl::Time now = absl::Now();
    for (const WorkerRecord* w : ordered) {
      v1::WorkerInfo* info = resp.add_workers();
      info->set_worker_id(w->id);
      info->set_address(w->address);
      info->set_alive(w->alive);
      info->set_ms_since_heartbeat(absl::ToInt64Milliseconds(now - w->last_heartbeat));
      for (int d : w->devices) {
        v1::DeviceInfo* di = info->add_devices();
        di->set_id(d);
        di->set_kind("cpu");
        di->set_local_index(devices_[d].local_index);
        di->set_worker_id(w->id);
      }
      if (req.with_memory() && w->alive) live.emplace_back(resp.workers_size() - 1, w->client);
    }
    resp.set_sessions(sessions_.size());
    resp.set_live_arrays(arrays_.size());
    resp.set_compiles(compiles_);
    resp.set_compile_cache_hits(cache_hits_);
    resp.set_executions(executions_);
  }
  for (auto& [idx, client] : live) {
    auto st = client->GetStats();
    if (!st.ok()) continue;
    v1::WorkerInfo* info = resp.mutable_workers(idx);
    for (const v1::DeviceMemoryStats& m : st->devices()) {
      v1::DeviceMemoryStats* out = info->add_memory();
      *out = m;
      out->set_device(info->devices(m.device()).id());
    }
  }
  return resp;
}

}  // namespace tessel::server
