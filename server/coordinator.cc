// The coordinator's workers and devices: registration, heartbeats, liveness,
// cordon and drain, stats and the cluster's view (Admin, Registry).
#include "server/coordinator.h"
#include "server/mpmd.h"

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
  {
    absl::MutexLock l(id_mu.get());
    *id = resp.worker_id();
  }
  v1::ClusterEvent e;
  e.set_kind(v1::ClusterEvent::WORKER_JOINED);
  e.set_worker_id(resp.worker_id());
  e.set_address(req.address());
  for (const DeviceRoute& r : workers_.Routes()) {
    if (r.worker_id == resp.worker_id()) e.add_devices(r.device);
  }
  e.set_message(StrFormat("worker %s (%s) joined with %d devices", resp.worker_id(), req.address(),
                          req.num_devices()));
  AddEvent(std::move(e));
  return resp;
}

absl::StatusOr<bool> Coordinator::Heartbeat(const std::string& worker_id, const std::string& secret,
                                            bool draining, absl::Duration drain) {
  TESSEL_ASSIGN_OR_RETURN(bool known, workers_.Heartbeat(worker_id, secret, absl::Now()));
  if (!known || !draining) return known;
  {
    absl::MutexLock l(&events_mu_);
    if (!draining_.insert(worker_id).second) return known;
  }
  auto devices = workers_.SetCordoned(worker_id, true);
  v1::ClusterEvent e;
  e.set_kind(v1::ClusterEvent::WORKER_DRAINING);
  e.set_worker_id(worker_id);
  if (devices.ok()) e.mutable_devices()->Add(devices->begin(), devices->end());
  e.set_deadline_unix_ms(absl::ToUnixMillis(absl::Now() + drain));
  e.set_message(
      StrFormat("worker %s was told to stop; it serves %.0f s more (cordoned: no new "
                "arrays or steps there)",
                worker_id, absl::ToDoubleSeconds(drain)));
  log_->warn("{}", e.message());
  AddEvent(std::move(e));
  return known;
}

void Coordinator::AddEvent(v1::ClusterEvent event) {
  event.set_unix_ms(absl::ToUnixMillis(absl::Now()));
  absl::MutexLock l(&events_mu_);
  event.set_seq(++next_event_);
  events_.push_back(std::move(event));
  while (events_.size() > kMaxEvents) events_.pop_front();
}

absl::StatusOr<v1::ClusterEventsResponse> Coordinator::ClusterEvents(
    const v1::ClusterEventsRequest& req) {
  {
    ArrayRegistry::Transaction l(arrays_);
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
  }
  v1::ClusterEventsResponse resp;
  absl::MutexLock l(&events_mu_);
  for (const v1::ClusterEvent& e : events_) {
    if (e.seq() > req.after()) *resp.add_events() = e;
  }
  return resp;
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
  v1::ClusterEvent e;
  e.set_kind(v1::ClusterEvent::WORKER_LOST);
  e.set_worker_id(w.id);
  e.set_address(w.address);
  e.mutable_devices()->Add(w.devices.begin(), w.devices.end());
  e.set_message(StrFormat("worker %s (%s) %s; %d arrays lost", w.id, w.address, why, lost));
  {
    absl::MutexLock l(&events_mu_);
    draining_.erase(w.id);
  }
  AddEvent(std::move(e));
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
      for (const std::string& id : arrays_.IdleSessions(absl::Now(), options_.session_lease)) {
        (void)EndSession(
            id,
            StrCat("expired: no call or keep-alive from its client for ",
                   absl::FormatDuration(options_.session_lease), " (the session lease)"),
            options_.session_lease);
      }
    }
    mu_.Lock();
  }
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
    ArrayRegistry::Transaction l(arrays_);
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
  TESSEL_ASSIGN_OR_RETURN(const ArrayRegistry::SessionView session,
                          arrays_.ViewSession(req.session_id()));
  const std::string& tenant = session.tenant;
  AddTenantUse(workers_.Routes(), arrays_.TenantUse(tenant),
               tenants()->LimitsOf(tenant).memory_quota_bytes, resp.mutable_usage());
  return resp;
}

v1::ReconcileResponse Coordinator::Reconcile() {
  v1::ReconcileResponse resp;
  std::vector<StatsTarget> live;
  {
    // Under the arrays' lock: each worker answers once it has run every
    // step and free numbered so far.
    ArrayRegistry::Transaction l(arrays_);
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
    ArrayRegistry::Transaction l(arrays_);
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
      info->set_collectives(st->collectives());
      info->set_collective_wait_ns(st->collective_wait_ns());
      info->set_collective_data_ns(st->collective_data_ns());
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
