// Coordinator: the coordinator daemon's logic, free of RPC. It owns the
// sessions, the array registry, the compile cache and the worker registry,
// and turns client requests into worker requests. SessionService,
// AdminService and RegistryService are thin gRPC shells over it.
//
// Thread-safety: every public method may be called from any thread; state is
// guarded by one mutex, never held across a blocking call to a worker.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "scheduler/compiler.h"
#include "server/worker_client.h"
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
    // How to reach a worker; tests substitute fakes.
    std::function<std::shared_ptr<WorkerClient>(const std::string& address)> connect = NewGrpcWorkerClient;
  };
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(Options options);
  ~Coordinator();

  // Registry.
  absl::StatusOr<v1::RegisterWorkerResponse> RegisterWorker(const v1::RegisterWorkerRequest& req);
  bool Heartbeat(const std::string& worker_id);

  // Session.
  v1::OpenSessionResponse OpenSession(const v1::OpenSessionRequest& req);
  absl::StatusOr<v1::CloseSessionResponse> CloseSession(const v1::CloseSessionRequest& req);
  absl::Status SetSessionOptions(const v1::SetSessionOptionsRequest& req);
  absl::StatusOr<v1::CompileResponse> Compile(const v1::CompileRequest& req);
  absl::StatusOr<v1::ExecuteResponse> Execute(const v1::ExecuteRequest& req);
  // After a pipelined Execute was rejected: its free output handles take the
  // error, so that it surfaces where the client waits on or fetches them.
  void MarkRejectedOutputs(const v1::ExecuteRequest& req, const absl::Status& error);
  absl::StatusOr<v1::AwaitResponse> Await(const v1::AwaitRequest& req);
  absl::Status Delete(const v1::DeleteRequest& req);
  absl::StatusOr<v1::ArrayInfoResponse> ArrayInfo(const v1::ArrayInfoRequest& req);
  absl::StatusOr<v1::StatsResponse> Stats(const v1::StatsRequest& req);

  // A Put in progress: data arrives in order, Finish makes the array READY.
  // Destroying an unfinished PutSink abandons the put and frees its buffers.
  class PutSink {
   public:
    virtual ~PutSink() = default;
    virtual absl::Status Write(const std::string& bytes) = 0;
    virtual absl::StatusOr<int64_t> Finish() = 0;
  };
  absl::StatusOr<std::unique_ptr<PutSink>> BeginPut(const v1::PutRequest::Header& header);

  // A Fetch in progress, once the array is ready.
  class FetchSource {
   public:
    virtual ~FetchSource() = default;
    virtual const v1::TensorType& type() const = 0;
    virtual bool Read(std::string* bytes) = 0;
    virtual absl::Status Finish() = 0;
  };
  absl::StatusOr<std::unique_ptr<FetchSource>> BeginFetch(const v1::FetchRequest& req);

  // Admin.
  v1::GetClusterResponse GetCluster(const v1::GetClusterRequest& req);

 private:
  struct WorkerRecord {
    std::string id;
    std::string address;
    std::vector<int> devices;  // global ids
    absl::Time last_heartbeat;
    bool alive = true;
    std::shared_ptr<WorkerClient> client;
    absl::flat_hash_set<std::string> loaded;  // executable ids
    bool open_queues = false;                 // a new queue epoch awaits its first message
  };
  struct DeviceRecord {
    std::string worker_id;
    int local_index = 0;
    uint64_t next_seq = 0;
    std::string kind = "cpu";
    uint64_t queue_epoch = 0;  // of the worker's registration; sent with every step and free
  };
  struct ArrayRecord {
    std::string session;
    v1::TensorType type;
    std::vector<int> devices;
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
  struct TransferCounts {
    int64_t h2d = 0, d2h = 0, d2d = 0;
  };
  enum class Direction { kHostToDevice, kDeviceToHost, kDeviceToDevice };
  struct SessionRecord {
    std::string client;
    v1::SessionOptions options;
    absl::flat_hash_set<uint64_t> arrays;
    int64_t live_bytes = 0;
    int64_t executions = 0;
    TransferCounts transfers;
    absl::flat_hash_map<int, TransferCounts> device_transfers;
    int64_t compiles = 0, cache_hits = 0, cache_misses = 0;
    int64_t donations = 0, donations_reused = 0;
    absl::flat_hash_map<uint64_t, Tombstone> tombstones;
    std::deque<uint64_t> tombstone_order;  // oldest first; bounded
  };
  struct ExecutableRecord {
    scheduler::CompiledProgram compiled;
    v1::Graph graph;  // to explain later cache misses
  };
  class PutSinkImpl;
  class FetchSourceImpl;

  explicit Coordinator(Options options);
  void MonitorLoop();
  absl::Status CheckSession(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The array, if `session` owns it; NOT_FOUND / PERMISSION_DENIED otherwise.
  absl::StatusOr<ArrayRecord*> OwnedArray(const std::string& session, uint64_t handle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<int>> ResolvePlacement(const v1::Placement& p) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UNAVAILABLE naming the first device of `devices` on a dead worker.
  absl::Status CheckAlive(const std::vector<int>& devices) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers a new array in its session (quota already checked).
  ArrayRecord& AddArray(const std::string& session, uint64_t handle, ArrayRecord record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes an array from the registry and its session, leaving a tombstone.
  void RetireArray(uint64_t handle, Tombstone tombstone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when `added` more bytes would exceed the session's quota.
  absl::Status CheckQuota(const std::string& session, int64_t added, absl::string_view what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies the transfer guard (the call's override, else the session's);
  // logs or fails as the level says. Counting is separate (CountTransfer).
  absl::Status GuardTransfer(const std::string& session, const v1::TransferGuard& call, Direction dir,
                             bool implicit, absl::string_view what, int64_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountTransfer(const std::string& session, int device, Direction dir, int64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An implicit device->device copy of an argument, for one step.
  struct Move {
    int argument = 0;
    uint64_t handle = 0, temp_handle = 0;
    v1::TensorType type;
    int from_device = -1, to_device = -1, from_local = 0, to_local = 0;
    std::shared_ptr<WorkerClient> from, to;
  };
  absl::StatusOr<Move> PlanMove(const ArrayRecord& rec, uint64_t handle, int to_device)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for the source to be ready, then relays it into the temporary handle.
  absl::Status RunMove(const std::string& session, const Move& m) ABSL_LOCKS_EXCLUDED(mu_);
  // What differs between `graph` and the nearest cached executable.
  std::string ExplainCacheMiss(const v1::Graph& graph, const std::vector<int>& donated) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the arrays and queues frees on their devices, in step order.
  // A sequenced free to send once mu_ is released: no RPC, callback or
  // stream teardown happens under mu_ (a step stream's teardown runs
  // callbacks that take it).
  struct PendingFree {
    std::shared_ptr<WorkerClient> client;
    v1::FreeRequest request;
    int device = 0;  // global id
  };
  // Retires `handles` and returns the frees to send (SendFrees).
  [[nodiscard]] std::vector<PendingFree> FreeArraysLocked(const std::vector<uint64_t>& handles)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendFrees(std::vector<PendingFree> frees) ABSL_LOCKS_EXCLUDED(mu_);
  // Asks a worker for figures that include every step and free sequenced on
  // its devices so far.
  v1::WorkerStatsRequest StatsRequestLocked(const WorkerRecord& w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `epoch`: the collective epoch the step ran under.
  void OnStepDone(const std::string& session, const std::vector<uint64_t>& outputs, int64_t epoch,
                  absl::StatusOr<v1::RunResponse> result);
  std::string CollectiveEpochLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Steps to `worker_id` were lost in transit: its devices' numbering starts
  // over in a new queue epoch, so the worker never waits on a gap.
  void RestartQueues(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Empty frees that open the new queue epochs RestartQueues began.
  std::vector<PendingFree> OpenersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool NotPending(const std::vector<uint64_t>& handles) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks (releasing mu_) until none of `handles` is pending, or `timeout`.
  bool AwaitNotPending(const std::vector<uint64_t>& handles, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const std::shared_ptr<spdlog::logger> log_;
  // Random per start: collective groups of an earlier coordinator are never reused.
  const uint64_t incarnation_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, WorkerRecord> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<DeviceRecord> devices_ ABSL_GUARDED_BY(mu_);  // by global id
  absl::flat_hash_map<uint64_t, ArrayRecord> arrays_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, SessionRecord> sessions_ ABSL_GUARDED_BY(mu_);
  // Node-based: Compile and Execute keep pointers to records after unlocking.
  absl::node_hash_map<std::string, ExecutableRecord> executables_ ABSL_GUARDED_BY(mu_);
  int64_t next_worker_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_execution_ ABSL_GUARDED_BY(mu_) = 0;
  // Bumped when a step reports a broken collective group; steps sent after
  // that meet in fresh groups (RunRequest.collective_epoch).
  int64_t collective_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t compiles_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t cache_hits_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t executions_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread monitor_;
};

}  // namespace tessel::server
