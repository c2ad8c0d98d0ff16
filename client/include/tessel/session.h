// A client's connection to a Tessel cluster. A Session owns the arrays it
// creates; closing it (destruction) frees them on the devices.
//
// Thread-safety: a Session may be used from several threads at once.
// Arrays and Executables are plain handles: copying one does not copy data.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tessel/graph.h"
#include "tessel/types.h"

namespace tessel {

// Where arrays live and steps run: one device by global id, or a full copy
// on every live device.
struct Placement {
  int device = 0;
  bool replicated = false;
  static Placement Device(int d) { return {d, false}; }
  static Placement Replicated() { return {0, true}; }
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

 private:
  friend class Session;
  std::string id_;
  bool cache_hit_ = false;
  std::vector<ArrayType> parameter_types_, output_types_;
  std::string plan_;
  std::vector<std::string> diagnostics_;
  int64_t estimated_bytes_ = 0;
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

enum class ArrayState { kPending, kReady, kDeleted, kLost, kError };

struct ArrayInfo {
  ArrayType type;
  ArrayState state = ArrayState::kPending;
  std::vector<int> devices;
  int64_t bytes_per_device = 0;
  std::string error;
};

struct ExecuteOptions {
  Placement placement;  // Default: device 0
  bool wait = false;    // return once the step has completed
};

struct DeviceMemory {
  int device = 0;
  int64_t bytes_in_use = 0, peak_bytes_in_use = 0, num_buffers = 0, bytes_cached = 0, bytes_limit = 0;
};

struct SessionStats {
  int64_t live_arrays = 0, live_bytes = 0, compiles = 0, compile_cache_hits = 0, executions = 0;
  int64_t bytes_host_to_device = 0, bytes_device_to_host = 0;
  std::vector<DeviceMemory> devices;
};

struct WorkerStatus {
  std::string id, address;
  bool alive = false;
  int64_t ms_since_heartbeat = 0;
  std::vector<int> devices;        // global ids
  std::vector<DeviceMemory> memory;  // when asked for
};

struct ClusterStatus {
  std::vector<WorkerStatus> workers;
  int64_t sessions = 0, live_arrays = 0, compiles = 0, compile_cache_hits = 0, executions = 0;
  int num_devices() const;
};

struct ConnectOptions {
  std::string client_name = "tessel-sdk";
  int64_t chunk_bytes = 1 << 20;  // Default: 1 MiB per streamed message
  int connect_timeout_ms = 10000;
};

class Session {
 public:
  static absl::StatusOr<std::unique_ptr<Session>> Connect(const std::string& address, ConnectOptions options = {});
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const;
  int protocol_version() const;

  absl::StatusOr<Executable> Compile(const Graph& graph);
  absl::StatusOr<Array> Put(const HostArray& array, Placement placement = {});
  // Returns at once with the output handles (unless options.wait); errors
  // of the step surface when an output is awaited or fetched.
  absl::StatusOr<std::vector<Array>> Execute(const Executable& exe, absl::Span<const Array> args,
                                             ExecuteOptions options = {});
  // OK once every array is ready; the first array's error otherwise.
  absl::Status Await(absl::Span<const Array> arrays);
  absl::StatusOr<HostArray> Fetch(const Array& array);
  absl::Status Delete(absl::Span<const Array> arrays);
  absl::StatusOr<ArrayInfo> Info(const Array& array);
  absl::StatusOr<SessionStats> Stats();
  absl::StatusOr<ClusterStatus> Cluster(bool with_memory = false);

 private:
  class Impl;
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Reads the coordinator address from `flag_value`, else $TESSEL_COORDINATOR.
absl::StatusOr<std::string> ResolveCoordinatorAddress(const std::string& flag_value);

}  // namespace tessel
