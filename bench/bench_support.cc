#include "bench/bench_support.h"

#include <grpcpp/grpcpp.h>
#include <spawn.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/process_tuning.h"
#include "core/security.h"
#include "tessel/graph.h"

extern char** environ;

namespace tessel::bench {
namespace {

// The baseline server: the cheapest unary handler and a stream of
// preallocated bytes, on the same message types Tessel uses.
class BaselineService final : public tessel::v1::Worker::Service {
 public:
  BaselineService() : bytes_(kFetchBytes, 'x'), sink_(kFetchBytes, 'y') {}
  grpc::Status GetVersion(grpc::ServerContext*, const tessel::v1::GetVersionRequest*,
                          tessel::v1::GetVersionResponse* r) override {
    r->set_version(1);
    return grpc::Status::OK;
  }
  grpc::Status FetchShard(grpc::ServerContext*, const tessel::v1::FetchShardRequest* req,
                          grpc::ServerWriter<tessel::v1::FetchShardResponse>* w) override {
    tessel::v1::FetchShardResponse msg;
    const int64_t chunk = 1 << 20;
    for (int64_t off = 0; off < kFetchBytes; off += chunk) {
      msg.mutable_data()->assign(bytes_.data() + off, chunk);
      if (!w->Write(msg)) break;
    }
    return grpc::Status::OK;
  }
  // Takes a stream of bytes into place, as a worker does a put's.
  grpc::Status PutShard(grpc::ServerContext*, grpc::ServerReader<tessel::v1::PutShardRequest>* r,
                        tessel::v1::PutShardResponse*) override {
    tessel::v1::PutShardRequest msg;
    size_t off = 0;
    while (r->Read(&msg)) {
      const std::string& d = msg.data();
      const size_t n = std::min(d.size(), sink_.size() - off);
      std::memcpy(sink_.data() + off, d.data(), n);
      off += n;
    }
    return grpc::Status::OK;
  }

 private:
  std::string bytes_;
  std::string sink_;
};

}  // namespace

// The bench's throwaway certificates under `pki` (MakeTestPki): the same
// files the secured cluster's daemons use.
tessel::TlsFiles BenchTls(const std::string& pki) {
  return {pki + "/d.pem", pki + "/d.key", pki + "/ca.pem"};
}

// Serves BaselineService until SIGTERM; over mutual TLS, as a worker's port
// is, when `pki` names the bench's certificates. The process raises glibc's
// mmap/trim thresholds as every Tessel daemon does, so the fetch row's
// baseline is a tuned stream, not one paying a page fault per 4 KiB.
int ServeBaseline(const std::string& port_file, const std::string& pki) {
  tessel::BlockTerminationSignals();
  tessel::TuneAllocatorForStreaming();  // a tuned stream, as the daemons' own
  BaselineService service;
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0",
                     pki.empty() ? grpc::InsecureServerCredentials()
                                 : tessel::ServerCredentials(BenchTls(pki), true),
                     &port);
  b.RegisterService(&service);
  auto server = b.BuildAndStart();
  std::ofstream(port_file + ".tmp") << port << "\n";
  std::rename((port_file + ".tmp").c_str(), port_file.c_str());
  tessel::WaitForTerminationSignal();
  server->Shutdown();
  return 0;
}

// Starts this binary as a baseline server (TLS with `pki`); its port, or 0
// after saying why not.
int StartBaseline(const std::string& port_file, const std::string& pki, pid_t* pid) {
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::string arg = "--serve-baseline=" + port_file, tls_arg = "--baseline-tls=" + pki;
  char* child_argv[] = {self.data(), arg.data(), pki.empty() ? nullptr : tls_arg.data(), nullptr};
  if (posix_spawn(pid, self.c_str(), nullptr, nullptr, child_argv, environ) != 0) {
    std::fprintf(stderr, "tessel-bench: cannot start the baseline server\n");
    return 0;
  }
  int port = 0;
  for (int i = 0; i < 1000 && port == 0; ++i) {
    std::ifstream in(port_file);
    if (!(in >> port)) port = 0;
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (port == 0) std::fprintf(stderr, "tessel-bench: the baseline server did not start\n");
  return port;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds per Execute(wait) of a 1-element add, over `steps` calls; the
// outputs are freed in batches, outside the count.
double ExecSeconds(tessel::Session& session, int steps) {
  GraphBuilder g("add1");
  auto x = g.Parameter({DType::kF32, {1}}, "x");
  auto exe = Check(session.Compile(Check(g.Build({g.Add(x, x)}))));
  auto xa = Check(session.Put(HostArray::From<float>({1}, {1.f})));
  std::vector<tessel::Array> garbage;
  auto step = [&] {
    auto outs = Check(session.Execute(exe, {xa}, {tessel::Placement::Device(0), true}));
    garbage.insert(garbage.end(), outs.begin(), outs.end());
    if (garbage.size() >= 500) {
      Check(session.Delete(garbage));
      garbage.clear();
    }
  };
  for (int i = 0; i < 100; ++i) step();
  const double t = TimePerCall(steps, step);
  Check(session.Delete(garbage));
  Check(session.Delete({xa}));
  return t;
}

// Steps per second of `clients` sessions, each on its own thread running
// `steps` Execute(wait) calls, all at once.
double LoadStepsPerSecond(const std::string& address, const tessel::ConnectOptions& connect,
                          int clients, int steps) {
  std::vector<std::unique_ptr<tessel::Session>> sessions;
  for (int i = 0; i < clients; ++i)
    sessions.push_back(Check(tessel::Session::Connect(address, connect)));
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (auto& s : sessions) threads.emplace_back([&s, steps] { ExecSeconds(*s, steps); });
  for (auto& t : threads) t.join();
  return double(clients) * steps / absl::ToDoubleSeconds(absl::Now() - start);
}

// Pairs of bare unary calls per second (the two hops of a step, with no work
// between) of `clients` threads, each with its own channel, `pairs` each,
// all at once, to the baseline server at `port`.
double BarePairsPerSecond(int port, const std::shared_ptr<grpc::ChannelCredentials>& creds,
                          int clients, int pairs) {
  std::vector<std::unique_ptr<tessel::v1::Worker::Stub>> stubs;
  for (int i = 0; i < clients; ++i) {
    stubs.push_back(
        tessel::v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), creds)));
  }
  auto run = [&stubs](int i, int n) {
    for (int k = 0; k < 2 * n; ++k) {
      grpc::ClientContext ctx;
      tessel::v1::GetVersionResponse r;
      if (!stubs[i]->GetVersion(&ctx, tessel::v1::GetVersionRequest(), &r).ok())
        Check(absl::UnavailableError("bare"));
    }
  };
  for (int i = 0; i < clients; ++i) run(i, 50);  // connected and warm
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int i = 0; i < clients; ++i) threads.emplace_back(run, i, pairs);
  for (auto& t : threads) t.join();
  return double(clients) * pairs / absl::ToDoubleSeconds(absl::Now() - start);
}

// A throwaway CA, one certificate for 127.0.0.1 signed by it (the openssl
// command), a client token and a join token, under `d`. False when openssl
// fails.
bool MakeTestPki(const std::string& d) {
  std::filesystem::create_directories(d);
  std::ofstream(d + "/ext")
      << "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n";
  std::ofstream(d + "/tokens") << "bench-token bench admin\n";
  std::ofstream(d + "/join") << "bench-join-token\n";
  auto run = [&](const std::string& cmd) {
    return std::system(("cd " + d + " && openssl " + cmd + " >/dev/null 2>&1").c_str()) == 0;
  };
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  return run("req -x509 " + ec + " -days 1 -subj /CN=tessel-bench-ca -keyout ca.key -out ca.pem") &&
         run("req " + ec + " -subj /CN=tessel-bench -keyout d.key -out d.csr") &&
         run("x509 -req -in d.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -extfile ext "
             "-out d.pem");
}

double GlooOnce(const Bench& b, int64_t bytes, int iters, bool sendrecv) {
  const std::string cmd = std::filesystem::path(b.self).parent_path().string() +
                          "/tessel-gloo-bench --iters=" + std::to_string(iters) +
                          (sendrecv ? " --sendrecv " : " ") + std::to_string(bytes);
  const std::string format =
      sendrecv ? "gloo_sendrecv bytes=%lld seconds=%lf" : "gloo_allreduce bytes=%lld seconds=%lf";
  FILE* f = popen(cmd.c_str(), "r");
  char line[256];
  double secs = 0;
  while (f != nullptr && std::fgets(line, sizeof line, f)) {
    long long b = 0;
    double t = 0;
    if (std::sscanf(line, format.c_str(), &b, &t) == 2 && b == bytes) secs = t;
  }
  if (f == nullptr || pclose(f) != 0 || secs <= 0)
    Check(absl::InternalError(absl::StrCat("failed: ", cmd)));
  return secs;
}

// `s` as the inside of a JSON string: quotes, backslashes and control
// characters escaped, UTF-8 as it is.
namespace {

std::string JsonString(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += absl::StrFormat("\\u%04x", ch);
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace

void Print(const std::vector<Row>& rows, bool json) {
  if (json) {
    std::printf("{");
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::printf(
          "%s\n  \"%s\": {\"value\": %.4g, \"baseline\": %.4g, \"ratio\": %.3f, \"goal\": "
          "\"%s%.2f\", \"unit\": \"%s\", \"met\": %s, \"note\": \"%s\"}",
          i ? "," : "", r.name.c_str(), r.value, r.baseline, r.ratio(),
          r.higher_is_better ? ">=" : "<=", r.goal, r.unit.c_str(), r.met() ? "true" : "false",
          JsonString(r.note).c_str());
    }
    std::printf("\n}\n");
    return;
  }
  std::printf("%-16s %12s %12s %-8s %7s %8s  %s\n", "benchmark", "tessel", "baseline", "unit",
              "ratio", "goal", "what");
  for (const Row& r : rows) {
    std::printf("%-16s %12.2f %12.2f %-8s %7.2f %3s%4.2f%s  %s\n", r.name.c_str(), r.value,
                r.baseline, r.unit.c_str(), r.ratio(), r.higher_is_better ? ">=" : "<=", r.goal,
                r.met() ? " " : "!", r.note.c_str());
  }
}

}  // namespace tessel::bench
