#include "server/dashboard.h"

#include <prometheus/registry.h>

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "core/json.h"
#include "core/security.h"
#include "core/trace.h"
#include "google/protobuf/util/json_util.h"
#include "server/dashboard_page.h"  // kDashboardPage: server/dashboard.html, embedded

namespace tessel::server {
namespace {

HttpResponse Text(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

std::string Json(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

std::string Quote(absl::string_view s) { return JsonString(s); }

std::string Number(double x) { return std::isfinite(x) ? absl::StrCat(x) : "null"; }

// The token an Authorization header carries: Bearer's, or basic auth's password.
std::string TokenOf(absl::string_view authorization) {
  absl::string_view a = absl::StripAsciiWhitespace(authorization);
  if (std::string bearer = BearerTokenOf(a); !bearer.empty()) return bearer;
  if (absl::ConsumePrefix(&a, "Basic ")) {
    std::string decoded;
    if (!absl::Base64Unescape(absl::StripAsciiWhitespace(a), &decoded)) return "";
    const size_t colon = decoded.find(':');
    return colon == std::string::npos ? "" : decoded.substr(colon + 1);
  }
  return "";
}

}  // namespace

std::optional<HttpResponse> Dashboard::Refuse(const HttpRequest& req) const {
  const std::shared_ptr<const Tenants> tenants = c_->tenants();
  if (!tenants->authenticating()) return std::nullopt;
  auto who = tenants->Authenticate(TokenOf(req.authorization));
  if (!who.ok()) {
    HttpResponse r = Text(401,
                          "the dashboard needs an admin token (as the basic-auth password, "
                          "or Authorization: Bearer)\n");
    r.headers.emplace_back("WWW-Authenticate", "Basic realm=\"tessel dashboard\"");
    return r;
  }
  if (!who->admin) {
    return Text(403, absl::StrCat("the dashboard: tenant ", who->tenant,
                                  "'s token is not an admin token\n"));
  }
  return std::nullopt;
}

std::optional<HttpResponse> Dashboard::Handle(const HttpRequest& req) {
  if (req.path != "/dashboard" && req.path != "/dashboard/" && req.path != "/dashboard/data" &&
      req.path != "/dashboard/profile") {
    return std::nullopt;
  }
  if (std::optional<HttpResponse> refused = Refuse(req)) return refused;
  if (req.path == "/dashboard/profile") {
    if (req.method != "POST")
      return Text(405, "/dashboard/profile: POST, not " + req.method + "\n");
    return Profile(req);
  }
  if (req.method != "GET" && req.method != "HEAD") {
    return Text(405, absl::StrCat(req.path, ": GET, not ", req.method, "\n"));
  }
  if (req.path == "/dashboard/data") return Data();
  HttpResponse r;
  r.content_type = "text/html; charset=utf-8";
  r.body = kDashboardPage;
  return r;
}

HttpResponse Dashboard::Data() {
  v1::GetClusterRequest with_memory;
  with_memory.set_with_memory(true);
  const v1::GetClusterResponse cluster = c_->GetCluster(with_memory);
  const v1::ListSessionsResponse sessions = c_->ListSessions();
  std::string out =
      absl::StrCat("{\"time_ms\":", absl::ToUnixMillis(absl::Now()), ",\"cluster\":", Json(cluster),
                   ",\"sessions\":", Json(sessions), ",\"step_latency\":[");
  // Each device's latency histogram: cumulative counts by upper bound (s).
  bool first = true;
  if (metrics_ != nullptr) {
    for (const prometheus::MetricFamily& f : metrics_->Collect()) {
      if (f.name != "tessel_step_seconds") continue;
      for (const prometheus::ClientMetric& m : f.metric) {
        std::string device;
        for (const auto& l : m.label) {
          if (l.name == "device") device = l.value;
        }
        absl::StrAppend(&out, first ? "" : ",", "{\"device\":", Quote(device),
                        ",\"count\":", m.histogram.sample_count,
                        ",\"sum\":", Number(m.histogram.sample_sum), ",\"buckets\":[");
        first = false;
        for (size_t k = 0; k < m.histogram.bucket.size(); ++k) {
          const auto& b = m.histogram.bucket[k];
          absl::StrAppend(&out, k ? "," : "", "[", Number(b.upper_bound), ",", b.cumulative_count,
                          "]");
        }
        out += "]}";
      }
    }
  }
  out += "],\"errors\":[";
  first = true;
  for (const Coordinator::StepError& e : c_->RecentErrors()) {
    absl::StrAppend(&out, first ? "" : ",", "{\"time_ms\":", absl::ToUnixMillis(e.when),
                    ",\"device\":", e.device, ",\"execution\":", e.execution,
                    ",\"session\":", Quote(e.session), ",\"message\":", Quote(e.message), "}");
    first = false;
  }
  out += "]}";
  HttpResponse r;
  r.content_type = "application/json";
  r.body = std::move(out);
  return r;
}

HttpResponse Dashboard::Profile(const HttpRequest& req) {
  double seconds = 0;
  for (absl::string_view kv : absl::StrSplit(req.query, '&')) {
    if (absl::ConsumePrefix(&kv, "seconds=") && !absl::SimpleAtod(kv, &seconds)) seconds = -1;
  }
  if (!(seconds >= 0.001 && seconds <= 60)) {
    return Text(400, absl::StrCat("/dashboard/profile: seconds must be 0.001 .. 60; got '",
                                  req.query, "'\n"));
  }
  v1::StartTraceRequest start;
  start.set_duration_ms(int64_t(std::llround(seconds * 1000)));
  auto started = c_->StartTrace(start);
  if (!started.ok()) return Text(409, absl::StrCat(started.status().message(), "\n"));
  absl::SleepFor(absl::Milliseconds(start.duration_ms()));
  auto trace = c_->StopTrace();
  if (!trace.ok()) return Text(500, absl::StrCat(trace.status().message(), "\n"));
  HttpResponse r;
  r.content_type = "application/json";
  r.body = std::move(*trace);
  r.headers.emplace_back("Content-Disposition", "attachment; filename=\"tessel-profile.json\"");
  return r;
}

}  // namespace tessel::server
