// LocalCluster: a coordinator and N workers started as real processes on
// 127.0.0.1, for the demo, the CLI's `tessel local`, tests and benchmarks.
// The destructor stops every process it started (SIGTERM, then SIGKILL).
// Children also get SIGTERM if this process dies. Workers register in order,
// so worker i owns global devices [i*D, (i+1)*D).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tessel {

class LocalCluster {
 public:
  struct Options {
    int workers = 2;
    int devices_per_worker = 1;
    int port = 0;                 // coordinator port; 0 picks a free one
    std::string binary_dir;       // Default: $TESSEL_BIN_DIR, else this executable's directory
    std::string log_dir;          // Default: a fresh directory under /tmp, removed at
                                  // destruction unless $TESSEL_KEEP_LOGS is set
    bool inherit_output = false;  // children log to this process's stdout/stderr
    std::vector<std::string> worker_flags;       // extra flags for every worker
    std::vector<std::string> coordinator_flags;  // extra flags for the coordinator
    int heartbeat_timeout_ms = 2000;
    // For a cluster started with security flags: the admin token and CA the
    // cluster's own calls (waiting for workers) present.
    std::string token, tls_ca_file;
  };
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(Options options);
  ~LocalCluster();

  const std::string& address() const { return address_; }
  const std::string& log_dir() const { return log_dir_; }
  int num_workers() const { return worker_pids_.size(); }
  // Sends `sig` to worker `i` (tests: SIGKILL to lose a worker, SIGSTOP and
  // SIGCONT to pause one) and returns once it has taken effect.
  absl::Status SignalWorker(int i, int sig);
  // Stops everything now; idempotent.
  void Stop();

 private:
  LocalCluster() = default;
  std::string address_;
  std::string log_dir_;
  bool owns_log_dir_ = false;
  pid_t coordinator_pid_ = -1;
  std::vector<pid_t> worker_pids_;
};

}  // namespace tessel
