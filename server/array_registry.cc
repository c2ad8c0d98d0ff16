#include "server/array_registry.h"

#include <algorithm>

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/dtype.h"
#include "core/status.h"
#include "server/worker_client.h"

namespace tessel::server {

using absl::StrCat;
using absl::StrFormat;

namespace {
std::string Ago(absl::Time when) {
  return StrCat(absl::FormatTime("%Y-%m-%d %H:%M:%E3S UTC", when, absl::UTCTimeZone()), " (",
                absl::FormatDuration(absl::Trunc(absl::Now() - when, absl::Milliseconds(1))),
                " ago)");
}
}  // namespace

int64_t ArrayRecord::device_bytes() const { return ByteSizeUnchecked(sharded ? block_type : type); }
int64_t ArrayRecord::bytes() const { return device_bytes() * int64_t(devices.size()); }

void ArrayRegistry::SetTenantLimits(
    const std::function<TenantLimits(const std::string&)>& limits_of) {
  absl::MutexLock l(&mu_);
  for (auto& [tenant, usage] : tenants_) usage.limits = limits_of(tenant);
}

absl::Status ArrayRegistry::OpenSession(const std::string& id, const std::string& client,
                                        const v1::SessionOptions& options,
                                        const std::string& tenant, TenantLimits limits) {
  absl::MutexLock l(&mu_);
  TenantUsage& t = tenants_[tenant];
  t.limits = limits;
  if (limits.max_sessions > 0 && t.sessions >= limits.max_sessions) {
    return absl::ResourceExhaustedError(StrCat(
        "tenant ", tenant, " already has ", t.sessions,
        " open sessions, its limit (max_sessions=", limits.max_sessions, "); close one first"));
  }
  ++t.sessions;
  SessionRecord& s = sessions_[id];
  s.client = client;
  s.tenant = tenant;
  s.options = options;
  s.opened = s.last_seen = absl::Now();
  return absl::OkStatus();
}

absl::Status ArrayRegistry::CheckSessionLocked(const std::string& id) const {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    if (auto e = ended_.find(id); e != ended_.end())
      return absl::NotFoundError(StrCat("session '", id, "' ", e->second));
    if (const size_t dot = id.rfind('.'); !incarnation_.empty() && dot != std::string::npos &&
                                          absl::string_view(id).substr(dot + 1) != incarnation_) {
      return absl::UnavailableError(
          StrCat("the coordinator restarted at ",
                 absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", started_, absl::UTCTimeZone()),
                 "; session '", id, "' was opened under its previous incarnation ",
                 id.substr(dot + 1), ", and its arrays were lost"));
    }
    return absl::NotFoundError(
        StrCat("session '", id, "' does not exist (closed, or never opened)"));
  }
  it->second.last_seen = absl::Now();
  return absl::OkStatus();
}

std::vector<std::string> ArrayRegistry::IdleSessions(absl::Time now, absl::Duration lease) const {
  absl::MutexLock l(&mu_);
  std::vector<std::string> idle;
  for (const auto& [id, s] : sessions_) {
    if (now - s.last_seen >= lease) idle.push_back(id);
  }
  return idle;
}

absl::Status ArrayRegistry::SetSessionOptions(const std::string& id,
                                              const v1::SessionOptions& options) {
  absl::MutexLock l(&mu_);
  TESSEL_RETURN_IF_ERROR(CheckSessionLocked(id));
  sessions_.at(id).options = options;
  return absl::OkStatus();
}

SessionRecord& ArrayRegistry::SessionLocked(const std::string& id) { return sessions_.at(id); }

SessionRecord* ArrayRegistry::FindSessionLocked(const std::string& id) {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : &it->second;
}

const SessionRecord* ArrayRegistry::FindSessionLocked(const std::string& id) const {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : &it->second;
}

void ArrayRegistry::EraseSessionLocked(const std::string& id, const std::string& why) {
  if (auto it = sessions_.find(id); it != sessions_.end()) {
    TenantUsage& t = tenants_[it->second.tenant];
    --t.sessions;
    t.live_bytes -= it->second.live_bytes;  // what is left (normally nothing: the arrays go first)
    sessions_.erase(it);
  }
  if (why.empty() || ended_.contains(id)) return;
  ended_[id] = why;
  ended_order_.push_back(id);
  while (ended_order_.size() > kMaxEnded) {
    ended_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
}

int64_t ArrayRegistry::num_sessions() const {
  absl::MutexLock l(&mu_);
  return sessions_.size();
}

int64_t ArrayRegistry::num_arrays() const {
  absl::MutexLock l(&mu_);
  return arrays_.size();
}

absl::StatusOr<ArrayRegistry::SessionView> ArrayRegistry::ViewSession(const std::string& id) const {
  absl::MutexLock l(&mu_);
  TESSEL_RETURN_IF_ERROR(CheckSessionLocked(id));
  const SessionRecord& s = sessions_.at(id);
  return SessionView{.tenant = s.tenant, .options = s.options};
}

void ArrayRegistry::CountCompile(const std::string& session, CompileEvent event) {
  absl::MutexLock l(&mu_);
  SessionRecord* s = FindSessionLocked(session);
  if (s == nullptr) return;
  switch (event) {
    case CompileEvent::kCacheHit: ++s->cache_hits; break;
    case CompileEvent::kCacheMiss: ++s->cache_misses; break;
    case CompileEvent::kCompiled: ++s->compiles; break;
  }
}

const Tombstone* ArrayRegistry::FindTombstoneLocked(const std::string& session,
                                                    uint64_t handle) const {
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return nullptr;
  return s->second.tombstones.Find(handle);
}

void TombstoneRing::Add(uint64_t handle, v1::ArrayState state, int64_t execution,
                        absl::string_view executable, absl::Time when) {
  Tombstone* t;
  if (handles_.size() < capacity_) {
    handles_.push_back(handle);
    t = &entries_.emplace_back();
  } else {
    handles_[next_] = handle;
    t = &entries_[next_];
    next_ = (next_ + 1) % capacity_;
  }
  t->state = state;
  t->execution = execution;
  t->executable.assign(executable.data(), executable.size());
  t->when = when;
}

const Tombstone* TombstoneRing::Find(uint64_t handle) const {
  // Newest first: the slots before next_, then the ones from the end down.
  for (size_t i = next_; i-- > 0;) {
    if (handles_[i] == handle) return &entries_[i];
  }
  for (size_t i = handles_.size(); i-- > next_;) {
    if (handles_[i] == handle) return &entries_[i];
  }
  return nullptr;
}

absl::StatusOr<ArrayRecord*> ArrayRegistry::OwnedLocked(const std::string& session,
                                                        uint64_t handle) {
  auto it = arrays_.find(handle);
  if (it == arrays_.end()) {
    if (const Tombstone* ts = FindTombstoneLocked(session, handle)) {
      if (ts->state == v1::DONATED) {
        return absl::FailedPreconditionError(
            StrFormat("array %#x was donated to execution %d ('%s') at %s; a donated array cannot "
                      "be used again",
                      handle, ts->execution, ts->executable, Ago(ts->when)));
      }
      return absl::NotFoundError(StrFormat("array %#x was deleted at %s", handle, Ago(ts->when)));
    }
    return absl::NotFoundError(
        StrFormat("array %#x does not exist (deleted, or never created)", handle));
  }
  if (it->second.session != session) {
    return absl::PermissionDeniedError(StrFormat("array %#x belongs to another session", handle));
  }
  return &it->second;
}

ArrayRecord* ArrayRegistry::FindLocked(uint64_t handle) {
  auto it = arrays_.find(handle);
  return it == arrays_.end() ? nullptr : &it->second;
}

bool ArrayRegistry::ContainsLocked(uint64_t handle) const { return arrays_.contains(handle); }

ArrayRecord& ArrayRegistry::AddLocked(const std::string& session, uint64_t handle,
                                      ArrayRecord record) {
  record.session = session;
  SessionRecord& s = sessions_.at(session);
  s.arrays.insert(handle);
  s.live_bytes += record.bytes();
  tenants_[s.tenant].live_bytes += record.bytes();
  ArrayRecord& a = arrays_[handle];
  a = std::move(record);
  return a;
}

void ArrayRegistry::RetireLocked(uint64_t handle, v1::ArrayState state, int64_t execution,
                                 absl::string_view executable, absl::Time when) {
  auto it = arrays_.find(handle);
  if (it == arrays_.end()) return;
  if (SessionRecord* sr = FindSessionLocked(it->second.session)) {
    sr->arrays.erase(handle);
    sr->live_bytes -= it->second.bytes();
    tenants_[sr->tenant].live_bytes -= it->second.bytes();
    sr->tombstones.Add(handle, state, execution, executable, when);
  }
  arrays_.erase(it);
}

absl::flat_hash_map<int, v1::FreeRequest> ArrayRegistry::CommitExecutionLocked(
    const std::string& session, ExecutionChanges changes) {
  SessionRecord& s = sessions_.at(session);
  ++s.executions;
  const absl::Time now = absl::Now();
  absl::flat_hash_map<int, v1::FreeRequest> elsewhere;
  for (uint64_t h : changes.donated) {
    for (int d : arrays_.at(h).devices) {
      if (std::find(changes.devices.begin(), changes.devices.end(), d) == changes.devices.end())
        elsewhere[d].add_buffers(h);
    }
    s.donations += changes.devices.size();
    RetireLocked(h, v1::DONATED, changes.execution, changes.executable, now);
  }
  for (auto& [handle, record] : changes.outputs) {
    record.producer = changes.execution;
    AddLocked(session, handle, std::move(record));
  }
  return elsewhere;
}

void ArrayRegistry::AddFailed(const std::string& session, const std::vector<uint64_t>& handles,
                              const absl::Status& error, absl::string_view producer) {
  absl::MutexLock l(&mu_);
  if (FindSessionLocked(session) == nullptr) return;
  for (uint64_t h : handles) {
    if (h == 0 || arrays_.contains(h)) continue;
    ArrayRecord a;
    a.state = v1::ERROR;
    a.error = error;
    a.producer_name = std::string(producer);
    AddLocked(session, h, std::move(a));
  }
}

absl::flat_hash_map<int, v1::FreeRequest> ArrayRegistry::RetireDeletedLocked(
    const std::vector<uint64_t>& handles) {
  absl::flat_hash_map<int, v1::FreeRequest> frees;
  const absl::Time now = absl::Now();
  for (uint64_t h : handles) {
    auto it = arrays_.find(h);
    if (it == arrays_.end()) continue;
    for (int d : it->second.devices) frees[d].add_buffers(h);
    RetireLocked(h, v1::DELETED, 0, "", now);
  }
  return frees;
}

absl::flat_hash_map<int, ArrayRegistry::DeviceUse> ArrayRegistry::TenantUseLocked(
    const std::string& tenant) const {
  absl::flat_hash_map<int, DeviceUse> use;
  for (const auto& [id, s] : sessions_) {
    if (s.tenant != tenant) continue;
    for (uint64_t h : s.arrays) {
      const ArrayRecord& a = arrays_.at(h);
      if (a.state != v1::READY && a.state != v1::PENDING) continue;  // no buffer holds it
      for (int d : a.devices) {
        DeviceUse& u = use[d];
        ++u.buffers;
        u.bytes += a.device_bytes();
      }
    }
  }
  return use;
}

absl::flat_hash_map<int, ArrayRegistry::DeviceUse> ArrayRegistry::TenantUse(
    const std::string& tenant) const {
  absl::MutexLock l(&mu_);
  return TenantUseLocked(tenant);
}

bool ArrayRegistry::OwnsBufferLocked(uint64_t handle, int device) const {
  auto it = arrays_.find(handle);
  if (it == arrays_.end()) return false;
  const std::vector<int>& on = it->second.devices;
  return std::find(on.begin(), on.end(), device) != on.end();
}

absl::Status ArrayRegistry::CheckQuotaLocked(const std::string& session, int64_t added,
                                             absl::string_view what) const {
  const SessionRecord& s = sessions_.at(session);
  if (added <= 0) return absl::OkStatus();
  const int64_t quota = s.options.memory_quota_bytes();
  if (quota > 0 && s.live_bytes + added > quota) {
    return absl::ResourceExhaustedError(
        StrFormat("session %s memory quota: %s needs %d more bytes; the session holds %d bytes in "
                  "%d live arrays, quota %d",
                  session, what, added, s.live_bytes, s.arrays.size(), quota));
  }
  auto t = tenants_.find(s.tenant);
  if (t != tenants_.end() && t->second.limits.memory_quota_bytes > 0 &&
      t->second.live_bytes + added > t->second.limits.memory_quota_bytes) {
    return absl::ResourceExhaustedError(
        StrFormat("tenant %s memory quota (set by the operator): %s in session %s needs %d more "
                  "bytes; the tenant's %d "
                  "sessions hold %d bytes, quota %d",
                  s.tenant, what, session, added, t->second.sessions, t->second.live_bytes,
                  t->second.limits.memory_quota_bytes));
  }
  return absl::OkStatus();
}

void ArrayRegistry::CountTransfer(const std::string& session, int device, Direction dir,
                                  int64_t bytes) {
  absl::MutexLock l(&mu_);
  CountTransferLocked(session, device, dir, bytes);
}

TransferCounts ArrayRegistry::total_transfers() const {
  absl::MutexLock l(&mu_);
  return total_transfers_;
}

void ArrayRegistry::CountTransferLocked(const std::string& session, int device, Direction dir,
                                        int64_t bytes) {
  switch (dir) {
    case Direction::kHostToDevice: total_transfers_.h2d += bytes; break;
    case Direction::kDeviceToHost: total_transfers_.d2h += bytes; break;
    case Direction::kDeviceToDevice: total_transfers_.d2d += bytes; break;
  }
  SessionRecord* s = FindSessionLocked(session);
  if (s == nullptr) return;
  TransferCounts& total = s->transfers;
  TransferCounts& dev = s->device_transfers[device];
  switch (dir) {
    case Direction::kHostToDevice: total.h2d += bytes, dev.h2d += bytes; break;
    case Direction::kDeviceToHost: total.d2h += bytes, dev.d2h += bytes; break;
    case Direction::kDeviceToDevice: total.d2d += bytes, dev.d2d += bytes; break;
  }
}

std::vector<uint64_t> ArrayRegistry::StepDone(const std::string& session,
                                              const std::vector<uint64_t>& outputs,
                                              const absl::Status& result, int reused_donations) {
  absl::MutexLock l(&mu_);
  if (result.ok()) {
    if (SessionRecord* s = FindSessionLocked(session)) s->donations_reused += reused_donations;
  }
  std::vector<uint64_t> failed;
  for (uint64_t h : outputs) {
    auto it = arrays_.find(h);
    if (it == arrays_.end()) continue;  // deleted meanwhile
    ArrayRecord& a = it->second;
    if (a.state != v1::PENDING) continue;
    if (!result.ok()) {
      a.state = v1::ERROR;
      a.error = result;
      a.pending = 0;
      failed.push_back(h);
    } else if (--a.pending == 0) {
      a.state = v1::READY;
    }
  }
  return failed;
}

bool ArrayRegistry::MarkReady(uint64_t handle) {
  absl::MutexLock l(&mu_);
  auto it = arrays_.find(handle);
  if (it == arrays_.end() || it->second.state != v1::PENDING) return false;
  it->second.state = v1::READY;
  return true;
}

int ArrayRegistry::LoseOn(const std::vector<int>& devices, const absl::Status& error) {
  absl::flat_hash_set<int> devs(devices.begin(), devices.end());
  absl::MutexLock l(&mu_);
  int lost = 0;
  for (auto& [h, a] : arrays_) {
    bool touches = false;
    for (int d : a.devices) touches |= devs.contains(d);
    if (touches && a.state != v1::ERROR) {
      a.state = v1::LOST;
      a.error = absl::Status(error.code(), StrFormat("array %#x %s", h, error.message()));
      a.pending = 0;
      ++lost;
    }
  }
  return lost;
}

ArrayRegistry::Held ArrayRegistry::HeldOn(const std::vector<int>& devices) const {
  absl::flat_hash_set<int> devs(devices.begin(), devices.end());
  std::set<std::string> sessions;
  Held held;
  absl::MutexLock l(&mu_);
  for (const auto& [h, a] : arrays_) {
    bool touches = false;
    for (int d : a.devices) touches |= devs.contains(d);
    if (!touches || a.state == v1::LOST) continue;
    ++held.arrays;
    held.bytes += a.bytes();
    held.pending += a.state == v1::PENDING;
    sessions.insert(a.session);
  }
  held.sessions.assign(sessions.begin(), sessions.end());
  return held;
}

bool ArrayRegistry::NotPendingLocked(const std::vector<uint64_t>& handles) const {
  for (uint64_t h : handles) {
    auto it = arrays_.find(h);
    if (it != arrays_.end() && it->second.state == v1::PENDING) return false;
  }
  return true;
}

bool ArrayRegistry::AwaitNotPending(const std::vector<uint64_t>& handles, absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  return AwaitNotPendingLocked(handles, timeout);
}

bool ArrayRegistry::AwaitNotPendingLocked(const std::vector<uint64_t>& handles,
                                          absl::Duration timeout) {
  if (HeldSteps::AnyHeld()) {  // the steps awaited may be among them
    mu_.Unlock();
    HeldSteps::Release();
    mu_.Lock();
  }
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return NotPendingLocked(handles); };
  return mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
}

}  // namespace tessel::server
