// Gloo plumbing shared by the groups of one worker: how a Gloo exception
// becomes a status, the TCP device every group connects through, and the
// rendezvous store as a joining group sees it.
#pragma once

#include <gloo/common/error.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/device.h>
#include <gloo/transport/tcp/attr.h>

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace tessel::worker {

// Maps an exception thrown by Gloo to a status: timeouts (Gloo says
// "timeout" or "Timed out"; the coordinator's store says DEADLINE_EXCEEDED)
// are DEADLINE_EXCEEDED; IO errors and peers gone (`gloo_error`: a
// gloo::Exception) are UNAVAILABLE; anything else is INTERNAL. The message
// is "<context>: <what>".
absl::Status FromGlooException(const std::exception& e, bool gloo_error, absl::string_view context);

// Runs `f`, which calls Gloo, and returns what it threw as a status.
template <typename F>
absl::Status CatchGloo(absl::string_view context, F&& f) {
  try {
    f();
    return absl::OkStatus();
  } catch (const gloo::Exception& e) {
    return FromGlooException(e, true, context);
  } catch (const std::exception& e) {
    return FromGlooException(e, false, context);
  }
}

// The rendezvous store and one TCP device (its event loop and the
// connections' listening sockets) for every group of this worker. The
// device opens when the first group connects: an open device's event loop
// wakes every 10 ms (Gloo's epoll timeout), which a worker that runs no
// collective need not pay, and 64 idle workers sharing a machine's cores
// would. Thread-safe; gloo's device is too.
class GlooEndpoint {
 public:
  GlooEndpoint(std::shared_ptr<gloo::rendezvous::Store> store, gloo::transport::tcp::attr attr)
      : store_(std::move(store)), attr_(std::move(attr)) {}

  gloo::rendezvous::Store& store() const { return *store_; }

  // Opens a device and closes it again: the same checks (the hostname
  // resolves to an address of this machine) the first real one meets.
  absl::Status Probe() const { return Open().status(); }

  // The device, opened by the first call.
  absl::StatusOr<std::shared_ptr<gloo::transport::Device>> Device() const;

  bool opened() const;

 private:
  std::string Opening() const;
  absl::StatusOr<std::shared_ptr<gloo::transport::Device>> Open() const;
  // Gloo (Debian's 0.5) takes getaddrinfo's failure for success unless it
  // is -1, which it never is, and then walks an unset result list: a name
  // that does not resolve must never reach it.
  absl::Status Resolvable() const;

  const std::shared_ptr<gloo::rendezvous::Store> store_;
  const gloo::transport::tcp::attr attr_;
  mutable absl::Mutex mu_;
  mutable std::shared_ptr<gloo::transport::Device> device_ ABSL_GUARDED_BY(mu_);
};

// Whether `key` is set in `store` now (a 1 ms wait: stores only wait).
bool KeyIsSet(gloo::rendezvous::Store& store, const std::string& key);

// The rendezvous store as one group's join sees it: every wait is cut into
// short slices, and between them it looks for the group's "abandoned" key,
// so a worker joining a group never waits out the join timeout for a peer
// that has given up on it (and moved on to the group's next epoch). A wait
// never outlasts `timeout`, whatever its caller asks.
class WatchfulStore final : public gloo::rendezvous::Store {
 public:
  WatchfulStore(gloo::rendezvous::Store& inner, std::string abandoned_key,
                std::chrono::milliseconds timeout)
      : inner_(inner), abandoned_key_(std::move(abandoned_key)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    inner_.set(key, data);
  }
  std::vector<char> get(const std::string& key) override {
    wait({key});
    return inner_.get(key);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  static constexpr std::chrono::milliseconds kSlice{100};

 private:
  gloo::rendezvous::Store& inner_;
  const std::string abandoned_key_;
  const std::chrono::milliseconds timeout_;
};

}  // namespace tessel::worker
