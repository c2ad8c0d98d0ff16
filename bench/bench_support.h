// What tessel-bench's entries share: the baseline gRPC server (a child
// process), timing helpers that alternate Tessel with its baseline, the row
// each entry reports, and the state of one run (Bench).
#pragma once

#include <errno.h>  // program_invocation_short_name
#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "core/security.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"
#include "tessel/v1/worker.grpc.pb.h"

namespace tessel::bench {

constexpr int64_t kFetchBytes = int64_t{256} << 20;

// One line of the report: Tessel's figure beside its baseline's, and the
// goal for their ratio.
struct Row {
  std::string name, unit;
  double value, baseline, goal;
  bool higher_is_better;
  std::string note;
  double ratio() const { return value / baseline; }
  bool met() const { return higher_is_better ? ratio() >= goal : ratio() <= goal; }
};

// One run: the local cluster (2 workers, 1 device each), a session on it,
// the baseline server, and the rows reported so far.
struct Bench {
  std::string dir;   // scratch, removed at the end
  std::string self;  // this binary
  int baseline_port = 0;
  std::unique_ptr<tessel::v1::Worker::Stub> baseline;
  LocalCluster::Options options;
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<Session> session;
  std::function<bool(const std::string&)> want;  // whether a row was asked for
  std::vector<Row> rows;
};

// Exits the process, saying why, on an error: a benchmark has no way on.
inline void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", program_invocation_short_name, s.ToString().c_str());
    std::exit(1);
  }
}
template <typename T>
T Check(absl::StatusOr<T> v) {
  Check(v.status());
  return std::move(*v);
}

double Median(std::vector<double> v);

template <typename F>
double TimeIt(int reps, F&& f) {  // median seconds per call
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    absl::Time s = absl::Now();
    f();
    t.push_back(absl::ToDoubleSeconds(absl::Now() - s));
  }
  return Median(t);
}

// Median seconds per call of `f` and of `g`, called in turn, so the
// machine's slow spells fall on both.
template <typename F, typename G>
std::pair<double, double> TimeAlternating(int reps, F&& f, G&& g) {
  std::vector<double> tf, tg;
  for (int i = 0; i < reps; ++i) {
    absl::Time s = absl::Now();
    f();
    tf.push_back(absl::ToDoubleSeconds(absl::Now() - s));
    s = absl::Now();
    g();
    tg.push_back(absl::ToDoubleSeconds(absl::Now() - s));
  }
  return {Median(tf), Median(tg)};
}

template <typename F>
double TimePerCall(int reps, F&& f) {  // mean seconds over a tight loop
  absl::Time s = absl::Now();
  for (int i = 0; i < reps; ++i) f();
  return absl::ToDoubleSeconds(absl::Now() - s) / reps;
}

// The bench's throwaway certificates under `pki` (MakeTestPki): the same
// files the secured cluster's daemons use.
TlsFiles BenchTls(const std::string& pki);

// Serves the baseline service until SIGTERM; over mutual TLS, as a
// worker's port is, when `pki` names the bench's certificates.
int ServeBaseline(const std::string& port_file, const std::string& pki);

// Starts this binary as a baseline server (TLS with `pki`); its port, or 0
// after saying why not.
int StartBaseline(const std::string& port_file, const std::string& pki, pid_t* pid);

// Seconds per Execute(wait) of a 1-element add, over `steps` calls.
double ExecSeconds(Session& session, int steps);

// Steps per second of `clients` sessions, each on its own thread running
// `steps` Execute(wait) calls, all at once.
double LoadStepsPerSecond(const std::string& address, const ConnectOptions& connect, int clients,
                          int steps);

// Pairs of bare unary calls per second of `clients` threads to the
// baseline server at `port`.
double BarePairsPerSecond(int port, const std::shared_ptr<grpc::ChannelCredentials>& creds,
                          int clients, int pairs);

// A throwaway CA, a certificate for 127.0.0.1, a client token and a join
// token under `d` (the openssl command). False when openssl fails.
bool MakeTestPki(const std::string& d);

// Seconds per call of `iters` back-to-back Gloo allreduces (or send/recv
// pairs) of `bytes` by a fresh pair of tessel-gloo-bench processes (the
// median call).
double GlooOnce(const Bench& b, int64_t bytes, int iters, bool sendrecv = false);

// The rows as a table, or as JSON (name -> value, baseline, ratio, goal,
// unit, met, note).
void Print(const std::vector<Row>& rows, bool json);

}  // namespace tessel::bench
