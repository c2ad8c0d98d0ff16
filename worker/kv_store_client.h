// KvStoreClient: a gloo::rendezvous::Store over the coordinator's key-value
// store (tessel.v1.Registry KvSet / KvGet), where the workers of a collective
// group publish their endpoints and find their peers'.
//
// Gloo's Store API reports failure by throwing: every failure here is a
// gloo::IoException whose message names the key and carries the
// coordinator's status (DEADLINE_EXCEEDED when a key was not set in time).
//
// Thread-safe (as the gRPC stub is). Holds the stub for its life.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "tessel/v1/admin.grpc.pb.h"

namespace tessel::worker {

class KvStoreClient final : public gloo::rendezvous::Store {
 public:
  struct Options {
    // How long get(), and wait() without a timeout, wait for a key.
    // Default: 30 s.
    absl::Duration timeout = absl::Seconds(30);
    // Deadline of one KvSet. Default: 10 s.
    absl::Duration set_timeout = absl::Seconds(10);
    // Presented with every call: only a registered worker may meet its
    // groups' peers.
    std::string worker_secret;
  };

  KvStoreClient(std::shared_ptr<v1::Registry::StubInterface> stub, Options options);

  void set(const std::string& key, const std::vector<char>& data) override;
  // Waits for the key up to Options::timeout.
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  // A zero timeout (gloo::kNoTimeout) means Options::timeout.
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // The id the coordinator gave this worker (again at each registration).
  void SetWorkerId(std::string id);

 private:
  std::string WorkerId() const;
  std::string Get(const std::string& key, absl::Duration timeout);

  const std::shared_ptr<v1::Registry::StubInterface> stub_;
  const Options options_;
  mutable absl::Mutex mu_;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessel::worker
