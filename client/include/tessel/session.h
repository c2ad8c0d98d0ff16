// A client's connection to a Tessel cluster. A Session owns the arrays it
// creates; closing it (destruction) frees them on the devices.
//
// Thread-safety: a Session may be used from several threads at once.
// Arrays and Executables are plain handles: copying one does not copy data.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tessel/graph.h"
#include "tessel/sharding.h"
#include "tessel/types.h"

namespace tessel {

// Where arrays live and steps run: one device by global id, a full copy on
// every live device, or blocks over a mesh's devices (Put only; a
// partitioned executable runs on its own mesh).
struct Placement {
  int device = 0;
  bool replicated = false;
  std::optional<NamedSharding> sharded;
  static Placement Device(int d) { return {d, false, std::nullopt}; }
  static Placement Replicated() { return {0, true, std::nullopt}; }
  static Placement Sharded(Mesh mesh, Sharding spec) {
    return {0, false, NamedSharding{std::move(mesh), std::move(spec)}};
  }
};

// Transfer guard levels, per direction (as in JAX's transfer guard).
// Implicit transfers are those not asked for by name: host values passed as
// arguments, arguments moved between devices, fetches marked implicit.
// kAllow and kLog let them happen (kLog also logs on the coordinator);
// kDisallow fails them; the *Explicit levels also cover Put and Fetch.
enum class TransferLevel { kUnset, kAllow, kLog, kDisallow, kLogExplicit, kDisallowExplicit };

struct TransferGuard {
  TransferLevel host_to_device = TransferLevel::kUnset;
  TransferLevel device_to_host = TransferLevel::kUnset;
  TransferLevel device_to_device = TransferLevel::kUnset;
  static TransferGuard All(TransferLevel l) { return {l, l, l}; }
};

struct SessionOptions {
  TransferGuard transfer_guard;    // Default: allow everything
  bool strict_donation = false;    // a donation that cannot reuse its buffer is an error
  bool forbid_compiles = false;    // Compile answers from the cache only
  int64_t memory_quota_bytes = 0;  // live array bytes over all devices; 0: none
};

// Where a donated parameter's buffer goes (Compile's plan, or a receipt).
struct DonationReceipt {
  int argument = 0;
  uint64_t handle = 0;  // the donated array (receipts only)
  bool reused = false;  // its buffer becomes `output`, in place
  int output = -1;
  uint64_t output_handle = 0;
  std::string reason;  // why not, when not reused
};

struct CompileOptions {
  std::vector<int> donate;       // parameters every execution donates
  bool strict_donation = false;  // or the session's option
  // Partitioned compile: the graph is partitioned over `mesh`. Each
  // parameter has a sharding (none listed: all replicated); each output may
  // have one (none listed, or Sharding::Unspecified(): propagation chooses).
  std::optional<Mesh> mesh;
  std::vector<Sharding> parameter_shardings, output_shardings;
};

// A collective in a partitioned plan, and why it is there.
struct PlannedCollective {
  std::string value;  // the plan value it produces
  std::string op;     // "all_reduce", "all_gather", ...
  std::vector<std::string> axes;
  int64_t bytes_per_device = 0;  // received by each device
  std::string reason;
};

class Executable {
 public:
  const std::string& id() const { return id_; }
  bool cache_hit() const { return cache_hit_; }
  const std::vector<ArrayType>& parameter_types() const { return parameter_types_; }
  const std::vector<ArrayType>& output_types() const { return output_types_; }
  const std::string& plan() const { return plan_; }
  const std::vector<std::string>& diagnostics() const { return diagnostics_; }
  int64_t estimated_bytes() const { return estimated_bytes_; }
  const std::vector<int>& donated_parameters() const { return donated_; }
  const std::vector<DonationReceipt>& aliases() const { return aliases_; }
  // On a miss: what differs from the nearest executable in the cache.
  const std::string& cache_miss_reason() const { return cache_miss_reason_; }
  const std::string& name() const { return name_; }
  // Partitioned executables: the mesh, the layouts every execution takes and
  // gives, and every collective of the plan (explicit ones included).
  bool partitioned() const { return mesh_.has_value(); }
  const std::optional<Mesh>& mesh() const { return mesh_; }
  const std::vector<Sharding>& parameter_shardings() const { return parameter_shardings_; }
  const std::vector<Sharding>& output_shardings() const { return output_shardings_; }
  const std::vector<PlannedCollective>& collectives() const { return collectives_; }

 private:
  friend class Session;
  std::string id_, name_;
  std::optional<Mesh> mesh_;
  std::vector<Sharding> parameter_shardings_, output_shardings_;
  std::vector<PlannedCollective> collectives_;
  bool cache_hit_ = false;
  std::vector<int> donated_;
  std::vector<DonationReceipt> aliases_;
  std::string cache_miss_reason_;
  std::vector<ArrayType> parameter_types_, output_types_;
  std::string plan_;
  std::vector<std::string> diagnostics_;
  int64_t estimated_bytes_ = 0;
};

// A checkpoint save whose snapshots are taken (Session::SaveCheckpoint).
struct PendingCheckpoint {
  std::string checkpoint;  // the coordinator's id of the save
  std::string path;
  int64_t bytes = 0;  // each distinct block once
  int chunks = 0;
};
// One array to restore: its name in the checkpoint, its type and placement.
struct CheckpointTarget {
  std::string name;
  ArrayType type;
  Placement placement;
};

// A handle to an array that lives on the devices.
class Array {
 public:
  Array() = default;
  uint64_t handle() const { return handle_; }
  const ArrayType& type() const { return type_; }

 private:
  friend class Session;
  Array(uint64_t h, ArrayType t) : handle_(h), type_(std::move(t)) {}
  uint64_t handle_ = 0;
  ArrayType type_;
};

enum class ArrayState { kPending, kReady, kDeleted, kLost, kError, kDonated };

struct ArrayInfo {
  ArrayType type;
  ArrayState state = ArrayState::kPending;
  std::vector<int> devices;
  int64_t bytes_per_device = 0;           // the largest block
  std::vector<int64_t> device_bytes;      // bytes on each of `devices`
  std::optional<NamedSharding> sharding;  // set for a sharded array
  std::string error;                      // or, once donated or deleted, what became of it
  int64_t producer_execution = 0;
  std::string producer;  // the executable's graph name, or "put"
};

struct ExecuteReceipt {
  int64_t execution_id = 0;
  std::vector<DonationReceipt> donations;  // one per donated argument
};

struct ExecuteOptions {
  Placement placement;      // Default: device 0
  bool wait = false;        // return once the step has completed
  std::vector<int> donate;  // arguments donated by this call (beside the executable's)
  bool strict_donation = false;
  std::optional<TransferGuard> transfer_guard;  // overrides the session's for this call
  // When set, Execute waits for the coordinator to accept the call (one round
  // trip) and fills in the receipt. Otherwise calls are pipelined.
  ExecuteReceipt* receipt = nullptr;
};

// How a Put or Fetch moved the array's bytes.
struct TransferReceipt {
  bool direct = false;  // straight between this client and the workers holding its blocks
  int blocks = 0;       // how many (block, worker) streams moved them, in parallel
  // A direct transfer was granted but failed (say, a worker this client
  // cannot reach): why; the bytes then went through the coordinator.
  std::string relayed_because;
};

struct TransferOptions {
  bool implicit = false;                        // not asked for by name (e.g. printing an array)
  std::optional<TransferGuard> transfer_guard;  // overrides the session's for this call
  TransferReceipt* receipt = nullptr;           // Put and Fetch fill it in
  // Whether to move the bytes straight between this client and the workers;
  // default: as ConnectOptions says (direct_transfers, direct_min_bytes).
  std::optional<bool> direct;
};

// What a Reshard did: bytes that crossed devices (counted device to
// device), bytes copied within a device, and one line per piece that crossed.
struct ReshardReceipt {
  int64_t execution_id = 0;
  int64_t bytes_moved = 0, bytes_copied = 0;
  std::vector<std::string> pieces;
};

struct DeviceMemory {
  int device = 0;
  int64_t bytes_in_use = 0, peak_bytes_in_use = 0, num_buffers = 0, bytes_cached = 0,
          bytes_limit = 0;
  int64_t largest_free_block = 0;
};

struct DeviceTransfers {
  int device = 0;
  int64_t host_to_device = 0, device_to_host = 0, device_to_device = 0;
};

struct LiveArray {
  uint64_t handle = 0;
  ArrayType type;
  ArrayState state = ArrayState::kPending;
  int64_t bytes = 0;  // over all its devices
  std::vector<int> devices;
  int64_t producer_execution = 0;
  std::string producer;
};

struct SessionStats {
  int64_t live_arrays = 0, live_bytes = 0, compiles = 0, compile_cache_hits = 0, executions = 0;
  int64_t bytes_host_to_device = 0, bytes_device_to_host = 0, bytes_device_to_device = 0;
  std::vector<DeviceMemory> devices;
  std::vector<DeviceTransfers> device_transfers;  // this session's
  // This session's compile requests: hits, misses, and misses compiled.
  int64_t session_cache_hits = 0, session_cache_misses = 0, session_compiles = 0;
  int64_t donations = 0, donations_reused = 0;  // per device a step ran on
  int64_t memory_quota_bytes = 0;
  std::vector<LiveArray> arrays;  // Stats(true) only
  // `devices` and the compile figures count only this session's tenant's
  // (a token without admin rights); otherwise each device's own figures.
  bool tenant_view = false;
};

// A live device as any tenant may see it, and what this session's tenant
// holds there.
struct DeviceView {
  int id = 0;  // global id
  std::string kind, worker_id;
  int local_index = 0;
  int64_t bytes_in_use = 0, num_buffers = 0;  // this session's tenant's arrays
};

struct WorkerStatus {
  std::string id, address;
  bool alive = false;
  int64_t ms_since_heartbeat = 0;
  std::vector<int> devices;               // global ids
  std::vector<std::string> device_kinds;  // "cpu" or "cuda", per device
  std::vector<DeviceMemory> memory;       // when asked for
};

struct ClusterStatus {
  std::vector<WorkerStatus> workers;
  int64_t sessions = 0, live_arrays = 0, compiles = 0, compile_cache_hits = 0, executions = 0;
  int num_devices() const;
};

// A buffer a worker holds that no array or open put owns (Admin.Reconcile).
struct UnownedBuffer {
  int device = 0;  // global id
  uint64_t handle = 0;
  int64_t bytes = 0;
};
struct Reconciliation {
  std::vector<UnownedBuffer> unowned;
  int64_t freed = 0;  // of those, found unowned the time before too: freed now
  int64_t buffers_checked = 0;
};

struct ConnectOptions {
  std::string client_name = "tessel-sdk";
  SessionOptions session;
  int64_t chunk_bytes = 1 << 20;  // Default: 1 MiB per streamed message
  int connect_timeout_ms = 10000;
  // Bearer token for a coordinator with --auth_tokens_file; empty: the
  // environment's $TESSEL_TOKEN, if set.
  std::string token;
  // TLS: a CA bundle (PEM file) verifying the coordinator turns TLS on;
  // empty: the environment's $TESSEL_TLS_CA, if set. A client certificate
  // and key are optional. `tls_server_name` overrides the name checked
  // against the coordinator's certificate (default: the address's host).
  std::string tls_ca_file, tls_cert_file, tls_key_file, tls_server_name;
  // Put and Fetch move an array's blocks straight between this client and
  // the workers holding them, in parallel, when the coordinator grants it
  // (falling back to the coordinator's relay when a worker cannot be
  // reached); false: always through the coordinator.
  bool direct_transfers = true;
  // Smaller arrays go through the coordinator: one round trip, not two.
  int64_t direct_min_bytes = 1 << 20;
  // A worker not connected within this long is taken as unreachable (and
  // not tried again for 30 s, doubling while it stays so).
  int direct_connect_timeout_ms = 2000;
};

class Session {
 public:
  static absl::StatusOr<std::unique_ptr<Session>> Connect(const std::string& address,
                                                          ConnectOptions options = {});
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const;
  int protocol_version() const;

  const SessionOptions& options() const;
  absl::Status SetOptions(const SessionOptions& options);

  absl::StatusOr<Executable> Compile(const Graph& graph, const CompileOptions& options = {});
  absl::StatusOr<Array> Put(const HostArray& array, Placement placement = {},
                            const TransferOptions& transfer = {});
  // Returns at once with the output handles (unless options.wait or
  // options.receipt): calls are pipelined over one stream and accepted in
  // order. Errors of the call or of the step surface when an output is
  // awaited or fetched. Donated arguments are invalid once the call is sent.
  absl::StatusOr<std::vector<Array>> Execute(const Executable& exe, absl::Span<const Array> args,
                                             ExecuteOptions options = {});
  // OK once every array is ready; the first array's error otherwise.
  absl::Status Await(absl::Span<const Array> arrays);
  absl::StatusOr<HostArray> Fetch(const Array& array, const TransferOptions& transfer = {});
  absl::Status Delete(absl::Span<const Array> arrays);
  // A copy of `array` on `placement` (another mesh or sharding, one device,
  // or every device): its blocks move worker to worker, never through the
  // coordinator or this client; `array` stays. Returns once the coordinator
  // accepted the copy; its errors surface where it is awaited or fetched.
  absl::StatusOr<Array> Reshard(const Array& array, const Placement& placement,
                                const TransferOptions& transfer = {},
                                ReshardReceipt* receipt = nullptr);
  absl::StatusOr<ArrayInfo> Info(const Array& array);
  // The executable's per-device program as a Graphviz digraph (DOT text).
  absl::StatusOr<std::string> PlanDot(const Executable& exe);

  // Checkpoints (docs/checkpoints.md): `arrays`, each under its name (a
  // directory of the checkpoint), saved by the workers that hold them as the
  // checkpoint `path` (absolute, on a volume every worker shares; it must
  // not exist). Returns once every device has snapshotted its blocks: the
  // arrays may be donated at once. CommitCheckpoint waits for the writes
  // and makes the checkpoint appear under its path.
  absl::StatusOr<PendingCheckpoint> SaveCheckpoint(
      const std::string& path, const std::vector<std::pair<std::string, Array>>& arrays,
      const std::string& metadata_json = "");
  absl::Status CommitCheckpoint(const PendingCheckpoint& save);
  // The named arrays of checkpoint `path`, each of its target's type and on
  // its placement (any mesh): each device reads the chunks its block
  // overlaps and checks their CRC32C.
  absl::StatusOr<std::vector<Array>> RestoreCheckpoint(const std::string& path,
                                                       const std::vector<CheckpointTarget>& arrays);
  // The entries of checkpoint directory `directory` that hold a commit
  // marker (checkpoints complete), by name.
  absl::StatusOr<std::vector<std::string>> ListCheckpoints(const std::string& directory);
  absl::Status RemoveCheckpoint(const std::string& path);
  // A CheckpointManager's hold on `directory` while this session lives (a
  // second is refused), or its release.
  absl::Status HoldCheckpoints(const std::string& directory, bool release = false);
  absl::StatusOr<SessionStats> Stats(bool with_arrays = false);
  // Admin.GetCluster: PERMISSION_DENIED for a token without admin rights,
  // which has Devices() instead.
  absl::StatusOr<ClusterStatus> Cluster(bool with_memory = false);
  absl::StatusOr<std::vector<DeviceView>> Devices();
  // Admin.Reconcile: every buffer the workers hold checked against the
  // coordinator's arrays (an admin token's call).
  absl::StatusOr<Reconciliation> Reconcile();

 private:
  class Impl;
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Asserts that a block of steps leaves memory as it found it:
//   auto check = MemoryCheck::Begin(session);
//   ... steps ...
//   absl::Status s = check->Verify();
// Verify is FAILED_PRECONDITION naming what grew: the session's new live
// arrays (with the execution that made them) and, per device, the bytes in
// use and the buffer count. Device figures are the whole device's: other
// sessions' allocations count too.
class MemoryCheck {
 public:
  static absl::StatusOr<MemoryCheck> Begin(Session& session);
  absl::Status Verify() const;

 private:
  MemoryCheck(Session* s, SessionStats before) : session_(s), before_(std::move(before)) {}
  Session* session_;
  SessionStats before_;
};

// Reads the coordinator address from `flag_value`, else $TESSEL_COORDINATOR.
absl::StatusOr<std::string> ResolveCoordinatorAddress(const std::string& flag_value);

}  // namespace tessel
