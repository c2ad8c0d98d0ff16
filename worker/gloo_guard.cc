#include "worker/gloo_guard.h"

#include <dlfcn.h>
#include <gloo/transport/tcp/address.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>

namespace tessel::worker {
namespace {

std::atomic<int64_t> resets{0};

// The guard's logger, shared with the event-loop threads that report.
struct GuardLogger {
  std::mutex mu;
  std::shared_ptr<spdlog::logger> log;
};
GuardLogger& Reporter() {
  static auto* reporter = new GuardLogger();  // never destroyed: loop threads may outlive statics
  return *reporter;
}

void ReportReset(int fd, int err) {
  resets.fetch_add(1, std::memory_order_relaxed);
  std::shared_ptr<spdlog::logger> log;
  {
    std::lock_guard<std::mutex> lock(Reporter().mu);
    log = Reporter().log;
  }
  if (log == nullptr) return;
  std::string self = "an unknown address";
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0)
    self = gloo::transport::tcp::Address(ss).str();
  log->warn(
      "Gloo connection at {} was reset by its peer before it was set up (getpeername: {}); its "
      "pair fails "
      "on first use",
      self, std::strerror(err));
}

}  // namespace

bool GlooPeerNameGuardActive() {
  void* const resolved = dlsym(RTLD_DEFAULT, "_ZN4gloo9transport3tcp7Address12fromPeerNameEi");
  return resolved == reinterpret_cast<void*>(&gloo::transport::tcp::Address::fromPeerName);
}

void SetGlooGuardLogger(std::shared_ptr<spdlog::logger> log) {
  std::lock_guard<std::mutex> lock(Reporter().mu);
  Reporter().log = std::move(log);
}

int64_t GlooConnectionsResetDuringSetup() { return resets.load(std::memory_order_relaxed); }

}  // namespace tessel::worker

// Replaces libgloo's definition (see gloo_guard.h). Gloo calls it only from
// Pair::handleConnected, on its event-loop thread, with a socket it has just
// accepted or connected. An empty Address on failure is what upstream's
// safePeerName returns; Gloo uses the peer address only in messages.
gloo::transport::tcp::Address gloo::transport::tcp::Address::fromPeerName(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) == -1) {
    tessel::worker::ReportReset(fd, errno);
    return Address();
  }
  return Address(ss);
}
