// Process-wide settings that every Tessel binary applies at start-up.
#pragma once

#include <cstdint>
#include <string>

namespace tessel {

// glibc maps and unmaps every malloc block >= 128 KiB by default, and trims
// the heap eagerly; for gRPC streams of 1 MiB messages that means a page fault
// per 4 KiB of payload (0.3-1.3 GB/s instead of ~3 GB/s on loopback). Raise
// both thresholds so message buffers are recycled from the heap instead.
// Safe to call more than once; call before starting gRPC.
void TuneAllocatorForStreaming();

// Abseil's Mutex records every acquisition in a process-wide lock graph to
// find lock-order cycles unless Abseil was built with NDEBUG, and Debian's is
// not: each lock pays for the bookkeeping. Lock order is fixed by design
// (written where the locks are declared), the clang thread-safety build
// checks it statically, and the unit tests run with the detection on; the
// binaries (daemons, CLI, bench, demo) skip it.
void SkipMutexCycleDetection();

}  // namespace tessel

namespace tessel {

// Blocks SIGINT and SIGTERM in the calling thread and every thread it
// starts afterwards, and ignores SIGPIPE (a peer gone is an error, not the
// end of the daemon); call first in main(). Then WaitForTerminationSignal()
// returns the signal number once one arrives.
void BlockTerminationSignals();
int WaitForTerminationSignal();

// Has the kernel send this process SIGTERM when its parent dies, so a daemon
// started by a client library (the Python SDK's local_cluster) stops with
// the program that started it, however that program ends. False if the
// parent is no longer `expected_parent` (it died before the call).
bool StopWithParent(int expected_parent);

}  // namespace tessel

namespace tessel {

// Tells the service manager (systemd, Type=notify) that the daemon is
// ready, with a one-line status; then, at shutdown, that it is stopping.
// No-ops outside a service manager (no $NOTIFY_SOCKET).
void NotifyReady(const std::string& status);
void NotifyStopping();

// --help lists the flags defined in the daemon's own source file (whose
// name contains `main_file`, e.g. "coordinator_main"), not only flags of files
// named after the program; --version prints Tessel's version.
void SetDaemonFlagsUsage(const std::string& main_file);

// Writes `port` to `path` (nothing when empty) through a rename, so a reader
// polling for the file never sees it half written.
void WritePortFile(const std::string& path, int port);

}  // namespace tessel

namespace tessel {

// The memory this process may use: physical memory, capped by the memory
// limit of its cgroup and every ancestor (cgroup v2 `memory.max`, or v1
// `memory.limit_in_bytes`), as a container runtime or a systemd unit's
// MemoryMax= sets it. `source` says where the figure came from.
// `cgroup_root` and `proc_self_cgroup` are there for tests.
struct MemoryBudget {
  int64_t bytes = 0;
  std::string source;
};
MemoryBudget ProcessMemoryBudget(const std::string& cgroup_root = "/sys/fs/cgroup",
                                 const std::string& proc_self_cgroup = "/proc/self/cgroup");

}  // namespace tessel
