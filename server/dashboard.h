// The coordinator's live dashboard, on its metrics port (--metrics_address):
//
//   GET  /dashboard                      the page (HTML and JavaScript, no CDN)
//   GET  /dashboard/data                 its figures, JSON: GetCluster with
//                                        device memory and collective times,
//                                        ListSessions, each device's step
//                                        latency histogram, recent step errors
//   POST /dashboard/profile?seconds=N    a profile of the next N seconds
//                                        (1 .. 60), trace-event JSON
//
// The page polls /dashboard/data and computes rates (steps per second,
// p50/p99 step latency, collective wait per round) from the differences
// between two polls, as Prometheus's rate() does; it keeps the memory
// history it draws.
//
// With tokens (--auth_tokens_file) every path needs an admin token: as
// `Authorization: Bearer <token>`, or HTTP basic auth whose password is the
// token (what a browser asks for). Without tokens the dashboard is as open
// as tessel.v1.Admin.
//
// Thread-safety: Handle may be called from any thread.
#pragma once

#include <optional>

#include "core/metrics.h"
#include "server/coordinator.h"

namespace tessel::server {

class Dashboard {
 public:
  // `metrics`: where the step latency histograms are (borrowed; may be null).
  Dashboard(Coordinator* coordinator, prometheus::Registry* metrics)
      : c_(coordinator), metrics_(metrics) {}
  // nullopt for a path that is not the dashboard's.
  std::optional<HttpResponse> Handle(const HttpRequest& req);

 private:
  std::optional<HttpResponse> Refuse(const HttpRequest& req) const;
  HttpResponse Data();
  HttpResponse Profile(const HttpRequest& req);
  Coordinator* const c_;
  prometheus::Registry* const metrics_;
};

}  // namespace tessel::server
