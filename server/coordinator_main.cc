// tessel-coordinator: accepts clients' graphs and arrays, drives the workers.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/metrics.h"
#include "core/process_tuning.h"
#include "core/reflection_v1.h"
#include "core/security.h"
#include "core/status.h"
#include "server/coordinator.h"
#include "server/dashboard.h"
#include "server/fault_injection.h"
#include "server/kv_store.h"
#include "server/services.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, host, "127.0.0.1", "Interface to listen on (0.0.0.0 for all).");
ABSL_FLAG(int, port, 0, "Port for Session, Admin and Registry services; 0 picks a free one.");
ABSL_FLAG(std::string, port_file, "",
          "If set, the chosen port is written to this file once serving.");
ABSL_FLAG(int, heartbeat_ms, 500, "Interval at which workers are told to heartbeat.");
ABSL_FLAG(int, heartbeat_timeout_ms, 2000, "A worker silent for this long is marked dead.");
ABSL_FLAG(int, reconcile_interval_s, 30,
          "How often every buffer the workers hold is checked against the coordinator's arrays and "
          "open puts; "
          "buffers found unowned twice in a row are freed (tessel_unowned_buffers_freed_total). 0: "
          "never.");
ABSL_FLAG(int, session_lease_s, 60,
          "A session whose client has made no call and sent no keep-alive for this long ends and "
          "its arrays are "
          "freed (the SDKs keep their sessions alive in the background). 0: sessions end only when "
          "closed.");
ABSL_FLAG(int, max_message_mb, 64,
          "Largest gRPC message accepted, in MiB; bulk data streams in chunks below it.");
ABSL_FLAG(std::string, log_level, "info", "Log level: trace, debug, info, warn, error.");
ABSL_FLAG(std::string, log_format, "text",
          "Log format: text, or json (one object per line: time, level, logger, thread, message).");
ABSL_FLAG(std::string, inject_faults, "",
          "For tests only: misbehave on the way to every worker, e.g. "
          "drop_step=0.01,delay_step=0.05,seed=7 "
          "(see server/fault_injection.h). Default: none.");
ABSL_FLAG(
    std::string, auth_tokens_file, "",
    "Client tokens: one 'TOKEN TENANT [admin] [memory_quota=BYTES] [max_sessions=N]' per line (see "
    "server/tenants.h). Set: Session calls need a token and see only their tenant's sessions; "
    "Admin calls "
    "need an admin token. Unset: every caller is tenant 'default' (loopback only, unless "
    "--insecure).");
ABSL_FLAG(int, auth_reload_s, 10,
          "How often --auth_tokens_file is checked for changes, in seconds; a changed file applies "
          "at once (tokens, "
          "tenants and limits; a file that no longer parses is logged and the previous one kept). "
          "0: never.");
ABSL_FLAG(int64_t, tenant_memory_quota_mb, 0,
          "Memory quota of a tenant whose tokens-file lines give none, over all its sessions, in "
          "MiB; 0: none.");
ABSL_FLAG(int64_t, max_sessions_per_tenant, 0,
          "Open sessions a tenant may hold at once when its tokens-file lines give no "
          "max_sessions; 0: no bound.");
ABSL_FLAG(int64_t, tenant_compile_cache_mb, 0,
          "Compile-cache bound of a tenant whose tokens-file lines give no compile_cache_quota, in "
          "MiB; its own "
          "least recently used executables go past it. 0: --compile_cache_mb shared evenly among "
          "the tenants.");
ABSL_FLAG(std::string, tls_worker_name, "",
          "With TLS: the name the workers' certificates must carry (e.g. tessel-worker), checked "
          "instead of the "
          "host each worker advertises; for workers whose addresses are not in their certificates "
          "(pod IPs).");
ABSL_FLAG(int64_t, compile_cache_mb, 1024,
          "Bound of the compile cache in MiB (programs, graphs and plans); the least recently used "
          "executables "
          "are evicted past it, each tenant's own first (one called again is compiled again).");
ABSL_FLAG(bool, direct_transfers, true,
          "Let clients that ask put and fetch an array's blocks straight to and from the workers "
          "holding them, "
          "with tickets signed by this coordinator; false relays every Put and Fetch through the "
          "coordinator.");
ABSL_FLAG(
    int, parent_pid, 0,
    "If set, stop (as on SIGTERM) when this parent process exits; for clients that start daemons.");

namespace {

// The figures Admin.GetCluster and ListSessions report, read at each scrape.
void AddCoordinatorMetrics(tessel::server::Coordinator* c, tessel::MetricsEndpoint& metrics) {
  metrics.AddCollector([c] {
    using tessel::CounterFamily;
    using tessel::GaugeFamily;
    const tessel::v1::GetClusterResponse cluster = c->GetCluster(tessel::v1::GetClusterRequest());
    int64_t alive = 0, dead = 0;
    for (const auto& w : cluster.workers()) ++(w.alive() ? alive : dead);
    std::map<std::string, std::pair<double, double>> tenants;  // sessions, bytes
    const tessel::v1::ListSessionsResponse listed = c->ListSessions();
    for (const auto& s : listed.sessions()) {
      auto& t = tenants[s.tenant()];
      t.first += 1;
      t.second += s.live_bytes();
    }
    tessel::Samples sessions, bytes;
    for (const auto& [tenant, t] : tenants) {
      sessions.push_back({{{"tenant", tenant}}, t.first});
      bytes.push_back({{{"tenant", tenant}}, t.second});
    }
    const tessel::server::TransferCounts moved = c->total_transfers();
    return std::vector<prometheus::MetricFamily>{
        GaugeFamily("tessel_sessions", "Open sessions, by tenant", sessions),
        GaugeFamily("tessel_session_bytes", "Bytes of live arrays, by tenant", bytes),
        GaugeFamily("tessel_live_arrays", "Live arrays over all sessions",
                    {{{}, double(cluster.live_arrays())}}),
        GaugeFamily("tessel_workers", "Workers by state",
                    {{{{"state", "alive"}}, double(alive)}, {{{"state", "dead"}}, double(dead)}}),
        CounterFamily("tessel_executions_total", "Executions accepted",
                      {{{}, double(cluster.executions())}}),
        CounterFamily("tessel_compiles_total", "Graphs compiled",
                      {{{}, double(cluster.compiles())}}),
        CounterFamily("tessel_compile_cache_hits_total", "Compiles answered from the cache",
                      {{{}, double(cluster.compile_cache_hits())}}),
        GaugeFamily("tessel_compile_cache_bytes", "Bytes held by cached executables",
                    {{{}, double(cluster.compile_cache_bytes())}}),
        CounterFamily("tessel_compile_cache_evictions_total",
                      "Executables evicted (least recently used)",
                      {{{}, double(cluster.compile_cache_evictions())}}),
        CounterFamily(
            "tessel_unowned_buffers_freed_total",
            "Buffers workers held that no array or open put owned, freed by reconciliation",
            {{{}, double(cluster.unowned_buffers_freed())}}),
        CounterFamily("tessel_transfer_bytes_total", "Bytes moved, by direction",
                      {{{{"direction", "host_to_device"}}, double(moved.h2d)},
                       {{{"direction", "device_to_host"}}, double(moved.d2h)},
                       {{{"direction", "device_to_device"}}, double(moved.d2d)}}),
    };
  });
}

// The coordinator's options from its flags (limits, cache, leases, tenants,
// how it reaches workers, faults to inject); INVALID_ARGUMENT naming a flag
// out of range or a tokens file that does not read. Warns of what a
// non-loopback host leaves open.
absl::StatusOr<tessel::server::Coordinator::Options> OptionsFromFlags(
    const tessel::DaemonSecurity& security, const tessel::server::TenantLimits& defaults,
    const std::shared_ptr<spdlog::logger>& log) {
  const std::string host = absl::GetFlag(FLAGS_host);
  const tessel::TlsFiles& tls = security.tls;
  const std::string& join_token = security.join_token;
  tessel::server::Coordinator::Options options;
  options.logger = log;
  if (defaults.memory_quota_bytes < 0 || defaults.max_sessions < 0 ||
      defaults.compile_cache_bytes < 0) {
    return absl::InvalidArgumentError(
        "--tenant_memory_quota_mb, --max_sessions_per_tenant and --tenant_compile_cache_mb: "
        "expected >= 0");
  }
  options.tenants = tessel::server::Tenants(defaults);
  if (absl::GetFlag(FLAGS_compile_cache_mb) < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--compile_cache_mb: expected >= 1, got ",
                                                   absl::GetFlag(FLAGS_compile_cache_mb)));
  }
  options.compile_cache_bytes = absl::GetFlag(FLAGS_compile_cache_mb) << 20;
  options.direct_transfers = absl::GetFlag(FLAGS_direct_transfers);
  if (absl::GetFlag(FLAGS_auth_reload_s) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_reload_s: expected >= 0, got ", absl::GetFlag(FLAGS_auth_reload_s)));
  }
  if (const std::string f = absl::GetFlag(FLAGS_auth_tokens_file); !f.empty()) {
    TESSEL_ASSIGN_OR_RETURN(options.tenants, tessel::server::Tenants::FromFile(f, defaults));
    log->info("clients authenticate: {} tenants in {}", options.tenants.num_tenants(), f);
  }
  if (!tessel::IsLoopbackHost(host)) {
    if (!tls.enabled())
      log->warn("--insecure: serving plaintext on {}; anyone on the network can read and change it",
                host);
    if (join_token.empty())
      log->warn("no --join_token_file: anyone who reaches {} can register a worker", host);
    if (!options.tenants.authenticating()) {
      log->warn("no --auth_tokens_file: anyone who reaches {} can open sessions and call Admin",
                host);
    }
  }
  auto worker_creds = tessel::ChannelCredentials(tls);
  const std::string worker_name = absl::GetFlag(FLAGS_tls_worker_name);
  options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_ms));
  options.heartbeat_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  if (absl::GetFlag(FLAGS_session_lease_s) < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--session_lease_s: expected >= 0, got ",
                                                   absl::GetFlag(FLAGS_session_lease_s)));
  }
  options.session_lease = absl::Seconds(absl::GetFlag(FLAGS_session_lease_s));
  if (absl::GetFlag(FLAGS_reconcile_interval_s) < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--reconcile_interval_s: expected >= 0, got ",
                                                   absl::GetFlag(FLAGS_reconcile_interval_s)));
  }
  options.reconcile_interval = absl::Seconds(absl::GetFlag(FLAGS_reconcile_interval_s));
  if (const std::string spec = absl::GetFlag(FLAGS_inject_faults); !spec.empty()) {
    auto plan = tessel::server::FaultPlan::Parse(spec);
    if (!plan.ok()) return tessel::Annotate(plan.status(), "--inject_faults: ");
    log->warn("injecting faults on the way to every worker: {}", spec);
    options.connect = [plan = *plan, worker_creds, worker_name](const std::string& address,
                                                                const std::string& secret) {
      return tessel::server::WithFaults(
          tessel::server::NewGrpcWorkerClient(address, secret, worker_creds, worker_name), plan,
          address);
    };
  } else {
    options.connect = [worker_creds, worker_name](const std::string& address,
                                                  const std::string& secret) {
      return tessel::server::NewGrpcWorkerClient(address, secret, worker_creds, worker_name);
    };
  }
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  const std::shared_ptr<spdlog::logger> log = tessel::StartDaemon(
      argc, argv,
      {.name = "coordinator",
       .usage =
           "tessel-coordinator [--host=H] [--port=P]\n"
           "Serves tessel.v1.Session (clients), tessel.v1.Registry (workers) and tessel.v1.Admin\n"
           "(operators), plus grpc.health.v1.Health and server reflection.",
       .main_file = "coordinator_main",
       .log_level = &FLAGS_log_level,
       .log_format = &FLAGS_log_format,
       .parent_pid = &FLAGS_parent_pid},
      &exit_code);
  if (log == nullptr) return exit_code;

  const std::string host = absl::GetFlag(FLAGS_host);
  auto security = tessel::DaemonSecurityFromFlags("tessel-coordinator", host);
  if (!security.ok()) {
    log->error("{}", std::string(security.status().message()));
    return 2;
  }
  const tessel::TlsFiles& tls = security->tls;
  const std::string& join_token = security->join_token;
  const tessel::server::TenantLimits defaults{absl::GetFlag(FLAGS_tenant_memory_quota_mb) << 20,
                                              absl::GetFlag(FLAGS_max_sessions_per_tenant),
                                              absl::GetFlag(FLAGS_tenant_compile_cache_mb) << 20};
  auto options_or = OptionsFromFlags(*security, defaults, log);
  if (!options_or.ok()) {
    log->error("{}", std::string(options_or.status().message()));
    return 2;
  }
  tessel::server::Coordinator::Options options = std::move(*options_or);
  auto metrics_or = tessel::MetricsEndpointFromFlags("tessel-coordinator", *security);
  if (!metrics_or.ok()) {
    log->error("{}", std::string(metrics_or.status().message()));
    return 2;
  }
  std::unique_ptr<tessel::MetricsEndpoint> metrics = std::move(*metrics_or);
  std::unique_ptr<tessel::StepMetrics> step_metrics;
  if (metrics != nullptr) {
    step_metrics = std::make_unique<tessel::StepMetrics>(
        metrics->registry(), "tessel", "from the coordinator sending it to its worker's answer");
    options.on_step_done = [sm = step_metrics.get()](int device, absl::Duration latency, bool ok) {
      sm->Observe(device, latency, ok);
    };
  }
  auto coordinator = tessel::server::Coordinator::Create(std::move(options));
  if (!coordinator.ok()) {
    log->error("{}", coordinator.status().ToString());
    return 1;
  }
  std::unique_ptr<tessel::server::Dashboard> dashboard;
  if (metrics != nullptr) {
    AddCoordinatorMetrics(coordinator->get(), *metrics);
    dashboard =
        std::make_unique<tessel::server::Dashboard>(coordinator->get(), &metrics->registry());
    metrics->SetPageHandler(
        [d = dashboard.get()](const tessel::HttpRequest& r) { return d->Handle(r); });
    log->info("metrics on port {} (/metrics; the dashboard at /dashboard)", metrics->port());
  }
  std::unique_ptr<tessel::server::TokensFileWatcher> tokens_watcher;
  if (const std::string f = absl::GetFlag(FLAGS_auth_tokens_file);
      !f.empty() && absl::GetFlag(FLAGS_auth_reload_s) > 0) {
    tessel::server::Coordinator* c = coordinator->get();
    tokens_watcher = std::make_unique<tessel::server::TokensFileWatcher>(
        f, defaults, absl::Seconds(absl::GetFlag(FLAGS_auth_reload_s)),
        [c, log, f](tessel::server::Tenants t) {
          log->info("--auth_tokens_file {} changed: {} tenants now", f, t.num_tenants());
          c->ReplaceTenants(std::move(t));
        },
        [log](const absl::Status& s) {
          log->error("{}; the previous tokens stay in force", std::string(s.message()));
        });
  }
  tessel::server::SessionService session(coordinator->get());
  tessel::server::AdminService admin(coordinator->get());
  tessel::server::KvStore kv_store;  // the workers' rendezvous for collectives
  tessel::server::RegistryService registry(coordinator->get(), &kv_store, join_token);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  tessel::ReflectionV1Service reflection_v1(
      {"tessel.v1.Session", "tessel.v1.Admin", "tessel.v1.Registry"});
  grpc::ServerBuilder builder;
  int port = 0;
  // Clients need no certificate; workers present theirs (verified by the CA).
  builder.AddListeningPort(absl::StrCat(host, ":", absl::GetFlag(FLAGS_port)),
                           tessel::ServerCredentials(tls, /*require_client_cert=*/false), &port);
  builder.RegisterService(&session);
  builder.RegisterService(&admin);
  builder.RegisterService(&registry);
  builder.RegisterService(&reflection_v1);
  const int max_msg = absl::GetFlag(FLAGS_max_message_mb) << 20;
  builder.SetMaxReceiveMessageSize(max_msg);
  builder.SetMaxSendMessageSize(max_msg);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    log->error("could not listen on {}:{}", host, absl::GetFlag(FLAGS_port));
    return 1;
  }
  // The whole server ("") is SERVING from here; each service by name too.
  for (const char* name : {"tessel.v1.Session", "tessel.v1.Admin", "tessel.v1.Registry"}) {
    server->GetHealthCheckService()->SetServingStatus(name, true);
  }
  log->info("tessel-coordinator serving on {}:{} ({})", host, port,
            tls.enabled() ? "TLS" : "plaintext");
  tessel::WritePortFile(absl::GetFlag(FLAGS_port_file), port);
  tessel::NotifyReady(absl::StrCat("serving on ", host, ":", port));
  int sig = tessel::WaitForTerminationSignal();
  log->info("signal {}: shutting down", sig);
  tessel::NotifyStopping();
  server->GetHealthCheckService()->Shutdown();  // every status NOT_SERVING while draining
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  // The endpoint's threads read the coordinator (scrapes, the dashboard):
  // they stop before it goes.
  if (metrics != nullptr) metrics->SetPageHandler(nullptr);
  metrics.reset();
  return 0;
}
