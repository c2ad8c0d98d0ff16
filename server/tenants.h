// Tenants: who may call the coordinator's Session and Admin services, and
// the operator's bounds on each tenant.
//
// The operator's --auth_tokens_file maps bearer tokens to tenants, one token
// per line (blank lines and '#' comments skipped):
//
//   TOKEN  TENANT  [admin] [memory_quota=BYTES] [max_sessions=N] [compile_cache_quota=BYTES]
//
// BYTES takes a KiB, MiB or GiB suffix. `admin` lets the token call the
// Admin service. A tenant's limits may be given on any of its lines, and
// must agree where given twice. A tenant without limits gets the defaults
// (--tenant_memory_quota_mb, --max_sessions_per_tenant,
// --tenant_compile_cache_mb; 0: unbounded, but for the compile cache, where
// it is the whole cache's bound shared evenly among the file's tenants).
//
// Without a tokens file every caller is tenant "default", with admin rights:
// the mode of a cluster on loopback.
//
// Thread-safety: immutable after construction.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace tessel::server {

struct TenantLimits {
  int64_t memory_quota_bytes = 0;   // over all the tenant's sessions; 0: none
  int64_t max_sessions = 0;         // open at once; 0: no bound
  int64_t compile_cache_bytes = 0;  // its cached executables; 0: an even share of the cache
};

struct Principal {
  std::string tenant;
  bool admin = false;
};

class Tenants {
 public:
  static constexpr absl::string_view kDefaultTenant = "default";

  // Every caller is the default tenant, an admin.
  explicit Tenants(TenantLimits defaults = {}) : defaults_(defaults) {}
  // INVALID_ARGUMENT naming the file, the line and what is wrong with it.
  static absl::StatusOr<Tenants> Parse(absl::string_view text, absl::string_view file,
                                       TenantLimits defaults);
  static absl::StatusOr<Tenants> FromFile(const std::string& path, TenantLimits defaults);

  bool authenticating() const { return !tokens_.empty(); }
  // The principal presenting `token`: UNAUTHENTICATED when tokens are
  // required and `token` is missing or unknown.
  absl::StatusOr<Principal> Authenticate(absl::string_view token) const;
  TenantLimits LimitsOf(const std::string& tenant) const;
  int64_t num_tenants() const { return limits_.size(); }

 private:
  TenantLimits defaults_;
  absl::flat_hash_map<std::string, Principal> tokens_;
  absl::flat_hash_map<std::string, TenantLimits> limits_;
};

// Rereads a tokens file whenever it changes (its modification time, size or
// inode: an editor's save and a Kubernetes Secret's symlink swap both count),
// checking every `every`, and hands the new tenants to `apply`. A file that
// no longer parses changes nothing: `on_error` hears why, and the tenants in
// force stay until a good file replaces it. Stops when destroyed.
class TokensFileWatcher {
 public:
  TokensFileWatcher(std::string path, TenantLimits defaults, absl::Duration every,
                    std::function<void(Tenants)> apply,
                    std::function<void(const absl::Status&)> on_error);
  ~TokensFileWatcher();
  TokensFileWatcher(const TokensFileWatcher&) = delete;
  TokensFileWatcher& operator=(const TokensFileWatcher&) = delete;

 private:
  void Loop();
  const std::string path_;
  const TenantLimits defaults_;
  const absl::Duration every_;
  const std::function<void(Tenants)> apply_;
  const std::function<void(const absl::Status&)> on_error_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace tessel::server
