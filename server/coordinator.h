// Coordinator: the coordinator daemon's logic, free of RPC. A thin façade
// over its parts: the WorkerRegistry (workers, devices, step queues), the
// ArrayRegistry (sessions, arrays, tombstones), the CompileCache and the
// ExecutePlanner (a request into per-device steps, pure). It turns client
// requests into worker requests; SessionService, AdminService and
// RegistryService are thin gRPC shells over it.
//
// Its files, one job each: coordinator.cc (workers, devices, stats, the
// cluster's view), coordinator_sessions.cc (sessions and their arrays, the
// transfer guard), coordinator_execute.cc (compile, and Execute as plan,
// commit, launch), coordinator_transfers.cc (put, fetch, reshard),
// coordinator_mpmd.cc (MPMD programs) and coordinator_checkpoints.cc.
//
// Thread-safety: every public method may be called from any thread. Each
// part has its own lock; the lock order is written below. No lock is held
// across a call to a worker, a callback or a client's destruction.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "google/protobuf/struct.pb.h"
#include "scheduler/compiler.h"
#include "server/array_registry.h"
#include "server/block_layout.h"
#include "server/compile_cache.h"
#include "server/execute_planner.h"
#include "server/worker_client.h"
#include "server/worker_registry.h"
#include "spdlog/logger.h"
#include "tessel/v1/admin.pb.h"
#include "tessel/v1/session.pb.h"

namespace tessel::server {

class Coordinator {
 public:
  struct Options {
    std::shared_ptr<spdlog::logger> logger;
    absl::Duration heartbeat_interval = absl::Milliseconds(500);
    // A worker silent this long is marked dead. Default: 4 heartbeats.
    absl::Duration heartbeat_timeout = absl::Seconds(2);
    // A session no call has named for this long ends, its arrays freed.
    // Zero: sessions end only when closed.
    absl::Duration session_lease = absl::Seconds(60);
    // How to reach a worker, presenting its secret; tests substitute fakes.
    std::function<std::shared_ptr<WorkerClient>(const std::string& address,
                                                const std::string& secret)>
        connect = [](const std::string& address, const std::string& secret) {
          return NewGrpcWorkerClient(address, secret);
        };
    // Who may call, and the operator's bounds on each tenant.
    Tenants tenants;
    // The compile cache's bound; the least recently used executables go.
    int64_t compile_cache_bytes = int64_t{1} << 30;
    // Called as each device step completes (on a client thread, no lock
    // held): its global device, the time since it was sent, and whether it
    // succeeded. Default: none.
    std::function<void(int device, absl::Duration latency, bool ok)> on_step_done;
    // Whether clients that ask (FetchRequest.direct, PutDirect) may read
    // and write arrays' blocks straight from and to the workers, with
    // tickets; otherwise every Put and Fetch is relayed through here.
    bool direct_transfers = true;
    // How long a ticket is good for (to start its read or write).
    absl::Duration ticket_lifetime = absl::Minutes(1);
    // How often every buffer the workers hold is checked against the arrays
    // here (Reconcile); those unowned twice in a row are freed. Zero: never.
    absl::Duration reconcile_interval = absl::Seconds(30);
  };
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(Options options);
  ~Coordinator();

  // Registry.
  absl::StatusOr<v1::RegisterWorkerResponse> RegisterWorker(const v1::RegisterWorkerRequest& req);
  // False for an unknown or dead worker; PERMISSION_DENIED when
  // `secret` is not the one the worker registered with.
  // `draining`: the worker was told to stop and serves `drain` more: it is
  // cordoned, and a WORKER_DRAINING event tells the clients.
  absl::StatusOr<bool> Heartbeat(const std::string& worker_id, const std::string& secret,
                                 bool draining = false,
                                 absl::Duration drain = absl::ZeroDuration());
  // The cluster's events after `after` (ClusterEventsRequest).
  absl::StatusOr<v1::ClusterEventsResponse> ClusterEvents(const v1::ClusterEventsRequest& req);
  // OK when `worker_id` is a live worker registered with `secret` and holds
  // one of the devices of the group `key` belongs to
  // ("devices:<global ids>@<epoch>/..."); PERMISSION_DENIED otherwise.
  absl::Status CheckKvCaller(const std::string& worker_id, const std::string& secret,
                             absl::string_view key) const;

  // Session.
  // RESOURCE_EXHAUSTED when the tenant has its maximum of sessions open.
  absl::StatusOr<v1::OpenSessionResponse> OpenSession(
      const v1::OpenSessionRequest& req,
      const std::string& tenant = std::string(Tenants::kDefaultTenant));
  // PERMISSION_DENIED unless `session` belongs to `tenant` (NOT_FOUND /
  // UNAVAILABLE as CheckSession for a session that is gone).
  absl::Status CheckTenant(const std::string& session, const std::string& tenant) const;
  // Who may call now: Options::tenants until ReplaceTenants.
  std::shared_ptr<const Tenants> tenants() const;
  // The operator's reloaded tokens file: calls from here on are checked
  // against `tenants`, and every tenant's limits are the new ones at once
  // (open sessions included). A tenant whose tokens are gone is refused
  // from its next call; its sessions end when their leases do.
  void ReplaceTenants(Tenants tenants);
  absl::StatusOr<v1::CloseSessionResponse> CloseSession(const v1::CloseSessionRequest& req);
  absl::StatusOr<v1::KeepAliveResponse> KeepAlive(const v1::KeepAliveRequest& req);
  absl::Status SetSessionOptions(const v1::SetSessionOptionsRequest& req);
  absl::StatusOr<v1::CompileResponse> Compile(const v1::CompileRequest& req);
  // A cached executable's per-device program as a Graphviz digraph.
  absl::StatusOr<v1::PlanDotResponse> PlanDot(const v1::PlanDotRequest& req);
  absl::StatusOr<v1::ExecuteResponse> Execute(const v1::ExecuteRequest& req);
  // After a pipelined Execute was rejected: its free output handles take the
  // error, so that it surfaces where the client waits on or fetches them.
  void MarkRejectedOutputs(const v1::ExecuteRequest& req, const absl::Status& error);
  absl::StatusOr<v1::AwaitResponse> Await(const v1::AwaitRequest& req);
  absl::Status Delete(const v1::DeleteRequest& req);
  // An ExecuteRequest's `release`: the session's handles among them are
  // deleted, the rest passed over (a dropped array's call may have been
  // refused, or its handle deleted already).
  void Release(const std::string& session,
               const google::protobuf::RepeatedField<uint64_t>& handles);
  // A copy of an array on another placement, its blocks moved worker to
  // worker as one sequenced step on each device involved (PlanReshard).
  absl::StatusOr<v1::ReshardResponse> Reshard(const v1::ReshardRequest& req) {
    return Reshard(req, nullptr);
  }
  absl::StatusOr<v1::ArrayInfoResponse> ArrayInfo(const v1::ArrayInfoRequest& req);
  // The session's counters; its tenant's compiles. Devices: each device's
  // own figures, or with `tenant_view` (a caller without admin rights) only
  // what the session's tenant holds there.
  absl::StatusOr<v1::StatsResponse> Stats(const v1::StatsRequest& req, bool tenant_view = false);
  // The live devices, and the session's tenant's arrays on each.
  absl::StatusOr<v1::ListDevicesResponse> ListDevices(const v1::ListDevicesRequest& req);

  // Checkpoints (coordinator_checkpoints.cc; docs/checkpoints.md).
  // SaveCheckpoint snapshots the arrays (each distinct block written by a
  // worker holding it) and returns; CommitCheckpoint waits for the writes
  // and makes the checkpoint appear, or removes it.
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint(const v1::SaveCheckpointRequest& req);
  absl::StatusOr<v1::CommitCheckpointResponse> CommitCheckpoint(
      const v1::CommitCheckpointRequest& req);
  absl::StatusOr<v1::ReadCheckpointResponse> ReadCheckpoint(const v1::ReadCheckpointRequest& req);
  // New arrays, each device reading its block from the chunks it overlaps.
  absl::StatusOr<v1::RestoreCheckpointResponse> RestoreCheckpoint(
      const v1::RestoreCheckpointRequest& req);
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(
      const v1::ListCheckpointsRequest& req);
  absl::Status RemoveCheckpoint(const v1::RemoveCheckpointRequest& req);
  // A CheckpointManager's hold on its directory (HoldCheckpointsRequest).
  absl::Status HoldCheckpoints(const v1::HoldCheckpointsRequest& req);

  // A Put in progress: data arrives in order, Finish makes the array READY.
  // Destroying an unfinished PutSink abandons the put and frees its buffers.
  class PutSink {
   public:
    virtual ~PutSink() = default;
    virtual absl::Status Write(const std::string& bytes) = 0;
    virtual absl::StatusOr<int64_t> Finish() = 0;
  };
  absl::StatusOr<std::unique_ptr<PutSink>> BeginPut(const v1::PutRequest::Header& header);
  // A put whose bytes the client writes to the workers itself (PutDirect):
  // the array is made pending, with a ticket for each (block, worker) to
  // write. Commit marks it ready once the client says every block is
  // written and shows each worker's receipt for its block (in the order of
  // blocks()); it frees the array given the client's error or a receipt
  // missing or not the worker's. Destroying it uncommitted frees it too.
  // Null when direct transfers are off.
  class DirectPut {
   public:
    virtual ~DirectPut() = default;
    virtual const std::vector<v1::DirectWrite>& blocks() const = 0;
    virtual absl::StatusOr<int64_t> Commit(absl::string_view error,
                                           absl::Span<const std::string> receipts) = 0;
  };
  absl::StatusOr<std::unique_ptr<DirectPut>> BeginDirectPut(const v1::PutRequest::Header& header);

  // A Fetch in progress, once the array is ready.
  class FetchSource {
   public:
    virtual ~FetchSource() = default;
    virtual const v1::TensorType& type() const = 0;
    virtual bool Read(std::string* bytes) = 0;
    virtual absl::Status Finish() = 0;
    // A direct read granted (FetchRequest.direct): the blocks for the
    // client to read itself; Read() then yields nothing. Null when relayed.
    virtual const std::vector<v1::DirectBlock>* direct() const { return nullptr; }
  };
  absl::StatusOr<std::unique_ptr<FetchSource>> BeginFetch(const v1::FetchRequest& req);

  // Admin.
  v1::GetClusterResponse GetCluster(const v1::GetClusterRequest& req);
  v1::ListSessionsResponse ListSessions();
  // Bytes moved since start, over every session.
  TransferCounts total_transfers() const { return arrays_.total_transfers(); }
  absl::StatusOr<v1::AdminCloseSessionResponse> AdminCloseSession(
      const v1::AdminCloseSessionRequest& req);
  absl::Status CordonWorker(const v1::CordonWorkerRequest& req);
  absl::StatusOr<v1::DrainWorkerResponse> DrainWorker(const v1::DrainWorkerRequest& req);
  // Every buffer the live workers hold (once each has run the frees sent
  // before asking), checked against the live arrays here: the unowned, and
  // a sequenced free of those already unowned at the previous call.
  v1::ReconcileResponse Reconcile() ABSL_LOCKS_EXCLUDED(arrays_.lock(), reconcile_mu_);
  // The profiler: starts every live worker's recorder and this process's
  // (each stops by itself after the duration); one trace at a time.
  absl::StatusOr<v1::StartTraceResponse> StartTrace(const v1::StartTraceRequest& req)
      ABSL_LOCKS_EXCLUDED(trace_mu_);
  // Stops them and answers the trace, as Chrome/Perfetto trace-event JSON
  // on this process's clock.
  absl::StatusOr<std::string> StopTrace() ABSL_LOCKS_EXCLUDED(trace_mu_);
  // The last steps that failed on a worker (at most kRecentErrors), oldest first.
  struct StepError {
    absl::Time when;
    int device = -1;
    int64_t execution = 0;
    std::string session, message;
  };
  static constexpr size_t kRecentErrors = 50;
  std::vector<StepError> RecentErrors() const ABSL_LOCKS_EXCLUDED(errors_mu_);

 private:
  class PutSinkImpl;
  class DirectPutImpl;
  // Where a put's blocks go: per block, each worker holding a copy.
  struct PutTarget {
    std::shared_ptr<WorkerClient> client;
    v1::PutShardRequest::Header header;
    std::vector<int> global_devices;  // the header's devices, by global id
  };
  struct PutPlan {
    std::optional<BlockLayout> layout;
    std::vector<std::vector<PutTarget>> targets;
    std::vector<int> devices;
    int64_t bytes = 0, device_bytes = 0;
  };
  // Checks a put and makes its array, pending.
  absl::StatusOr<PutPlan> PlanPut(const v1::PutRequest::Header& header);
  // Frees an unfinished put's array and whatever of it the workers hold.
  void AbandonPut(uint64_t handle);
  class FetchSourceImpl;
  class DirectFetchSource;

  explicit Coordinator(Options options);
  void MonitorLoop();
  // Steps sent to a device and answered, for Admin.
  struct DeviceSteps {
    int64_t sent = 0, done = 0, errors = 0;
    double total_ms = 0;
  };
  void StepSent(int device);
  void StepAnswered(int device, absl::Duration latency, bool ok);
  int64_t StepsInFlight(const std::vector<int>& devices) const;
  // `w` is dead (`why`, the rest of "was on worker W (ADDRESS), which ..."):
  // its arrays are lost and its calls in flight cancelled.
  void LoseWorker(const WorkerRegistry::Expired& w, const std::string& why);
  // Applies the transfer guard (the call's override, else the session's);
  // logs or fails as the level says. Counting is separate (CountTransfer).
  absl::Status GuardTransferLocked(const std::string& session, const v1::TransferGuard& call,
                                   Direction dir, bool implicit, absl::string_view what,
                                   int64_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(arrays_.lock());
  // Retires `handles` and returns their frees, numbered on their devices
  // after every step already sent there; SendFrees sends them.
  [[nodiscard]] std::vector<PendingFree> FreeArraysLocked(const std::vector<uint64_t>& handles)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(arrays_.lock());
  void SendFrees(std::vector<PendingFree> frees);
  // Ends session `id`: frees its arrays (sent to the workers) and forgets
  // it; later calls naming it are told `why` (empty: closed by its client).
  // Returns the number of arrays freed. A positive `idle_for` ends it only
  // if no call has named it for that long (an expiring lease), else frees
  // nothing.
  absl::StatusOr<int64_t> EndSession(const std::string& id, const std::string& why,
                                     absl::Duration idle_for = absl::ZeroDuration());
  // MPMD programs (server/mpmd.h): each region compiled as an executable of
  // its own; an execution runs each region's step after moving the values it
  // reads (Reshard), then frees what passed between them.
  struct MpmdProgram;
  absl::StatusOr<v1::CompileResponse> CompileMpmd(const v1::CompileRequest& req);
  absl::StatusOr<v1::ExecuteResponse> ExecuteMpmd(const v1::ExecuteRequest& req,
                                                  const MpmdProgram& program);
  // `tenant`'s MPMD program `id`, or null.
  std::shared_ptr<const MpmdProgram> FindMpmd(const std::string& tenant,
                                              const std::string& id) const
      ABSL_LOCKS_EXCLUDED(mpmd_mu_);
  // A tenant's bound in the compile cache: its own, else an even share of
  // the cache among the tokens file's tenants (0, the whole cache, when
  // every caller is the default tenant).
  int64_t TenantCacheBytes(const std::string& tenant) const;
  // The workers drop the programs of executables the cache evicted, after
  // the steps already sent (WorkerRegistry::SequenceUnloads).
  void UnloadEvicted(const std::vector<std::string>& evicted) ABSL_LOCKS_EXCLUDED(arrays_.lock());
  // `tenant`'s executable `id`, compiled again for `session` from the
  // source the cache kept when it evicted it (a compile: counted, and
  // refused under forbid_compiles); NOT_FOUND when there is none, alike
  // for an id never compiled and another tenant's.
  absl::StatusOr<std::shared_ptr<const CachedExecutable>> CompileEvicted(const std::string& session,
                                                                         const std::string& tenant,
                                                                         const std::string& id)
      ABSL_LOCKS_EXCLUDED(arrays_.lock());
  // A reshard's steps, each for its global device, before they are
  // sequenced there and sent.
  struct ReshardSteps {
    std::string session, what;
    uint64_t output = 0;
    int64_t epoch = 0;  // the collective epoch they run under
    std::vector<std::pair<int, v1::RunRequest>> steps;
    // Deferred receivers': "<sending devices> -> <receiving devices>", which
    // names their group on the workers (transfers with equal ones share it).
    std::string group;
  };
  // With `deferred`, a one-way reshard (ReshardPlan::one_way) sends only its
  // senders' steps, which run when the source is made, and leaves the
  // receivers' in `*deferred` for SendReshardSteps, when the target is
  // needed: a receiver sent early would hold up its device's queue. The
  // caller must send them, on failure too (the target is pending until then).
  absl::StatusOr<v1::ReshardResponse> Reshard(const v1::ReshardRequest& req,
                                              ReshardSteps* deferred);
  void SendReshardSteps(ReshardSteps steps) ABSL_LOCKS_EXCLUDED(arrays_.lock());
  struct SequencedStep {
    std::shared_ptr<WorkerClient> client;  // null: the device's worker is dead
    v1::RunRequest run;
    int device = 0;
  };
  std::vector<SequencedStep> SequenceStepsLocked(ReshardSteps& steps)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(arrays_.lock());
  void SendSequenced(const ReshardSteps& steps, std::vector<SequencedStep> sequenced)
      ABSL_LOCKS_EXCLUDED(arrays_.lock());
  // Execute's three phases. Planning checks the session, the arguments, the
  // transfer guard and the quota, and changes nothing; committing (which
  // cannot fail) numbers the execution, retires the donated arrays,
  // registers the outputs and numbers each device's step; launching sends
  // the frees, the moves and the steps, outside the lock.
  struct ExecuteLaunch;
  struct AcceptedExecution;
  absl::StatusOr<ExecutePlan> PlanExecuteLocked(const v1::ExecuteRequest& req,
                                                const CachedExecutable& exe,
                                                const std::vector<DeviceRoute>& routes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(arrays_.lock());
  void CommitExecuteLocked(const v1::ExecuteRequest& req, const CachedExecutable& exe,
                           ExecutePlan plan, AcceptedExecution& run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(arrays_.lock());
  void LaunchExecute(const v1::ExecuteRequest& req, const CachedExecutable& exe,
                     AcceptedExecution& run) ABSL_LOCKS_EXCLUDED(arrays_.lock());
  // A handle no array holds, for arrays the coordinator makes itself (moved
  // arguments, an MPMD program's intermediates).
  uint64_t FreshHandleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(arrays_.lock());
  // Waits for `handles` of `session`; the first one's error, prefixed "`what` failed: ".
  absl::Status AwaitAll(const std::string& session, absl::Span<const uint64_t> handles,
                        absl::string_view what) ABSL_LOCKS_EXCLUDED(arrays_.lock());
  // The record of a new array of `type` on `placement` (devices, and mesh,
  // sharding and block type when sharded; PENDING), or why it cannot go there.
  absl::StatusOr<ArrayRecord> PlaceRecordLocked(const v1::TensorType& type,
                                                const v1::Placement& placement,
                                                absl::string_view what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(arrays_.lock());
  // Waits for the source to be ready, then relays it into the temporary handle.
  absl::Status RunMove(const std::string& session, const PlannedMove& m, const DeviceRoute& from,
                       const DeviceRoute& to) ABSL_LOCKS_EXCLUDED(arrays_.lock());
  // `epoch`: the collective epoch the step ran under.
  void OnStepDone(const std::string& session, const std::vector<uint64_t>& outputs, int64_t epoch,
                  absl::StatusOr<v1::RunResponse> result) ABSL_LOCKS_EXCLUDED(arrays_.lock());
  // "<incarnation hex>.<epoch>": collective groups of another coordinator or
  // of an epoch before a broken group are never reused.
  std::string CollectiveEpoch(int64_t epoch) const;
  // Steps to `worker_id` were lost in transit: its devices' numbering starts
  // over in a new queue epoch, so the worker never waits on a gap.
  void RestartQueues(const std::string& worker_id);

  // The worker through which a checkpoint's files are read and written.
  struct CheckpointFiles {
    std::shared_ptr<WorkerClient> client;
    std::string address;
  };
  absl::StatusOr<CheckpointFiles> CheckpointFilesWorker(absl::string_view what) const;
  absl::StatusOr<v1::CheckpointFilesResponse> CallCheckpointFiles(
      const CheckpointFiles& w, const v1::CheckpointFilesRequest& req) const;
  // The committed checkpoint's manifest, once it is checked to be the
  // session's tenant's and not still being written.
  absl::StatusOr<google::protobuf::Struct> ReadManifest(const std::string& session,
                                                        const std::string& path)
      ABSL_LOCKS_EXCLUDED(arrays_.lock(), checkpoints_mu_);
  // Sequences `steps` (global device, request) and waits for them all; the first error.
  absl::Status RunCheckpointSteps(std::vector<std::pair<int, v1::RunRequest>> steps,
                                  absl::string_view what) ABSL_LOCKS_EXCLUDED(arrays_.lock());
  struct SavingCheckpoint {
    std::string session, path, temp;
    std::vector<std::string> writers;  // addresses; set once snapshotted
    std::string files_worker;
    v1::CheckpointFilesRequest metadata;  // the zarr.json files and the manifest
  };
  mutable absl::Mutex checkpoints_mu_;  // after arrays_'s; nothing is called under it
  absl::flat_hash_map<std::string, SavingCheckpoint> saving_ ABSL_GUARDED_BY(checkpoints_mu_);
  // Directory -> the session whose CheckpointManager holds it.
  absl::flat_hash_map<std::string, std::string> held_ ABSL_GUARDED_BY(checkpoints_mu_);
  std::atomic<uint64_t> next_checkpoint_{0};

  // Appends an event (its seq and time filled in), the oldest dropped past kMaxEvents.
  void AddEvent(v1::ClusterEvent event) ABSL_LOCKS_EXCLUDED(events_mu_);
  static constexpr size_t kMaxEvents = 1024;
  mutable absl::Mutex events_mu_;  // a leaf
  std::deque<v1::ClusterEvent> events_ ABSL_GUARDED_BY(events_mu_);
  uint64_t next_event_ ABSL_GUARDED_BY(events_mu_) = 0;
  absl::flat_hash_set<std::string> draining_ ABSL_GUARDED_BY(events_mu_);  // worker ids

  mutable absl::Mutex mpmd_mu_;  // a leaf
  absl::flat_hash_map<std::string, std::shared_ptr<const MpmdProgram>> mpmd_
      ABSL_GUARDED_BY(mpmd_mu_);
  std::deque<std::string> mpmd_order_
      ABSL_GUARDED_BY(mpmd_mu_);  // oldest first; kMaxMpmdPrograms at most
  static constexpr size_t kMaxMpmdPrograms = 256;
  // Lock order: arrays_'s lock, then workers_'s, or then checkpoints_mu_;
  // cache_'s, tenants_mu_, reconcile_mu_ and mu_ are leaves. None is held across an RPC, a callback
  // or a client's destruction.
  const Options options_;
  const std::shared_ptr<spdlog::logger> log_;
  // Random per start (16 hex digits): collective groups, worker ids and
  // session ids carry it, so none of an earlier coordinator is reused.
  const std::string incarnation_;
  WorkerRegistry workers_;
  ArrayRegistry arrays_;
  CompileCache cache_;
  mutable absl::Mutex tenants_mu_;  // a leaf: only the pointer is swapped under it
  std::shared_ptr<const Tenants> tenants_ ABSL_GUARDED_BY(tenants_mu_);
  mutable absl::Mutex steps_mu_;  // a leaf: nothing is called under it
  absl::flat_hash_map<int, DeviceSteps> device_steps_ ABSL_GUARDED_BY(steps_mu_);
  std::atomic<int64_t> next_execution_{0};
  // Bumped when a step reports a broken collective group; steps sent after
  // that meet in fresh groups (RunRequest.collective_epoch).
  std::atomic<int64_t> collective_epoch_{0};
  // Buffers found unowned by the last Reconcile: freed if the next finds them so again.
  absl::Mutex reconcile_mu_;  // a leaf
  absl::flat_hash_set<std::pair<int, uint64_t>> unowned_ ABSL_GUARDED_BY(reconcile_mu_);
  std::atomic<int64_t> unowned_freed_{0};
  mutable absl::Mutex errors_mu_;  // a leaf
  std::deque<StepError> recent_errors_ ABSL_GUARDED_BY(errors_mu_);
  // The trace being recorded (StartTrace), if any: until when, and the
  // workers asked to record it.
  absl::Mutex trace_mu_;  // held across the workers' Trace calls: one trace at a time
  std::optional<absl::Time> trace_until_ ABSL_GUARDED_BY(trace_mu_);
  std::vector<StatsTarget> traced_ ABSL_GUARDED_BY(trace_mu_);
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread monitor_;
};

}  // namespace tessel::server
