// The daemons' transport-security flags (only the daemons link this file:
// the SDK takes the same settings as ConnectOptions).
#include <algorithm>

#include "absl/flags/flag.h"
#include "core/security.h"

ABSL_FLAG(
    std::string, tls_cert, "",
    "PEM certificate (chain) this daemon presents, as a server and to the other daemons. With "
    "--tls_key "
    "and --tls_ca: TLS on every port, mutual between the daemons. Reloaded when the file changes.");
ABSL_FLAG(std::string, tls_key, "",
          "PEM private key of --tls_cert. Reloaded when the file changes.");
ABSL_FLAG(
    std::string, tls_ca, "",
    "PEM CA bundle that verifies the other daemons' certificates (and is handed to no one else).");
ABSL_FLAG(int, tls_reload_s, 10, "How often the TLS files are checked for changes, in seconds.");
ABSL_FLAG(std::string, join_token_file, "",
          "File whose first line is the cluster's join token: the coordinator asks it of workers "
          "(to register, "
          "heartbeat and meet), a worker presents it. Unset on the coordinator: any caller may "
          "register a worker "
          "(loopback only, unless --insecure).");
ABSL_FLAG(bool, insecure, false,
          "Allow plaintext (no TLS) on a non-loopback --host. Anyone who reaches the port can then "
          "read and "
          "change what it carries; use only on a network you trust.");

namespace tessel {
namespace {

TlsFiles TlsFilesFromFlags() {
  return TlsFiles{absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                  absl::GetFlag(FLAGS_tls_ca), std::max(1, absl::GetFlag(FLAGS_tls_reload_s))};
}

bool InsecureFromFlags() { return absl::GetFlag(FLAGS_insecure); }

}  // namespace

absl::StatusOr<DaemonSecurity> DaemonSecurityFromFlags(absl::string_view daemon,
                                                       absl::string_view host) {
  DaemonSecurity out;
  out.tls = TlsFilesFromFlags();
  out.insecure = InsecureFromFlags();
  if (absl::Status s = CheckTlsFiles(out.tls, /*server=*/true); !s.ok()) return s;
  if (absl::Status s = CheckListenSecurity(daemon, host, out.tls, InsecureFromFlags()); !s.ok())
    return s;
  if (const std::string f = absl::GetFlag(FLAGS_join_token_file); !f.empty()) {
    auto t = ReadSecretFile("join_token_file", f);
    if (!t.ok()) return t.status();
    out.join_token = *t;
  }
  return out;
}

}  // namespace tessel
