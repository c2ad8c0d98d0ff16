// The daemons' --metrics_* flags (only the daemons link this file).
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/metrics.h"
#include "core/process_tuning.h"

ABSL_FLAG(std::string, metrics_address, "",
          "Serve Prometheus metrics (text format, plaintext HTTP, /metrics) on host:port (port 0 "
          "picks a free "
          "one, written to --metrics_port_file); a non-loopback host needs --insecure, TLS or not "
          "(the endpoint "
          "has no TLS of its own). Empty: no endpoint.");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, the metrics endpoint's port is written here once serving.");
ABSL_FLAG(std::string, metrics_auth_file, "",
          "File whose first line is USER:PASSWORD: scrapes must present them by HTTP basic auth "
          "(Prometheus's "
          "basic_auth). Unset: no authentication.");

namespace tessel {

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpointFromFlags(
    absl::string_view daemon, const DaemonSecurity& daemon_security) {
  const std::string address = absl::GetFlag(FLAGS_metrics_address);
  if (address.empty()) return std::unique_ptr<MetricsEndpoint>();
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_address=", address, ": expected host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  if (!daemon_security.insecure && !IsLoopbackHost(host)) {
    return absl::FailedPreconditionError(
        absl::StrCat(daemon, ": --metrics_address=", address,
                     " is not a loopback address, and the metrics endpoint is "
                     "plaintext HTTP (TLS or not): give --insecure to serve it on a network you "
                     "trust, or keep it on "
                     "loopback behind a TLS-terminating proxy"));
  }
  MetricsEndpoint::BasicAuth auth;
  if (const std::string f = absl::GetFlag(FLAGS_metrics_auth_file); !f.empty()) {
    auto line = ReadSecretFile("metrics_auth_file", f);
    if (!line.ok()) return line.status();
    std::pair<std::string, std::string> up = absl::StrSplit(*line, absl::MaxSplits(':', 1));
    if (up.first.empty() || up.second.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics_auth_file=", f, ": expected USER:PASSWORD on the first line"));
    }
    auth.user = up.first;
    auth.password = up.second;
  }
  auto m = MetricsEndpoint::Start(address, auth);
  if (!m.ok())
    return absl::Status(m.status().code(),
                        absl::StrCat("--metrics_address: ", m.status().message()));
  WritePortFile(absl::GetFlag(FLAGS_metrics_port_file), (*m)->port());
  return m;
}

}  // namespace tessel
