#include "core/process_tuning.h"

#include <systemd/sd-daemon.h>

#include <malloc.h>

namespace tessel {

void TuneAllocatorForStreaming() {
  // 64 MiB: messages and chunk buffers come from the heap; only truly large
  // allocations (device buffers use their own pool) are mapped.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  mallopt(M_TOP_PAD, 16 << 20);
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
