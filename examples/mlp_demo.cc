// Trains a two-layer MLP on a synthetic regression task on a local Tessel
// cluster of two worker processes, three ways from the same start:
//   1. on one device;
//   2. data-parallel: the batch split over {data: 2}, one device per worker;
//   3. model-parallel: the hidden layer split over {model: 2}.
// Forward and backward pass are one graph, the gradients taken by the
// compiler (GraphBuilder::ValueAndGrad; a fourth run steps with them written
// out by hand, and must agree); the weights stay on the devices
// between steps and only the loss comes back. The partitioned plans are
// printed with every collective and the reason for it, and the three runs
// must reach the same loss. At the end the trained weights are evaluated on
// held-out data on the other worker, and the cluster's stats are printed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/process_tuning.h"
#include "examples/mlp_model.h"
#include "tessel/graph.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"

#define TESSEL_DEMO_CONCAT2(a, b) a##b
#define TESSEL_DEMO_CONCAT(a, b) TESSEL_DEMO_CONCAT2(a, b)
#define TESSEL_DEMO_ASSIGN(lhs, expr)                                                           \
  auto TESSEL_DEMO_CONCAT(r_, __LINE__) = (expr);                                               \
  if (!TESSEL_DEMO_CONCAT(r_, __LINE__).ok()) return TESSEL_DEMO_CONCAT(r_, __LINE__).status(); \
  lhs = std::move(*TESSEL_DEMO_CONCAT(r_, __LINE__))
#define TESSEL_DEMO_RETURN_IF_ERROR(expr) \
  do {                                    \
    absl::Status s_ = (expr);             \
    if (!s_.ok()) return s_;              \
  } while (0)

namespace {

constexpr int64_t kBatch = 512, kIn = 16, kHidden = 64;
constexpr int kSteps = 400, kReportEvery = 40;
constexpr float kLearningRate = 0.1f;

using tessel::HostArray;

const tessel::mlp::Shape kShape{
    .batch = kBatch, .in = kIn, .hidden = kHidden, .out = 1, .learning_rate = kLearningRate};
tessel::ArrayType F32(std::vector<int64_t> dims) { return tessel::mlp::F32(std::move(dims)); }

// A fixed random "teacher" function the student learns: y = sin(x . u) + 0.5 * (x . v)^2 / kIn.
void MakeData(std::mt19937& rng, HostArray& x, HostArray& y) {
  std::normal_distribution<float> n(0.f, 1.f);
  static std::vector<float> u, v;
  if (u.empty()) {
    std::mt19937 teacher(7);
    for (int i = 0; i < kIn; ++i) {
      u.push_back(n(teacher) / std::sqrt(float(kIn)));
      v.push_back(n(teacher) / std::sqrt(float(kIn)));
    }
  }
  x = HostArray(F32({kBatch, kIn}));
  y = HostArray(F32({kBatch, 1}));
  auto xs = x.as_mutable<float>();
  auto ys = y.as_mutable<float>();
  for (int64_t b = 0; b < kBatch; ++b) {
    float du = 0, dv = 0;
    for (int i = 0; i < kIn; ++i) {
      float xi = n(rng);
      xs[b * kIn + i] = xi;
      du += xi * u[i];
      dv += xi * v[i];
    }
    ys[b] = std::sin(2 * du) + 0.5f * dv * dv;
  }
}

float Variance(const HostArray& y) {
  double mean = 0, sq = 0;
  for (float v : y.as<float>()) mean += v;
  mean /= kBatch;
  for (float v : y.as<float>()) sq += (v - mean) * (v - mean);
  return sq / kBatch;
}

struct Run {
  std::string name;
  std::vector<float> losses;  // at step 1 and every kReportEvery
  double seconds = 0;
  std::vector<tessel::Array> params;
};

// Trains from `init` with `train` (partitioned or not): puts the parameters
// and the data with the executable's layouts (or on device 0), then steps.
absl::StatusOr<Run> Train(tessel::Session& session, const tessel::Executable& train,
                          const std::string& name, const std::vector<HostArray>& init,
                          const HostArray& hx, const HostArray& hy) {
  auto placement = [&](size_t i) {
    return train.partitioned()
               ? tessel::Placement::Sharded(*train.mesh(), train.parameter_shardings()[i])
               : tessel::Placement::Device(0);
  };
  Run run{name};
  for (size_t i = 0; i < init.size(); ++i) {
    TESSEL_DEMO_ASSIGN(tessel::Array a, session.Put(init[i], placement(i)));
    run.params.push_back(a);
  }
  TESSEL_DEMO_ASSIGN(tessel::Array x, session.Put(hx, placement(init.size())));
  TESSEL_DEMO_ASSIGN(tessel::Array y, session.Put(hy, placement(init.size() + 1)));
  const absl::Time start = absl::Now();
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<tessel::Array> args = run.params;
    args.push_back(x);
    args.push_back(y);
    TESSEL_DEMO_ASSIGN(std::vector<tessel::Array> outs, session.Execute(train, args));
    TESSEL_DEMO_RETURN_IF_ERROR(session.Delete(run.params));
    run.params.assign(outs.begin() + 1, outs.end());
    if (step == 1 || step % kReportEvery == 0) {
      TESSEL_DEMO_ASSIGN(HostArray l, session.Fetch(outs[0]));
      run.losses.push_back(l.as<float>()[0]);
    }
    TESSEL_DEMO_RETURN_IF_ERROR(session.Delete({outs[0]}));
  }
  run.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  TESSEL_DEMO_RETURN_IF_ERROR(session.Delete({x, y}));
  return run;
}

void PrintPlan(const tessel::Executable& exe, const std::vector<std::string>& params,
               const std::vector<std::string>& outputs) {
  std::printf("  mesh %s\n", exe.mesh()->ToString().c_str());
  for (size_t i = 0; i < params.size(); ++i) {
    std::printf("    %-3s %-10s %s\n", params[i].c_str(),
                exe.parameter_types()[i].ToString().c_str(),
                exe.parameter_shardings()[i].ToString().c_str());
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    std::printf("    %-3s %-10s %s\n", outputs[i].c_str(), exe.output_types()[i].ToString().c_str(),
                exe.output_shardings()[i].ToString().c_str());
  }
  int64_t bytes = 0;
  for (const auto& c : exe.collectives()) bytes += c.bytes_per_device;
  std::printf("  %zu collectives per step, %lld bytes received per device:\n",
              exe.collectives().size(), (long long)bytes);
  for (const auto& c : exe.collectives()) {
    std::printf("    %s over %s, %lld bytes: %s\n", c.op.c_str(),
                absl::StrJoin(c.axes, ",").c_str(), (long long)c.bytes_per_device,
                c.reason.c_str());
  }
}

// The runs' losses side by side and their steps/s; returns the largest
// relative difference from the first run's loss.
float PrintLosses(const std::vector<Run>& runs) {
  std::printf("%6s", "step");
  for (const Run& r : runs) std::printf(" %16s", r.name.c_str());
  std::printf("\n");
  float worst = 0;
  for (size_t i = 0; i < runs[0].losses.size(); ++i) {
    std::printf("%6d", i == 0 ? 1 : int(i) * kReportEvery);
    for (const Run& r : runs) {
      std::printf(" %16.6f", r.losses[i]);
      worst = std::max(worst, std::abs(r.losses[i] - runs[0].losses[i]) / runs[0].losses[i]);
    }
    std::printf("\n");
  }
  std::printf("%6s", "steps/s");
  for (const Run& r : runs) std::printf(" %16.0f", kSteps / r.seconds);
  std::printf("\nlargest relative difference from the one-device loss: %.2e\n", worst);
  return worst;
}

// Held-out evaluation on the other worker's device.
absl::Status EvaluateHeldOut(tessel::Session& s, const std::vector<tessel::Array>& params,
                             std::mt19937& rng) {
  tessel::Session* session = &s;
  TESSEL_DEMO_ASSIGN(tessel::Graph eval_graph, tessel::mlp::EvalLoss(kShape));
  TESSEL_DEMO_ASSIGN(tessel::Executable eval, session->Compile(eval_graph));
  HostArray tx, ty;
  MakeData(rng, tx, ty);
  const tessel::Placement dev1 = tessel::Placement::Device(1);
  std::vector<tessel::Array> eval_args;
  for (const tessel::Array& p : params) {
    TESSEL_DEMO_ASSIGN(HostArray h, session->Fetch(p));
    TESSEL_DEMO_ASSIGN(tessel::Array a, session->Put(h, dev1));
    eval_args.push_back(a);
  }
  TESSEL_DEMO_ASSIGN(tessel::Array ex, session->Put(tx, dev1));
  TESSEL_DEMO_ASSIGN(tessel::Array ey, session->Put(ty, dev1));
  eval_args.push_back(ex);
  eval_args.push_back(ey);
  TESSEL_DEMO_ASSIGN(std::vector<tessel::Array> eouts, session->Execute(eval, eval_args, {dev1}));
  TESSEL_DEMO_ASSIGN(HostArray el, session->Fetch(eouts[0]));
  std::printf("held-out loss on device 1: %.5f (predicting the mean: %.4f)\n", el.as<float>()[0],
              Variance(ty));
  return absl::OkStatus();
}

// What the cluster and the session did, and each device's memory.
absl::Status PrintStats(tessel::Session& s) {
  tessel::Session* session = &s;
  TESSEL_DEMO_ASSIGN(tessel::SessionStats st, session->Stats());
  TESSEL_DEMO_ASSIGN(tessel::ClusterStatus cs, session->Cluster(true));
  std::printf(
      "\ncluster: %zu workers, %d devices; %lld compiles (%lld cache hits), %lld executions\n",
      cs.workers.size(), cs.num_devices(), (long long)cs.compiles, (long long)cs.compile_cache_hits,
      (long long)cs.executions);
  std::printf(
      "session: %lld live arrays (%lld bytes), %lld bytes host->device, %lld bytes device->host\n",
      (long long)st.live_arrays, (long long)st.live_bytes, (long long)st.bytes_host_to_device,
      (long long)st.bytes_device_to_host);
  for (const auto& w : cs.workers) {
    for (const auto& m : w.memory) {
      std::printf("  %s device %d: %lld bytes in use, peak %lld, %lld buffers\n", w.id.c_str(),
                  m.device, (long long)m.bytes_in_use, (long long)m.peak_bytes_in_use,
                  (long long)m.num_buffers);
    }
  }
  return absl::OkStatus();
}

absl::Status Main() {
  tessel::LocalCluster::Options options;
  options.workers = 2;
  options.devices_per_worker = 1;
  TESSEL_DEMO_ASSIGN(auto cluster, tessel::LocalCluster::Start(options));
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("local cluster: coordinator %s, 2 worker processes (logs in %s)\n",
              cluster->address().c_str(), cluster->log_dir().c_str());
  TESSEL_DEMO_ASSIGN(auto session, tessel::Session::Connect(cluster->address()));
  TESSEL_DEMO_ASSIGN(tessel::Graph train_graph, tessel::mlp::TrainStep(kShape));
  TESSEL_DEMO_ASSIGN(tessel::Graph by_hand_graph, tessel::mlp::HandWrittenTrainStep(kShape));
  TESSEL_DEMO_ASSIGN(tessel::Executable by_hand, session->Compile(by_hand_graph));
  TESSEL_DEMO_ASSIGN(tessel::Executable train, session->Compile(train_graph));
  std::printf("compiled %s: %d nodes; plan on one device:\n%s", train_graph.name().c_str(),
              train_graph.num_nodes(), train.plan().c_str());
  for (const auto& d : train.diagnostics()) std::printf("%s\n", d.c_str());

  // The same step, partitioned two ways. The outputs keep the parameters'
  // layouts, so each step's results are the next step's arguments.
  using tessel::Sharding;
  const Sharding rep = Sharding::Replicated();
  const std::vector<std::string> param_names = {"w1", "b1", "w2", "b2", "x", "y"};
  const std::vector<std::string> output_names = {"loss", "w1'", "b1'", "w2'", "b2'"};
  tessel::CompileOptions data_parallel;
  data_parallel.mesh = tessel::Mesh({{"data", 2}});
  const Sharding rows = Sharding::Split({"data", ""});
  data_parallel.parameter_shardings = {rep, rep, rep, rep, rows, rows};
  data_parallel.output_shardings = {rep, rep, rep, rep, rep};
  tessel::CompileOptions model_parallel;
  model_parallel.mesh = tessel::Mesh({{"model", 2}});
  const Sharding cols = Sharding::Split({"", "model"}), hidden = Sharding::Split({"model"}),
                 hidden_rows = Sharding::Split({"model", ""});
  model_parallel.parameter_shardings = {cols, hidden, hidden_rows, rep, rep, rep};
  model_parallel.output_shardings = {rep, cols, hidden, hidden_rows, rep};
  TESSEL_DEMO_ASSIGN(tessel::Executable train_dp, session->Compile(train_graph, data_parallel));
  TESSEL_DEMO_ASSIGN(tessel::Executable train_mp, session->Compile(train_graph, model_parallel));
  std::printf("\ndata-parallel plan (the batch split over the workers):\n");
  PrintPlan(train_dp, param_names, output_names);
  std::printf("\nmodel-parallel plan (the hidden layer split over the workers):\n");
  PrintPlan(train_mp, param_names, output_names);

  std::mt19937 rng(42);
  std::normal_distribution<float> n(0.f, 1.f);
  auto init = [&](std::vector<int64_t> dims, float scale) {
    HostArray a(F32(std::move(dims)));
    for (float& v : a.as_mutable<float>()) v = n(rng) * scale;
    return a;
  };
  HostArray hx, hy;
  MakeData(rng, hx, hy);
  const std::vector<HostArray> start = {
      init({kIn, kHidden}, 1.f / std::sqrt(float(kIn))), init({kHidden}, 0.f),
      init({kHidden, 1}, 1.f / std::sqrt(float(kHidden))), init({1}, 0.f)};
  std::printf(
      "\ntraining: batch %lld, %lld -> %lld -> 1, lr %.2f, %d steps; predicting the mean scores "
      "%.4f\n",
      (long long)kBatch, (long long)kIn, (long long)kHidden, kLearningRate, kSteps, Variance(hy));
  std::vector<Run> runs;
  for (auto [exe, name] :
       {std::pair{&train, "one device"}, std::pair{&train_dp, "data-parallel"},
        std::pair{&train_mp, "model-parallel"}, std::pair{&by_hand, "by hand"}}) {
    TESSEL_DEMO_ASSIGN(Run r, Train(*session, *exe, name, start, hx, hy));
    runs.push_back(std::move(r));
  }
  const float worst = PrintLosses(runs);
  const float loss = runs[0].losses.back();
  std::vector<tessel::Array> params = runs[0].params;
  for (size_t i = 1; i < runs.size(); ++i)
    TESSEL_DEMO_RETURN_IF_ERROR(session->Delete(runs[i].params));

  TESSEL_DEMO_RETURN_IF_ERROR(EvaluateHeldOut(*session, params, rng));

  TESSEL_DEMO_RETURN_IF_ERROR(PrintStats(*session));
  if (!(loss < 0.5f * Variance(hy))) {
    return absl::InternalError(absl::StrFormat("training did not converge: loss %.4f", loss));
  }
  if (!(worst < 1e-3f)) {
    return absl::InternalError(absl::StrFormat(
        "the partitioned or hand-differentiated runs' loss differs from one device's by %.2e",
        worst));
  }
  return absl::OkStatus();
}

}  // namespace

int main() {
  tessel::TuneAllocatorForStreaming();
  tessel::SkipMutexCycleDetection();
  absl::Status s = Main();
  if (!s.ok()) {
    std::fprintf(stderr, "mlp_demo: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
