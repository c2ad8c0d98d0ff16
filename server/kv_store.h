// KvStore: the coordinator's key-value store, where the workers of a
// collective group meet (each publishes its Gloo endpoint under a key scoped
// by the group, then waits for its peers'). The Registry service's KvSet and
// KvGet are thin shells over it.
//
// Thread-safety: every method may be called from any thread. Get blocks the
// calling thread until the key is set or the timeout passes.
// Keys are never removed; the limits below bound what a cluster can store.
#pragma once

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tessel::server {

class KvStore {
 public:
  struct Limits {
    // Default: 1 KiB.
    int64_t max_key_bytes = 1 << 10;
    // Default: 1 MiB.
    int64_t max_value_bytes = 1 << 20;
    // Default: 100,000.
    int64_t max_keys = 100'000;
    // Keys and values together. Default: 256 MiB.
    int64_t max_total_bytes = int64_t{256} << 20;
    // Per group: the keys sharing a prefix up to the first '/' (the whole
    // key without one). Defaults: 4,096 keys, 16 MiB.
    int64_t max_group_keys = 4096;
    int64_t max_group_bytes = int64_t{16} << 20;
  };

  explicit KvStore(Limits limits);
  KvStore() : KvStore(Limits{}) {}

  // Sets `key` (replacing an earlier value) and wakes its waiters.
  // INVALID_ARGUMENT for an empty or too long key, a too large value, or a
  // store that is full; RESOURCE_EXHAUSTED for a group at its limits;
  // PERMISSION_DENIED when another `writer` set the key first (an empty
  // writer may replace only keys set by an empty writer).
  absl::Status Set(absl::string_view key, std::string value, const std::string& writer = "");

  // The value of `key`, waiting up to `timeout` for it to be set (a zero or
  // negative timeout looks once). DEADLINE_EXCEEDED naming the key when it
  // is still unset; INVALID_ARGUMENT for an empty or too long key.
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) const;

  int64_t num_keys() const;

 private:
  absl::Status CheckKey(absl::string_view key) const;

  const Limits limits_;
  mutable absl::Mutex mu_;
  struct Entry {
    std::string value, writer;
  };
  struct GroupUsage {
    int64_t keys = 0, bytes = 0;
  };
  absl::flat_hash_map<std::string, Entry> values_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, GroupUsage> groups_ ABSL_GUARDED_BY(mu_);
  int64_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessel::server
