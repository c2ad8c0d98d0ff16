#include "worker/collectives/gloo_endpoint.h"

#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace tessel::worker {

absl::Status FromGlooException(const std::exception& e, bool gloo_error,
                               absl::string_view context) {
  const std::string lower = absl::AsciiStrToLower(e.what());
  const std::string message = absl::StrCat(context, ": ", e.what());
  if (absl::StrContains(lower, "timeout") || absl::StrContains(lower, "timed out") ||
      absl::StrContains(lower, "deadline")) {
    return absl::DeadlineExceededError(message);
  }
  if (gloo_error) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

absl::StatusOr<std::shared_ptr<gloo::transport::Device>> GlooEndpoint::Device() const {
  absl::MutexLock l(&mu_);
  if (device_ == nullptr) {
    TESSEL_ASSIGN_OR_RETURN(device_, Open());
  }
  return device_;
}

bool GlooEndpoint::opened() const {
  absl::MutexLock l(&mu_);
  return device_ != nullptr;
}

std::string GlooEndpoint::Opening() const {
  return absl::StrCat("collectives: opening a Gloo TCP device on '", attr_.hostname, "'");
}

absl::StatusOr<std::shared_ptr<gloo::transport::Device>> GlooEndpoint::Open() const {
  TESSEL_RETURN_IF_ERROR(Resolvable());
  std::shared_ptr<gloo::transport::Device> opened;
  TESSEL_RETURN_IF_ERROR(
      CatchGloo(Opening(), [&] { opened = gloo::transport::tcp::CreateDevice(attr_); }));
  return opened;
}

absl::Status GlooEndpoint::Resolvable() const {
  addrinfo hints{};
  hints.ai_family = attr_.ai_family;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rv = getaddrinfo(attr_.hostname.c_str(), nullptr, &hints, &found);
  if (rv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(Opening(), ": the host name does not resolve: ", gai_strerror(rv)));
  }
  freeaddrinfo(found);
  return absl::OkStatus();
}

bool KeyIsSet(gloo::rendezvous::Store& store, const std::string& key) {
  try {
    store.wait({key}, std::chrono::milliseconds(1));
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

void WatchfulStore::wait(const std::vector<std::string>& keys,
                         const std::chrono::milliseconds& timeout) {
  using Clock = std::chrono::steady_clock;
  // At most the join's own timeout, whatever the caller asks (Gloo's
  // PrefixStore asks for its 30 s default).
  const Clock::time_point deadline =
      Clock::now() + (timeout.count() > 0 ? std::min(timeout, timeout_) : timeout_);
  for (const std::string& key : keys) {
    while (true) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      bool present = false;
      try {
        inner_.wait({key}, std::clamp(left, std::chrono::milliseconds(1), kSlice));
        present = true;
      } catch (const std::exception&) {
        if (Clock::now() >= deadline) throw;  // the store's own words: which key, how long
      }
      if (present) break;
      if (KeyIsSet(inner_, abandoned_key_)) {
        throw gloo::IoException(
            "a peer gave up on this group while this worker was joining it; the group starts "
            "over");
      }
    }
  }
}

}  // namespace tessel::worker
