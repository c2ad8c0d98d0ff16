// tessel-scale-bench: the coordinator at cluster scale, by simulation. The
// real coordinator's parts (WorkerRegistry, ArrayRegistry, CompileCache,
// ExecutePlanner, the sequenced step and free streams) drive 64, 256 and
// 1,024 in-process workers that answer every call at once, so what is
// measured is the coordinator's own work: its CPU per step per worker (a
// replicated step runs on every device; a sharded one gives each device
// a block), its memory per registered worker, and the compile and plan of
// a program whose all_reduce spans every device.
//
//   build/bin/tessel-scale-bench [--json] [--only=SUBSTR]
//
// Rows (the tessel-bench format: value beside a baseline, as a ratio):
//   sim_replicated_step_1024w  us of coordinator CPU per worker per step
//                              at 1,024 workers, vs the same at 64. Goal:
//                              linear growth (ratio <= 1.25) and <= 2 us.
//   sim_sharded_step_1024w     the same for a step sharded over 1,024.
//   sim_allreduce_step_1024w   the same for a psum over every device.
//   sim_memory_per_worker      KiB of resident memory per worker added
//                              from 256 to 1,024, vs from 64 to 256.
//   sim_compile_allreduce_1024d ms to compile, partition and plan a psum
//                              over a 1,024-device mesh and run it once
//                              (loaded on every worker), against its goal
//                              of 1,000 ms (the 64-device figure goes to
//                              stderr).
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "core/version.h"
#include "google/protobuf/text_format.h"
#include "server/coordinator.h"
#include "server/worker_client.h"
#include "spdlog/sinks/null_sink.h"
#include "spdlog/spdlog.h"
#include "tessel/graph.h"

namespace {

using tessel::server::Coordinator;
using tessel::server::WorkerClient;
namespace v1 = tessel::v1;

// A worker that answers every call at once, on the caller's thread.
class InstantWorker final : public WorkerClient {
 public:
  absl::Status LoadProgram(const v1::Program&, uint64_t) override { return absl::OkStatus(); }
  void Run(const v1::RunRequest&, RunDone done) override { done(v1::RunResponse()); }
  void Free(const v1::FreeRequest&, Done done) override { done(absl::OkStatus()); }
  absl::StatusOr<std::unique_ptr<PutStream>> BeginPut(const v1::PutShardRequest::Header&) override {
    return absl::UnimplementedError("simulated worker: no puts");
  }
  std::unique_ptr<FetchStream> BeginFetch(const v1::FetchShardRequest&) override { return nullptr; }
  absl::StatusOr<v1::WorkerStatsResponse> GetStats(const v1::WorkerStatsRequest&) override {
    return v1::WorkerStatsResponse();
  }
  void CancelAll() override {}
};

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

double ResidentKiB() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024.0);
}

v1::Graph Parse(const std::string& text) {
  v1::Graph g;
  if (!google::protobuf::TextFormat::ParseFromString(text, &g)) {
    std::fprintf(stderr, "tessel-scale-bench: a graph did not parse\n");
    std::exit(1);
  }
  return g;
}

v1::Mesh LineMesh(int n) {
  v1::Mesh m;
  m.add_axis_names("d");
  m.add_axis_sizes(n);
  for (int i = 0; i < n; ++i) m.add_devices(i);
  return m;
}

// A coordinator with `n` instant workers of one device each, and a session.
struct Cluster {
  std::unique_ptr<Coordinator> c;
  std::string session;
  uint64_t next_handle = 1;
};

void AddWorkers(Cluster& cl, int from, int to) {
  for (int w = from; w < to; ++w) {
    v1::RegisterWorkerRequest r;
    r.set_address(absl::StrFormat("10.%d.%d.%d:7000", w >> 16, (w >> 8) & 255, w & 255));
    r.set_num_devices(1);
    r.set_protocol_version(tessel::kProtocolVersionMax);
    r.set_worker_secret(absl::StrCat("secret-of-worker-", w, "-0123456789abcdef"));
    auto reg = cl.c->RegisterWorker(r);
    if (!reg.ok()) {
      std::fprintf(stderr, "tessel-scale-bench: %s\n", reg.status().ToString().c_str());
      std::exit(1);
    }
  }
}

Cluster Start(int n) {
  Coordinator::Options o;
  o.logger =
      std::make_shared<spdlog::logger>("sim", std::make_shared<spdlog::sinks::null_sink_mt>());
  o.heartbeat_interval = absl::Seconds(60);
  o.heartbeat_timeout = absl::Seconds(3600);
  o.connect = [](const std::string&, const std::string&) -> std::shared_ptr<WorkerClient> {
    return std::make_shared<InstantWorker>();
  };
  auto c = Coordinator::Create(o);
  if (!c.ok()) {
    std::fprintf(stderr, "tessel-scale-bench: %s\n", c.status().ToString().c_str());
    std::exit(1);
  }
  Cluster cl{std::move(*c), "", 1};
  AddWorkers(cl, 0, n);
  v1::OpenSessionRequest open;
  open.set_client("tessel-scale-bench");
  cl.session = cl.c->OpenSession(open)->session_id();
  return cl;
}

constexpr char kIota[] = R"pb(
  name: "iota"
  nodes { name: "i" op: CONSTANT constant { iota { dimension: 0 } } type { dtype: F32 dims: D } }
  nodes { name: "two" op: CONSTANT constant { fill { f: 2 } } type { dtype: F32 dims: D } }
  nodes { name: "z" op: MUL operands: [ "i", "two" ] }
  outputs: "z"
)pb";

// `split`: the parameters (if any) and the output blocked over the mesh.
std::string Compile(Cluster& cl, const v1::Graph& g, const v1::Mesh* mesh, bool split) {
  v1::CompileRequest req;
  req.set_session_id(cl.session);
  *req.mutable_graph() = g;
  if (mesh != nullptr) {
    *req.mutable_mesh() = *mesh;
    if (split) {
      for (const v1::Node& n : g.nodes()) {
        if (n.op() == v1::PARAMETER) req.add_parameter_shardings()->add_dims()->add_axes("d");
      }
      req.add_output_shardings()->add_dims()->add_axes("d");
    }
  }
  auto r = cl.c->Compile(req);
  if (!r.ok()) {
    std::fprintf(stderr, "tessel-scale-bench: compile: %s\n", r.status().ToString().c_str());
    std::exit(1);
  }
  return r->executable_id();
}

uint64_t Execute(Cluster& cl, const std::string& exe, std::vector<uint64_t> args) {
  v1::ExecuteRequest req;
  req.set_session_id(cl.session);
  req.set_executable_id(exe);
  for (uint64_t a : args) req.add_arguments(a);
  const uint64_t out = cl.next_handle++;
  req.add_outputs(out);
  auto r = cl.c->Execute(req);
  if (!r.ok()) {
    std::fprintf(stderr, "tessel-scale-bench: execute: %s\n", r.status().ToString().c_str());
    std::exit(1);
  }
  return out;
}

// Coordinator CPU per worker per step, in us: `steps` steps of `exe`, each
// output released by the call two steps later (as the SDKs release what
// their programs drop).
double StepCpuPerWorker(Cluster& cl, const std::string& exe, bool replicated, int n, int steps,
                        const std::vector<uint64_t>& args = {}) {
  std::vector<uint64_t> made;  // this loop's outputs
  auto run = [&](int count) {
    for (int s = 0; s < count; ++s) {
      v1::ExecuteRequest req;
      req.set_session_id(cl.session);
      req.set_executable_id(exe);
      for (uint64_t a : args) req.add_arguments(a);
      made.push_back(cl.next_handle++);
      req.add_outputs(made.back());
      if (made.size() > 2) req.add_release(made[made.size() - 3]);
      if (replicated) req.mutable_placement()->set_replicated(true);
      auto r = cl.c->Execute(req);
      if (!r.ok()) {
        std::fprintf(stderr, "tessel-scale-bench: execute: %s\n", r.status().ToString().c_str());
        std::exit(1);
      }
    }
  };
  run(std::max(2, steps / 10));  // warm: the plan cache, the registry's tables
  const double t0 = CpuSeconds();
  run(steps);
  return (CpuSeconds() - t0) / steps / n * 1e6;
}

v1::Graph AllReduceGraph(int n) {
  const tessel::Mesh line({{"d", n}});
  const tessel::Sharding split = tessel::Sharding::Split({"d"});
  tessel::GraphBuilder g("psum");
  auto a = g.Parameter({tessel::DType::kF32, {4 * int64_t{n}}}, "a");
  auto r = g.ManualRegion(line, {a}, {split}, split,
                          [](tessel::GraphBuilder& b, const std::vector<tessel::Value>& in) {
                            return b.AllReduce(in[0], {"d"});
                          });
  auto built = g.Build({r});
  if (!built.ok()) {
    std::fprintf(stderr, "tessel-scale-bench: %s\n", built.status().ToString().c_str());
    std::exit(1);
  }
  return Parse(built->ToTextProto());
}

struct Row {
  std::string name, unit, goal, note;
  double value, baseline;
  bool met;
};

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) json = true;
    if (std::strncmp(argv[i], "--only=", 7) == 0) only = argv[i] + 7;
  }
  const int sizes[] = {64, 256, 1024};
  std::map<int, double> replicated, sharded, allreduce, compile_ms;
  // Memory: one coordinator grown from 64 to 256 to 1,024 workers; each
  // figure is the growth per worker added (the first 64 pay the process's
  // one-time allocations).
  double kib_64_256 = 0, kib_256_1024 = 0;
  {
    Cluster cl = Start(64);
    const double at64 = ResidentKiB();
    AddWorkers(cl, 64, 256);
    const double at256 = ResidentKiB();
    AddWorkers(cl, 256, 1024);
    kib_64_256 = (at256 - at64) / 192;
    kib_256_1024 = (ResidentKiB() - at256) / 768;
  }
  for (int n : sizes) {
    Cluster cl = Start(n);
    std::string iota = kIota;
    iota = absl::StrReplaceAll(iota, {{"dims: D", absl::StrCat("dims: ", 4 * n)}});
    const v1::Graph g = Parse(iota);
    const v1::Mesh mesh = LineMesh(n);
    const int steps = std::max(20, 20000 / n);
    replicated[n] = StepCpuPerWorker(cl, Compile(cl, g, nullptr, false), true, n, steps);
    const std::string split = Compile(cl, g, &mesh, true);
    sharded[n] = StepCpuPerWorker(cl, split, false, n, steps);
    // The psum's compile, partition and plan, and its first run: the
    // program loaded on every worker and the collective's group set up.
    const uint64_t x = Execute(cl, split, {});
    const v1::Graph psum = AllReduceGraph(n);
    const absl::Time t0 = absl::Now();
    const std::string psum_exe = Compile(cl, psum, &mesh, true);
    Execute(cl, psum_exe, {x});
    compile_ms[n] = absl::ToDoubleMilliseconds(absl::Now() - t0);
    allreduce[n] = StepCpuPerWorker(cl, psum_exe, false, n, steps, {x});
    std::fprintf(stderr,
                 "%5d workers: replicated %.2f us, sharded %.2f us, psum %.2f us of CPU per worker "
                 "per step; psum compiled and first run in %.1f ms\n",
                 n, replicated[n], sharded[n], allreduce[n], compile_ms[n]);
  }
  std::fprintf(stderr, "memory per worker added: %.1f KiB (64 to 256), %.1f KiB (256 to 1,024)\n",
               kib_64_256, kib_256_1024);
  // A per-step CPU row: at 1,024 workers beside 64; linear (within 1.25x) and at most 2 us.
  auto linear = [](const char* name, const char* what, std::map<int, double>& us) {
    return Row{
        name,
        "us",
        "<=1.25",
        absl::StrCat("coordinator CPU per worker per ", what,
                     ", 1,024 simulated workers vs 64 (linear: within 1.25x; and at most 2 us)"),
        us[1024],
        us[64],
        us[1024] <= 2 && us[1024] <= 1.25 * us[64]};
  };
  std::vector<Row> rows = {
      linear("sim_replicated_step_1024w", "replicated step", replicated),
      linear("sim_sharded_step_1024w", "step sharded over all of them", sharded),
      linear("sim_allreduce_step_1024w", "step of a psum over all of them", allreduce),
      {"sim_memory_per_worker", "KiB", "-",
       "coordinator resident memory per worker registered, from 256 to 1,024 workers vs from 64 to "
       "256",
       kib_256_1024, kib_64_256, true},
      {"sim_compile_allreduce_1024d", "ms", "<=1000ms",
       "compile, partition and plan of a psum over a 1,024-device mesh and its first run (loaded "
       "on every worker)",
       compile_ms[1024], 1000, compile_ms[1024] <= 1000},
  };
  if (json) std::printf("{\n");
  bool first = true;
  for (const Row& r : rows) {
    if (!only.empty() && r.name.find(only) == std::string::npos) continue;
    const double ratio = r.baseline > 0 ? r.value / r.baseline : 0;
    if (json) {
      std::printf(
          "%s  \"%s\": {\"value\": %.4g, \"baseline\": %.4g, \"ratio\": %.3f, \"goal\": \"%s\", "
          "\"unit\": \"%s\", \"met\": %s, \"note\": \"%s\"}",
          first ? "" : ",\n", r.name.c_str(), r.value, r.baseline, ratio, r.goal.c_str(),
          r.unit.c_str(), r.met ? "true" : "false", r.note.c_str());
    } else {
      std::printf("%-28s %12.3f %12.3f %-4s %7.2f  %s %s\n", r.name.c_str(), r.value, r.baseline,
                  r.unit.c_str(), ratio, r.goal.c_str(), r.met ? "" : "MISSED");
    }
    first = false;
  }
  if (json) std::printf("\n}\n");
  return 0;
}
