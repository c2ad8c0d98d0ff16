// ArrayRegistry: sessions and the arrays they own: each array's type,
// devices, layout, state and error; what became of retired arrays
// (tombstones: donated to which execution, or deleted, and when); quotas and
// the per-session counters.
//
// Thread-safety: its own lock, private. Simple reads and changes lock it
// themselves. A compound one (an Execute that checks its arguments, retires
// the donated ones and registers its outputs as one step) is a Transaction:
// the lock is held while one is alive, and the *Locked methods need one
// (checked statically: `lock()` names the lock for annotations, and cannot
// take or release it). Lock order: this lock first, then WorkerRegistry's
// (sequence numbers are handed out under it); CompileCache's is never taken
// under it. No RPC, callback or client destruction happens in a Transaction.
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/tenants.h"
#include "tessel/v1/session.pb.h"
#include "tessel/v1/worker.pb.h"

namespace tessel::server {

struct ArrayRecord {
  std::string session;
  v1::TensorType type;
  std::vector<int> devices;  // global ids
  v1::ArrayState state = v1::PENDING;
  absl::Status error;
  int pending = 0;  // device steps still running
  int64_t producer = 0;
  std::string producer_name;  // the executable's graph name, or "put"
  // Sharded: `devices` are the mesh's, in mesh order, each holding a block
  // of `block_type`. Otherwise each device holds the whole `type`.
  bool sharded = false;
  v1::Mesh mesh;
  v1::Sharding sharding;
  v1::TensorType block_type;
  int64_t device_bytes() const;  // on each of its devices
  int64_t bytes() const;         // over all its devices
};

// What became of an array that is gone: donated or deleted, when, where.
struct Tombstone {
  v1::ArrayState state = v1::DELETED;
  int64_t execution = 0;
  std::string executable;
  absl::Time when;
};

// A session's last `capacity` tombstones, the oldest overwritten first.
// Every donation and delete adds one, so adding is the cheap side: a slot
// written in place (its name's storage reused), no hashing, no allocation
// once full. Finding one is a scan of the handles, newest first: it only
// happens when a call names an array that is gone.
class TombstoneRing {
 public:
  explicit TombstoneRing(size_t capacity) : capacity_(capacity) {}
  void Add(uint64_t handle, v1::ArrayState state, int64_t execution, absl::string_view executable,
           absl::Time when);
  // The newest tombstone of `handle`; null when it has none (any more).
  const Tombstone* Find(uint64_t handle) const;
  size_t size() const { return handles_.size(); }

 private:
  size_t capacity_;
  std::vector<uint64_t> handles_;  // beside entries_, so the scan reads only these
  std::vector<Tombstone> entries_;
  size_t next_ = 0;  // the slot the next Add writes, once full
};

struct TransferCounts {
  int64_t h2d = 0, d2h = 0, d2d = 0;
};
enum class Direction { kHostToDevice, kDeviceToHost, kDeviceToDevice };

// At most this many tombstones per session; the oldest go first.
inline constexpr size_t kMaxTombstonesPerSession = 1 << 16;

struct SessionRecord {
  std::string client;
  std::string tenant = std::string(Tenants::kDefaultTenant);
  v1::SessionOptions options;
  absl::flat_hash_set<uint64_t> arrays;
  int64_t live_bytes = 0;
  int64_t executions = 0;
  TransferCounts transfers;
  absl::flat_hash_map<int, TransferCounts> device_transfers;
  int64_t compiles = 0, cache_hits = 0, cache_misses = 0;
  int64_t donations = 0, donations_reused = 0;
  TombstoneRing tombstones{kMaxTombstonesPerSession};
  absl::Time opened;
  // The last call that named the session (its lease runs from here).
  // Renewed by CheckSessionLocked, which is const to its callers.
  mutable absl::Time last_seen;
};

class ArrayRegistry {
 public:
  static constexpr size_t kMaxTombstones = kMaxTombstonesPerSession;

  // The registry's lock held for one compound read or change.
  class ABSL_SCOPED_LOCKABLE Transaction {
   public:
    explicit Transaction(const ArrayRegistry& r) ABSL_EXCLUSIVE_LOCK_FUNCTION(r.mu_)
        : lock_(&r.mu_) {}
    ~Transaction() ABSL_UNLOCK_FUNCTION() {}
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;

   private:
    absl::MutexLock lock_;
  };
  // The lock, for thread-safety annotations only: a const Mutex cannot be
  // taken or released.
  const absl::Mutex& lock() const ABSL_LOCK_RETURNED(mu_) { return mu_; }

  // `incarnation`: the coordinator's (hex), which its session ids end in
  // (".<incarnation>"); `started`: when it started. A session id of another
  // incarnation is then answered UNAVAILABLE: the coordinator restarted.
  explicit ArrayRegistry(std::string incarnation = "", absl::Time started = absl::InfinitePast())
      : incarnation_(std::move(incarnation)), started_(started) {}

  // RESOURCE_EXHAUSTED when the tenant already has `limits.max_sessions`
  // open sessions.
  absl::Status OpenSession(const std::string& id, const std::string& client,
                           const v1::SessionOptions& options,
                           const std::string& tenant = std::string(Tenants::kDefaultTenant),
                           TenantLimits limits = {});
  // Every tenant this registry knows gets `limits_of(tenant)`: quotas are
  // checked against them from the next allocation, session counts from the
  // next OpenSession (sessions already open stay open).
  void SetTenantLimits(const std::function<TenantLimits(const std::string&)>& limits_of);
  // NOT_FOUND naming a session that is closed or was never opened;
  // UNAVAILABLE for a session of an earlier coordinator incarnation.
  absl::Status CheckSessionLocked(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The session's record (CheckSessionLocked first).
  SessionRecord& SessionLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Null when the session is gone.
  SessionRecord* FindSessionLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const SessionRecord* FindSessionLocked(const std::string& id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the session (its arrays retired first). A non-empty `why`
  // ("expired: …", "was closed by an operator: …") is what later calls
  // naming it are told.
  void EraseSessionLocked(const std::string& id, const std::string& why = "")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sessions no call has named for `lease` or longer at `now`.
  std::vector<std::string> IdleSessions(absl::Time now, absl::Duration lease) const;
  // NOT_FOUND when the session is gone.
  absl::Status SetSessionOptions(const std::string& id, const v1::SessionOptions& options);
  // Every open session, for Admin.ListSessions.
  template <typename F>
  void ForEachSessionLocked(F f) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [id, s] : sessions_) f(id, s);
  }
  int64_t num_sessions() const;
  int64_t num_arrays() const;

  // What a call needs of its session (CheckSessionLocked's errors, and its
  // lease renewed), read as one.
  struct SessionView {
    std::string tenant;
    v1::SessionOptions options;
  };
  absl::StatusOr<SessionView> ViewSession(const std::string& id) const;
  // The session's compile counters; nothing when it is gone.
  enum class CompileEvent { kCacheHit, kCacheMiss, kCompiled };
  void CountCompile(const std::string& session, CompileEvent event);

  // The array, if `session` owns it. A retired one answers what became of
  // it: FAILED_PRECONDITION naming the execution it was donated to, or
  // NOT_FOUND saying when it was deleted; PERMISSION_DENIED for another
  // session's array.
  absl::StatusOr<ArrayRecord*> OwnedLocked(const std::string& session, uint64_t handle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ArrayRecord* FindLocked(uint64_t handle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ContainsLocked(uint64_t handle) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Tombstone* FindTombstoneLocked(const std::string& session, uint64_t handle) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Registers a new array in its session (quota already checked).
  ArrayRecord& AddLocked(const std::string& session, uint64_t handle, ArrayRecord record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes an array from the registry and its session, leaving a tombstone.
  void RetireLocked(uint64_t handle, v1::ArrayState state, int64_t execution,
                    absl::string_view executable, absl::Time when)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An accepted execution's changes to the arrays, made as one: the session
  // counts it; its donated arguments are retired, their tombstones naming
  // it; its outputs are registered. Returns, by device, the donated buffers
  // on devices the execution does not run on (to free after what reads them
  // there).
  struct ExecutionChanges {
    int64_t execution = 0;
    absl::string_view executable;
    std::vector<int> devices;  // where its steps run
    std::vector<uint64_t> donated;
    std::vector<std::pair<uint64_t, ArrayRecord>> outputs;
  };
  absl::flat_hash_map<int, v1::FreeRequest> CommitExecutionLocked(const std::string& session,
                                                                  ExecutionChanges changes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers `handles` not yet known as ERROR with `error` (the outputs of
  // a call that was rejected); nothing when the session is gone.
  void AddFailed(const std::string& session, const std::vector<uint64_t>& handles,
                 const absl::Status& error, absl::string_view producer);
  // Retires `handles` as deleted; returns, by device, the buffers to free there.
  absl::flat_hash_map<int, v1::FreeRequest> RetireDeletedLocked(
      const std::vector<uint64_t>& handles) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // RESOURCE_EXHAUSTED when `added` more bytes would exceed the session's
  // own quota or its tenant's (set by the operator).
  absl::Status CheckQuotaLocked(const std::string& session, int64_t added,
                                absl::string_view what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountTransfer(const std::string& session, int device, Direction dir, int64_t bytes);
  // The live arrays with a buffer on any of `devices`.
  struct Held {
    int64_t arrays = 0, bytes = 0, pending = 0;
    std::vector<std::string> sessions;  // sorted, each once
  };
  Held HeldOn(const std::vector<int>& devices) const;
  // `tenant`'s live arrays, by global device: buffers and bytes there.
  struct DeviceUse {
    int64_t buffers = 0, bytes = 0;
  };
  absl::flat_hash_map<int, DeviceUse> TenantUseLocked(const std::string& tenant) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::flat_hash_map<int, DeviceUse> TenantUse(const std::string& tenant) const;
  // Whether a live array (a pending put's included) has `handle` on global device `device`.
  bool OwnsBufferLocked(uint64_t handle, int device) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every session's transfers since the coordinator started.
  TransferCounts total_transfers() const;
  void CountTransferLocked(const std::string& session, int device, Direction dir, int64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // One device's step that makes `outputs` ended: on success an output
  // becomes READY when its last device reports; on failure every PENDING
  // output takes the error. Returns the outputs that failed by this report.
  std::vector<uint64_t> StepDone(const std::string& session, const std::vector<uint64_t>& outputs,
                                 const absl::Status& result, int reused_donations);
  // A put's data all arrived: PENDING becomes READY.
  bool MarkReady(uint64_t handle);
  // Every array on one of `devices` that has not failed becomes LOST with
  // `error`; returns how many.
  int LoseOn(const std::vector<int>& devices, const absl::Status& error);

  bool NotPendingLocked(const std::vector<uint64_t>& handles) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks until none of `handles` is pending, or `timeout`.
  bool AwaitNotPending(const std::vector<uint64_t>& handles, absl::Duration timeout);
  // Blocks (releasing the lock) until none of `handles` is pending, or `timeout`.
  bool AwaitNotPendingLocked(const std::vector<uint64_t>& handles, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

 private:
  const std::string incarnation_;
  const absl::Time started_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, ArrayRecord> arrays_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, SessionRecord> sessions_ ABSL_GUARDED_BY(mu_);
  struct TenantUsage {
    TenantLimits limits;
    int64_t live_bytes = 0;
    int64_t sessions = 0;
  };
  absl::flat_hash_map<std::string, TenantUsage> tenants_ ABSL_GUARDED_BY(mu_);
  TransferCounts total_transfers_ ABSL_GUARDED_BY(mu_);
  // Why recently ended sessions ended, for the calls that still name them;
  // the oldest are forgotten past kMaxEnded.
  static constexpr size_t kMaxEnded = 4096;
  absl::flat_hash_map<std::string, std::string> ended_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> ended_order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessel::server
