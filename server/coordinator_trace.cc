// The profiler's fan-out: Admin.StartTrace and StopTrace over this
// process's recorder and every live worker's.
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/trace.h"
#include "server/coordinator.h"

namespace tessel::server {

using absl::StrCat;

namespace {

// A worker's events travel in one reply, under the 64 MiB message limit.
constexpr int64_t kDefaultTraceEvents = 100'000;
constexpr int64_t kMaxTraceEvents = 250'000;
constexpr absl::Duration kMaxTraceDuration = absl::Minutes(10);

}  // namespace

absl::StatusOr<v1::StartTraceResponse> Coordinator::StartTrace(const v1::StartTraceRequest& req) {
  const absl::Duration duration = absl::Milliseconds(req.duration_ms());
  if (duration < absl::Milliseconds(1) || duration > kMaxTraceDuration) {
    return absl::InvalidArgumentError(StrCat("StartTrace: duration_ms must be 1 .. ",
                                             absl::ToInt64Milliseconds(kMaxTraceDuration),
                                             " (10 minutes); got ", req.duration_ms()));
  }
  const int64_t events =
      req.max_events_per_process() == 0 ? kDefaultTraceEvents : req.max_events_per_process();
  if (events < 1 || events > kMaxTraceEvents) {
    return absl::InvalidArgumentError(StrCat("StartTrace: max_events_per_process must be 1 .. ",
                                             kMaxTraceEvents, " (0: ", kDefaultTraceEvents,
                                             "); got ", req.max_events_per_process()));
  }
  absl::MutexLock l(&trace_mu_);
  const absl::Time now = absl::Now();
  if (trace_until_.has_value() && now < *trace_until_) {
    return absl::FailedPreconditionError(
        StrCat("StartTrace: a trace is being recorded already, for ",
               absl::FormatDuration(absl::Trunc(*trace_until_ - now, absl::Milliseconds(1))),
               " more (StopTrace ends it)"));
  }
  const absl::Time until = now + duration;
  trace::Recorder::Get().Start(events, until);
  traced_.clear();
  v1::TraceRequest start;
  start.set_start(true);
  start.set_capacity(events);
  start.set_duration_ms(req.duration_ms());
  v1::StartTraceResponse resp;
  for (StatsTarget& t : workers_.LiveStatsTargets()) {
    auto r = t.client->Trace(start);
    if (!r.ok()) {
      log_->warn("StartTrace: worker {} records no trace: {}", t.worker_id, r.status().ToString());
      continue;
    }
    resp.add_workers(t.worker_id);
    traced_.push_back(std::move(t));
  }
  trace_until_ = until;
  log_->info("tracing for {} on this coordinator and {} workers", absl::FormatDuration(duration),
             traced_.size());
  resp.set_coordinator_unix_ns(trace::NowNs());
  return resp;
}

absl::StatusOr<std::string> Coordinator::StopTrace() {
  absl::MutexLock l(&trace_mu_);
  if (!trace_until_.has_value()) {
    return absl::FailedPreconditionError("StopTrace: no trace was started (StartTrace)");
  }
  std::vector<trace::ProcessEvents> processes(1);
  processes[0].name = "coordinator";
  trace::Recorder::Get().Stop(&processes[0].events);
  v1::TraceRequest stop;
  for (const StatsTarget& t : traced_) {
    auto r = t.client->Trace(stop);
    if (!r.ok()) {
      // Its events are lost with it; the trace says so.
      log_->warn("StopTrace: worker {} answered no events: {}", t.worker_id, r.status().ToString());
      trace::ProcessEvents lost{
          .name = StrCat("worker ", t.worker_id, " (lost: ", r.status().message(), ")")};
      lost.events.set_clock_error_ns(-1);
      processes.push_back(std::move(lost));
      continue;
    }
    processes.push_back(trace::ProcessEvents{.name = StrCat("worker ", t.worker_id),
                                             .events = std::move(*r->mutable_events()),
                                             .global_device = t.devices});
  }
  trace_until_.reset();
  traced_.clear();
  return trace::WriteChromeTrace(processes);
}

std::vector<Coordinator::StepError> Coordinator::RecentErrors() const {
  absl::MutexLock l(&errors_mu_);
  return {recent_errors_.begin(), recent_errors_.end()};
}

}  // namespace tessel::server
