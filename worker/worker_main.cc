// tessel-worker: owns devices, runs the coordinator's programs on them.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sched.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <map>
#include <optional>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/logging.h"
#include "core/metrics.h"
#include "core/process_tuning.h"
#include "core/reflection_v1.h"
#include "core/security.h"
#include "core/status.h"
#include "core/trace.h"
#include "core/version.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"
#include "tessel/v1/admin.grpc.pb.h"
#include "worker/collectives.h"
#include "worker/cpu/cpu_device.h"
#include "worker/cpu/dot.h"
#include "worker/cuda/plugin.h"
#include "worker/kv_store_client.h"
#include "worker/worker_runtime.h"
#include "worker/worker_service.h"

ABSL_FLAG(std::string, coordinator, "",
          "Address (host:port) of the tessel-coordinator to register with. Required.");
ABSL_FLAG(std::string, host, "127.0.0.1",
          "Interface to listen on; also the host advertised to the coordinator.");
ABSL_FLAG(int, port, 0, "Port to serve tessel.v1.Worker on; 0 picks a free one.");
ABSL_FLAG(
    std::string, client_address, "",
    "host:port clients use to reach this worker's port when they put and fetch arrays directly; "
    "default: the address registered with the coordinator. Clients that cannot reach it go through "
    "the coordinator.");
ABSL_FLAG(int, devices, 1, "Number of CPU devices this worker exposes.");
ABSL_FLAG(
    std::string, device_kind, "cpu",
    "Which devices to expose: cpu (--devices of them), cuda (every GPU the CUDA runtime sees; "
    "CUDA_VISIBLE_DEVICES narrows it), or both (CPU devices first, then GPUs).");
ABSL_FLAG(std::string, kernel_cache_dir, "",
          "Where compiled CUDA kernels are cached on disk; default $TESSEL_KERNEL_CACHE, else "
          "~/.cache/tessel/kernels.");
ABSL_FLAG(std::string, cuda_plugin, "",
          "The CUDA backend (libtessel_cuda.so) that --device_kind=cuda|both loads; default: "
          "beside this binary, "
          "else the dynamic loader's search path.");
ABSL_FLAG(
    int64_t, device_memory_bytes, 0,
    "Memory limit per device in bytes; 0 means 80% of the memory this process may use (its "
    "cgroup's limit, else "
    "physical memory) divided among the CPU devices, which together may not exceed it, "
    "and 90% of each GPU's free memory. With --device_kind=both it limits the CPU devices only.");
ABSL_FLAG(int, kernel_threads, 0,
          "Threads each CPU device's kernels may use (OpenBLAS's GEMM threads, large fused loops). "
          "0: the cores "
          "this process may run on, divided among its CPU devices (at least 1), so that devices "
          "running at once "
          "do not oversubscribe them.");
ABSL_FLAG(int, register_timeout_s, 30,
          "How long to keep trying to reach the coordinator at start-up.");
ABSL_FLAG(std::string, log_level, "info", "Log level: trace, debug, info, warn, error.");
ABSL_FLAG(std::string, log_format, "text",
          "Log format: text, or json (one object per line: time, level, logger, thread, message).");
ABSL_FLAG(
    int, collective_timeout_s, 60,
    "How long a collective waits for the rest of its group (and the rendezvous for its peers).");
ABSL_FLAG(std::string, worker_id, "",
          "This worker's persistent identity, kept across restarts (default: the host name and the "
          "port). A "
          "worker that registers again under it with a new incarnation replaces the old at once.");
ABSL_FLAG(std::string, checkpoint_root, "/",
          "Checkpoints may be saved and restored only under this directory (absolute): the shared "
          "volume every worker mounts at the same path. Default: anywhere this process may write.");
ABSL_FLAG(int64_t, checkpoint_staging_mb, 1024,
          "Bytes a checkpoint save may hold for writing, per worker, in MiB: a save's step waits "
          "for room beyond it (a larger chunk is written alone).");
ABSL_FLAG(int, drain_s, 0,
          "On SIGTERM, serve this many seconds more while the coordinator marks the worker "
          "draining (cordoned; clients see it in their cluster events and may save a "
          "checkpoint), or until it holds no array; then stop. 0: stop at once.");
ABSL_FLAG(
    int, parent_pid, 0,
    "If set, stop (as on SIGTERM) when this parent process exits; for clients that start daemons.");

namespace {

struct Registration {
  std::string worker_id;
  int64_t heartbeat_ms = 500;
  uint64_t queue_epoch = 0;
  std::string coordinator_incarnation;
};

// The cores this process may run on (its affinity mask, as a cpuset or
// taskset narrows it), else the machine's.
int UsableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, int(std::thread::hardware_concurrency()));
}

// The devices --device_kind asks for. A kind that names GPUs finds none on
// a machine without them, or without the CUDA libraries the plugin needs,
// or in a build without the plugin: with "both" that leaves the CPU
// devices, with "cuda" it is an error saying why.
absl::StatusOr<std::vector<std::unique_ptr<tessel::worker::Device>>> MakeDevices(
    const std::string& kind, int num_cpu, spdlog::logger& log) {
  if (kind != "cpu" && kind != "cuda" && kind != "both") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device_kind: expected cpu, cuda or both, got '", kind, "'"));
  }
  std::vector<std::unique_ptr<tessel::worker::Device>> devices;
  if (kind != "cuda") {
    // The CPU devices together stay within what this process may use: a
    // container's or a unit's memory limit, else physical memory.
    const tessel::MemoryBudget budget = tessel::ProcessMemoryBudget();
    int64_t limit = absl::GetFlag(FLAGS_device_memory_bytes);
    if (limit > 0 && limit > budget.bytes / num_cpu) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device_memory_bytes=", limit, " for ", num_cpu, " CPU devices (",
                       limit * num_cpu, " bytes in all) exceeds the ", budget.bytes,
                       " bytes this process may use (", budget.source, ")"));
    }
    if (limit <= 0) limit = budget.bytes / 10 * 8 / num_cpu;
    log.info("CPU devices: {} of {} bytes each ({} bytes available, from {})", num_cpu, limit,
             budget.bytes, budget.source);
    for (int i = 0; i < num_cpu; ++i) {
      devices.push_back(
          std::make_unique<tessel::cpu::CpuDevice>(tessel::cpu::CpuDevice::Options{i, limit}));
    }
    const int cores = UsableCores();
    int threads = absl::GetFlag(FLAGS_kernel_threads);
    if (threads <= 0) threads = std::max(1, cores / num_cpu);
    tessel::cpu::SetKernelThreads(threads);
    log.info("CPU kernels: {} threads per device ({} cores, {} CPU devices)", threads, cores,
             num_cpu);
  }
  if (kind == "cpu") return devices;
  int found = 0;
  std::string why;
  auto plugin = tessel::cuda::LoadPlugin(absl::GetFlag(FLAGS_cuda_plugin));
  if (!plugin.ok()) {
    why = std::string(plugin.status().message());
  } else {
    const tessel::cuda::PluginApi& cuda = **plugin;
    found = cuda.probe(&why);
    std::string cache = absl::GetFlag(FLAGS_kernel_cache_dir);
    if (cache.empty()) cache = cuda.default_kernel_cache_dir();
    for (int g = 0; g < found; ++g) {
      tessel::cuda::PluginDeviceOptions o;
      o.local_index = int(devices.size());
      o.ordinal = g;
      o.memory_limit_bytes = kind == "cuda" ? absl::GetFlag(FLAGS_device_memory_bytes) : 0;
      o.kernel_cache_dir = cache;
      o.collective_timeout_ms = int64_t{absl::GetFlag(FLAGS_collective_timeout_s)} * 1000;
      std::string arch;
      auto d = cuda.create_device(o, &arch);
      if (!d.ok()) return d.status();
      log.info("cuda:{} is GPU {} ({}), kernels cached in {}", o.local_index, g, arch,
               cache.empty() ? "memory" : cache);
      devices.push_back(std::move(*d));
    }
  }
  if (found == 0) {
    if (kind == "cuda")
      return absl::FailedPreconditionError(
          absl::StrCat("--device_kind=cuda: no CUDA devices (", why, ")"));
    log.info("no CUDA devices ({}); serving CPU devices only", why);
  }
  return devices;
}

// Who this worker is to the coordinator, for every registration.
struct Identity {
  std::string address, secret, name, incarnation, client_address;
};

// The coordinator's clock against this process's, from the heartbeats'
// round trips: the coordinator answered somewhere within each, so the
// offset is known within half the round trip. The beat with the shortest
// round trip among the last 32 gives the estimate the profiler uses; the
// registration's is the first.
class ClockEstimate {
 public:
  void Beat(int64_t sent_ns, int64_t coordinator_ns) {
    const int64_t back_ns = tessel::trace::NowNs();
    const int64_t half = std::max<int64_t>(0, back_ns - sent_ns) / 2;
    samples_[next_++ % samples_.size()] = {coordinator_ns - (sent_ns + half), half};
    const Sample* best = nullptr;
    for (const Sample& x : samples_) {
      if (x.error_ns >= 0 && (best == nullptr || x.error_ns < best->error_ns)) best = &x;
    }
    tessel::trace::Recorder::Get().SetClockOffset(best->offset_ns, best->error_ns);
  }

 private:
  struct Sample {
    int64_t offset_ns = 0;
    int64_t error_ns = -1;  // -1: none yet
  };
  std::array<Sample, 32> samples_;
  size_t next_ = 0;
};
// The worker's: fed by its registrations and heartbeats (one thread at a time).
ClockEstimate& Clock() {
  static ClockEstimate* c = new ClockEstimate();
  return *c;
}

absl::StatusOr<Registration> Register(tessel::v1::Registry::Stub& stub, const Identity& me,
                                      const std::vector<std::string>& kinds,
                                      absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  grpc::Status last;
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    tessel::v1::RegisterWorkerRequest req;
    req.set_address(me.address);
    req.set_client_address(me.client_address);
    req.set_worker_name(me.name);
    req.set_worker_incarnation(me.incarnation);
    req.set_num_devices(int(kinds.size()));
    for (const std::string& k : kinds) req.add_device_kinds(k);
    req.set_device_kind(kinds.empty() ? "cpu" : kinds.front());
    req.set_protocol_version(tessel::kProtocolVersionMax);
    req.set_worker_secret(me.secret);
    tessel::v1::RegisterWorkerResponse resp;
    const int64_t sent_ns = tessel::trace::NowNs();
    last = stub.RegisterWorker(&ctx, req, &resp);
    if (last.ok()) {
      if (resp.coordinator_unix_ns() != 0) Clock().Beat(sent_ns, resp.coordinator_unix_ns());
      return Registration{resp.worker_id(), std::max<int64_t>(50, resp.heartbeat_interval_ms()),
                          resp.queue_epoch(), resp.coordinator_incarnation()};
    }
    if (last.error_code() != grpc::StatusCode::UNAVAILABLE &&
        last.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::UnavailableError(
      absl::StrCat("could not register with the coordinator: ", last.error_message()));
}

}  // namespace

namespace {

// Device memory and steps as GetStats reports them, read at each scrape.
void AddWorkerMetrics(tessel::worker::WorkerRuntime* runtime, tessel::MetricsEndpoint& metrics) {
  metrics.AddCollector([runtime] {
    const tessel::v1::WorkerStatsResponse stats = runtime->Stats({}, absl::ZeroDuration());
    tessel::Samples in_use, peak, buffers, cached, limit;
    for (const auto& d : stats.devices()) {
      const std::map<std::string, std::string> labels{{"device", std::to_string(d.device())}};
      in_use.push_back({labels, double(d.bytes_in_use())});
      peak.push_back({labels, double(d.peak_bytes_in_use())});
      buffers.push_back({labels, double(d.num_buffers())});
      cached.push_back({labels, double(d.bytes_cached())});
      limit.push_back({labels, double(d.bytes_limit())});
    }
    return std::vector<prometheus::MetricFamily>{
        tessel::GaugeFamily("tessel_worker_device_bytes_in_use",
                            "Bytes held by live buffers, by local device", in_use),
        tessel::GaugeFamily("tessel_worker_device_peak_bytes", "Peak bytes in use, by local device",
                            peak),
        tessel::GaugeFamily("tessel_worker_device_buffers", "Live buffers, by local device",
                            buffers),
        tessel::GaugeFamily("tessel_worker_device_bytes_cached",
                            "Freed bytes kept for reuse, by local device", cached),
        tessel::GaugeFamily("tessel_worker_device_bytes_limit", "Device memory limit (0: none)",
                            limit),
        tessel::CounterFamily("tessel_worker_steps_total", "Steps run on this worker",
                              {{{}, double(stats.steps_run())}}),
    };
  });
}

// The instructions the CPU kernels were built to use (TESSEL_ISA) that this
// CPU lacks, as a list for the error; empty when it has them all.
std::string MissingKernelInstructions() {
  std::string missing;
#if defined(__x86_64__)
  const std::string isa = TESSEL_KERNEL_ISA;
  __builtin_cpu_init();
  auto need = [&](bool has, const char* name) {
    if (!has) missing += missing.empty() ? name : std::string(", ") + name;
  };
  if (isa == "x86-64-v2" || isa == "x86-64-v3" || isa == "x86-64-v4") {
    need(__builtin_cpu_supports("sse4.2"), "sse4.2");
    need(__builtin_cpu_supports("popcnt"), "popcnt");
  }
  if (isa == "x86-64-v3" || isa == "x86-64-v4") {
    need(__builtin_cpu_supports("avx2"), "avx2");
    need(__builtin_cpu_supports("fma"), "fma");
    need(__builtin_cpu_supports("bmi2"), "bmi2");
  }
  if (isa == "x86-64-v4") {
    need(__builtin_cpu_supports("avx512f"), "avx512f");
    need(__builtin_cpu_supports("avx512bw"), "avx512bw");
  }
#endif
  return missing;
}

// What the heartbeat thread works with.
struct Beat {
  tessel::v1::Registry::Stub& registry;
  const Identity& me;
  const std::vector<std::string>& kinds;
  const std::string& coordinator;
  tessel::worker::WorkerRuntime& runtime;
  tessel::worker::KvStoreClient& store;
  grpc::HealthCheckServiceInterface& health;
  spdlog::logger& log;
  const std::atomic<bool>& stop;
  // Set on SIGTERM with --drain_s: each heartbeat says so.
  const std::atomic<int64_t>& drain_ms;
};

// Heartbeats until `stop`, registering again when the coordinator no
// longer knows this worker (a restarted coordinator: the old one's arrays
// and programs are dropped). Without a coordinator the worker can run
// nothing new: tessel.v1.Worker reports NOT_SERVING from the first failed
// heartbeat until the coordinator answers again. The loss and the recovery
// are logged once each, with a reminder every 30 s in between (each
// failure at debug level).
void Heartbeats(const Beat& b, const Registration& registration) {
  Registration r = registration;
  std::optional<absl::Time> lost_since;
  absl::Time reminded;
  auto lost = [&](const std::string& why) {
    const absl::Time now = absl::Now();
    if (!lost_since) {
      lost_since = reminded = now;
      b.health.SetServingStatus("tessel.v1.Worker", false);
      b.log.warn("lost the coordinator at {}: {}; NOT_SERVING until it answers", b.coordinator,
                 why);
    } else if (now - reminded >= absl::Seconds(30)) {
      reminded = now;
      b.log.warn("still no coordinator at {} after {:.0f} s: {}", b.coordinator,
                 absl::ToDoubleSeconds(now - *lost_since), why);
    } else {
      b.log.debug("heartbeat to {} failed: {}", b.coordinator, why);
    }
  };
  auto found = [&] {
    if (!lost_since) return;
    b.log.info("the coordinator at {} answers again after {:.1f} s; SERVING", b.coordinator,
               absl::ToDoubleSeconds(absl::Now() - *lost_since));
    lost_since.reset();
    b.health.SetServingStatus("tessel.v1.Worker", true);
  };
  while (!b.stop) {
    absl::SleepFor(absl::Milliseconds(r.heartbeat_ms));
    if (b.stop) break;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(std::max<int64_t>(1000, r.heartbeat_ms)));
    tessel::v1::HeartbeatRequest req;
    req.set_worker_id(r.worker_id);
    req.set_worker_secret(b.me.secret);
    if (const int64_t drain = b.drain_ms.load(); drain > 0) {
      req.set_draining(true);
      req.set_drain_ms(drain);
    }
    tessel::v1::HeartbeatResponse resp;
    const int64_t sent_ns = tessel::trace::NowNs();
    grpc::Status s = b.registry.Heartbeat(&ctx, req, &resp);
    if (s.ok() && resp.coordinator_unix_ns() != 0)
      Clock().Beat(sent_ns, resp.coordinator_unix_ns());
    if (s.ok() && !resp.known()) {
      b.log.warn("coordinator does not know worker {}; registering again", r.worker_id);
      auto again = Register(b.registry, b.me, b.kinds, absl::Seconds(5));
      if (again.ok()) {
        if (again->coordinator_incarnation != r.coordinator_incarnation) {
          auto [arrays, bytes] = b.runtime.ForgetAllArrays();
          const int64_t programs = b.runtime.ForgetPrograms();
          b.log.warn(
              "the coordinator restarted (incarnation {} -> {}): dropped the old one's {} arrays "
              "({} bytes) "
              "and {} programs",
              r.coordinator_incarnation, again->coordinator_incarnation, arrays, bytes, programs);
        }
        r = *again;
        b.store.SetWorkerId(r.worker_id);
        b.runtime.StartQueueEpoch(r.queue_epoch);
        b.log.info("registered again as {}", r.worker_id);
        found();
      } else {
        lost(std::string(again.status().message()));
      }
    } else if (s.ok()) {
      found();
    } else {
      lost(s.error_message());
    }
  }
}

// The worker's gRPC server on `host` (--port), with `services`; only the
// cluster's daemons (certificates signed by the CA) may connect. Null, or
// *port 0, when it could not listen.
std::unique_ptr<grpc::Server> Serve(const std::string& host, const tessel::TlsFiles& tls,
                                    std::initializer_list<grpc::Service*> services, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(host, ":", absl::GetFlag(FLAGS_port)),
                           tessel::ServerCredentials(tls, /*require_client_cert=*/true), port);
  for (grpc::Service* s : services) builder.RegisterService(s);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(64 << 20);
  return builder.BuildAndStart();
}

// Whether this worker can start: its CPU has the kernels' instructions,
// --coordinator and --devices are given and in range. 0, or the exit code after saying why not.
int CheckStart(spdlog::logger& log) {
  if (const std::string missing = MissingKernelInstructions(); !missing.empty()) {
    log.error(
        "this tessel-worker's CPU kernels were built for {} and this CPU lacks {}: rebuild with "
        "-DTESSEL_ISA=x86-64-v2 (or -DTESSEL_NATIVE=ON on this machine)",
        TESSEL_KERNEL_ISA, missing);
    return 2;
  }
  if (absl::GetFlag(FLAGS_coordinator).empty()) {
    log.error("--coordinator is required");
    return 2;
  }
  if (const int n = absl::GetFlag(FLAGS_devices); n < 1 || n > 256) {
    log.error("--devices: expected 1..256, got {}", n);
    return 2;
  }
  return 0;
}

// The worker's devices (--device_kind, --devices; their kinds into
// `kinds`) and the runtime over them.
absl::StatusOr<std::unique_ptr<tessel::worker::WorkerRuntime>> MakeRuntime(
    const std::shared_ptr<spdlog::logger>& log, std::vector<std::string>* kinds) {
  tessel::worker::WorkerRuntime::Options options;
  TESSEL_ASSIGN_OR_RETURN(options.devices, MakeDevices(absl::GetFlag(FLAGS_device_kind),
                                                       absl::GetFlag(FLAGS_devices), *log));
  for (const auto& d : options.devices) kinds->push_back(d->kind());
  options.logger = log;
  options.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  if (options.checkpoint_root.empty() || options.checkpoint_root.front() != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint_root: expected an absolute directory, got '", options.checkpoint_root, "'"));
  }
  const int64_t staging_mb = absl::GetFlag(FLAGS_checkpoint_staging_mb);
  if (staging_mb < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--checkpoint_staging_mb: expected at least 1, got ", staging_mb));
  }
  options.checkpoint_staging_bytes = staging_mb << 20;
  return tessel::worker::WorkerRuntime::Create(std::move(options));
}

// The worker's step metrics on `metrics` (null: none served).
std::unique_ptr<tessel::StepMetrics> WorkerMetrics(tessel::MetricsEndpoint* metrics,
                                                   tessel::worker::WorkerRuntime* runtime,
                                                   spdlog::logger& log) {
  if (metrics == nullptr) return nullptr;
  auto step_metrics = std::make_unique<tessel::StepMetrics>(
      metrics->registry(), "tessel_worker", "from its arrival on the worker to its answer");
  AddWorkerMetrics(runtime, *metrics);
  log.info("metrics on port {} (/metrics)", metrics->port());
  return step_metrics;
}

// Who this worker is to the coordinator: its address and secret, its name
// (--worker_id, else "<hostname>:<port>"), a fresh incarnation, and the
// address clients reach it at (--client_address).
Identity MakeIdentity(const std::string& address, const std::string& secret, int port) {
  Identity me{address, secret, absl::GetFlag(FLAGS_worker_id), tessel::RandomSecret().substr(0, 16),
              absl::GetFlag(FLAGS_client_address)};
  if (me.name.empty()) {
    char hostname[256] = {};
    gethostname(hostname, sizeof hostname - 1);
    me.name = absl::StrCat(hostname, ":", port);
  }
  return me;
}

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  const std::shared_ptr<spdlog::logger> log = tessel::StartDaemon(
      argc, argv,
      {.name = "worker",
       .usage =
           "tessel-worker --coordinator=HOST:PORT [--devices=N] [--device_kind=cpu|cuda|both] "
           "[--port=P]\n"
           "Serves tessel.v1.Worker: owns N CPU devices and/or the machine's GPUs, runs the "
           "programs "
           "the coordinator sends,\n"
           "registers with the coordinator and heartbeats. Also serves grpc.health.v1.Health and "
           "reflection.",
       .main_file = "worker_main",
       .log_level = &FLAGS_log_level,
       .log_format = &FLAGS_log_format,
       .parent_pid = &FLAGS_parent_pid},
      &exit_code);
  if (log == nullptr) return exit_code;
  if (const int code = CheckStart(*log); code != 0) return code;
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  std::vector<std::string> kinds;
  auto runtime = MakeRuntime(log, &kinds);
  if (!runtime.ok()) {
    log->error("{}", runtime.status().ToString());
    return 1;
  }
  const std::string host = absl::GetFlag(FLAGS_host);
  auto security = tessel::DaemonSecurityFromFlags("tessel-worker", host);
  if (!security.ok()) {
    log->error("{}", std::string(security.status().message()));
    return 2;
  }
  const tessel::TlsFiles& tls = security->tls;
  const std::string& join_token = security->join_token;
  if (!tls.enabled() && !tessel::IsLoopbackHost(host)) {
    log->warn("--insecure: serving plaintext on {}; anyone on the network can read and change it",
              host);
  }
  // Drawn anew at each start and given only to the coordinator: the key to
  // this worker's service.
  const std::string secret = tessel::RandomSecret();
  auto metrics_or = tessel::MetricsEndpointFromFlags("tessel-worker", *security);
  if (!metrics_or.ok()) {
    log->error("{}", std::string(metrics_or.status().message()));
    return 2;
  }
  std::unique_ptr<tessel::MetricsEndpoint> metrics = std::move(*metrics_or);
  std::unique_ptr<tessel::StepMetrics> step_metrics =
      WorkerMetrics(metrics.get(), runtime->get(), *log);
  tessel::worker::WorkerService service(runtime->get(), secret, step_metrics.get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  tessel::ReflectionV1Service reflection_v1({"tessel.v1.Worker"});
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(host, tls, {&service, &reflection_v1}, &port);
  if (!server || port == 0) {
    log->error("could not listen on {}:{}", host, absl::GetFlag(FLAGS_port));
    return 1;
  }
  const std::string address = absl::StrCat(host, ":", port);
  log->info("serving tessel.v1.Worker on {} with devices [{}]", address, absl::StrJoin(kinds, ","));

  auto channel = tessel::CreateChannelWithToken(coordinator, tessel::ChannelCredentials(tls),
                                                grpc::ChannelArguments(), join_token);
  std::shared_ptr<tessel::v1::Registry::Stub> registry = tessel::v1::Registry::NewStub(channel);
  // Collectives: groups meet through the coordinator's key-value store.
  const absl::Duration collective_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_collective_timeout_s));
  auto store = std::make_shared<tessel::worker::KvStoreClient>(
      registry, tessel::worker::KvStoreClient::Options{.timeout = collective_timeout,
                                                       .worker_secret = secret});
  if (auto collectives = tessel::worker::NewCommunicatorRegistry({.self = address,
                                                                  .store = store,
                                                                  .hostname = host,
                                                                  .timeout = collective_timeout,
                                                                  .logger = log});
      collectives.ok()) {
    (*runtime)->SetCollectives(std::move(*collectives));
  } else {
    log->error("{}", collectives.status().ToString());
    return 1;
  }
  const Identity me = MakeIdentity(address, secret, port);
  log->info("worker {} (incarnation {})", me.name, me.incarnation);
  auto reg = Register(*registry, me, kinds, absl::Seconds(absl::GetFlag(FLAGS_register_timeout_s)));
  if (!reg.ok()) {
    log->error("{}", reg.status().ToString());
    server->Shutdown();
    return 1;
  }
  log->info("registered with {} as {}", coordinator, reg->worker_id);
  store->SetWorkerId(reg->worker_id);
  // tessel.v1.Worker is SERVING once registered (the whole server, "", from
  // the start).
  server->GetHealthCheckService()->SetServingStatus("tessel.v1.Worker", true);
  tessel::NotifyReady(
      absl::StrCat("serving ", address, ", registered with ", coordinator, " as ", reg->worker_id));
  (*runtime)->StartQueueEpoch(reg->queue_epoch);

  std::atomic<bool> stop{false};
  std::atomic<int64_t> drain_ms{0};
  const Beat beat{
      *registry, me,   kinds,   coordinator, **runtime, *store, *server->GetHealthCheckService(),
      *log,      stop, drain_ms};
  std::thread heartbeat([&] { Heartbeats(beat, *reg); });

  int sig = tessel::WaitForTerminationSignal();
  if (const int drain_s = absl::GetFlag(FLAGS_drain_s); drain_s > 0) {
    // Still serving: the steps in flight finish, and clients told by the
    // coordinator may save what the devices hold before it goes.
    const absl::Time deadline = absl::Now() + absl::Seconds(drain_s);
    drain_ms = int64_t{drain_s} * 1000;
    log->warn("signal {}: draining; serving {} s more or until no array is held here", sig,
              drain_s);
    while (absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(200));
      if ((*runtime)->Stats({}, absl::ZeroDuration(), /*with_buffers=*/true).buffers_size() == 0) {
        log->info("no array is held here any more; stopping");
        break;
      }
    }
  }
  tessel::NotifyStopping();
  server->GetHealthCheckService()->Shutdown();  // every status NOT_SERVING while draining
  log->info("signal {}: shutting down", sig);
  stop = true;
  heartbeat.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
