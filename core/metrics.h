// The daemons' Prometheus endpoint (--metrics_address): the text exposition
// format over HTTP at /metrics, served by prometheus-cpp's pull exposer.
//
// Two kinds of figures: those the daemon already keeps (sessions, arrays,
// device memory, the compile cache) are read at each scrape by collectors,
// so a scrape and an Admin call agree; those only an event can give (step
// latency, errors) are recorded as they happen, in StepMetrics.
//
// Plaintext HTTP, behind HTTP basic auth when given a user and password
// (Prometheus's `basic_auth`). Not HTTPS: Debian's civetweb, under
// prometheus-cpp's exposer, crashes on its first HTTPS request with OpenSSL
// 3 (it calls a null function pointer). So, like a plaintext gRPC port, the
// endpoint binds loopback unless --insecure says the network is trusted; a
// TLS-terminating proxy in front carries it across an untrusted one.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/security.h"

namespace tessel {

// An HTTP request on the metrics port that is not a scrape (a daemon's
// pages: the coordinator's /dashboard), and its answer.
struct HttpRequest {
  std::string method;         // "GET", "POST"
  std::string path;           // "/dashboard/data"
  std::string query;          // after '?', undecoded
  std::string authorization;  // the Authorization header, as sent
  std::string body;
};
struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // more headers
};

class MetricsEndpoint {
 public:
  using Collector = std::function<std::vector<prometheus::MetricFamily>()>;
  // Answers the requests whose path it takes (nullopt: not its own; the
  // scrape endpoint answers /metrics). Called on the endpoint's threads.
  using PageHandler = std::function<std::optional<HttpResponse>(const HttpRequest&)>;

  struct BasicAuth {
    std::string user, password;  // both empty: no authentication
  };
  // Serves `address` ("host:port"; port 0 picks a free one).
  // UNAVAILABLE naming the address when it cannot listen there.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& address,
                                                                const BasicAuth& auth = {});
  ~MetricsEndpoint();

  int port() const;
  // Where event figures are registered.
  prometheus::Registry& registry() { return *registry_; }
  // Figures computed at each scrape.
  void AddCollector(Collector collect);
  // Serves pages beside /metrics (one handler per process: the endpoint's
  // server calls it before its own handlers). Without a handler, or for a
  // path it declines, the endpoint answers as before.
  void SetPageHandler(PageHandler handler);

 private:
  class Collectors;
  MetricsEndpoint() = default;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<Collectors> collectors_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

// The daemons' --metrics_address, --metrics_port_file and
// --metrics_auth_file (a file whose first line is USER:PASSWORD): the
// endpoint they ask for, its port written to --metrics_port_file; nullptr
// when --metrics_address is empty. FAILED_PRECONDITION for an address off
// loopback without --insecure (`daemon_security.insecure`); the error names
// the flag.
absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpointFromFlags(
    absl::string_view daemon, const DaemonSecurity& daemon_security);

// One family of gauges or counters, a sample per label set.
using Samples = std::vector<std::pair<std::map<std::string, std::string>, double>>;
prometheus::MetricFamily GaugeFamily(const std::string& name, const std::string& help,
                                     const Samples& samples);
prometheus::MetricFamily CounterFamily(const std::string& name, const std::string& help,
                                       const Samples& samples);

// Steps as they complete, by device: a latency histogram
// (<prefix>_step_seconds) and an error counter (<prefix>_step_errors_total).
class StepMetrics {
 public:
  StepMetrics(prometheus::Registry& registry, const std::string& prefix, const std::string& what);
  void Observe(int device, absl::Duration latency, bool ok);

 private:
  struct Device {
    prometheus::Histogram* latency;
    prometheus::Counter* errors;
  };
  prometheus::Family<prometheus::Histogram>& latency_;
  prometheus::Family<prometheus::Counter>& errors_;
  absl::Mutex mu_;
  std::map<int, Device> devices_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessel
