// Tenants: who may call the coordinator's Session and Admin services, and
// the operator's bounds on each tenant.
//
// The operator's --auth_tokens_file maps bearer tokens to tenants, one token
// per line (blank lines and '#' comments skipped):
//
//   TOKEN  TENANT  [admin] [memory_quota=BYTES] [max_sessions=N]
//
// BYTES takes a KiB, MiB or GiB suffix. `admin` lets the token call the
// Admin service. A tenant's limits may be given on any of its lines, and
// must agree where given twice. A tenant without limits gets the defaults
// (--tenant_memory_quota_mb, --max_sessions_per_tenant; 0: unbounded).
//
// Without a tokens file every caller is tenant "default", with admin rights:
// the mode of a cluster on loopback.
//
// Thread-safety: immutable after construction.
#pragma once

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tessel::server {

struct TenantLimits {
  int64_t memory_quota_bytes = 0;  // over all the tenant's sessions; 0: none
  int64_t max_sessions = 0;        // open at once; 0: no bound
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
  static absl::StatusOr<Tenants> Parse(absl::string_view text, absl::string_view file, TenantLimits defaults);
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

}  // namespace tessel::server
