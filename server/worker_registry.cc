#include "server/worker_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/security.h"
#include "core/status.h"
#include "core/version.h"

namespace tessel::server {

using absl::StrCat;

absl::Status WorkerRegistry::Validate(const v1::RegisterWorkerRequest& req) {
  if (req.protocol_version() < kProtocolVersionMin ||
      req.protocol_version() > kProtocolVersionMax) {
    return absl::FailedPreconditionError(
        StrCat("worker at ", req.address(), " speaks protocol ", req.protocol_version(),
               "; coordinator speaks [", kProtocolVersionMin, ", ", kProtocolVersionMax, "]"));
  }
  if (req.num_devices() < 1 || req.num_devices() > 1024) {
    return absl::InvalidArgumentError(StrCat(
        "worker at ", req.address(), ": num_devices expected 1..1024, got ", req.num_devices()));
  }
  if (req.address().empty())
    return absl::InvalidArgumentError("worker registered without an address");
  if (req.worker_secret().size() < 16) {
    return absl::InvalidArgumentError(StrCat("worker at ", req.address(),
                                             ": worker_secret expected at least 16 "
                                             "characters, got ",
                                             req.worker_secret().size()));
  }
  if (req.device_kinds_size() != 0 && req.device_kinds_size() != req.num_devices()) {
    return absl::InvalidArgumentError(StrCat("worker at ", req.address(), ": ",
                                             req.device_kinds_size(), " device kinds for ",
                                             req.num_devices(), " devices"));
  }
  return absl::OkStatus();
}

v1::RegisterWorkerResponse WorkerRegistry::Register(const v1::RegisterWorkerRequest& req,
                                                    std::shared_ptr<WorkerClient> client,
                                                    absl::Duration heartbeat_interval,
                                                    uint64_t queue_epoch) {
  absl::MutexLock l(&mu_);
  WorkerRecord w;
  w.id = StrCat("w", next_worker_++, id_suffix_);
  w.address = req.address();
  w.client_address = req.client_address().empty() ? req.address() : req.client_address();
  w.secret = req.worker_secret();
  w.name = req.worker_name().empty() ? req.address() : req.worker_name();
  w.incarnation = req.worker_incarnation();
  w.last_heartbeat = absl::Now();
  w.client = std::move(client);
  for (int i = 0; i < req.num_devices(); ++i) {
    w.devices.push_back(devices_.size());
    const std::string& kind = req.device_kinds_size() > 0 ? req.device_kinds(i) : req.device_kind();
    devices_.push_back(DeviceRecord{w.id, i, 0, kind.empty() ? "cpu" : kind, queue_epoch});
  }
  std::string kinds;
  for (int d : w.devices) absl::StrAppend(&kinds, kinds.empty() ? "" : ",", devices_[d].kind);
  log_->info(
      "worker {} ({}, incarnation {}) registered from {} with {} devices [{}] (global ids {}..{})",
      w.id, w.name, w.incarnation.empty() ? "-" : w.incarnation, w.address, req.num_devices(),
      kinds, w.devices.front(), w.devices.back());
  v1::RegisterWorkerResponse resp;
  resp.set_worker_id(w.id);
  resp.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(heartbeat_interval));
  resp.set_queue_epoch(queue_epoch);
  workers_.emplace(w.id, std::move(w));
  return resp;
}

absl::StatusOr<bool> WorkerRegistry::Heartbeat(const std::string& worker_id,
                                               const std::string& secret, absl::Time now) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || !it->second.alive) return false;
  if (!SecretEquals(it->second.secret, secret)) {
    return absl::PermissionDeniedError(StrCat("heartbeat for worker ", worker_id,
                                              " without the secret it "
                                              "registered with"));
  }
  it->second.last_heartbeat = now;
  return true;
}

absl::Status WorkerRegistry::CheckMember(const std::string& worker_id, const std::string& secret,
                                         const std::vector<int>& devices) const {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || !it->second.alive || !SecretEquals(it->second.secret, secret)) {
    return absl::PermissionDeniedError(
        StrCat("'", worker_id, "' is not a live worker registered with that secret"));
  }
  for (int d : devices) {
    if (std::find(it->second.devices.begin(), it->second.devices.end(), d) !=
        it->second.devices.end()) {
      return absl::OkStatus();
    }
  }
  return absl::PermissionDeniedError(
      StrCat("worker ", worker_id, " holds none of the group's devices"));
}

std::vector<WorkerRegistry::Expired> WorkerRegistry::ExpireSilent(absl::Time now,
                                                                  absl::Duration timeout) {
  std::vector<Expired> out;
  absl::MutexLock l(&mu_);
  for (auto& [id, w] : workers_) {
    if (!w.alive || now - w.last_heartbeat < timeout) continue;
    w.alive = false;
    out.push_back(Expired{id, w.address, w.devices, w.client, now - w.last_heartbeat});
  }
  return out;
}

std::vector<WorkerRegistry::Expired> WorkerRegistry::Supersede(const v1::RegisterWorkerRequest& req,
                                                               absl::Time now) {
  const std::string name = req.worker_name().empty() ? req.address() : req.worker_name();
  std::vector<Expired> out;
  absl::MutexLock l(&mu_);
  for (auto& [id, w] : workers_) {
    if (!w.alive) continue;
    const bool restarted = w.name == name && w.incarnation != req.worker_incarnation();
    const bool moved_in = w.address == req.address() && w.name != name;
    if (!restarted && !moved_in) continue;
    w.alive = false;
    out.push_back(Expired{id, w.address, w.devices, w.client, now - w.last_heartbeat, w.name});
  }
  return out;
}

absl::StatusOr<std::vector<int>> WorkerRegistry::SetCordoned(const std::string& worker_id,
                                                             bool cordoned) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(StrCat("no worker '", worker_id, "' (Admin.GetCluster lists them)"));
  }
  if (it->second.cordoned != cordoned) {
    log_->warn("worker {} ({}) {}", worker_id, it->second.address,
               cordoned ? "cordoned" : "uncordoned");
  }
  it->second.cordoned = cordoned;
  return it->second.devices;
}

bool WorkerRegistry::RestartQueues(const std::string& worker_id, uint64_t new_epoch) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || !it->second.alive || it->second.client == nullptr) return false;
  for (int d : it->second.devices) {
    devices_[d].queue_epoch = new_epoch;
    devices_[d].next_seq = 0;
  }
  it->second.open_queues = true;
  log_->warn(
      "worker {} ({}): steps were lost in transit; its devices' queues start over (epoch {:#x})",
      worker_id, it->second.address, new_epoch);
  return true;
}

std::vector<PendingFree> WorkerRegistry::TakeOpeners() {
  std::vector<PendingFree> openers;
  absl::MutexLock l(&mu_);
  for (auto& [id, w] : workers_) {
    if (!w.open_queues || !w.alive || w.client == nullptr) continue;
    w.open_queues = false;
    for (int d : w.devices) {
      DeviceRecord& dev = devices_[d];
      if (dev.next_seq > 0) continue;  // a step of the new epoch went already
      v1::FreeRequest open;
      open.set_device(dev.local_index);
      open.set_seq(dev.next_seq++);
      open.set_queue_epoch(dev.queue_epoch);
      openers.push_back(PendingFree{w.client, std::move(open), d});
    }
  }
  return openers;
}

int WorkerRegistry::num_devices() const {
  absl::MutexLock l(&mu_);
  return devices_.size();
}

absl::Status WorkerRegistry::DeadLocked(int device) const {
  const WorkerRecord& w = workers_.at(devices_[device].worker_id);
  if (w.alive) return absl::OkStatus();
  return absl::UnavailableError(
      StrCat("device ", device, " is on worker ", w.id, " (", w.address, "), which is dead"));
}

absl::Status WorkerRegistry::CheckAlive(const std::vector<int>& devices) const {
  absl::MutexLock l(&mu_);
  for (int d : devices) {
    if (d < 0 || d >= int(devices_.size())) {
      return absl::InvalidArgumentError(StrCat(
          "device ", d, " does not exist: the cluster has devices 0..", int(devices_.size()) - 1));
    }
    if (absl::Status s = DeadLocked(d); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> ResolvePlacement(const std::vector<DeviceRoute>& routes,
                                                  const v1::Placement& p) {
  std::vector<int> out;
  if (p.kind_case() == v1::Placement::kReplicated && p.replicated()) {
    for (const DeviceRoute& r : routes) {
      if (r.alive && !r.cordoned) out.push_back(r.device);
    }
    if (out.empty()) return absl::UnavailableError("no live, uncordoned devices in the cluster");
    return out;
  }
  const int d = p.device();
  if (d < 0 || d >= int(routes.size())) {
    return absl::InvalidArgumentError(StrCat(
        "device ", d, " does not exist: the cluster has devices 0..", int(routes.size()) - 1));
  }
  const DeviceRoute& r = routes[d];
  if (!r.alive) {
    return absl::UnavailableError(
        StrCat("device ", d, " is on worker ", r.worker_id, " (", r.address, "), which is dead"));
  }
  if (r.cordoned) {
    return absl::FailedPreconditionError(
        StrCat("device ", d, " is on worker ", r.worker_id, " (", r.address,
               "), which an operator cordoned: it takes no new arrays or steps"));
  }
  return std::vector<int>{d};
}

absl::StatusOr<std::vector<int>> WorkerRegistry::ResolvePlacement(const v1::Placement& p) const {
  return server::ResolvePlacement(Routes(), p);
}

std::vector<DeviceRoute> WorkerRegistry::Routes() const {
  absl::MutexLock l(&mu_);
  std::vector<DeviceRoute> out;
  out.reserve(devices_.size());
  for (int d = 0; d < int(devices_.size()); ++d) {
    const WorkerRecord& w = workers_.at(devices_[d].worker_id);
    out.push_back(
        DeviceRoute{d, devices_[d].local_index, w.id, w.address, w.alive, w.client, w.cordoned});
  }
  return out;
}

absl::StatusOr<WorkerTicket> WorkerRegistry::Sign(int device, absl::string_view grant,
                                                  absl::Time expiry) const {
  absl::MutexLock l(&mu_);
  TESSEL_RETURN_IF_ERROR(DeadLocked(device));
  const WorkerRecord& w = workers_.at(devices_.at(device).worker_id);
  return WorkerTicket{w.client_address, SignTicket(w.secret, grant, expiry)};
}

absl::Status WorkerRegistry::CheckReceipt(int device, absl::string_view grant,
                                          absl::string_view receipt, absl::Time now) const {
  absl::MutexLock l(&mu_);
  TESSEL_RETURN_IF_ERROR(DeadLocked(device));
  const WorkerRecord& w = workers_.at(devices_.at(device).worker_id);
  if (!CheckTicket(w.secret, receipt, grant, now).ok()) {
    return absl::PermissionDeniedError(
        StrCat("the one given is not signed by worker ", w.id, " for this block, or has expired"));
  }
  return absl::OkStatus();
}

std::vector<QueueSlot> WorkerRegistry::Reserve(const std::vector<int>& devices,
                                               const std::vector<int>& counts,
                                               const std::string* executable) {
  absl::MutexLock l(&mu_);
  std::vector<QueueSlot> out;
  out.reserve(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    DeviceRecord& dev = devices_.at(devices[i]);
    WorkerRecord& w = workers_.at(dev.worker_id);
    QueueSlot slot;
    slot.local_index = dev.local_index;
    slot.queue_epoch = dev.queue_epoch;
    if (w.alive && w.client) {
      slot.client = w.client;
      slot.first_seq = dev.next_seq;
      dev.next_seq += counts[i];
      if (executable != nullptr) {
        auto [it, fresh] = w.loaded.try_emplace(*executable, 0);
        if (fresh) it->second = ++load_generation_;
        slot.needs_load = fresh;
        slot.load_generation = it->second;
      }
    }
    out.push_back(std::move(slot));
  }
  return out;
}

std::vector<PendingFree> WorkerRegistry::SequenceFrees(
    absl::flat_hash_map<int, v1::FreeRequest> frees) {
  std::vector<int> devices;
  for (const auto& [d, r] : frees) devices.push_back(d);
  std::sort(devices.begin(), devices.end());
  std::vector<QueueSlot> slots = Reserve(devices, std::vector<int>(devices.size(), 1));
  std::vector<PendingFree> out;
  for (size_t i = 0; i < devices.size(); ++i) {
    if (!slots[i].client) continue;
    v1::FreeRequest& req = frees[devices[i]];
    req.set_device(slots[i].local_index);
    req.set_seq(slots[i].first_seq);
    req.set_queue_epoch(slots[i].queue_epoch);
    out.push_back(PendingFree{std::move(slots[i].client), std::move(req), devices[i]});
  }
  return out;
}

std::vector<PendingFree> WorkerRegistry::SequenceUnloads(const std::string& executable) {
  absl::MutexLock l(&mu_);
  std::vector<PendingFree> out;
  for (auto& [id, w] : workers_) {
    auto it = w.loaded.find(executable);
    if (it == w.loaded.end()) continue;
    const uint64_t generation = it->second;
    w.loaded.erase(it);
    if (!w.alive || !w.client) continue;
    for (int d : w.devices) {
      DeviceRecord& dev = devices_.at(d);
      v1::FreeRequest req;
      req.set_device(dev.local_index);
      req.set_seq(dev.next_seq++);
      req.set_queue_epoch(dev.queue_epoch);
      v1::ProgramUnload* u = req.add_unload();
      u->set_executable_id(executable);
      u->set_generation(generation);
      out.push_back(PendingFree{w.client, std::move(req), d});
    }
  }
  return out;
}

void WorkerRegistry::ForgetLoaded(const WorkerClient* client, const std::string& executable) {
  absl::MutexLock l(&mu_);
  for (auto& [id, w] : workers_) {
    if (w.client.get() == client) w.loaded.erase(executable);
  }
}

v1::WorkerStatsRequest WorkerRegistry::StatsRequestLocked(const WorkerRecord& w) const {
  v1::WorkerStatsRequest req;
  for (int d : w.devices) {
    const DeviceRecord& dev = devices_.at(d);
    while (req.sequenced_size() <= dev.local_index) req.add_sequenced(0);
    req.set_sequenced(dev.local_index, dev.next_seq);
  }
  return req;
}

std::vector<StatsTarget> WorkerRegistry::LiveStatsTargets() const {
  absl::MutexLock l(&mu_);
  std::vector<StatsTarget> out;
  for (const auto& [id, w] : workers_) {
    if (w.alive && w.client)
      out.push_back(StatsTarget{id, w.devices, w.client, StatsRequestLocked(w)});
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.devices[0] < b.devices[0]; });
  return out;
}

void WorkerRegistry::Describe(absl::Time now, v1::GetClusterResponse* resp) const {
  absl::MutexLock l(&mu_);
  std::vector<const WorkerRecord*> ordered;
  for (const auto& [id, w] : workers_) ordered.push_back(&w);
  std::sort(ordered.begin(), ordered.end(),
            [](auto* a, auto* b) { return a->devices.front() < b->devices.front(); });
  for (const WorkerRecord* w : ordered) {
    v1::WorkerInfo* info = resp->add_workers();
    info->set_worker_id(w->id);
    info->set_address(w->address);
    info->set_name(w->name);
    info->set_incarnation(w->incarnation);
    info->set_cordoned(w->cordoned);
    info->set_alive(w->alive);
    info->set_ms_since_heartbeat(absl::ToInt64Milliseconds(now - w->last_heartbeat));
    for (int d : w->devices) {
      v1::DeviceInfo* di = info->add_devices();
      di->set_id(d);
      di->set_kind(devices_[d].kind);
      di->set_local_index(devices_[d].local_index);
      di->set_worker_id(w->id);
    }
  }
}

std::vector<std::shared_ptr<WorkerClient>> WorkerRegistry::TakeClients() {
  absl::MutexLock l(&mu_);
  std::vector<std::shared_ptr<WorkerClient>> out;
  for (auto& [id, w] : workers_) {
    if (w.client) out.push_back(std::move(w.client));
    w.client = nullptr;
  }
  return out;
}

}  // namespace tessel::server
