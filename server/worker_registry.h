// WorkerRegistry: the workers and their devices as the coordinator sees
// them: where each global device lives, whether its worker is alive, and the
// step queue of each device (its queue epoch and next sequence number).
//
// Thread-safety: every method takes the registry's own lock and returns with
// it released; nothing under it calls out (no RPC, no callback, no client
// destruction). Lock order: a caller may hold ArrayRegistry's lock when it
// calls in here (every sequence number is handed out under that lock, so a
// device's steps and frees are numbered in the order the arrays changed);
// never the other way round.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/worker_client.h"
#include "spdlog/logger.h"
#include "tessel/v1/admin.pb.h"
#include "tessel/v1/session.pb.h"

namespace tessel::server {

// A sequenced free, to send once every lock is released.
struct PendingFree {
  std::shared_ptr<WorkerClient> client;
  v1::FreeRequest request;
  int device = 0;  // global id
};

// Where a global device lives.
struct DeviceRoute {
  int device = 0;  // global id
  int local_index = 0;
  std::string worker_id, address;
  bool alive = false;
  std::shared_ptr<WorkerClient> client;
  bool cordoned = false;
};

// Sequence numbers reserved on one device for one step's messages.
struct QueueSlot {
  std::shared_ptr<WorkerClient> client;
  int local_index = 0;
  uint64_t first_seq = 0;  // this and the next `count - 1`
  uint64_t queue_epoch = 0;
  bool needs_load =
      false;  // the executable Reserve was given goes to this worker for the first time
  uint64_t load_generation = 0;  // with needs_load: the number of that load
};

// Which worker's devices to ask for memory figures, with the request that
// covers every step sequenced on them so far.
struct StatsTarget {
  std::string worker_id;
  std::vector<int> devices;  // global ids, by local index
  std::shared_ptr<WorkerClient> client;
  v1::WorkerStatsRequest request;
};

// A client's authority to read or write one buffer on the worker holding
// it directly (WorkerRegistry::Sign).
struct WorkerTicket {
  std::string address;  // where clients reach the worker
  std::string ticket;   // FetchShardRequest.ticket, PutShardRequest.Header.ticket
};

// ResolvePlacement over a snapshot of the routes (WorkerRegistry::Routes).
absl::StatusOr<std::vector<int>> ResolvePlacement(const std::vector<DeviceRoute>& routes,
                                                  const v1::Placement& p);

class WorkerRegistry {
 public:
  // Worker ids are "w<n><id_suffix>": the coordinator passes its incarnation,
  // so an id is never reused by a restarted coordinator (a worker still
  // heartbeating under an old id is told it is unknown, and registers again).
  explicit WorkerRegistry(std::shared_ptr<spdlog::logger> log, std::string id_suffix = "")
      : log_(std::move(log)), id_suffix_(std::move(id_suffix)) {}

  // INVALID_ARGUMENT / FAILED_PRECONDITION naming the worker's address and
  // what is wrong with its registration.
  static absl::Status Validate(const v1::RegisterWorkerRequest& req);
  // Adds a validated worker reached through `client`; its devices take the
  // next global ids and start in `queue_epoch` (nonzero, new).
  v1::RegisterWorkerResponse Register(const v1::RegisterWorkerRequest& req,
                                      std::shared_ptr<WorkerClient> client,
                                      absl::Duration heartbeat_interval, uint64_t queue_epoch);
  // False for an unknown or dead worker (it must register again);
  // PERMISSION_DENIED when `secret` is not the one it registered with.
  absl::StatusOr<bool> Heartbeat(const std::string& worker_id, const std::string& secret,
                                 absl::Time now);
  // OK when `worker_id` is live, registered with `secret`, and holds one of
  // `devices` (global ids); PERMISSION_DENIED saying which is not so.
  absl::Status CheckMember(const std::string& worker_id, const std::string& secret,
                           const std::vector<int>& devices) const;

  struct Expired {
    std::string id, address;
    std::vector<int> devices;
    std::shared_ptr<WorkerClient> client;
    absl::Duration silent;
    std::string name;
  };
  // Marks dead every live worker silent for `timeout` or longer.
  std::vector<Expired> ExpireSilent(absl::Time now, absl::Duration timeout);
  // A worker registering as `req` replaces these live ones, now marked dead:
  // those of its name with another incarnation (it restarted), and those at
  // its address under another name (the address is its now).
  std::vector<Expired> Supersede(const v1::RegisterWorkerRequest& req, absl::Time now);

  // Cordons (or lifts the cordon of) `worker_id`; returns its devices.
  // NOT_FOUND naming an unknown worker.
  absl::StatusOr<std::vector<int>> SetCordoned(const std::string& worker_id, bool cordoned);

  // Steps to `worker_id` were lost in transit: its devices' numbering starts
  // over at 0 in a new queue epoch, to be opened by TakeOpeners (or by the
  // next step). False when the worker is unknown, dead or closed.
  bool RestartQueues(const std::string& worker_id, uint64_t new_epoch);
  // An empty free for each device whose new queue epoch no step opened yet:
  // what waits on the worker behind the lost steps fails now.
  std::vector<PendingFree> TakeOpeners();

  int num_devices() const;
  // UNAVAILABLE naming the first of `devices` on a dead worker.
  absl::Status CheckAlive(const std::vector<int>& devices) const;
  // INVALID_ARGUMENT for a device that does not exist, UNAVAILABLE for a
  // dead one; every live device for a replicated placement.
  absl::StatusOr<std::vector<int>> ResolvePlacement(const v1::Placement& p) const;
  // Every device by global id.
  std::vector<DeviceRoute> Routes() const;
  // A ticket for `grant` (ReadGrant, WriteGrant) on the worker holding
  // global device `device`, until `expiry`, signed with the worker's secret;
  // UNAVAILABLE when the worker is dead.
  absl::StatusOr<WorkerTicket> Sign(int device, absl::string_view grant, absl::Time expiry) const;
  // OK when `receipt` is the worker's (the one holding global device
  // `device`) signature for `grant` (WrittenGrant), unexpired at `now`;
  // PERMISSION_DENIED when not, UNAVAILABLE when the worker is dead.
  absl::Status CheckReceipt(int device, absl::string_view grant, absl::string_view receipt,
                            absl::Time now) const;

  // Reserves `counts[i]` consecutive sequence numbers on `devices[i]`, all
  // together: no other reservation interleaves with this one on any of
  // them. A dead device's slot has no client.
  // With `executable`, each slot also says whether its worker must load it
  // first (marked loaded from then on; ForgetLoaded if the load fails).
  std::vector<QueueSlot> Reserve(const std::vector<int>& devices, const std::vector<int>& counts,
                                 const std::string* executable = nullptr);
  // Sequences `frees` (by global device; device and seq are filled in) and
  // drops those for dead workers.
  std::vector<PendingFree> SequenceFrees(absl::flat_hash_map<int, v1::FreeRequest> frees);
  // Every live worker that loaded `executable` drops it from each of its
  // devices after the steps already numbered there (sequenced frees that
  // carry the unload), and is marked as not holding it.
  std::vector<PendingFree> SequenceUnloads(const std::string& executable);

  // A load failed: the next step loads again.
  void ForgetLoaded(const WorkerClient* client, const std::string& executable);

  std::vector<StatsTarget> LiveStatsTargets() const;
  // Workers in the order of their devices, with `ms_since_heartbeat` at `now`.
  void Describe(absl::Time now, v1::GetClusterResponse* resp) const;

  // Shutting down: the clients, released from the registry. Later calls
  // find no clients.
  std::vector<std::shared_ptr<WorkerClient>> TakeClients();

 private:
  struct WorkerRecord {
    std::string id;
    std::string address;
    std::string client_address;  // RegisterWorkerRequest.client_address, else address
    std::string secret;          // RegisterWorkerRequest.worker_secret
    std::string name, incarnation;
    std::vector<int> devices;  // global ids
    absl::Time last_heartbeat;
    bool cordoned = false;
    bool alive = true;
    std::shared_ptr<WorkerClient> client;
    absl::flat_hash_map<std::string, uint64_t>
        loaded;                // executable ids, with the generation of their load
    bool open_queues = false;  // a new queue epoch awaits its first message
  };
  struct DeviceRecord {
    std::string worker_id;
    int local_index = 0;
    uint64_t next_seq = 0;
    std::string kind = "cpu";
    uint64_t queue_epoch = 0;  // of the worker's registration; sent with every step and free
  };
  v1::WorkerStatsRequest StatsRequestLocked(const WorkerRecord& w) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status DeadLocked(int device) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<spdlog::logger> log_;

  const std::string id_suffix_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, WorkerRecord> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<DeviceRecord> devices_ ABSL_GUARDED_BY(mu_);  // by global id
  int64_t next_worker_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t load_generation_ ABSL_GUARDED_BY(mu_) = 0;  // numbers every load of a program
};

}  // namespace tessel::server
