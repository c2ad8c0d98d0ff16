// tessel: the command-line client. See `tessel --help`.
#include <grpcpp/grpcpp.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <fstream>
#include <iostream>
#include <map>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/cli/checkpoint_command.h"
#include "core/process_tuning.h"
#include "core/security.h"
#include "core/status.h"
#include "google/protobuf/util/json_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tessel/graph.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"
#include "tessel/types.h"
#include "tessel/v1/admin.grpc.pb.h"

namespace {

constexpr char kUsage[] = R"usage(tessel: run array programs on a Tessel cluster.

Usage:
  tessel local --workers N --devices-per-worker D [--device-kind cpu|cuda|both] [--port P] [--verbose]
      Start a coordinator on 127.0.0.1 and N worker processes with D CPU devices
      each (--device-kind cuda: every GPU the worker sees; both: the CPU devices,
      then the GPUs); print the coordinator's address; run until Ctrl-C or
      SIGTERM, then stop every process started.
  tessel status [--coordinator HOST:PORT] [--json]
      Workers, their devices, heartbeat age and device memory. --json prints
      Admin.GetCluster's answer in protobuf's JSON mapping. With a tenant's
      token (not an admin's): the live devices and what the tenant holds.
  tessel run GRAPH.textproto --input NAME=FILE.npy ... [--fetch NAME=OUT.npy ...]
             [--device D | --replicated | --mesh AXES [--shard ...]] [--coordinator HOST:PORT]
      Compile and run a graph. Inputs are bound to parameters by name; only the
      outputs named with --fetch come back to the host (the rest are freed).
      With --mesh, each input is put as blocks over the mesh's devices.
  tessel compile GRAPH.textproto [--mesh AXES [--shard NAME=SPEC ...] [--out-shard NAME=SPEC ...]]
                 [--dot | --svg OUT.svg] [--coordinator HOST:PORT]
      Compile a graph and print the plan and the diagnostics. With --mesh the
      graph is partitioned: the plan is the per-device program, and every
      collective it needs is listed with its bytes and the reason for it.
      --dot prints the per-device program as a Graphviz digraph instead
      (fusions as boxes, collectives in colour with their bytes and reasons,
      donated parameters marked); --svg OUT.svg draws it with Graphviz's dot.

Partitioning flags:
  --mesh data=2,model=2          mesh axes over the cluster's devices 0..n-1
  --shard x="P('data', None)"    a parameter's sharding (default: replicated)
  --out-shard y="P(None, 'model')"  an output's sharding (default: chosen by
                                 propagation); P(..., unreduced=(model,)) keeps
                                 partial sums over `model`
  tessel stats [--coordinator HOST:PORT]
      Cluster counters and per-device memory: bytes in use, peak, buffers,
      cached bytes, the largest cached block and the limit.
  tessel top [--interval S] [--iterations N] [--coordinator HOST:PORT]
      A live view of each device: steps per second, queue depth, errors,
      mean step latency, memory in use and peak; refreshed every S seconds
      (default 1), N times (default: until interrupted).
  tessel profile [--duration 10s] [--out trace.json.gz] [--max-events N] [--coordinator HOST:PORT]
      Record a trace of the whole cluster for the duration (1 ms .. 10 min)
      and write it as Chrome/Perfetto trace-event JSON (gzipped when OUT ends
      in .gz): each device's steps, kernels and collectives (waiting for peers
      vs moving data), transfers, memory in use, and the coordinator's
      compiles and dispatches, on the coordinator's clock (each worker's
      offset and its error bound in otherData). Open it in ui.perfetto.dev or
      chrome://tracing. Needs an admin token on a secured cluster.
  tessel checkpoint ls DIRECTORY
  tessel checkpoint inspect PATH [--verify]
      A checkpoint directory read where it lies (no cluster needed): ls lists
      the checkpoints under DIRECTORY (committed or not, step, arrays, bytes);
      inspect lists a checkpoint's arrays, their chunks and placements, and
      with --verify reads every chunk and checks its CRC32C (exit 1 if one is
      missing, torn or corrupt).
  tessel health [--address HOST:PORT] [--service NAME] [--timeout S]
                [--tls-ca CA.pem [--tls-cert C.pem --tls-key K.pem] [--tls-server-name NAME]]
      Ask a daemon (coordinator or worker; default: the coordinator) its
      grpc.health.v1 status; exit 0 when SERVING, 1 otherwise or without an
      answer within S seconds (default 3). A probe for containers and scripts.

The coordinator address comes from --coordinator, else $TESSEL_COORDINATOR.
A secured cluster: --token TOKEN (else $TESSEL_TOKEN) is the client's bearer
token; --tls-ca CA.pem (else $TESSEL_TLS_CA) turns TLS on and verifies the
daemon's certificate.
Arrays are .npy files; bf16 travels as two-byte void ('<V2'), as ml_dtypes' bfloat16 saves it.
)usage";

struct Args {
  std::string command;
  std::vector<std::string> positional;
  std::multimap<std::string, std::string> flags;

  std::string Get(const std::string& k, const std::string& def = "") const {
    auto it = flags.find(k);
    return it == flags.end() ? def : it->second;
  }
  std::vector<std::string> All(const std::string& k) const {
    std::vector<std::string> out;
    for (auto [it, end] = flags.equal_range(k); it != end; ++it) out.push_back(it->second);
    return out;
  }
};

const std::set<std::string> kBoolFlags = {"verbose", "replicated", "help", "json", "verify", "dot"};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s.rfind("--", 0) == 0) {
      std::string key = s.substr(2), value;
      if (auto eq = key.find('='); eq != std::string::npos) {
        value = key.substr(eq + 1);
        key = key.substr(0, eq);
      } else if (kBoolFlags.contains(key)) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      }
      a.flags.emplace(key, value);
    } else if (s == "-h") {
      a.flags.emplace("help", "true");
    } else if (a.command.empty()) {
      a.command = s;
    } else {
      a.positional.push_back(s);
    }
  }
  return a;
}

// The flags and the number of operands (the graph) each command takes; any
// other flag is refused rather than ignored.
struct CommandSpec {
  std::set<std::string> flags;
  size_t operands = 0;
};
const std::map<std::string, CommandSpec> kCommands = {
    {"local", {{"workers", "devices-per-worker", "device-kind", "port", "verbose"}}},
    {"status", {{"coordinator", "json", "token", "tls-ca"}}},
    {"stats", {{"coordinator", "token", "tls-ca"}}},
    {"run",
     {{"input", "fetch", "device", "replicated", "mesh", "shard", "out-shard", "coordinator",
       "token", "tls-ca"},
      1}},
    {"compile",
     {{"mesh", "shard", "out-shard", "coordinator", "token", "tls-ca", "dot", "svg"}, 1}},
    {"health",
     {{"address", "service", "timeout", "coordinator", "tls-ca", "tls-cert", "tls-key",
       "tls-server-name"}}},
    {"top", {{"coordinator", "interval", "iterations", "token", "tls-ca"}}},
    {"checkpoint", {{"verify"}, 2}},
    {"profile", {{"coordinator", "duration", "out", "max-events", "token", "tls-ca"}}},
};

// Empty when `a` fits its command; else what is wrong, naming the flag.
std::string CheckArgs(const Args& a, const CommandSpec& spec) {
  for (const auto& [key, value] : a.flags) {
    if (key == "help" || spec.flags.contains(key)) continue;
    std::vector<std::string> known;
    for (const auto& f : spec.flags) known.push_back("--" + f);
    return absl::StrCat("unknown flag --", key, "; '", a.command, "' takes ",
                        known.empty() ? "no flags" : absl::StrJoin(known, ", "));
  }
  if (a.positional.size() != spec.operands) {
    const std::string want = spec.operands == 0   ? "no operand"
                             : spec.operands == 1 ? "one graph file"
                                                  : "a subcommand and a path";
    return absl::StrCat("expected ", want, ", got ", a.positional.size(),
                        a.positional.empty() ? "" : ": " + absl::StrJoin(a.positional, " "));
  }
  return "";
}

int Fail(const absl::Status& s) {
  std::cerr << "tessel: " << s.message() << " [" << absl::StatusCodeToString(s.code()) << "]\n";
  return 1;
}

absl::StatusOr<std::unique_ptr<tessel::Session>> Connect(const Args& a) {
  auto addr = tessel::ResolveCoordinatorAddress(a.Get("coordinator"));
  if (!addr.ok()) return addr.status();
  tessel::ConnectOptions o;
  o.client_name = "tessel-cli";
  o.token = a.Get("token");
  o.tls_ca_file = a.Get("tls-ca");
  return tessel::Session::Connect(*addr, o);
}

// A channel with the CLI's --token and --tls-ca (else $TESSEL_TOKEN and
// $TESSEL_TLS_CA), for the calls made without a session.
std::shared_ptr<grpc::Channel> Channel(const Args& a, const std::string& address) {
  auto flag_or_env = [&](const char* flag, const char* var) {
    std::string v = a.Get(flag);
    if (const char* e = std::getenv(var); v.empty() && e != nullptr) v = e;
    return v;
  };
  tessel::TlsFiles tls;
  tls.ca = flag_or_env("tls-ca", "TESSEL_TLS_CA");
  tls.cert = a.Get("tls-cert");
  tls.key = a.Get("tls-key");
  grpc::ChannelArguments args;
  if (const std::string name = a.Get("tls-server-name"); !name.empty())
    args.SetSslTargetNameOverride(name);
  return tessel::CreateChannelWithToken(address, tessel::ChannelCredentials(tls), args,
                                        flag_or_env("token", "TESSEL_TOKEN"));
}

// Writes `data` to `path`, gzipped when the path ends in .gz.
absl::Status WriteMaybeGzipped(const std::string& path, const std::string& data) {
  if (absl::EndsWith(path, ".gz")) {
    gzFile f = gzopen(path.c_str(), "wb");
    if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot write ", path));
    const bool ok = gzwrite(f, data.data(), unsigned(data.size())) == int(data.size());
    if (gzclose(f) != Z_OK || !ok)
      return absl::DataLossError(absl::StrCat("writing ", path, " failed"));
    return absl::OkStatus();
  }
  std::ofstream f(path, std::ios::binary);
  f.write(data.data(), std::streamsize(data.size()));
  f.close();
  if (!f) return absl::DataLossError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

std::string Bytes(int64_t b) {
  if (b >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / double(1 << 30));
  if (b >= (1 << 20)) return absl::StrFormat("%.2f MiB", b / double(1 << 20));
  if (b >= (1 << 10)) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrCat(b, " B");
}

int Local(const Args& a) {
  int workers = 2, devices = 1, port = 0;
  if (!absl::SimpleAtoi(a.Get("workers", "2"), &workers) ||
      !absl::SimpleAtoi(a.Get("devices-per-worker", "1"), &devices) ||
      !absl::SimpleAtoi(a.Get("port", "0"), &port)) {
    return Fail(
        absl::InvalidArgumentError("--workers, --devices-per-worker and --port take integers"));
  }
  tessel::LocalCluster::Options o;
  o.workers = workers;
  o.devices_per_worker = devices;
  o.port = port;
  o.inherit_output = a.Get("verbose") == "true";
  const std::string kind = a.Get("device-kind", "cpu");
  if (kind != "cpu" && kind != "cuda" && kind != "both") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--device-kind: expected cpu, cuda or both, got '", kind, "'")));
  }
  o.worker_flags.push_back("--device_kind=" + kind);
  auto cluster = tessel::LocalCluster::Start(o);
  if (!cluster.ok()) return Fail(cluster.status());
  std::cout << (*cluster)->address() << std::endl;
  std::cerr << "tessel local: coordinator on " << (*cluster)->address() << " with " << workers
            << " workers x " << devices << " " << kind << " devices; logs in "
            << (*cluster)->log_dir() << "\n"
            << "  export TESSEL_COORDINATOR=" << (*cluster)->address() << "\n"
            << "Ctrl-C stops the cluster." << std::endl;
  int sig = tessel::WaitForTerminationSignal();
  std::cerr << "tessel local: signal " << sig << ", stopping " << workers + 1 << " processes"
            << std::endl;
  (*cluster)->Stop();
  return 0;
}

void PrintCluster(const tessel::ClusterStatus& c) {
  std::cout << absl::StrFormat("%-6s %-22s %-6s %-10s %s\n", "worker", "address", "state",
                               "heartbeat", "devices");
  for (const auto& w : c.workers) {
    std::cout << absl::StrFormat(
        "%-6s %-22s %-6s %-10s %s\n", w.id, w.address, w.alive ? "alive" : "dead",
        absl::StrCat(w.ms_since_heartbeat, " ms ago"), absl::StrJoin(w.devices, ","));
    for (const auto& m : w.memory) {
      std::cout << absl::StrFormat(
          "         device %-3d in use %-12s peak %-12s buffers %-6d cached %-12s largest free "
          "%-12s limit %s\n",
          m.device, Bytes(m.bytes_in_use), Bytes(m.peak_bytes_in_use), m.num_buffers,
          Bytes(m.bytes_cached), Bytes(m.largest_free_block),
          m.bytes_limit ? Bytes(m.bytes_limit) : "none");
    }
  }
  std::cout << absl::StrFormat(
      "%d live devices, %d sessions, %d live arrays, %d compiles (%d cache hits), %d executions\n",
      c.num_devices(), c.sessions, c.live_arrays, c.compiles, c.compile_cache_hits, c.executions);
}

// Admin.GetCluster (with device memory) over the CLI's channel.
absl::StatusOr<tessel::v1::GetClusterResponse> GetCluster(const Args& a) {
  auto addr = tessel::ResolveCoordinatorAddress(a.Get("coordinator"));
  if (!addr.ok()) return addr.status();
  auto admin = tessel::v1::Admin::NewStub(Channel(a, *addr));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  tessel::v1::GetClusterRequest req;
  req.set_with_memory(true);
  tessel::v1::GetClusterResponse resp;
  if (grpc::Status st = admin->GetCluster(&ctx, req, &resp); !st.ok()) {
    const bool unreachable = st.error_code() == grpc::StatusCode::UNAVAILABLE ||
                             st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                        absl::StrCat(unreachable ? "no coordinator at " : "coordinator ", *addr,
                                     ": ", st.error_message()));
  }
  return resp;
}

// `tessel status --json`: Admin.GetCluster's answer (with device memory) in
// protobuf's JSON mapping, so its schema is the API's (proto/tessel/v1/admin.proto).
int StatusJson(const Args& a) {
  auto got = GetCluster(a);
  if (!got.ok()) return Fail(got.status());
  const tessel::v1::GetClusterResponse& resp = *got;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.always_print_primitive_fields = true;
  std::string json;
  if (auto st = google::protobuf::util::MessageToJsonString(resp, &json, o); !st.ok()) {
    return Fail(absl::InternalError(absl::StrCat("cluster status as JSON: ", st.ToString())));
  }
  std::cout << json;
  return 0;
}

int Status(const Args& a) {
  if (a.Get("json") == "true") return StatusJson(a);
  auto s = Connect(a);
  if (!s.ok()) return Fail(s.status());
  auto c = (*s)->Cluster(/*with_memory=*/true);
  if (c.ok()) {
    PrintCluster(*c);
    return 0;
  }
  if (c.status().code() != absl::StatusCode::kPermissionDenied) return Fail(c.status());
  // A tenant's token: where its devices are, and what it holds on each.
  auto devices = (*s)->Devices();
  if (!devices.ok()) return Fail(devices.status());
  std::cout << absl::StrFormat("%-6s %-6s %-24s %-14s %s\n", "device", "kind", "worker",
                               "yours in use", "buffers");
  for (const tessel::DeviceView& d : *devices) {
    std::cout << absl::StrFormat("%-6d %-6s %-24s %-14s %d\n", d.id, d.kind, d.worker_id,
                                 Bytes(d.bytes_in_use), d.num_buffers);
  }
  std::cout << devices->size()
            << " live devices (a tenant's view: cluster-wide figures need an admin token)\n";
  return 0;
}

absl::StatusOr<std::pair<std::string, std::string>> SplitBinding(const std::string& flag,
                                                                 const std::string& s) {
  auto eq = s.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == s.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " '", s, "': expected NAME=FILE.npy"));
  }
  return std::make_pair(s.substr(0, eq), s.substr(eq + 1));
}

// --mesh, --shard and --out-shard as compile options (none: unpartitioned).
absl::StatusOr<tessel::CompileOptions> PartitionOptions(const Args& a, const tessel::Graph& g) {
  tessel::CompileOptions o;
  const std::string mesh = a.Get("mesh");
  if (mesh.empty()) {
    if (!a.All("shard").empty() || !a.All("out-shard").empty()) {
      return absl::InvalidArgumentError("--shard and --out-shard need --mesh");
    }
    return o;
  }
  TESSEL_ASSIGN_OR_RETURN(o.mesh, tessel::Mesh::Parse(mesh));
  // Binds NAME=SPEC flags to positions in `names`.
  auto bind = [](const std::string& flag, const std::vector<std::string>& flags,
                 const std::vector<std::string>& names, const tessel::Sharding& fill,
                 std::vector<tessel::Sharding>& out) -> absl::Status {
    if (flags.empty()) return absl::OkStatus();
    out.assign(names.size(), fill);
    for (const std::string& b : flags) {
      auto eq = b.find('=');
      const std::string name = b.substr(0, eq);
      auto it = std::find(names.begin(), names.end(), name);
      if (eq == std::string::npos || it == names.end()) {
        return absl::InvalidArgumentError(absl::StrCat("--", flag, " '", b,
                                                       "': expected NAME=SPEC with NAME one of ",
                                                       absl::StrJoin(names, ", ")));
      }
      TESSEL_ASSIGN_OR_RETURN(out[it - names.begin()], tessel::Sharding::Parse(b.substr(eq + 1)));
    }
    return absl::OkStatus();
  };
  TESSEL_RETURN_IF_ERROR(bind("shard", a.All("shard"), g.parameter_names(),
                              tessel::Sharding::Replicated(), o.parameter_shardings));
  TESSEL_RETURN_IF_ERROR(bind("out-shard", a.All("out-shard"), g.output_names(),
                              tessel::Sharding::Unspecified(), o.output_shardings));
  return o;
}

int Compile(const Args& a) {
  if (a.positional.size() != 1)
    return Fail(absl::InvalidArgumentError("compile: expected one GRAPH.textproto"));
  auto g = tessel::Graph::FromFile(a.positional[0]);
  if (!g.ok()) return Fail(g.status());
  auto options = PartitionOptions(a, *g);
  if (!options.ok()) return Fail(options.status());
  auto s = Connect(a);
  if (!s.ok()) return Fail(s.status());
  auto exe = (*s)->Compile(*g, *options);
  if (!exe.ok()) return Fail(exe.status());
  if (a.Get("dot") == "true" || !a.Get("svg").empty()) {
    auto dot = (*s)->PlanDot(*exe);
    if (!dot.ok()) return Fail(dot.status());
    if (a.Get("svg").empty()) {
      std::cout << *dot;
      return 0;
    }
    // Graphviz draws it: `dot -Tsvg -o FILE`, the DOT text on its stdin.
    const std::string command = absl::StrCat("dot -Tsvg -o '", a.Get("svg"), "'");
    FILE* pipe = popen(command.c_str(), "w");
    if (pipe == nullptr)
      return Fail(absl::UnavailableError("compile --svg: cannot run Graphviz's dot"));
    fwrite(dot->data(), 1, dot->size(), pipe);
    if (const int rc = pclose(pipe); rc != 0) {
      return Fail(absl::UnavailableError(absl::StrCat("compile --svg: Graphviz's dot failed (exit ",
                                                      rc, "); is it installed (graphviz)?")));
    }
    std::cout << "wrote " << a.Get("svg") << "\n";
    return 0;
  }
  std::cout << exe->plan();
  for (const std::string& d : exe->diagnostics()) std::cout << d << "\n";
  std::cout << "executable " << exe->id()
            << (exe->cache_hit() ? " (cache hit)"
                                 : absl::StrCat(" (compiled: ", exe->cache_miss_reason(), ")"))
            << "\n";
  return 0;
}

int Run(const Args& a) {
  if (a.positional.size() != 1)
    return Fail(absl::InvalidArgumentError("run: expected one GRAPH.textproto"));
  auto g = tessel::Graph::FromFile(a.positional[0]);
  if (!g.ok()) return Fail(g.status());
  std::map<std::string, std::string> inputs, fetches;
  for (const std::string& b : a.All("input")) {
    auto kv = SplitBinding("input", b);
    if (!kv.ok()) return Fail(kv.status());
    inputs.insert(*kv);
  }
  for (const std::string& b : a.All("fetch")) {
    auto kv = SplitBinding("fetch", b);
    if (!kv.ok()) return Fail(kv.status());
    fetches.insert(*kv);
  }
  tessel::Placement placement;
  if (a.Get("replicated") == "true") {
    placement = tessel::Placement::Replicated();
  } else if (!absl::SimpleAtoi(a.Get("device", "0"), &placement.device)) {
    return Fail(absl::InvalidArgumentError("--device takes an integer"));
  }
  const std::vector<std::string> params = g->parameter_names();
  const std::vector<std::string> outputs = g->output_names();
  for (const auto& [name, file] : inputs) {
    if (std::find(params.begin(), params.end(), name) == params.end()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--input ", name, ": the graph has no parameter '", name,
                       "' (parameters: ", absl::StrJoin(params, ", "), ")")));
    }
  }
  for (const auto& [name, file] : fetches) {
    if (std::find(outputs.begin(), outputs.end(), name) == outputs.end()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--fetch ", name, ": the graph has no output '", name,
                       "' (outputs: ", absl::StrJoin(outputs, ", "), ")")));
    }
  }
  auto options = PartitionOptions(a, *g);
  if (!options.ok()) return Fail(options.status());
  auto s = Connect(a);
  if (!s.ok()) return Fail(s.status());
  tessel::Session& session = **s;
  auto exe = session.Compile(*g, *options);
  if (!exe.ok()) return Fail(exe.status());
  std::vector<tessel::Array> args;
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = inputs.find(params[i]);
    if (it == inputs.end()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("parameter '", params[i], "' (", exe->parameter_types()[i].ToString(),
                       ") has no --input ", params[i], "=FILE.npy")));
    }
    auto host = tessel::ReadNpy(it->second);
    if (!host.ok()) return Fail(host.status());
    if (!(host->type() == exe->parameter_types()[i])) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--input ", params[i], "=", it->second, ": expected ",
                       exe->parameter_types()[i].ToString(), ", got ", host->type().ToString())));
    }
    auto arr = session.Put(
        *host, exe->partitioned()
                   ? tessel::Placement::Sharded(*exe->mesh(), exe->parameter_shardings()[i])
                   : placement);
    if (!arr.ok()) return Fail(arr.status());
    args.push_back(*arr);
  }
  auto outs = session.Execute(*exe, args, {placement});
  if (!outs.ok()) return Fail(outs.status());
  if (auto st = session.Await(*outs); !st.ok()) return Fail(st);
  int rc = 0;
  std::vector<tessel::Array> unfetched;
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto it = fetches.find(outputs[i]);
    if (it == fetches.end()) {
      unfetched.push_back((*outs)[i]);
      continue;
    }
    auto host = session.Fetch((*outs)[i]);
    if (!host.ok()) return Fail(host.status());
    if (auto st = tessel::WriteNpy(it->second, *host); !st.ok()) return Fail(st);
    std::cerr << outputs[i] << " " << host->type().ToString() << " -> " << it->second << "\n";
  }
  (void)session.Delete(unfetched);
  return rc;
}

int Stats(const Args& a) { return Status(a); }

// `tessel top`: each device's steps per second (between two looks),
// queue depth, errors, mean step latency and memory, refreshed every
// --interval seconds; on a terminal the screen is redrawn in place.
int Top(const Args& a) {
  double interval = 1;
  int64_t iterations = 0;  // 0: until interrupted
  if (!absl::SimpleAtod(a.Get("interval", "1"), &interval) || !(interval > 0)) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--interval: expected a positive number of seconds, got '", a.Get("interval"), "'")));
  }
  if (!absl::SimpleAtoi(a.Get("iterations", "0"), &iterations) || iterations < 0) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--iterations: expected a count >= 0, got '", a.Get("iterations"), "'")));
  }
  const bool tty = isatty(STDOUT_FILENO);
  absl::flat_hash_map<int, int64_t> last_steps;
  absl::Time last = absl::Now();
  for (int64_t i = 0; iterations == 0 || i < iterations; ++i) {
    if (i > 0) absl::SleepFor(absl::Seconds(interval));
    auto got = GetCluster(a);
    if (!got.ok()) return Fail(got.status());
    const absl::Time now = absl::Now();
    const double secs = std::max(1e-6, absl::ToDoubleSeconds(now - last));
    absl::flat_hash_map<int, const tessel::v1::DeviceMemoryStats*> memory;
    for (const auto& w : got->workers()) {
      for (const auto& m : w.memory()) memory[m.device()] = &m;
    }
    std::string out = tty ? "\x1b[H\x1b[2J" : "";
    absl::StrAppendFormat(
        &out, "%d sessions, %d live arrays, %d executions, compile cache %s (%d evicted)\n",
        got->sessions(), got->live_arrays(), got->executions(), Bytes(got->compile_cache_bytes()),
        got->compile_cache_evictions());
    absl::StrAppendFormat(&out, "%-6s %-16s %-6s %9s %6s %7s %9s %12s %12s\n", "device", "worker",
                          "state", "steps/s", "queue", "errors", "mean ms", "in use", "peak");
    for (const auto& w : got->workers()) {
      const std::string state = !w.alive() ? "dead" : w.cordoned() ? "cordon" : "alive";
      for (const auto& d : w.devices()) {
        const auto prev = last_steps.find(d.id());
        const std::string rate = i == 0 || prev == last_steps.end()
                                     ? "-"
                                     : absl::StrFormat("%.1f", (d.steps() - prev->second) / secs);
        last_steps[d.id()] = d.steps();
        const auto m = memory.find(d.id());
        absl::StrAppendFormat(&out, "%-6d %-16s %-6s %9s %6d %7d %9.3f %12s %12s\n", d.id(),
                              w.worker_id(), state, rate, d.queue_depth(), d.step_errors(),
                              d.mean_step_ms(),
                              m == memory.end() ? "-" : Bytes(m->second->bytes_in_use()),
                              m == memory.end() ? "-" : Bytes(m->second->peak_bytes_in_use()));
      }
    }
    std::cout << out << std::flush;
    last = now;
  }
  return 0;
}

int Health(const Args& a) {
  double timeout_s = 3;
  if (!absl::SimpleAtod(a.Get("timeout", "3"), &timeout_s) || !(timeout_s > 0)) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--timeout: expected a positive number of seconds, got '", a.Get("timeout"), "'")));
  }
  std::string address = a.Get("address");
  if (address.empty()) {
    auto resolved = tessel::ResolveCoordinatorAddress(a.Get("coordinator"));
    if (!resolved.ok()) return Fail(resolved.status());
    address = *resolved;
  }
  auto stub = grpc::health::v1::Health::NewStub(Channel(a, address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::duration_cast<std::chrono::system_clock::duration>(
                       std::chrono::duration<double>(timeout_s)));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(a.Get("service"));
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status st = stub->Check(&ctx, request, &response);
  std::string what = request.service().empty()
                         ? address
                         : absl::StrCat(address, " (service '", request.service(), "')");
  if (st.error_code() == grpc::StatusCode::NOT_FOUND) {
    std::cerr << "tessel health: " << address << " has no status for the service '"
              << request.service()
              << "' (it reports the whole server under '' and each of its services by full name)\n";
    return 1;
  }
  if (!st.ok()) {
    std::cerr << "tessel health: no answer from " << what << " within " << timeout_s
              << " s: " << st.error_message() << " ["
              << absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code())) << "]\n";
    return 1;
  }
  const std::string& status =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  (response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? std::cout : std::cerr)
      << what << ": " << status << "\n";
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

// `tessel profile`: Admin.StartTrace, the duration, Admin.StopTrace, the file.
int Profile(const Args& a) {
  absl::Duration duration;
  const std::string d = a.Get("duration", "10s");
  double seconds = 0;
  if (absl::SimpleAtod(d, &seconds)) {
    duration = absl::Seconds(seconds);
  } else if (!absl::ParseDuration(d, &duration)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--duration: expected a duration such as 10s, 500ms or 2m, got '", d, "'")));
  }
  int64_t max_events = 0;
  if (!absl::SimpleAtoi(a.Get("max-events", "0"), &max_events)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--max-events: expected an integer, got '", a.Get("max-events"), "'")));
  }
  const std::string out = a.Get("out", "trace.json.gz");
  auto addr = tessel::ResolveCoordinatorAddress(a.Get("coordinator"));
  if (!addr.ok()) return Fail(addr.status());
  auto admin = tessel::v1::Admin::NewStub(Channel(a, *addr));
  auto failed = [&](const char* call, const grpc::Status& st) {
    return Fail(
        absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                     absl::StrCat("coordinator ", *addr, ": ", call, ": ", st.error_message())));
  };
  tessel::v1::StartTraceRequest start;
  start.set_duration_ms(absl::ToInt64Milliseconds(duration));
  start.set_max_events_per_process(max_events);
  tessel::v1::StartTraceResponse started;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (grpc::Status st = admin->StartTrace(&ctx, start, &started); !st.ok())
      return failed("StartTrace", st);
  }
  std::cerr << "tessel profile: tracing the coordinator and " << started.workers_size()
            << " workers for " << absl::FormatDuration(duration) << "\n";
  absl::SleepFor(duration);
  std::string json;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    auto reader = admin->StopTrace(&ctx, tessel::v1::StopTraceRequest());
    tessel::v1::TraceChunk chunk;
    while (reader->Read(&chunk)) json += chunk.json();
    if (grpc::Status st = reader->Finish(); !st.ok()) return failed("StopTrace", st);
  }
  if (absl::Status w = WriteMaybeGzipped(out, json); !w.ok()) return Fail(w);
  std::cout << "wrote " << out << " (" << Bytes(int64_t(json.size()))
            << " of trace-event JSON); open it in https://ui.perfetto.dev or chrome://tracing\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  tessel::BlockTerminationSignals();
  tessel::TuneAllocatorForStreaming();
  tessel::SkipMutexCycleDetection();
  Args a = Parse(argc, argv);
  if (a.command.empty() || a.command == "help" || a.Get("help") == "true") {
    std::cout << kUsage;
    return a.command.empty() && a.Get("help") != "true" ? 2 : 0;
  }
  if (auto spec = kCommands.find(a.command); spec != kCommands.end()) {
    if (std::string wrong = CheckArgs(a, spec->second); !wrong.empty()) {
      std::cerr << "tessel " << a.command << ": " << wrong
                << " (tessel help lists each command's flags)\n";
      return 2;
    }
  }
  if (a.command == "local") return Local(a);
  if (a.command == "status") return Status(a);
  if (a.command == "run") return Run(a);
  if (a.command == "compile") return Compile(a);
  if (a.command == "stats") return Stats(a);
  if (a.command == "health") return Health(a);
  if (a.command == "top") return Top(a);
  if (a.command == "profile") return Profile(a);
  if (a.command == "checkpoint") {
    return tessel::cli::CheckpointCommand(a.positional, a.Get("verify") == "true");
  }
  std::cerr << "tessel: unknown command '" << a.command << "'\n\n" << kUsage;
  return 2;
}
