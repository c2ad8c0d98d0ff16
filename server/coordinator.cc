#include "server/coordinator.h"

#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "core/status.h"
#include "core/version.h"

namespace tessel::server {

using absl::StrCat;
using absl::StrFormat;

namespace {
uint64_t RandomU64() {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  return rng();
}

std::string RandomId(absl::string_view prefix) { return StrFormat("%s%016x", prefix, RandomU64()); }

// Bounded memory for what became of retired arrays.
constexpr size_t kMaxTombstones = 1 << 16;

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

// "expected f32[4], got s32[4] (dtype differs)", for signature mismatches.
std::string TypeDifference(const v1::TensorType& want, const v1::TensorType& got) {
  return StrCat("expected ", TypeString(want), ", got ", TypeString(got), " (",
                want.dtype() != got.dtype() ? "dtype" : "shape", " differs)");
}

std::string Ago(absl::Time when) {
  return StrCat(absl::FormatTime("%Y-%m-%d %H:%M:%E3S UTC", when, absl::UTCTimeZone()), " (",
                absl::FormatDuration(absl::Trunc(absl::Now() - when, absl::Milliseconds(1))), " ago)");
}

}  // namespace

int64_t Coordinator::ArrayRecord::device_bytes() const { return ByteSizeUnchecked(sharded ? block_type : type); }
int64_t Coordinator::ArrayRecord::bytes() const { return device_bytes() * int64_t(devices.size()); }

absl::Status Coordinator::CheckAlive(const std::vector<int>& devices) const {
  for (int d : devices) {
    const WorkerRecord& w = workers_.at(devices_[d].worker_id);
    if (!w.alive) {
      return absl::UnavailableError(StrCat("device ", d, " is on worker ", w.id, " (", w.address, "), which is dead"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(Options options) {
  if (!options.logger) return absl::InvalidArgumentError("Coordinator needs a logger");
  if (!options.connect) return absl::InvalidArgumentError("Coordinator needs a connect function");
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(options)));
}

Coordinator::Coordinator(Options options)
    : options_(std::move(options)),
      log_(options_.logger),
      incarnation_(RandomU64()),
      monitor_([this] { MonitorLoop(); }) {}

std::string Coordinator::CollectiveEpochLocked() const {
  return StrFormat("%016x.%d", incarnation_, collective_epoch_);
}

Coordinator::~Coordinator() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  monitor_.join();
  // The worker clients go first: tearing down their step streams fails the
  // steps in flight, whose callbacks use the maps destroyed after them.
  std::vector<std::shared_ptr<WorkerClient>> clients;
  {
    absl::MutexLock l(&mu_);
    for (auto& [id, w] : workers_) clients.push_back(std::move(w.client));
  }
  for (auto& c : clients) c->CancelAll();
  clients.clear();
}

void Coordinator::RestartQueues(const std::string& worker_id) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(worker_id);
  // Shutting down, the clients are gone first: their streams' last callbacks land here.
  if (stop_ || it == workers_.end() || !it->second.alive || it->second.client == nullptr) return;
  uint64_t epoch = 0;
  while (epoch == 0) epoch = RandomU64();
  for (int d : it->second.devices) {
    devices_[d].queue_epoch = epoch;
    devices_[d].next_seq = 0;
  }
  // The monitor opens the new epoch on the worker (OpenersLocked) unless a
  // step does first: not from here, on the transport's thread, where a
  // worker that keeps failing would make each failure send the next.
  it->second.open_queues = true;
  log_->warn("worker {} ({}): steps were lost in transit; its devices' queues start over (epoch {:#x})", worker_id,
             it->second.address, epoch);
}

std::vector<Coordinator::PendingFree> Coordinator::OpenersLocked() {
  std::vector<PendingFree> openers;
  for (auto& [id, w] : workers_) {
    if (!w.open_queues || !w.alive || w.client == nullptr) continue;
    w.open_queues = false;
    for (int d : w.devices) {
      DeviceRecord& dev = devices_[d];
      if (dev.next_seq > 0) continue;  // a step of the new epoch went already
      // An empty free opens the new epoch: what waits on the worker behind
      // the lost steps fails now, not at the next step.
      v1::FreeRequest open;
      open.set_device(dev.local_index);
      open.set_seq(dev.next_seq++);
      open.set_queue_epoch(dev.queue_epoch);
      openers.push_back(PendingFree{w.client, std::move(open), d});
    }
  }
  return openers;
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
  if (req.device_kinds_size() != 0 && req.device_kinds_size() != req.num_devices()) {
    return absl::InvalidArgumentError(StrCat("worker at ", req.address(), ": ", req.device_kinds_size(),
                                             " device kinds for ", req.num_devices(), " devices"));
  }
  std::shared_ptr<WorkerClient> client = options_.connect(req.address());
  absl::MutexLock l(&mu_);
  WorkerRecord w;
  w.id = StrCat("w", next_worker_++);
  client->SetStepsLostCallback([this, id = w.id] { RestartQueues(id); });
  uint64_t queue_epoch = 0;
  while (queue_epoch == 0) queue_epoch = RandomU64();
  w.address = req.address();
  w.last_heartbeat = absl::Now();
  w.client = std::move(client);
  for (int i = 0; i < req.num_devices(); ++i) {
    w.devices.push_back(devices_.size());
    const std::string& kind = req.device_kinds_size() > 0 ? req.device_kinds(i) : req.device_kind();
    devices_.push_back(DeviceRecord{w.id, i, 0, kind.empty() ? "cpu" : kind, queue_epoch});
  }
  std::string kinds;
  for (int d : w.devices) absl::StrAppend(&kinds, kinds.empty() ? "" : ",", devices_[d].kind);
  log_->info("worker {} registered from {} with {} devices [{}] (global ids {}..{})", w.id, w.address,
             req.num_devices(), kinds, w.devices.front(), w.devices.back());
  v1::RegisterWorkerResponse resp;
  resp.set_worker_id(w.id);
  resp.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
  resp.set_queue_epoch(queue_epoch);
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
    std::vector<std::shared_ptr<WorkerClient>> to_cancel;
    for (auto& [id, w] : workers_) {
      if (!w.alive || now - w.last_heartbeat < options_.heartbeat_timeout) continue;
      w.alive = false;
      to_cancel.push_back(w.client);
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
    std::vector<PendingFree> openers = OpenersLocked();
    if (!to_cancel.empty() || !openers.empty()) {
      // Cancelling fails the calls in flight, whose callbacks take mu_.
      mu_.Unlock();
      for (auto& c : to_cancel) c->CancelAll();
      to_cancel.clear();
      SendFrees(std::move(openers));
      mu_.Lock();
    }
  }
}

// ---------------------------------------------------------------- sessions

v1::OpenSessionResponse Coordinator::OpenSession(const v1::OpenSessionRequest& req) {
  v1::OpenSessionResponse resp;
  resp.set_session_id(RandomId("s"));
  absl::MutexLock l(&mu_);
  SessionRecord& s = sessions_[resp.session_id()];
  s.client = req.client();
  s.options = req.options();
  log_->info("session {} opened by '{}'", resp.session_id(), req.client());
  return resp;
}

absl::Status Coordinator::SetSessionOptions(const v1::SetSessionOptionsRequest& req) {
  absl::MutexLock l(&mu_);
  TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
  if (req.options().memory_quota_bytes() < 0) {
    return absl::InvalidArgumentError(StrCat("memory_quota_bytes: expected >= 0, got ",
                                             req.options().memory_quota_bytes()));
  }
  sessions_[req.session_id()].options = req.options();
  return absl::OkStatus();
}

absl::Status Coordinator::CheckSession(const std::string& id) const {
  if (!sessions_.contains(id)) {
    return absl::NotFoundError(StrCat("session '", id, "' does not exist (closed, or never opened)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CloseSessionResponse> Coordinator::CloseSession(const v1::CloseSessionRequest& req) {
  v1::CloseSessionResponse resp;
  std::vector<PendingFree> frees;
  {
    absl::MutexLock l(&mu_);
    TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
    SessionRecord& s = sessions_[req.session_id()];
    std::vector<uint64_t> handles(s.arrays.begin(), s.arrays.end());
    frees = FreeArraysLocked(handles);
    sessions_.erase(req.session_id());
    log_->info("session {} closed; {} arrays freed", req.session_id(), handles.size());
    resp.set_arrays_freed(handles.size());
  }
  SendFrees(std::move(frees));
  return resp;
}

absl::StatusOr<Coordinator::ArrayRecord*> Coordinator::OwnedArray(const std::string& session, uint64_t handle) {
  auto it = arrays_.find(handle);
  if (it == arrays_.end()) {
    auto s = sessions_.find(session);
    if (s != sessions_.end()) {
      auto t = s->second.tombstones.find(handle);
      if (t != s->second.tombstones.end()) {
        const Tombstone& ts = t->second;
        if (ts.state == v1::DONATED) {
          return absl::FailedPreconditionError(StrFormat(
              "array %#x was donated to execution %d ('%s') at %s; a donated array cannot be used again", handle,
              ts.execution, ts.executable, Ago(ts.when)));
        }
        return absl::NotFoundError(StrFormat("array %#x was deleted at %s", handle, Ago(ts.when)));
      }
    }
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

Coordinator::ArrayRecord& Coordinator::AddArray(const std::string& session, uint64_t handle, ArrayRecord record) {
  record.session = session;
  SessionRecord& s = sessions_.at(session);
  s.arrays.insert(handle);
  s.live_bytes += record.bytes();
  ArrayRecord& a = arrays_[handle];
  a = std::move(record);
  return a;
}

void Coordinator::RetireArray(uint64_t handle, Tombstone tombstone) {
  auto it = arrays_.find(handle);
  if (it == arrays_.end()) return;
  auto s = sessions_.find(it->second.session);
  if (s != sessions_.end()) {
    SessionRecord& sr = s->second;
    sr.arrays.erase(handle);
    sr.live_bytes -= it->second.bytes();
    if (sr.tombstones.insert_or_assign(handle, std::move(tombstone)).second) sr.tombstone_order.push_back(handle);
    while (sr.tombstone_order.size() > kMaxTombstones) {
      sr.tombstones.erase(sr.tombstone_order.front());
      sr.tombstone_order.pop_front();
    }
  }
  arrays_.erase(it);
}

absl::Status Coordinator::CheckQuota(const std::string& session, int64_t added, absl::string_view what) const {
  const SessionRecord& s = sessions_.at(session);
  const int64_t quota = s.options.memory_quota_bytes();
  if (quota <= 0 || added <= 0 || s.live_bytes + added <= quota) return absl::OkStatus();
  return absl::ResourceExhaustedError(StrFormat(
      "session %s memory quota: %s needs %d more bytes; the session holds %d bytes in %d live arrays, quota %d",
      session, what, added, s.live_bytes, s.arrays.size(), quota));
}

absl::Status Coordinator::GuardTransfer(const std::string& session, const v1::TransferGuard& call, Direction dir,
                                        bool implicit, absl::string_view what, int64_t bytes) const {
  const int d = static_cast<int>(dir);
  v1::TransferLevel level = LevelFor(call, d);
  const bool from_call = level != v1::TRANSFER_UNSET;
  if (!from_call) level = LevelFor(sessions_.at(session).options.transfer_guard(), d);
  const bool covers = implicit || level == v1::TRANSFER_LOG_EXPLICIT || level == v1::TRANSFER_DISALLOW_EXPLICIT;
  if (!covers) return absl::OkStatus();
  const std::string text = StrFormat("%s %s transfer of %s (%d bytes)", implicit ? "implicit" : "explicit",
                                     DirectionName(d), what, bytes);
  if (level == v1::TRANSFER_DISALLOW || level == v1::TRANSFER_DISALLOW_EXPLICIT) {
    return absl::FailedPreconditionError(StrCat("transfer guard: ", text, " is disallowed (", LevelName(level),
                                                " set by the ", from_call ? "call" : "session", ")"));
  }
  if (level == v1::TRANSFER_LOG || level == v1::TRANSFER_LOG_EXPLICIT) {
    log_->warn("session {}: transfer guard: {}", session, text);
  }
  return absl::OkStatus();
}

void Coordinator::CountTransfer(const std::string& session, int device, Direction dir, int64_t bytes) {
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return;
  TransferCounts& total = s->second.transfers;
  TransferCounts& dev = s->second.device_transfers[device];
  switch (dir) {
    case Direction::kHostToDevice: total.h2d += bytes, dev.h2d += bytes; break;
    case Direction::kDeviceToHost: total.d2h += bytes, dev.d2h += bytes; break;
    case Direction::kDeviceToDevice: total.d2d += bytes, dev.d2d += bytes; break;
  }
}

std::string Coordinator::ExplainCacheMiss(const v1::Graph& graph, const std::vector<int>& donated) const {
  const ExecutableRecord* nearest = nullptr;
  std::vector<std::string> best;
  int same_name = 0;
  for (const auto& [id, e] : executables_) {
    if (e.graph.name() != graph.name()) continue;
    ++same_name;
    std::vector<std::string> diffs;
    // Parameters, by index.
    absl::flat_hash_map<int, const v1::Node*> mine, theirs;
    for (const v1::Node& n : graph.nodes()) {
      if (n.op() == v1::PARAMETER) mine[n.parameter().index()] = &n;
    }
    for (const v1::Node& n : e.graph.nodes()) {
      if (n.op() == v1::PARAMETER) theirs[n.parameter().index()] = &n;
    }
    for (const auto& [i, n] : mine) {
      auto t = theirs.find(i);
      if (t == theirs.end()) {
        diffs.push_back(StrCat("parameter ", i, " '", n->name(), "' is new"));
      } else if (!SameType(n->type(), t->second->type())) {
        diffs.push_back(StrCat("parameter ", i, " '", n->name(), "': ", TypeString(n->type()), " here, ",
                               TypeString(t->second->type()), " in the cached one (",
                               n->type().dtype() != t->second->type().dtype() ? "dtype" : "shape", ")"));
      }
    }
    if (theirs.size() > mine.size()) {
      diffs.push_back(StrCat(theirs.size() - mine.size(), " fewer parameters than the cached one"));
    }
    std::vector<int> want = donated, had = e.compiled.donated_parameters;
    std::sort(want.begin(), want.end());
    std::sort(had.begin(), had.end());
    if (want != had) {
      diffs.push_back(StrCat("donated parameters [", absl::StrJoin(want, ","), "] here, [", absl::StrJoin(had, ","),
                             "] in the cached one"));
    }
    if (graph.nodes_size() != e.graph.nodes_size()) {
      diffs.push_back(StrCat(graph.nodes_size(), " nodes here, ", e.graph.nodes_size(), " in the cached one"));
    } else {
      for (int i = 0; i < graph.nodes_size(); ++i) {
        const v1::Node& a = graph.nodes(i);
        if (a.op() == v1::PARAMETER) continue;
        if (a.SerializeAsString() != e.graph.nodes(i).SerializeAsString()) {
          diffs.push_back(StrCat("node ", i, " '", a.name(), "' (", OpName(a.op()), ") differs"));
          break;
        }
      }
    }
    if (graph.outputs_size() != e.graph.outputs_size()) {
      diffs.push_back(StrCat(graph.outputs_size(), " outputs here, ", e.graph.outputs_size(), " in the cached one"));
    }
    if (nearest == nullptr || diffs.size() < best.size()) {
      nearest = &e;
      best = std::move(diffs);
    }
  }
  if (nearest == nullptr) {
    return StrCat("no executable of graph '", graph.name(), "' was compiled before (", executables_.size(),
                  " executables in the cache)");
  }
  if (best.empty()) best.push_back("they differ only in attributes outside nodes and parameters");
  return StrCat("nearest cached executable of graph '", graph.name(), "' (", nearest->compiled.fingerprint, ", one of ",
                same_name, "): ", absl::StrJoin(best, "; "));
}

// ---------------------------------------------------------------- compile

absl::StatusOr<v1::CompileResponse> Coordinator::Compile(const v1::CompileRequest& req) {
  const std::vector<int> donated(req.donated_parameters().begin(), req.donated_parameters().end());
  scheduler::CompileOptions options{.donated_parameters = donated};
  if (req.has_mesh()) {
    {
      absl::MutexLock l(&mu_);
      auto mesh = NormalizeMesh(req.mesh(), devices_.size());
      if (!mesh.ok()) return Annotate(mesh.status(), StrCat("graph '", req.graph().name(), "': "));
      options.mesh = std::move(*mesh);
    }
    options.parameter_shardings.assign(req.parameter_shardings().begin(), req.parameter_shardings().end());
    options.output_shardings.assign(req.output_shardings().begin(), req.output_shardings().end());
  } else if (req.parameter_shardings_size() > 0 || req.output_shardings_size() > 0) {
    return absl::InvalidArgumentError(StrCat("graph '", req.graph().name(), "': shardings need a mesh"));
  }
  const std::string key = scheduler::ExecutableKey(req.graph(), options);
  v1::CompileResponse resp;
  const scheduler::CompiledProgram* compiled = nullptr;
  bool strict = req.strict_donation();
  {
    absl::MutexLock l(&mu_);
    TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
    SessionRecord& s = sessions_.at(req.session_id());
    strict |= s.options.strict_donation();
    auto it = executables_.find(key);
    if (it != executables_.end()) {
      ++cache_hits_;
      ++s.cache_hits;
      compiled = &it->second.compiled;
      resp.set_cache_hit(true);
    } else {
      ++s.cache_misses;
      resp.set_cache_miss_reason(ExplainCacheMiss(req.graph(), donated));
      if (s.options.forbid_compiles()) {
        return absl::FailedPreconditionError(StrCat("session ", req.session_id(),
                                                    " forbids new compiles, and graph '", req.graph().name(),
                                                    "' is not in the compile cache: ", resp.cache_miss_reason()));
      }
    }
  }
  if (compiled == nullptr) {
    options.strict_donation = strict;
    auto c = scheduler::Compile(req.graph(), options);
    if (!c.ok()) {
      log_->info("session {}: compile of '{}' failed: {}", req.session_id(), req.graph().name(), c.status().ToString());
      return Annotate(c.status(), StrCat("graph '", req.graph().name(), "': "));
    }
    absl::MutexLock l(&mu_);
    ++compiles_;
    if (auto s = sessions_.find(req.session_id()); s != sessions_.end()) ++s->second.compiles;
    auto [it, inserted] = executables_.try_emplace(key, ExecutableRecord{std::move(*c), req.graph()});
    compiled = &it->second.compiled;
    log_->info("session {}: compiled '{}' as {} ({})", req.session_id(), req.graph().name(), key,
               resp.cache_miss_reason());
  } else if (strict) {
    TESSEL_RETURN_IF_ERROR(scheduler::CheckStrictDonation(*compiled));
  }
  // Records are never erased, so `compiled` stays valid without the lock.
  resp.set_executable_id(compiled->fingerprint);
  for (const auto& t : compiled->global_parameter_types) *resp.add_parameter_types() = t;
  for (const auto& t : compiled->global_output_types) *resp.add_output_types() = t;
  if (compiled->partitioned()) {
    *resp.mutable_mesh() = compiled->mesh;
    for (const auto& sh : compiled->parameter_shardings) *resp.add_parameter_shardings() = sh;
    for (const auto& sh : compiled->output_shardings) *resp.add_output_shardings() = sh;
    for (const scheduler::PlannedCollective& pc : compiled->collectives) {
      v1::CollectiveInfo* ci = resp.add_collectives();
      ci->set_value(pc.value);
      ci->set_op(OpName(pc.op));
      for (const std::string& a : pc.axes) ci->add_axes(a);
      ci->set_bytes_per_device(pc.bytes_per_device);
      ci->set_reason(pc.reason);
    }
  }
  resp.set_plan(compiled->plan_text);
  for (const auto& d : compiled->diagnostics) resp.add_diagnostics(d);
  resp.set_estimated_bytes(compiled->estimated_peak_bytes);
  for (const scheduler::AliasDecision& d : compiled->declared_aliases) {
    v1::Alias* a = resp.add_aliases();
    a->set_parameter(d.parameter);
    a->set_output(d.output);
    a->set_reason(d.reason);
  }
  return resp;
}

// ---------------------------------------------------------------- execute

absl::StatusOr<v1::ExecuteResponse> Coordinator::Execute(const v1::ExecuteRequest& req) {
  struct Launch {
    std::shared_ptr<WorkerClient> client;
    v1::RunRequest run;
    bool needs_load;
    std::optional<v1::FreeRequest> free_after;  // the moved copies, once the step ran
    int device = 0;                             // global id
  };
  std::vector<Launch> launches;
  std::vector<PendingFree> early_frees;  // donated copies on devices the step does not run on
  std::vector<Move> moves;
  std::vector<uint64_t> outputs(req.outputs().begin(), req.outputs().end());
  const v1::Program* program = nullptr;
  std::shared_ptr<v1::Program> loaded_program;  // partitioned: the program with its workers' addresses
  bool partitioned = false;
  int64_t execution_id = 0;
  int64_t epoch = 0;
  v1::ExecuteResponse resp;
  {
    absl::MutexLock l(&mu_);
    TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
    SessionRecord& session = sessions_.at(req.session_id());
    auto exe = executables_.find(req.executable_id());
    if (exe == executables_.end()) {
      return absl::NotFoundError(StrCat("executable '", req.executable_id(), "' was never compiled here"));
    }
    const scheduler::CompiledProgram& c = exe->second.compiled;
    const std::string& exe_name = exe->second.graph.name();
    program = &c.program;
    partitioned = c.partitioned();
    std::vector<int> devices;
    if (partitioned) {
      devices.assign(c.mesh.devices().begin(), c.mesh.devices().end());
      TESSEL_RETURN_IF_ERROR(CheckAlive(devices));
    } else {
      TESSEL_ASSIGN_OR_RETURN(devices, ResolvePlacement(req.placement()));
    }
    if (req.arguments_size() != int(c.parameter_types.size())) {
      return absl::InvalidArgumentError(StrCat("executable '", exe_name, "' (", req.executable_id(), ") takes ",
                                               c.parameter_types.size(), " arguments, got ", req.arguments_size()));
    }
    if (req.outputs_size() != int(c.output_types.size())) {
      return absl::InvalidArgumentError(StrCat("executable '", exe_name, "' (", req.executable_id(), ") has ",
                                               c.output_types.size(), " outputs; the request names ",
                                               req.outputs_size(), " output handles"));
    }
    // The donation set: the executable's declared parameters and the call's.
    std::vector<bool> donated(req.arguments_size(), false);
    std::vector<int> donated_list;
    for (int p : c.donated_parameters) donated[p] = true;
    for (int i : req.donate()) {
      if (i < 0 || i >= req.arguments_size()) {
        return absl::InvalidArgumentError(StrCat("donate: argument ", i, " does not exist; executable '", exe_name,
                                                 "' takes ", req.arguments_size(), " arguments"));
      }
      donated[i] = true;
    }
    for (int i = 0; i < req.arguments_size(); ++i) {
      if (donated[i]) donated_list.push_back(i);
    }
    absl::Status upstream_error;
    int64_t donated_bytes = 0;
    for (int i = 0; i < req.arguments_size(); ++i) {
      const std::string& pname = c.program.parameters(i).name();
      auto a = OwnedArray(req.session_id(), req.arguments(i));
      if (!a.ok()) return Annotate(a.status(), StrCat("argument ", i, " '", pname, "': "));
      const ArrayRecord& rec = **a;
      if (!SameType(rec.type, c.global_parameter_types[i])) {
        return absl::InvalidArgumentError(StrFormat(
            "argument %d '%s' (array %#x) does not match the signature of executable '%s': %s. An executable runs "
            "only on the signature it was compiled for; compile the graph for this one",
            i, pname, req.arguments(i), exe_name, TypeDifference(c.global_parameter_types[i], rec.type)));
      }
      if (partitioned || rec.sharded) {
        // Blocks are never moved implicitly: the layout must be the one compiled for.
        const v1::Sharding want = partitioned ? c.parameter_shardings[i] : Replicated(rec.type.dims_size());
        const bool same_mesh = !partitioned || !rec.sharded || SameMesh(rec.mesh, c.mesh);
        bool ok = same_mesh && (rec.sharded ? SameSharding(rec.sharding, want) : IsReplicated(want));
        for (int d : devices) ok &= std::find(rec.devices.begin(), rec.devices.end(), d) != rec.devices.end();
        if (!ok) {
          const std::string have = rec.sharded ? StrCat(ShardingString(rec.sharding), " on mesh ", MeshString(rec.mesh))
                                               : StrCat("whole on device ", absl::StrJoin(rec.devices, ","));
          const std::string need = partitioned ? StrCat(ShardingString(want), " on mesh ", MeshString(c.mesh))
                                               : StrCat("whole on device ", absl::StrJoin(devices, ","));
          return absl::InvalidArgumentError(StrFormat(
              "argument %d '%s' (array %#x, %s) is laid out %s; executable '%s' takes it %s. Blocks are not moved "
              "implicitly: put the array with that sharding, or compile for its layout",
              i, pname, req.arguments(i), TypeString(rec.type), have, exe_name, need));
        }
      }
      if (rec.state == v1::LOST) return Annotate(rec.error, StrCat("argument ", i, " '", pname, "': "));
      if (rec.state == v1::ERROR && upstream_error.ok()) {
        upstream_error = Annotate(rec.error, StrFormat("argument %d '%s' (array %#x) failed earlier: ", i, pname,
                                                       req.arguments(i)));
      }
      for (int d : devices) {
        if (std::find(rec.devices.begin(), rec.devices.end(), d) == rec.devices.end()) {
          const std::string what = StrFormat("argument %d '%s' (array %#x, %s) from device %s to device %d", i,
                                             pname, req.arguments(i), TypeString(rec.type),
                                             absl::StrJoin(rec.devices, ","), d);
          TESSEL_RETURN_IF_ERROR(GuardTransfer(req.session_id(), req.transfer_guard(), Direction::kDeviceToDevice,
                                               true, what, ByteSizeUnchecked(rec.type)));
          if (donated[i]) {
            return absl::InvalidArgumentError(StrFormat(
                "argument %d '%s' (array %#x) is donated but lives on device %s, not on device %d where the step "
                "runs; a donated buffer cannot change devices",
                i, pname, req.arguments(i), absl::StrJoin(rec.devices, ","), d));
          }
          TESSEL_ASSIGN_OR_RETURN(Move m, PlanMove(rec, req.arguments(i), d));
          m.argument = i;
          moves.push_back(std::move(m));
        }
      }
      if (donated[i]) {
        for (int j = 0; j < req.arguments_size(); ++j) {
          if (j != i && req.arguments(j) == req.arguments(i)) {
            return absl::InvalidArgumentError(StrFormat(
                "argument %d '%s' donates array %#x, which is also argument %d; an array cannot be donated and "
                "read in the same call",
                i, pname, req.arguments(i), j));
          }
        }
        donated_bytes += rec.bytes();
      }
    }
    std::vector<scheduler::AliasDecision> aliases =
        scheduler::AssignAliases(c.program, c.alias_candidates, donated_list);
    if (req.strict_donation() || session.options.strict_donation()) {
      for (const scheduler::AliasDecision& d : aliases) {
        if (d.output < 0) {
          return absl::InvalidArgumentError(StrFormat(
              "strict donation: argument %d '%s' (array %#x) cannot give its buffer to any output of '%s': %s",
              d.parameter, c.program.parameters(d.parameter).name(), req.arguments(d.parameter), exe_name,
              d.reason));
        }
      }
    }
    absl::flat_hash_set<uint64_t> seen;
    int64_t output_bytes = 0;
    for (int i = 0; i < req.outputs_size(); ++i) {
      uint64_t h = req.outputs(i);
      if (h == 0) return absl::InvalidArgumentError(StrCat("output handle ", i, " is 0; handles must be nonzero"));
      if (!seen.insert(h).second || arrays_.contains(h)) {
        return absl::AlreadyExistsError(StrFormat("output handle %d (%#x) is already in use", i, h));
      }
      output_bytes += ByteSizeUnchecked(c.output_types[i]) * int64_t(devices.size());  // per-device types
    }
    TESSEL_RETURN_IF_ERROR(
        CheckQuota(req.session_id(), output_bytes - donated_bytes, StrCat("execution of '", exe_name, "'")));

    // Accepted: from here on nothing fails.
    execution_id = ++next_execution_;
    epoch = collective_epoch_;
    resp.set_execution_id(execution_id);
    ++executions_;
    ++session.executions;
    for (const scheduler::AliasDecision& d : aliases) {
      v1::DonationReceipt* r = resp.add_donations();
      r->set_argument(d.parameter);
      r->set_handle(req.arguments(d.parameter));
      r->set_reused(d.output >= 0);
      r->set_output(d.output);
      if (d.output >= 0) r->set_output_handle(req.outputs(d.output));
      r->set_reason(d.reason);
    }
    // Donated arrays are gone from now on; copies on devices the step does
    // not run on are freed in order after what reads them there.
    const absl::Time now = absl::Now();
    for (int i : donated_list) {
      const uint64_t h = req.arguments(i);
      for (int d : arrays_.at(h).devices) {
        if (std::find(devices.begin(), devices.end(), d) != devices.end()) continue;
        DeviceRecord& dev = devices_[d];
        WorkerRecord& w = workers_.at(dev.worker_id);
        if (!w.alive) continue;
        v1::FreeRequest fr;
        fr.set_device(dev.local_index);
        fr.set_seq(dev.next_seq++);
        fr.set_queue_epoch(dev.queue_epoch);
        fr.add_buffers(h);
        early_frees.push_back(PendingFree{w.client, std::move(fr), d});
      }
      session.donations += devices.size();
      RetireArray(h, Tombstone{v1::DONATED, execution_id, exe_name, now});
    }
    for (int i = 0; i < req.outputs_size(); ++i) {
      ArrayRecord a;
      a.type = c.global_output_types[i];
      a.devices = devices;
      if (partitioned) {
        a.sharded = true;
        a.mesh = c.mesh;
        a.sharding = c.output_shardings[i];
        a.block_type = c.output_types[i];
      }
      a.producer = execution_id;
      a.producer_name = exe_name;
      if (!upstream_error.ok()) {
        a.state = v1::ERROR;
        a.error = upstream_error;
      } else {
        a.state = v1::PENDING;
        a.pending = devices.size();
      }
      AddArray(req.session_id(), req.outputs(i), std::move(a));
    }
    for (size_t pos = 0; pos < devices.size(); ++pos) {
      const int d = devices[pos];
      DeviceRecord& dev = devices_[d];
      WorkerRecord& w = workers_.at(dev.worker_id);
      Launch launch{w.client, {}, !w.loaded.contains(req.executable_id())};
      launch.device = d;
      w.loaded.insert(req.executable_id());
      if (partitioned && launch.needs_load && !loaded_program) {
        // Workers find their peers for collectives by address.
        loaded_program = std::make_shared<v1::Program>(c.program);
        for (int md : c.mesh.devices()) loaded_program->add_device_workers(workers_.at(devices_[md].worker_id).address);
      }
      launch.run.set_device(dev.local_index);
      launch.run.set_mesh_position(pos);
      launch.run.set_seq(dev.next_seq++);
      launch.run.set_queue_epoch(dev.queue_epoch);
      launch.run.set_executable_id(req.executable_id());
      *launch.run.mutable_arguments() = req.arguments();
      for (const Move& m : moves) {
        if (m.to_device != d) continue;
        launch.run.set_arguments(m.argument, m.temp_handle);
        if (!launch.free_after) launch.free_after.emplace().set_device(dev.local_index);
        launch.free_after->add_buffers(m.temp_handle);
      }
      *launch.run.mutable_outputs() = req.outputs();
      launch.run.set_execution_id(execution_id);
      if (partitioned) launch.run.set_collective_epoch(CollectiveEpochLocked());
      for (int i : donated_list) launch.run.add_donated(i);
      for (const scheduler::AliasDecision& al : aliases) {
        if (al.output < 0) continue;
        v1::RunAlias* ra = launch.run.add_aliases();
        ra->set_argument(al.parameter);
        ra->set_output(al.output);
      }
      if (launch.free_after) {
        launch.free_after->set_seq(dev.next_seq++);
        launch.free_after->set_queue_epoch(dev.queue_epoch);
      }
      launches.push_back(std::move(launch));
    }
  }
  SendFrees(std::move(early_frees));
  // Implicit moves (the guard allowed them) land before the step is sent;
  // the step reads the moved copies, freed right after it on their device.
  for (const Move& m : moves) {
    absl::Status s = RunMove(req.session_id(), m);
    if (!s.ok()) log_->warn("execution {}: {}", execution_id, s.ToString());
  }
  // The step still runs when an argument failed upstream: it consumes the
  // donated buffers and marks its outputs with the error on the workers.
  for (Launch& launch : launches) {
    if (launch.needs_load) {
      absl::Status s = launch.client->LoadProgram(loaded_program ? *loaded_program : *program);
      if (!s.ok()) {
        // The sequence number must still be consumed; the step fails on the
        // worker. The next step tries the load again.
        log_->error("execution {}: loading {} failed: {}", execution_id, req.executable_id(), s.ToString());
        absl::MutexLock l(&mu_);
        for (auto& [id, w] : workers_) {
          if (w.client == launch.client) w.loaded.erase(req.executable_id());
        }
      }
    }
    launch.client->Run(launch.run, [this, session = req.session_id(), outputs, epoch, execution_id,
                                    device = launch.device](absl::StatusOr<v1::RunResponse> r) {
      // Workers speak of their local devices; users know the global ids.
      if (!r.ok()) r = Annotate(r.status(), StrCat("execution ", execution_id, " on device ", device, ": "));
      OnStepDone(session, outputs, epoch, std::move(r));
    });
    if (launch.free_after) {
      launch.client->Free(*launch.free_after, [log = log_](absl::Status s) {
        if (!s.ok()) log->warn("free of moved arguments failed: {}", s.ToString());
      });
    }
  }
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

absl::StatusOr<Coordinator::Move> Coordinator::PlanMove(const ArrayRecord& rec, uint64_t handle, int to_device) {
  Move m;
  m.handle = handle;
  m.type = rec.type;
  m.to_device = to_device;
  for (int d : rec.devices) {
    const WorkerRecord& w = workers_.at(devices_[d].worker_id);
    if (!w.alive) continue;
    m.from_device = d;
    m.from = w.client;
    m.from_local = devices_[d].local_index;
    break;
  }
  if (!m.from) return absl::UnavailableError(StrFormat("array %#x: no live device holds it", handle));
  const DeviceRecord& dest = devices_[to_device];
  m.to = workers_.at(dest.worker_id).client;
  m.to_local = dest.local_index;
  static thread_local std::mt19937_64 rng(std::random_device{}());
  do {
    m.temp_handle = rng();
  } while (m.temp_handle == 0 || arrays_.contains(m.temp_handle));
  return m;
}

absl::Status Coordinator::RunMove(const std::string& session, const Move& m) {
  {
    absl::MutexLock l(&mu_);
    std::vector<uint64_t> handles{m.handle};
    AwaitNotPending(handles, absl::InfiniteDuration());
  }
  v1::PutShardRequest::Header h;
  h.set_buffer(m.temp_handle);
  *h.mutable_type() = m.type;
  h.add_devices(m.to_local);
  TESSEL_ASSIGN_OR_RETURN(auto put, m.to->BeginPut(h));
  v1::FetchShardRequest fr;
  fr.set_device(m.from_local);
  fr.set_buffer(m.handle);
  auto fetch = m.from->BeginFetch(fr);
  std::string chunk;
  int64_t moved = 0;
  absl::Status s;
  while (s.ok() && fetch->Read(&chunk)) {
    moved += chunk.size();
    s = put->Write(chunk);
  }
  absl::Status fs = fetch->Finish();
  absl::Status ps = put->Finish();
  if (s.ok()) s = fs.ok() ? ps : fs;
  if (!s.ok()) {
    return Annotate(s, StrFormat("moving array %#x from device %d to device %d: ", m.handle, m.from_device,
                                 m.to_device));
  }
  absl::MutexLock l(&mu_);
  CountTransfer(session, m.to_device, Direction::kDeviceToDevice, moved);
  return absl::OkStatus();
}

void Coordinator::MarkRejectedOutputs(const v1::ExecuteRequest& req, const absl::Status& error) {
  absl::MutexLock l(&mu_);
  if (!sessions_.contains(req.session_id())) return;
  for (uint64_t h : req.outputs()) {
    if (h == 0 || arrays_.contains(h)) continue;
    ArrayRecord a;
    a.state = v1::ERROR;
    a.error = Annotate(error, "the execution that was to make this array was rejected: ");
    a.producer_name = "rejected execution";
    AddArray(req.session_id(), h, std::move(a));
  }
}

void Coordinator::OnStepDone(const std::string& session, const std::vector<uint64_t>& outputs, int64_t epoch,
                             absl::StatusOr<v1::RunResponse> result) {
  absl::MutexLock l(&mu_);
  if (!result.ok() && result.status().GetPayload(kGroupBrokenPayload).has_value() && epoch == collective_epoch_) {
    ++collective_epoch_;
    log_->warn("a collective group broke ({}); steps from now on meet in groups of epoch {}",
               result.status().ToString(), CollectiveEpochLocked());
  }
  if (result.ok()) {
    auto s = sessions_.find(session);
    if (s != sessions_.end()) s->second.donations_reused += result->reused_size();
  }
  for (uint64_t h : outputs) {
    auto it = arrays_.find(h);
    if (it == arrays_.end()) continue;  // deleted meanwhile
    ArrayRecord& a = it->second;
    if (a.state != v1::PENDING) continue;
    if (!result.ok()) {
      a.state = v1::ERROR;
      a.error = result.status();
      a.pending = 0;
      log_->warn("session {} execution {}: array {:#x} failed: {}", a.session, a.producer, h,
                 result.status().ToString());
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
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return NotPending(handles); };
  return mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
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

std::vector<Coordinator::PendingFree> Coordinator::FreeArraysLocked(const std::vector<uint64_t>& handles) {
  // Group per device so each device gets one sequenced free.
  absl::flat_hash_map<int, v1::FreeRequest> frees;
  const absl::Time now = absl::Now();
  for (uint64_t h : handles) {
    auto it = arrays_.find(h);
    if (it == arrays_.end()) continue;
    for (int d : it->second.devices) frees[d].add_buffers(h);
    RetireArray(h, Tombstone{v1::DELETED, 0, "", now});
  }
  std::vector<PendingFree> out;
  for (auto& [d, req] : frees) {
    DeviceRecord& dev = devices_[d];
    WorkerRecord& w = workers_.at(dev.worker_id);
    if (!w.alive) continue;
    req.set_device(dev.local_index);
    req.set_seq(dev.next_seq++);
    req.set_queue_epoch(dev.queue_epoch);
    out.push_back(PendingFree{w.client, std::move(req), d});
  }
  return out;
}

void Coordinator::SendFrees(std::vector<PendingFree> frees) {
  for (PendingFree& f : frees) {
    f.client->Free(f.request, [log = log_, d = f.device](absl::Status s) {
      if (!s.ok()) log->warn("free on device {} failed: {}", d, s.ToString());
    });
  }
}

v1::WorkerStatsRequest Coordinator::StatsRequestLocked(const WorkerRecord& w) const {
  v1::WorkerStatsRequest req;
  for (int d : w.devices) {
    const DeviceRecord& dev = devices_.at(d);
    while (req.sequenced_size() <= dev.local_index) req.add_sequenced(0);
    req.set_sequenced(dev.local_index, dev.next_seq);
  }
  return req;
}

absl::Status Coordinator::Delete(const v1::DeleteRequest& req) {
  std::vector<PendingFree> frees;
  {
    absl::MutexLock l(&mu_);
    TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
    for (uint64_t h : req.handles()) TESSEL_RETURN_IF_ERROR(OwnedArray(req.session_id(), h).status());
    frees = FreeArraysLocked(std::vector<uint64_t>(req.handles().begin(), req.handles().end()));
  }
  SendFrees(std::move(frees));
  return absl::OkStatus();
}

absl::StatusOr<v1::ArrayInfoResponse> Coordinator::ArrayInfo(const v1::ArrayInfoRequest& req) {
  absl::MutexLock l(&mu_);
  TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
  v1::ArrayInfoResponse resp;
  auto a_or = OwnedArray(req.session_id(), req.handle());
  if (!a_or.ok()) {
    // A retired array still answers what became of it.
    const SessionRecord& s = sessions_.at(req.session_id());
    auto t = s.tombstones.find(req.handle());
    if (t == s.tombstones.end()) return a_or.status();
    resp.set_state(t->second.state);
    resp.set_error(std::string(a_or.status().message()));
    resp.set_producer_execution(t->second.execution);
    return resp;
  }
  ArrayRecord* a = *a_or;
  *resp.mutable_type() = a->type;
  resp.set_state(a->state);
  for (int d : a->devices) resp.add_devices(d);
  resp.set_bytes_per_device(a->device_bytes());
  for (size_t i = 0; i < a->devices.size(); ++i) resp.add_device_bytes(a->device_bytes());
  if (a->sharded) {
    *resp.mutable_sharding()->mutable_mesh() = a->mesh;
    *resp.mutable_sharding()->mutable_sharding() = a->sharding;
  }
  if (!a->error.ok()) resp.set_error(std::string(a->error.message()));
  resp.set_producer_execution(a->producer);
  resp.set_producer(a->producer_name);
  return resp;
}

absl::StatusOr<v1::StatsResponse> Coordinator::Stats(const v1::StatsRequest& req) {
  struct Live {
    std::vector<int> devices;
    std::shared_ptr<WorkerClient> client;
    v1::WorkerStatsRequest request;
  };
  std::vector<Live> live;
  v1::StatsResponse resp;
  {
    absl::MutexLock l(&mu_);
    TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
    const SessionRecord& s = sessions_.at(req.session_id());
    resp.set_live_arrays(s.arrays.size());
    resp.set_live_bytes(s.live_bytes);
    resp.set_compiles(compiles_);
    resp.set_compile_cache_hits(cache_hits_);
    resp.set_executions(s.executions);
    resp.set_bytes_host_to_device(s.transfers.h2d);
    resp.set_bytes_device_to_host(s.transfers.d2h);
    resp.set_bytes_device_to_device(s.transfers.d2d);
    std::vector<int> devs;
    for (const auto& [d, t] : s.device_transfers) devs.push_back(d);
    std::sort(devs.begin(), devs.end());
    for (int d : devs) {
      const TransferCounts& t = s.device_transfers.at(d);
      v1::TransferCounters* out = resp.add_device_transfers();
      out->set_device(d);
      out->set_host_to_device(t.h2d);
      out->set_device_to_host(t.d2h);
      out->set_device_to_device(t.d2d);
    }
    resp.set_compile_cache_misses(s.cache_misses);
    resp.set_session_compiles(s.compiles);
    resp.set_session_cache_hits(s.cache_hits);
    resp.set_donations(s.donations);
    resp.set_donations_reused(s.donations_reused);
    resp.set_memory_quota_bytes(s.options.memory_quota_bytes());
    if (req.with_arrays()) {
      std::vector<uint64_t> handles(s.arrays.begin(), s.arrays.end());
      std::sort(handles.begin(), handles.end(), [&](uint64_t x, uint64_t y) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        const ArrayRecord &a = arrays_.at(x), &b = arrays_.at(y);
        return std::tie(a.producer, x) < std::tie(b.producer, y);
      });
      for (uint64_t h : handles) {
        const ArrayRecord& a = arrays_.at(h);
        v1::LiveArray* la = resp.add_arrays();
        la->set_handle(h);
        *la->mutable_type() = a.type;
        la->set_state(a.state);
        la->set_bytes(a.bytes());
        for (int d : a.devices) la->add_devices(d);
        la->set_producer_execution(a.producer);
        la->set_producer(a.producer_name);
      }
    }
    for (const auto& [id, w] : workers_) {
      if (w.alive) live.push_back({w.devices, w.client, StatsRequestLocked(w)});
    }
  }
  for (auto& [devices, client, request] : live) {
    auto st = client->GetStats(request);
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
  struct Live {
    int index;  // in resp.workers
    std::shared_ptr<WorkerClient> client;
    v1::WorkerStatsRequest request;
  };
  std::vector<Live> live;
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
        di->set_kind(devices_[d].kind);
        di->set_local_index(devices_[d].local_index);
        di->set_worker_id(w->id);
      }
      if (req.with_memory() && w->alive) live.push_back({resp.workers_size() - 1, w->client, StatsRequestLocked(*w)});
    }
    resp.set_sessions(sessions_.size());
    resp.set_live_arrays(arrays_.size());
    resp.set_compiles(compiles_);
    resp.set_compile_cache_hits(cache_hits_);
    resp.set_executions(executions_);
  }
  for (auto& [idx, client, request] : live) {
    auto st = client->GetStats(request);
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
