#include "core/process_tuning.h"

#include <systemd/sd-daemon.h>

#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "core/version.h"

#include <malloc.h>

namespace tessel {

void TuneAllocatorForStreaming() {
  // 64 MiB: messages and chunk buffers come from the heap; only truly large
  // allocations (device buffers use their own pool) are mapped.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  mallopt(M_TOP_PAD, 16 << 20);
}

void SkipMutexCycleDetection() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

}  // namespace tessel

#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>

namespace tessel {
namespace {
sigset_t TerminationSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}
}  // namespace

void BlockTerminationSignals() {
  sigset_t set = TerminationSet();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // A peer that closed its end makes a write fail with EPIPE, which every
  // caller handles; the default SIGPIPE would kill the daemon instead (Gloo
  // writes to its pairs without MSG_NOSIGNAL).
  signal(SIGPIPE, SIG_IGN);
}

int WaitForTerminationSignal() {
  sigset_t set = TerminationSet();
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

bool StopWithParent(int expected_parent) {
  if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) return false;
  return getppid() == expected_parent;
}

}  // namespace tessel

namespace tessel {

void NotifyReady(const std::string& status) {
  const std::string message = "READY=1\nSTATUS=" + status;
  sd_notify(0, message.c_str());
}

void NotifyStopping() { sd_notify(0, "STOPPING=1"); }

}  // namespace tessel

#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

namespace tessel {
namespace {

// A limit file's value: a byte count, or nothing for "max" / unlimited
// (v1 writes "unlimited" as a page-rounded 2^63).
bool ReadLimit(const std::string& path, int64_t* bytes) {
  std::ifstream f(path);
  std::string v;
  if (!(f >> v) || v == "max") return false;
  try {
    const long long n = std::stoll(v);
    if (n <= 0 || n >= (int64_t{1} << 60)) return false;
    *bytes = n;
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace

MemoryBudget ProcessMemoryBudget(const std::string& cgroup_root,
                                 const std::string& proc_self_cgroup) {
  MemoryBudget b;
  b.bytes = int64_t(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  b.source = "physical memory";
  auto cap = [&](const std::string& file) {
    int64_t n = 0;
    if (ReadLimit(file, &n) && n < b.bytes) {
      b.bytes = n;
      b.source = file;
    }
  };
  // Each cgroup from this process's up to the root of what is mounted. A
  // cgroup namespace (a container) mounts its own cgroup as the root while
  // /proc/self/cgroup may still name the full path: the path is then
  // matched by its longest tail that exists below the mount.
  auto walk = [&](const std::string& mount, std::string path, const std::string& name) {
    while (path.size() > 1 && !std::filesystem::is_directory(mount + path)) {
      const size_t next = path.find('/', 1);
      path = next == std::string::npos ? "/" : path.substr(next);
    }
    while (true) {
      const std::string dir = path == "/" || path.empty() ? mount : mount + path;
      cap(dir + "/" + name);
      if (path == "/" || path.empty()) break;
      path = path.substr(0, path.rfind('/'));
      if (path.empty()) path = "/";
    }
  };
  std::ifstream f(proc_self_cgroup);
  std::string line;
  while (std::getline(f, line)) {
    // hierarchy-id:controllers:path
    const size_t a = line.find(':'), c = line.find(':', a + 1);
    if (a == std::string::npos || c == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, c - a - 1), path = line.substr(c + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {
      walk(cgroup_root, path, "memory.max");               // v2
      walk(cgroup_root + "/unified", path, "memory.max");  // hybrid layout
    } else {
      std::stringstream list(controllers);
      std::string each;
      while (std::getline(list, each, ',')) {
        if (each == "memory") walk(cgroup_root + "/memory", path, "memory.limit_in_bytes");
      }
    }
  }
  return b;
}

}  // namespace tessel

namespace tessel {

void WritePortFile(const std::string& path, int port) {
  if (path.empty()) return;
  std::ofstream(path + ".tmp") << port << "\n";
  std::rename((path + ".tmp").c_str(), path.c_str());
}

void SetDaemonFlagsUsage(const std::string& main_file) {
  absl::FlagsUsageConfig config;
  // The daemon's own flags and the transport-security and metrics ones they
  // share.
  config.contains_help_flags = [main_file](absl::string_view path) {
    return absl::StrContains(path, main_file) || absl::StrContains(path, "core/security") ||
           absl::StrContains(path, "core/metrics");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.version_string = [] { return absl::StrCat("Tessel ", kTesselVersion, "\n"); };
  absl::SetFlagsUsageConfig(config);
}

}  // namespace tessel
