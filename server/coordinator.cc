#include "server/coordinator.h"
#include "server/mpmd.h"

#include <algorithm>
#include <optional>
#include <random>
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

namespace tessel::server {

using absl::StrCat;
using absl::StrFormat;

namespace {
uint64_t RandomU64() {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  return rng();
}

uint64_t RandomNonzero() {
  uint64_t v = 0;
  while (v == 0) v = RandomU64();
  return v;
}

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

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(Options options) {
  if (!options.logger) return absl::InvalidArgumentError("Coordinator needs a logger");
  if (!options.connect) return absl::InvalidArgumentError("Coordinator needs a connect function");
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(options)));
}

Coordinator::Coordinator(Options options)
    : options_(std::move(options)),
      log_(options_.logger),
      incarnation_(StrFormat("%016x", RandomU64())),
      workers_(log_, StrCat(".", incarnation_)),
      arrays_(incarnation_, absl::Now()),
      cache_(options_.compile_cache_bytes),
      tenants_(std::make_shared<const Tenants>(options_.tenants)),
      monitor_([this] { MonitorLoop(); }) {}

std::shared_ptr<const Tenants> Coordinator::tenants() const {
  absl::ReaderMutexLock l(&tenants_mu_);
  return tenants_;
}

void Coordinator::ReplaceTenants(Tenants tenants) {
  auto next = std::make_shared<const Tenants>(std::move(tenants));
  {
    absl::MutexLock l(&tenants_mu_);
    tenants_ = next;
  }
  arrays_.SetTenantLimits([&next](const std::string& tenant) { return next->LimitsOf(tenant); });
}

std::string Coordinator::CollectiveEpoch(int64_t epoch) const {
  return StrCat(incarnation_, ".", epoch);
}

Coordinator::~Coordinator() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  monitor_.join();
  // The worker clients go first: tearing down their step streams fails the
  // steps in flight, whose callbacks use the registries destroyed after them.
  std::vector<std::shared_ptr<WorkerClient>> clients = workers_.TakeClients();
  for (auto& c : clients) c->CancelAll();
  clients.clear();
}

void Coordinator::RestartQueues(const std::string& worker_id) {
  // Shutting down, the clients are gone first: their streams' last callbacks
  // land here and find no client. The monitor opens the new epoch on the
  // worker (TakeOpeners) unless a step does first: not from here, on the
  // transport's thread, where a worker that keeps failing would make each
  // failure send the next.
  workers_.RestartQueues(worker_id, RandomNonzero());
}

// ---------------------------------------------------------------- workers

absl::StatusOr<v1::RegisterWorkerResponse> Coordinator::RegisterWorker(
    const v1::RegisterWorkerRequest& req) {
  TESSEL_RETURN_IF_ERROR(WorkerRegistry::Validate(req));
  for (const WorkerRegistry::Expired& old : workers_.Supersede(req, absl::Now())) {
    const std::string name = req.worker_name().empty() ? req.address() : req.worker_name();
    LoseWorker(old, old.name == name
                        ? StrCat("restarted (", name, " registered again, incarnation ",
                                 req.worker_incarnation(), ", from ", req.address(), ")")
                        : StrCat("was replaced at its address by worker ", name));
  }
  std::shared_ptr<WorkerClient> client = options_.connect(req.address(), req.worker_secret());
  // The id is known once registered; the callback looks it up then.
  auto id = std::make_shared<std::string>();
  auto id_mu = std::make_shared<absl::Mutex>();
  client->SetStepsLostCallback([this, id, id_mu] {
    std::string worker;
    {
      absl::MutexLock l(id_mu.get());
      worker = *id;
    }
    if (!worker.empty()) RestartQueues(worker);
  });
  v1::RegisterWorkerResponse resp =
      workers_.Register(req, std::move(client), options_.heartbeat_interval, RandomNonzero());
  resp.set_coordinator_incarnation(incarnation_);
  absl::MutexLock l(id_mu.get());
  *id = resp.worker_id();
  return resp;
}

absl::StatusOr<bool> Coordinator::Heartbeat(const std::string& worker_id,
                                            const std::string& secret) {
  return workers_.Heartbeat(worker_id, secret, absl::Now());
}

absl::Status Coordinator::CheckKvCaller(const std::string& worker_id, const std::string& secret,
                                        absl::string_view key) const {
  // "devices:<global ids>[;from:<ranks>]@<epoch>/<Gloo's key>", as the
  // workers' groups scope their keys (a one-way transfer's names its senders).
  std::vector<int> devices;
  absl::string_view rest = key;
  bool parsed = absl::ConsumePrefix(&rest, "devices:");
  const size_t at = rest.find('@');
  parsed = parsed && at != absl::string_view::npos && rest.find('/', at) != absl::string_view::npos;
  if (parsed) {
    std::vector<absl::string_view> parts =
        absl::StrSplit(rest.substr(0, at), absl::MaxSplits(";from:", 1));
    for (size_t i = 0; i < parts.size(); ++i) {
      for (absl::string_view d : absl::StrSplit(parts[i], ',')) {
        int id = 0;
        if (!absl::SimpleAtoi(d, &id)) parsed = false;
        if (i == 0) devices.push_back(id);
      }
    }
  }
  if (!parsed) {
    return absl::PermissionDeniedError(
        StrCat("rendezvous key '", key.substr(0, 64),
               "': expected devices:<global ids>[;from:<ranks>]@<epoch>/<key>"));
  }
  return workers_.CheckMember(worker_id, secret, devices);
}

void Coordinator::LoseWorker(const WorkerRegistry::Expired& w, const std::string& why) {
  const int lost = arrays_.LoseOn(
      w.devices,
      absl::UnavailableError(StrFormat("was on worker %s (%s), which %s", w.id, w.address, why)));
  log_->warn("worker {} ({}) {}; marked dead, {} arrays lost", w.id, w.address, why, lost);
  // Cancelling fails the calls in flight, whose callbacks take the registries' locks.
  if (w.client != nullptr) w.client->CancelAll();
}

void Coordinator::StepSent(int device) {
  absl::MutexLock l(&steps_mu_);
  ++device_steps_[device].sent;
}

void Coordinator::StepAnswered(int device, absl::Duration latency, bool ok) {
  absl::MutexLock l(&steps_mu_);
  DeviceSteps& d = device_steps_[device];
  ++d.done;
  d.errors += !ok;
  d.total_ms += absl::ToDoubleMilliseconds(latency);
}

int64_t Coordinator::StepsInFlight(const std::vector<int>& devices) const {
  absl::MutexLock l(&steps_mu_);
  int64_t n = 0;
  for (int d : devices) {
    if (auto it = device_steps_.find(d); it != device_steps_.end())
      n += it->second.sent - it->second.done;
  }
  return n;
}

absl::Status Coordinator::CordonWorker(const v1::CordonWorkerRequest& req) {
  return workers_.SetCordoned(req.worker_id(), !req.uncordon()).status();
}

absl::StatusOr<v1::DrainWorkerResponse> Coordinator::DrainWorker(
    const v1::DrainWorkerRequest& req) {
  TESSEL_ASSIGN_OR_RETURN(std::vector<int> devices, workers_.SetCordoned(req.worker_id(), true));
  const absl::Time deadline =
      absl::Now() +
      (req.timeout_ms() > 0 ? absl::Milliseconds(req.timeout_ms()) : absl::Seconds(60));
  ArrayRegistry::Held held = arrays_.HeldOn(devices);
  bool idle = false;
  while (true) {
    idle = held.pending == 0 && StepsInFlight(devices) == 0;
    if (idle || absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(20));
    held = arrays_.HeldOn(devices);
  }
  v1::DrainWorkerResponse resp;
  resp.set_idle(idle);
  resp.set_arrays(held.arrays);
  resp.set_bytes(held.bytes);
  for (const std::string& s : held.sessions) resp.add_sessions(s);
  log_->warn("worker {} drained: {}, {} arrays ({} bytes) of {} sessions still on it",
             req.worker_id(), idle ? "idle" : "steps still running", held.arrays, held.bytes,
             held.sessions.size());
  return resp;
}

void Coordinator::MonitorLoop() {
  absl::Time next_reconcile = absl::Now() + options_.reconcile_interval;
  absl::MutexLock l(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.heartbeat_interval);
    if (stop_) break;
    mu_.Unlock();
    std::vector<WorkerRegistry::Expired> expired =
        workers_.ExpireSilent(absl::Now(), options_.heartbeat_timeout);
    for (const WorkerRegistry::Expired& w : expired) {
      LoseWorker(w,
                 StrCat("stopped heartbeating (silent for ", absl::FormatDuration(w.silent), ")"));
    }
    expired.clear();
    SendFrees(workers_.TakeOpeners());
    if (options_.reconcile_interval > absl::ZeroDuration() && absl::Now() >= next_reconcile) {
      (void)Reconcile();
      next_reconcile = absl::Now() + options_.reconcile_interval;
    }
    if (options_.session_lease > absl::ZeroDuration()) {
      std::vector<std::string> idle;
      {
        absl::MutexLock a(&arrays_.mu());
        idle = arrays_.IdleSessionsLocked(absl::Now(), options_.session_lease);
      }
      for (const std::string& id : idle) {
        // A call may have renewed it since: EndSession checks again only
        // that it exists, so look at the clock once more under the lock.
        bool still_idle = false;
        {
          absl::MutexLock a(&arrays_.mu());
          const SessionRecord* s = arrays_.FindSessionLocked(id);
          still_idle = s != nullptr && absl::Now() - s->last_seen >= options_.session_lease;
        }
        if (!still_idle) continue;
        (void)EndSession(
            id, StrCat("expired: no call or keep-alive from its client for ",
                       absl::FormatDuration(options_.session_lease), " (the session lease)"));
      }
    }
    mu_.Lock();
  }
}

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
  absl::MutexLock l(&arrays_.mu());
  TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(session));
  const SessionRecord* s = arrays_.FindSessionLocked(session);
  if (s->tenant != tenant) {
    return absl::PermissionDeniedError(StrCat("session ", session, " belongs to another tenant"));
  }
  return absl::OkStatus();
}

absl::Status Coordinator::SetSessionOptions(const v1::SetSessionOptionsRequest& req) {
  absl::MutexLock l(&arrays_.mu());
  TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
  if (req.options().memory_quota_bytes() < 0) {
    return absl::InvalidArgumentError(
        StrCat("memory_quota_bytes: expected >= 0, got ", req.options().memory_quota_bytes()));
  }
  arrays_.SessionLocked(req.session_id()).options = req.options();
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Coordinator::EndSession(const std::string& id, const std::string& why) {
  std::vector<PendingFree> frees;
  int64_t freed = 0;
  {
    absl::MutexLock l(&arrays_.mu());
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
  absl::MutexLock l(&arrays_.mu());
  TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));  // renews the lease
  v1::KeepAliveResponse resp;
  resp.set_lease_ms(absl::ToInt64Milliseconds(options_.session_lease));
  return resp;
}

v1::ListSessionsResponse Coordinator::ListSessions() {
  v1::ListSessionsResponse resp;
  const absl::Time now = absl::Now();
  const int64_t lease_ms = absl::ToInt64Milliseconds(options_.session_lease);
  absl::MutexLock l(&arrays_.mu());
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

// ---------------------------------------------------------------- compile

absl::StatusOr<v1::CompileResponse> Coordinator::Compile(const v1::CompileRequest& req) {
  if (IsMpmd(req.graph())) return CompileMpmd(req);
  const std::vector<int> donated(req.donated_parameters().begin(), req.donated_parameters().end());
  scheduler::CompileOptions options{.donated_parameters = donated};
  if (req.has_mesh()) {
    auto mesh = NormalizeMesh(req.mesh(), workers_.num_devices());
    if (!mesh.ok()) return Annotate(mesh.status(), StrCat("graph '", req.graph().name(), "': "));
    options.mesh = std::move(*mesh);
    options.parameter_shardings.assign(req.parameter_shardings().begin(),
                                       req.parameter_shardings().end());
    options.output_shardings.assign(req.output_shardings().begin(), req.output_shardings().end());
  } else if (req.parameter_shardings_size() > 0 || req.output_shardings_size() > 0) {
    return absl::InvalidArgumentError(
        StrCat("graph '", req.graph().name(), "': shardings need a mesh"));
  }
  v1::CompileResponse resp;
  bool strict = req.strict_donation();
  bool forbid = false;
  {
    absl::MutexLock l(&arrays_.mu());
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
    const SessionRecord& s = arrays_.SessionLocked(req.session_id());
    strict |= s.options.strict_donation();
    forbid = s.options.forbid_compiles();
    options.owner = s.tenant;
  }
  const std::string key = scheduler::ExecutableKey(req.graph(), options);
  const std::string& tenant = options.owner;
  std::shared_ptr<const CachedExecutable> entry = cache_.Lookup(tenant, key);
  if (entry != nullptr) {
    resp.set_cache_hit(true);
    log_->debug("session {}: compile of '{}' hit the cache ({})", req.session_id(),
                req.graph().name(), key);
  } else {
    resp.set_cache_miss_reason(cache_.ExplainMiss(tenant, req.graph(), donated));
  }
  {
    absl::MutexLock l(&arrays_.mu());
    if (SessionRecord* s = arrays_.FindSessionLocked(req.session_id()))
      ++(entry ? s->cache_hits : s->cache_misses);
  }
  if (entry == nullptr && forbid) {
    return absl::FailedPreconditionError(
        StrCat("session ", req.session_id(), " forbids new compiles, and graph '",
               req.graph().name(), "' is not in the compile cache: ", resp.cache_miss_reason()));
  }
  if (entry == nullptr) {
    options.strict_donation = strict;
    auto c = scheduler::Compile(req.graph(), options);
    if (!c.ok()) {
      log_->info("session {}: compile of '{}' failed: {}", req.session_id(), req.graph().name(),
                 c.status().ToString());
      return Annotate(c.status(), StrCat("graph '", req.graph().name(), "': "));
    }
    std::vector<std::string> evicted;
    entry = cache_.Insert(tenant, std::move(*c), req.graph(), options, TenantCacheBytes(tenant),
                          &evicted);
    UnloadEvicted(evicted);
    {
      absl::MutexLock l(&arrays_.mu());
      if (SessionRecord* s = arrays_.FindSessionLocked(req.session_id())) ++s->compiles;
    }
    log_->info("session {}: compiled '{}' as {} ({})", req.session_id(), req.graph().name(), key,
               resp.cache_miss_reason());
  } else if (strict) {
    TESSEL_RETURN_IF_ERROR(scheduler::CheckStrictDonation(entry->compiled));
  }
  const scheduler::CompiledProgram* compiled = &entry->compiled;
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

namespace {

// What an id neither compiled nor evicted here is told, and an id of another
// tenant's alike: nothing says it exists.
absl::Status NeverCompiled(const std::string& id) {
  return absl::NotFoundError(StrCat("executable '", id, "' was never compiled here"));
}

}  // namespace

void Coordinator::UnloadEvicted(const std::vector<std::string>& evicted) {
  for (const std::string& id : evicted) SendFrees(workers_.SequenceUnloads(id));
}

int64_t Coordinator::TenantCacheBytes(const std::string& tenant) const {
  const std::shared_ptr<const Tenants> t = tenants();
  if (int64_t own = t->LimitsOf(tenant).compile_cache_bytes; own > 0) return own;
  // An even share: no tenant's compiles can push out another's.
  return t->authenticating() ? cache_.max_bytes() / std::max<int64_t>(1, t->num_tenants()) : 0;
}

absl::StatusOr<std::shared_ptr<const CachedExecutable>> Coordinator::CompileEvicted(
    const std::string& session, const std::string& tenant, const std::string& id) {
  // Another tenant's executable is answered as one never compiled: nothing
  // says it exists.
  std::optional<ExecutableSource> source = cache_.EvictedSource(tenant, id);
  if (!source.has_value()) {
    if (cache_.WasEvicted(tenant, id)) {
      const int64_t bound = TenantCacheBytes(tenant);
      return absl::NotFoundError(StrCat(
          "executable '", id, "' was evicted from the compile cache (least recently used, over ",
          bound > 0 ? StrCat("tenant ", tenant, "'s ", bound >> 20)
                    : StrCat("its ", cache_.max_bytes() >> 20),
          " MiB), its graph too: compile it again"));
    }
    return NeverCompiled(id);
  }
  const std::string what = StrCat("executable '", id, "' of graph '", source->graph.name(), "'");
  {
    absl::MutexLock l(&arrays_.mu());
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(session));
    SessionRecord& s = arrays_.SessionLocked(session);
    ++s.cache_misses;
    if (s.options.forbid_compiles()) {
      return absl::FailedPreconditionError(
          StrCat("session ", session, " forbids new compiles, and ", what,
                 " was evicted from the compile cache (least "
                 "recently used, over its bound): running it compiles it again"));
    }
  }
  auto c = scheduler::Compile(source->graph, source->options);
  if (!c.ok()) return Annotate(c.status(), StrCat(what, ", compiled again after its eviction: "));
  std::vector<std::string> evicted;
  std::shared_ptr<const CachedExecutable> exe =
      cache_.Insert(tenant, std::move(*c), std::move(source->graph), std::move(source->options),
                    TenantCacheBytes(tenant), &evicted);
  UnloadEvicted(evicted);
  {
    absl::MutexLock l(&arrays_.mu());
    if (SessionRecord* s = arrays_.FindSessionLocked(session)) ++s->compiles;
  }
  log_->info("session {}: compiled {} again: it was evicted from the compile cache", session, what);
  return exe;
}

// ---------------------------------------------------------------- execute

// One device's step of an accepted execution, with its worker.
struct Coordinator::ExecuteLaunch {
  PlannedStep step;
  std::shared_ptr<WorkerClient> client;  // null: its worker died since the plan was made
  bool needs_load = false;
  uint64_t load_generation = 0;
};

// An execution the arrays took (CommitExecuteLocked): what is sent for it.
struct Coordinator::AcceptedExecution {
  int64_t execution_id = 0;
  int64_t epoch = 0;  // the collective epoch its steps run under
  v1::ExecuteResponse response;
  std::vector<DeviceRoute> routes;
  std::vector<ExecuteLaunch> launches;
  std::vector<PendingFree> early_frees;  // donated copies on devices the step does not run on
  std::vector<PlannedMove> moves;
  // Partitioned: the program with its workers' addresses, for the loads.
  std::shared_ptr<v1::Program> loaded_program;
};

absl::StatusOr<v1::ExecuteResponse> Coordinator::Execute(const v1::ExecuteRequest& req) {
  // Whoever's it is: the session's tenant is checked when planning, under
  // the lock that reads the session anyway (the common path takes it once).
  std::shared_ptr<const CachedExecutable> exe = cache_.FindAnyTenant(req.executable_id());
  if (exe == nullptr) {
    std::string tenant;
    {
      absl::MutexLock l(&arrays_.mu());
      TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
      tenant = arrays_.SessionLocked(req.session_id()).tenant;
    }
    if (auto mpmd = FindMpmd(tenant, req.executable_id())) return ExecuteMpmd(req, *mpmd);
    TESSEL_ASSIGN_OR_RETURN(exe, CompileEvicted(req.session_id(), tenant, req.executable_id()));
  }
  AcceptedExecution run;
  {
    // Checking the arguments, retiring the donated ones, registering the
    // outputs and numbering the steps are one change to the arrays.
    absl::MutexLock l(&arrays_.mu());
    run.routes = workers_.Routes();
    TESSEL_ASSIGN_OR_RETURN(ExecutePlan plan, PlanExecuteLocked(req, *exe, run.routes));
    CommitExecuteLocked(req, *exe, std::move(plan), run);
  }
  LaunchExecute(req, *exe, run);
  if (req.wait())
    TESSEL_RETURN_IF_ERROR(
        AwaitAll(req.session_id(), req.outputs(), StrCat("execution ", run.execution_id)));
  return std::move(run.response);
}

absl::StatusOr<ExecutePlan> Coordinator::PlanExecuteLocked(const v1::ExecuteRequest& req,
                                                           const CachedExecutable& exe,
                                                           const std::vector<DeviceRoute>& routes) {
  const scheduler::CompiledProgram& c = exe.compiled;
  TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
  const SessionRecord& session = arrays_.SessionLocked(req.session_id());
  if (exe.tenant != session.tenant) return NeverCompiled(req.executable_id());  // another tenant's
  ExecuteInput in;
  in.request = &req;
  in.executable = &exe;
  if (!c.partitioned()) {
    TESSEL_ASSIGN_OR_RETURN(in.placement, ResolvePlacement(routes, req.placement()));
  }
  if (req.arguments_size() == int(c.parameter_types.size())) {
    for (int i = 0; i < req.arguments_size(); ++i) {
      auto a = arrays_.OwnedLocked(req.session_id(), req.arguments(i));
      if (!a.ok()) {
        return Annotate(a.status(),
                        StrCat("argument ", i, " '", c.program.parameters(i).name(), "': "));
      }
      in.arguments.push_back(*a);
    }
  }  // else PlanExecute names the arity mismatch
  in.routes = &routes;
  in.strict_donation = req.strict_donation() || session.options.strict_donation();
  in.handle_in_use = [&](uint64_t h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(arrays_.mu()) {
    return arrays_.ContainsLocked(h);
  };
  in.fresh_handle = [&]()
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(arrays_.mu()) { return FreshHandleLocked(); };
  TESSEL_ASSIGN_OR_RETURN(ExecutePlan plan, PlanExecute(in));
  for (const PlannedMove& m : plan.moves) {
    TESSEL_RETURN_IF_ERROR(GuardTransferLocked(req.session_id(), req.transfer_guard(),
                                               Direction::kDeviceToDevice, true, m.what,
                                               ByteSizeUnchecked(m.type)));
  }
  TESSEL_RETURN_IF_ERROR(arrays_.CheckQuotaLocked(req.session_id(),
                                                  plan.output_bytes - plan.donated_bytes,
                                                  StrCat("execution of '", exe.graph.name(), "'")));
  return plan;
}

void Coordinator::CommitExecuteLocked(const v1::ExecuteRequest& req, const CachedExecutable& exe,
                                      ExecutePlan plan, AcceptedExecution& run) {
  // Accepted: from here on nothing fails.
  const scheduler::CompiledProgram& c = exe.compiled;
  const std::string& exe_name = exe.graph.name();
  SessionRecord& session = arrays_.SessionLocked(req.session_id());
  run.execution_id = ++next_execution_;
  run.epoch = collective_epoch_.load();
  run.response.set_execution_id(run.execution_id);
  ++session.executions;
  for (const scheduler::AliasDecision& d : plan.aliases) {
    v1::DonationReceipt* r = run.response.add_donations();
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
  absl::flat_hash_map<int, v1::FreeRequest> donated_elsewhere;
  for (int i : plan.donated) {
    const uint64_t h = req.arguments(i);
    for (int d : arrays_.FindLocked(h)->devices) {
      if (std::find(plan.devices.begin(), plan.devices.end(), d) == plan.devices.end()) {
        donated_elsewhere[d].add_buffers(h);
      }
    }
    session.donations += plan.devices.size();
    arrays_.RetireLocked(h, v1::DONATED, run.execution_id, exe_name, now);
  }
  if (!donated_elsewhere.empty())
    run.early_frees = workers_.SequenceFrees(std::move(donated_elsewhere));
  for (int i = 0; i < req.outputs_size(); ++i) {
    plan.outputs[i].producer = run.execution_id;
    arrays_.AddLocked(req.session_id(), req.outputs(i), std::move(plan.outputs[i]));
  }
  // Every device's step (and the free of its moved copies) is numbered at
  // once: no other step interleaves with this one on any of its devices.
  std::vector<int> counts;
  for (const PlannedStep& st : plan.steps) counts.push_back(st.free_after ? 2 : 1);
  std::vector<QueueSlot> slots = workers_.Reserve(plan.devices, counts, &req.executable_id());
  for (size_t pos = 0; pos < plan.steps.size(); ++pos) {
    PlannedStep& st = plan.steps[pos];
    QueueSlot& slot = slots[pos];
    ExecuteLaunch launch;
    launch.client = std::move(slot.client);
    launch.needs_load = slot.needs_load;
    launch.load_generation = slot.load_generation;
    if (c.partitioned() && launch.needs_load && !run.loaded_program) {
      // Workers find their peers for collectives by address.
      run.loaded_program = std::make_shared<v1::Program>(c.program);
      for (int md : c.mesh.devices())
        run.loaded_program->add_device_workers(run.routes[md].address);
    }
    st.run.set_device(slot.local_index);
    st.run.set_seq(slot.first_seq);
    st.run.set_queue_epoch(slot.queue_epoch);
    st.run.set_execution_id(run.execution_id);
    if (c.partitioned()) st.run.set_collective_epoch(CollectiveEpoch(run.epoch));
    if (st.free_after) {
      st.free_after->set_device(slot.local_index);
      st.free_after->set_seq(slot.first_seq + 1);
      st.free_after->set_queue_epoch(slot.queue_epoch);
    }
    launch.step = std::move(st);
    run.launches.push_back(std::move(launch));
  }
  run.moves = std::move(plan.moves);
}

void Coordinator::LaunchExecute(const v1::ExecuteRequest& req, const CachedExecutable& exe,
                                AcceptedExecution& run) {
  const int64_t execution_id = run.execution_id, epoch = run.epoch;
  const std::vector<uint64_t> outputs(req.outputs().begin(), req.outputs().end());
  SendFrees(std::move(run.early_frees));
  // Implicit moves (the guard allowed them) land before the step is sent;
  // the step reads the moved copies, freed right after it on their device.
  for (const PlannedMove& m : run.moves) {
    absl::Status s =
        RunMove(req.session_id(), m, run.routes[m.from_device], run.routes[m.to_device]);
    if (!s.ok()) log_->warn("execution {}: {}", execution_id, s.ToString());
  }
  if (log_->should_log(spdlog::level::debug)) {
    std::vector<int> on;
    for (const ExecuteLaunch& l : run.launches) on.push_back(l.step.device);
    log_->debug(
        "session {}: execution {} of '{}' ({}) on devices [{}], {} arguments, {} outputs, {} moves",
        req.session_id(), execution_id, exe.graph.name(), req.executable_id(),
        absl::StrJoin(on, ","), req.arguments_size(), outputs.size(), run.moves.size());
  }
  // The step still runs when an argument failed upstream: it consumes the
  // donated buffers and marks its outputs with the error on the workers.
  for (ExecuteLaunch& launch : run.launches) {
    const int device = launch.step.device;
    if (launch.client == nullptr) {
      OnStepDone(req.session_id(), outputs, epoch,
                 absl::UnavailableError(StrCat("execution ", execution_id, " on device ", device,
                                               ": its worker died before the step was sent")));
      continue;
    }
    absl::Status load;
    if (launch.needs_load) {
      HeldSteps::Release();  // what this thread holds need not wait for the load
      load = launch.client->LoadProgram(
          run.loaded_program ? *run.loaded_program : exe.compiled.program, launch.load_generation);
      if (!load.ok()) {
        // The sequence number must still be consumed: the step is sent and
        // fails on the worker, and its outputs carry the load's error rather
        // than the worker's "not loaded". The next step tries the load again.
        log_->error("execution {}: loading {} failed: {}", execution_id, req.executable_id(),
                    load.ToString());
        workers_.ForgetLoaded(launch.client.get(), req.executable_id());
      }
    }
    StepSent(device);
    launch.client->Run(launch.step.run, [this, session = req.session_id(), outputs, epoch,
                                         execution_id, device, load = std::move(load),
                                         sent = absl::Now()](absl::StatusOr<v1::RunResponse> r) {
      if (!load.ok()) r = load;
      const absl::Duration latency = absl::Now() - sent;
      StepAnswered(device, latency, r.ok());
      if (options_.on_step_done) options_.on_step_done(device, latency, r.ok());
      // Workers speak of their local devices; users know the global ids.
      if (!r.ok())
        r = Annotate(r.status(), StrCat("execution ", execution_id, " on device ", device, ": "));
      OnStepDone(session, outputs, epoch, std::move(r));
    });
    if (launch.step.free_after) {
      launch.client->Free(*launch.step.free_after, [log = log_](absl::Status s) {
        if (!s.ok()) log->warn("free of moved arguments failed: {}", s.ToString());
      });
    }
  }
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

absl::Status Coordinator::RunMove(const std::string& session, const PlannedMove& m,
                                  const DeviceRoute& from, const DeviceRoute& to) {
  {
    absl::MutexLock l(&arrays_.mu());
    arrays_.AwaitNotPendingLocked({m.handle}, absl::InfiniteDuration());
  }
  absl::Status s;
  int64_t moved = 0;
  if (from.client == nullptr || to.client == nullptr) {
    s = absl::UnavailableError("a worker is gone");
  } else {
    v1::PutShardRequest::Header h;
    h.set_buffer(m.temp_handle);
    *h.mutable_type() = m.type;
    h.add_devices(to.local_index);
    TESSEL_ASSIGN_OR_RETURN(auto put, to.client->BeginPut(h));
    v1::FetchShardRequest fr;
    fr.set_device(from.local_index);
    fr.set_buffer(m.handle);
    auto fetch = from.client->BeginFetch(fr);
    std::string chunk;
    while (s.ok() && fetch->Read(&chunk)) {
      moved += chunk.size();
      s = put->Write(chunk);
    }
    absl::Status fs = fetch->Finish();
    absl::Status ps = put->Finish();
    if (s.ok()) s = fs.ok() ? ps : fs;
  }
  if (!s.ok()) {
    return Annotate(s, StrFormat("moving array %#x from device %d to device %d: ", m.handle,
                                 m.from_device, m.to_device));
  }
  arrays_.CountTransfer(session, m.to_device, Direction::kDeviceToDevice, moved);
  return absl::OkStatus();
}

void Coordinator::MarkRejectedOutputs(const v1::ExecuteRequest& req, const absl::Status& error) {
  absl::MutexLock l(&arrays_.mu());
  if (arrays_.FindSessionLocked(req.session_id()) == nullptr) return;
  for (uint64_t h : req.outputs()) {
    if (h == 0 || arrays_.ContainsLocked(h)) continue;
    ArrayRecord a;
    a.state = v1::ERROR;
    a.error = Annotate(error, "the execution that was to make this array was rejected: ");
    a.producer_name = "rejected execution";
    arrays_.AddLocked(req.session_id(), h, std::move(a));
  }
}

void Coordinator::OnStepDone(const std::string& session, const std::vector<uint64_t>& outputs,
                             int64_t epoch, absl::StatusOr<v1::RunResponse> result) {
  if (!result.ok() && result.status().GetPayload(kGroupBrokenPayload).has_value()) {
    int64_t expected = epoch;
    if (collective_epoch_.compare_exchange_strong(expected, epoch + 1)) {
      log_->warn("a collective group broke ({}); steps from now on meet in groups of epoch {}",
                 result.status().ToString(), CollectiveEpoch(epoch + 1));
    }
  }
  const absl::Status status = result.status();
  const std::vector<uint64_t> failed =
      arrays_.StepDone(session, outputs, status, result.ok() ? result->reused_size() : 0);
  for (uint64_t h : failed)
    log_->warn("session {}: array {:#x} failed: {}", session, h, status.ToString());
}

absl::StatusOr<v1::AwaitResponse> Coordinator::Await(const v1::AwaitRequest& req) {
  std::vector<uint64_t> handles(req.handles().begin(), req.handles().end());
  absl::MutexLock l(&arrays_.mu());
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
    absl::MutexLock l(&arrays_.mu());
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
    for (uint64_t h : req.handles())
      TESSEL_RETURN_IF_ERROR(arrays_.OwnedLocked(req.session_id(), h).status());
    frees = FreeArraysLocked(std::vector<uint64_t>(req.handles().begin(), req.handles().end()));
  }
  SendFrees(std::move(frees));
  return absl::OkStatus();
}

absl::StatusOr<v1::ArrayInfoResponse> Coordinator::ArrayInfo(const v1::ArrayInfoRequest& req) {
  absl::MutexLock l(&arrays_.mu());
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

namespace {

// The tenant's arrays on each of `routes`' devices, in the figures of a
// device's own (bytes and buffers; its limit: the tenant's quota).
void AddTenantUse(const std::vector<DeviceRoute>& routes,
                  const absl::flat_hash_map<int, ArrayRegistry::DeviceUse>& use, int64_t quota,
                  google::protobuf::RepeatedPtrField<v1::DeviceMemoryStats>* out) {
  for (const DeviceRoute& r : routes) {
    if (!r.alive) continue;
    v1::DeviceMemoryStats* m = out->Add();
    m->set_device(r.device);
    if (auto it = use.find(r.device); it != use.end()) {
      m->set_bytes_in_use(it->second.bytes);
      m->set_num_buffers(it->second.buffers);
    }
    m->set_bytes_limit(quota);
  }
}

}  // namespace

absl::StatusOr<v1::StatsResponse> Coordinator::Stats(const v1::StatsRequest& req,
                                                     bool tenant_view) {
  v1::StatsResponse resp;
  std::vector<StatsTarget> live;
  {
    absl::MutexLock l(&arrays_.mu());
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
    const SessionRecord& s = arrays_.SessionLocked(req.session_id());
    resp.set_live_arrays(s.arrays.size());
    resp.set_live_bytes(s.live_bytes);
    const CompileCache::Counts compiled = cache_.counts(s.tenant);  // the tenant's own
    resp.set_compiles(compiled.compiles);
    resp.set_compile_cache_hits(compiled.hits);
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
      struct Row {
        int64_t producer;
        uint64_t handle;
        const ArrayRecord* a;
      };
      std::vector<Row> rows;
      for (uint64_t h : s.arrays)
        rows.push_back(Row{arrays_.FindLocked(h)->producer, h, arrays_.FindLocked(h)});
      std::sort(rows.begin(), rows.end(), [](const Row& x, const Row& y) {
        return std::tie(x.producer, x.handle) < std::tie(y.producer, y.handle);
      });
      for (const Row& r : rows) {
        v1::LiveArray* la = resp.add_arrays();
        la->set_handle(r.handle);
        *la->mutable_type() = r.a->type;
        la->set_state(r.a->state);
        la->set_bytes(r.a->bytes());
        for (int d : r.a->devices) la->add_devices(d);
        la->set_producer_execution(r.a->producer);
        la->set_producer(r.a->producer_name);
      }
    }
    if (tenant_view) {
      resp.set_tenant_view(true);
      AddTenantUse(workers_.Routes(), arrays_.TenantUseLocked(s.tenant),
                   tenants()->LimitsOf(s.tenant).memory_quota_bytes, resp.mutable_devices());
      return resp;
    }
    // Under the arrays' lock: the figures cover every step and free numbered so far.
    live = workers_.LiveStatsTargets();
  }
  for (StatsTarget& t : live) {
    auto st = t.client->GetStats(t.request);
    if (!st.ok()) continue;
    for (const v1::DeviceMemoryStats& m : st->devices()) {
      v1::DeviceMemoryStats* out = resp.add_devices();
      *out = m;
      out->set_device(t.devices.at(m.device()));
    }
  }
  std::sort(resp.mutable_devices()->begin(), resp.mutable_devices()->end(),
            [](const auto& a, const auto& b) { return a.device() < b.device(); });
  return resp;
}

absl::StatusOr<v1::ListDevicesResponse> Coordinator::ListDevices(
    const v1::ListDevicesRequest& req) {
  v1::GetClusterResponse cluster;
  workers_.Describe(absl::Now(), &cluster);
  v1::ListDevicesResponse resp;
  for (const v1::WorkerInfo& w : cluster.workers()) {
    if (!w.alive()) continue;
    for (const v1::DeviceInfo& d : w.devices()) {
      v1::DeviceInfo* out = resp.add_devices();
      out->set_id(d.id());
      out->set_kind(d.kind());
      out->set_local_index(d.local_index());
      out->set_worker_id(d.worker_id());
    }
  }
  std::sort(resp.mutable_devices()->begin(), resp.mutable_devices()->end(),
            [](const v1::DeviceInfo& a, const v1::DeviceInfo& b) { return a.id() < b.id(); });
  absl::MutexLock l(&arrays_.mu());
  TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
  const std::string& tenant = arrays_.SessionLocked(req.session_id()).tenant;
  AddTenantUse(workers_.Routes(), arrays_.TenantUseLocked(tenant),
               tenants()->LimitsOf(tenant).memory_quota_bytes, resp.mutable_usage());
  return resp;
}

v1::ReconcileResponse Coordinator::Reconcile() {
  v1::ReconcileResponse resp;
  std::vector<StatsTarget> live;
  {
    // Under the arrays' lock: each worker answers once it has run every
    // step and free numbered so far.
    absl::MutexLock l(&arrays_.mu());
    live = workers_.LiveStatsTargets();
  }
  std::vector<std::tuple<int, uint64_t, int64_t>> held;  // global device, handle, bytes
  for (StatsTarget& t : live) {
    t.request.set_with_buffers(true);
    auto st = t.client->GetStats(t.request);
    if (!st.ok()) continue;  // a dead worker's buffers are lost anyway
    for (const v1::StoredBuffer& b : st->buffers()) {
      if (b.device() < 0 || b.device() >= int(t.devices.size())) continue;
      held.emplace_back(t.devices[b.device()], b.handle(), b.bytes());
    }
  }
  resp.set_buffers_checked(held.size());
  std::vector<PendingFree> frees;
  {
    // Ownership now, not when the workers were asked: an array made since
    // is owned, and a free numbered here runs after every step sent before.
    absl::MutexLock l(&arrays_.mu());
    absl::flat_hash_map<int, v1::FreeRequest> orphans;
    absl::flat_hash_set<std::pair<int, uint64_t>> unowned;
    for (const auto& [device, handle, bytes] : held) {
      if (arrays_.OwnsBufferLocked(handle, device)) continue;
      v1::UnownedBuffer* u = resp.add_unowned();
      u->set_device(device);
      u->set_handle(handle);
      u->set_bytes(bytes);
      unowned.emplace(device, handle);
    }
    {
      absl::MutexLock r(&reconcile_mu_);
      for (const auto& key : unowned) {
        if (unowned_.contains(key)) orphans[key.first].add_buffers(key.second);
      }
      unowned_ = std::move(unowned);
    }
    for (const auto& [device, f] : orphans) resp.set_freed(resp.freed() + f.buffers_size());
    if (!orphans.empty()) frees = workers_.SequenceFrees(std::move(orphans));
  }
  if (resp.freed() > 0) {
    unowned_freed_ += resp.freed();
    log_->warn(
        "reconciliation: freed {} buffers that no array or open put owned at two checks in a row "
        "({} "
        "unowned now, of {} checked)",
        resp.freed(), resp.unowned_size(), resp.buffers_checked());
  }
  SendFrees(std::move(frees));
  return resp;
}

v1::GetClusterResponse Coordinator::GetCluster(const v1::GetClusterRequest& req) {
  v1::GetClusterResponse resp;
  workers_.Describe(absl::Now(), &resp);
  {
    absl::MutexLock l(&steps_mu_);
    for (v1::WorkerInfo& w : *resp.mutable_workers()) {
      for (v1::DeviceInfo& d : *w.mutable_devices()) {
        auto it = device_steps_.find(d.id());
        if (it == device_steps_.end()) continue;
        const DeviceSteps& s = it->second;
        d.set_queue_depth(s.sent - s.done);
        d.set_steps(s.done);
        d.set_step_errors(s.errors);
        d.set_mean_step_ms(s.done > 0 ? s.total_ms / s.done : 0);
      }
    }
  }
  resp.set_sessions(arrays_.num_sessions());
  resp.set_live_arrays(arrays_.num_arrays());
  resp.set_compiles(cache_.compiles());
  resp.set_compile_cache_hits(cache_.hits());
  resp.set_compile_cache_bytes(cache_.bytes());
  resp.set_compile_cache_evictions(cache_.evictions());
  resp.set_executions(next_execution_.load());
  resp.set_unowned_buffers_freed(unowned_freed_.load());
  if (!req.with_memory()) return resp;
  for (StatsTarget& t : workers_.LiveStatsTargets()) {
    auto st = t.client->GetStats(t.request);
    if (!st.ok()) continue;
    for (int i = 0; i < resp.workers_size(); ++i) {
      v1::WorkerInfo* info = resp.mutable_workers(i);
      if (info->worker_id() != t.worker_id) continue;
      for (const v1::DeviceMemoryStats& m : st->devices()) {
        v1::DeviceMemoryStats* out = info->add_memory();
        *out = m;
        out->set_device(info->devices(m.device()).id());
      }
    }
  }
  return resp;
}

}  // namespace tessel::server
