#include "core/metrics.h"

#include <CivetServer.h>
#include <civetweb.h>

#include <exception>

#include "absl/strings/str_cat.h"

namespace tessel {

class MetricsEndpoint::Collectors final : public prometheus::Collectable {
 public:
  void Add(Collector c) {
    absl::MutexLock l(&mu_);
    collectors_.push_back(std::move(c));
  }
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<Collector> collectors;
    {
      absl::MutexLock l(&mu_);
      collectors = collectors_;
    }
    std::vector<prometheus::MetricFamily> out;
    for (const Collector& c : collectors) {
      std::vector<prometheus::MetricFamily> f = c();
      out.insert(out.end(), std::make_move_iterator(f.begin()), std::make_move_iterator(f.end()));
    }
    return out;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<Collector> collectors_ ABSL_GUARDED_BY(mu_);
};

namespace {

// The process's page handler (SetPageHandler): civetweb's request callback
// carries no pointer of ours.
absl::Mutex page_mu(absl::kConstInit);
MetricsEndpoint::PageHandler* page_handler ABSL_GUARDED_BY(page_mu) = nullptr;

// civetweb's begin_request: a page the handler takes is answered here
// (returning its status); 0 leaves the request to the endpoint.
int BeginRequest(mg_connection* conn) {
  MetricsEndpoint::PageHandler handler;
  {
    absl::MutexLock l(&page_mu);
    if (page_handler == nullptr) return 0;
    handler = *page_handler;
  }
  const mg_request_info* info = mg_get_request_info(conn);
  HttpRequest req;
  req.method = info->request_method ? info->request_method : "";
  req.path = info->local_uri ? info->local_uri : "";
  if (req.path == "/metrics") return 0;
  req.query = info->query_string ? info->query_string : "";
  if (const char* a = mg_get_header(conn, "Authorization"); a != nullptr) req.authorization = a;
  constexpr long long kMaxBody = 1 << 20;
  if (info->content_length > kMaxBody) return 0;
  if (info->content_length > 0) {
    req.body.resize(size_t(info->content_length));
    const int n = mg_read(conn, req.body.data(), req.body.size());
    req.body.resize(n > 0 ? size_t(n) : 0);
  }
  std::optional<HttpResponse> resp = handler(req);
  if (!resp.has_value()) return 0;
  std::string head = absl::StrCat(
      "HTTP/1.1 ", resp->status, " ", mg_get_response_code_text(conn, resp->status),
      "\r\nContent-Type: ", resp->content_type, "\r\nContent-Length: ", resp->body.size(),
      "\r\nCache-Control: no-store\r\nConnection: close\r\n");
  for (const auto& [k, v] : resp->headers) absl::StrAppend(&head, k, ": ", v, "\r\n");
  head += "\r\n";
  mg_write(conn, head.data(), head.size());
  if (req.method != "HEAD") mg_write(conn, resp->body.data(), resp->body.size());
  return resp->status;
}

}  // namespace

void MetricsEndpoint::SetPageHandler(PageHandler handler) {
  absl::MutexLock l(&page_mu);
  delete page_handler;
  page_handler = handler ? new PageHandler(std::move(handler)) : nullptr;
}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& address,
                                                                        const BasicAuth& auth) {
  std::unique_ptr<MetricsEndpoint> m(new MetricsEndpoint());
  m->registry_ = std::make_shared<prometheus::Registry>();
  m->collectors_ = std::make_shared<Collectors>();
  try {
    // Four threads: a page may hold one for seconds (the dashboard's
    // profile of the next N seconds) while scrapes go on.
    static const CivetCallbacks* callbacks = [] {
      auto* cb = new CivetCallbacks();
      cb->begin_request = &BeginRequest;
      return cb;
    }();
    m->exposer_ = std::make_unique<prometheus::Exposer>(address, 4, callbacks);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("metrics endpoint: cannot listen on ", address, ": ", e.what()));
  }
  if (!auth.user.empty() || !auth.password.empty()) {
    m->exposer_->RegisterAuth(
        [user = auth.user, password = auth.password](const std::string& u, const std::string& p) {
          const bool user_ok = SecretEquals(u, user), password_ok = SecretEquals(p, password);
          return user_ok && password_ok;
        },
        "tessel");
  }
  m->exposer_->RegisterCollectable(m->registry_);
  m->exposer_->RegisterCollectable(m->collectors_);
  return m;
}

MetricsEndpoint::~MetricsEndpoint() = default;

int MetricsEndpoint::port() const {
  std::vector<int> ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

void MetricsEndpoint::AddCollector(Collector collect) { collectors_->Add(std::move(collect)); }

namespace {

prometheus::MetricFamily Family(const std::string& name, const std::string& help,
                                prometheus::MetricType type, const Samples& samples) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  for (const auto& [labels, value] : samples) {
    prometheus::ClientMetric m;
    for (const auto& [k, v] : labels) m.label.push_back({k, v});
    if (type == prometheus::MetricType::Counter) {
      m.counter.value = value;
    } else {
      m.gauge.value = value;
    }
    f.metric.push_back(std::move(m));
  }
  return f;
}

}  // namespace

prometheus::MetricFamily GaugeFamily(const std::string& name, const std::string& help,
                                     const Samples& samples) {
  return Family(name, help, prometheus::MetricType::Gauge, samples);
}

prometheus::MetricFamily CounterFamily(const std::string& name, const std::string& help,
                                       const Samples& samples) {
  return Family(name, help, prometheus::MetricType::Counter, samples);
}

StepMetrics::StepMetrics(prometheus::Registry& registry, const std::string& prefix,
                         const std::string& what)
    : latency_(prometheus::BuildHistogram()
                   .Name(prefix + "_step_seconds")
                   .Help(absl::StrCat("Step latency by device: ", what))
                   .Register(registry)),
      errors_(prometheus::BuildCounter()
                  .Name(prefix + "_step_errors_total")
                  .Help("Steps that failed, by device")
                  .Register(registry)) {}

void StepMetrics::Observe(int device, absl::Duration latency, bool ok) {
  Device* d;
  {
    absl::MutexLock l(&mu_);
    auto it = devices_.find(device);
    if (it == devices_.end()) {
      const std::map<std::string, std::string> labels{{"device", std::to_string(device)}};
      // 50 µs .. ~26 s, doubling.
      prometheus::Histogram::BucketBoundaries bounds;
      for (double b = 50e-6; b < 30; b *= 2) bounds.push_back(b);
      it = devices_.emplace(device, Device{&latency_.Add(labels, bounds), &errors_.Add(labels)})
               .first;
    }
    d = &it->second;
  }
  d->latency->Observe(absl::ToDoubleSeconds(latency));
  if (!ok) d->errors->Increment();
}

}  // namespace tessel
