// tessel-bench: Tessel beside its baselines, in one run, as ratios.
//
//   exec_roundtrip  Execute of a 1-element add (wait for completion, no
//                   fetch) vs two bare gRPC unary round trips (the
//                   client->coordinator->worker floor). Goal <= 1.5x.
//   fetch_256mib    Fetch of a 256 MiB array (read from the worker
//                   directly) vs a bare gRPC server stream of the same bytes
//                   in 1 MiB messages, 7 alternated rounds. Goal >= 0.9x.
//   put_256mib      Put of a 256 MiB array (written to the worker
//                   directly) vs a bare gRPC client stream of the same bytes
//                   in 1 MiB messages, 7 alternated rounds. Goal >= 0.9x.
//   fused_chain     4-op elementwise chain over 2^26 f32 vs a plain copy
//                   loop over the same bytes, in GB/s. Goal >= 0.8x.
//   dot_2048        f32 2048^3 dot_general vs OpenBLAS sgemm called
//                   directly, in GFLOP/s. Goal >= 0.9x.
//   seed_loop_*, loop_peak_256mib  the seed loop, donated and guarded;
//                   seed_loop_traced: the loop while tessel.profiler's trace
//                   records vs untraced. Goal >= 0.95x.
//   all_reduce_{1,16,256}mib  psum of an f32 block per device in a manual
//                   region over {x: 2}, one device on each of 2 worker
//                   processes, donated, steps pipelined as a training loop
//                   issues them; bus bandwidth vs Gloo's ring allreduce
//                   called directly by 2 processes (tessel-gloo-bench).
//                   Goal >= 0.9x.
//   reshard_256mib  device_put of a 256 MiB f32 array from device 0 (worker
//                   0) to device 1 (worker 1), worker to worker, awaited, vs
//                   Gloo send/recv of the same bytes by 2 processes
//                   (tessel-gloo-bench --sendrecv), in GB/s. Goal >= 0.8x.
//   sharded_sum     tanh(x) * 2 + 1 summed over 2^26 f32: x split over 2
//                   workers vs whole on 1, in GB/s of x read.
//   while_tiny      per-iteration cost of a 10,000-iteration while loop with
//                   a 1-element body, run on the device, vs the same step
//                   dispatched from the client (donated, pipelined). Goal
//                   <= 0.05x (1/20).
//   fanout_{16,64}w a replicated 1-element step over 16 and 64
//                   single-device workers (one cluster each, on this
//                   machine): Execute(wait) p50 vs the same over 2 workers,
//                   with the pipelined steps/s beside. Goal <= 5x.
//   exec_roundtrip_tls, fetch_256mib_tls  the same calls on a secured cluster
//                   (TLS on every port, mutual between the daemons; a client
//                   token) vs the plaintext cluster. Goals <= 1.1x, >= 0.5x.
//   load_8x2000_tls 8 clients, each its own session and thread, 2,000
//                   Execute(wait) steps each, on the secured cluster vs the
//                   plaintext one, in steps/s. Goal >= 0.9x.
//   grpc_load_tls   the transport's own cost under that load: 8 threads,
//                   2,000 pairs of bare unary calls each (a step's two
//                   hops), mutual TLS vs plaintext, to the baseline server.
//   mlp_grad_step   one SGD step of a 2-layer MLP (batch 2048, 128 -> 256 ->
//                   8) with its gradients from GraphBuilder::ValueAndGrad vs
//                   the same step with its backward pass written by hand,
//                   parameters donated, steps pipelined. Goal <= 1.1x.
//
// The baselines' gRPC server runs in a child process (this binary with
// --serve-baseline), as the daemons do.
//
// Each benchmark is an entry of kEntries: the rows it reports and the
// function that measures them (bench_support.h has what they share).
#include <cblas.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "bench/bench_support.h"
#include "bench/psum_programs.h"
#include "core/process_tuning.h"
#include "core/security.h"
#include "examples/mlp_model.h"
#include "tessel/graph.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"
#include "tessel/v1/admin.grpc.pb.h"
#include "tessel/v1/worker.grpc.pb.h"

namespace {

using tessel::ArrayType;
using tessel::DType;
using tessel::GraphBuilder;
using tessel::HostArray;
using tessel::Value;
using tessel::bench::BarePairsPerSecond;
using tessel::bench::Bench;
using tessel::bench::BenchTls;
using tessel::bench::Check;
using tessel::bench::ExecSeconds;
using tessel::bench::GlooOnce;
using tessel::bench::kFetchBytes;
using tessel::bench::LoadStepsPerSecond;
using tessel::bench::MakeTestPki;
using tessel::bench::Median;
using tessel::bench::Print;
using tessel::bench::Row;
using tessel::bench::ServeBaseline;
using tessel::bench::StartBaseline;
using tessel::bench::TimeAlternating;
using tessel::bench::TimeIt;
using tessel::bench::TimePerCall;

// 1. Execute round trip vs two bare unary round trips.
void ExecRoundtrip(Bench& b) {
  tessel::Session* session = b.session.get();
  tessel::v1::Worker::Stub* bstub = b.baseline.get();
  auto bare = [&] {
    grpc::ClientContext ctx;
    tessel::v1::GetVersionResponse r;
    Check(absl::Status(bstub->GetVersion(&ctx, tessel::v1::GetVersionRequest(), &r).ok()
                           ? absl::OkStatus()
                           : absl::UnavailableError("baseline unary failed")));
  };
  for (int i = 0; i < 200; ++i) bare();
  double t_exec = ExecSeconds(*session, 2000);
  double t_bare = 2 * TimePerCall(2000, bare);
  b.rows.push_back({"exec_roundtrip", "us", t_exec * 1e6, t_bare * 1e6, 1.5, false,
                    "Execute(wait) of a 1-element add vs 2x bare gRPC unary round trip"});
}

// 2. Fetch 256 MiB vs a bare server stream.
void Fetch256(Bench& b) {
  tessel::Session* session = b.session.get();
  tessel::v1::Worker::Stub* bstub = b.baseline.get();
  HostArray big(ArrayType{DType::kF32, {kFetchBytes / 4}});
  std::memset(big.mutable_data(), 1, big.size_bytes());
  auto arr = Check(session->Put(big));
  big = HostArray();
  (void)Check(session->Fetch(arr));
  auto [t_fetch, t_bare] = TimeAlternating(
      7, [&] { (void)Check(session->Fetch(arr)); },
      [&] {
        grpc::ClientContext ctx;
        tessel::v1::FetchShardRequest req;
        auto reader = bstub->FetchShard(&ctx, req);
        tessel::v1::FetchShardResponse msg;
        HostArray out(ArrayType{DType::kU8, {kFetchBytes}});
        int64_t off = 0;
        while (reader->Read(&msg)) {
          std::memcpy(out.mutable_data() + off, msg.data().data(), msg.data().size());
          off += msg.data().size();
        }
        (void)reader->Finish();
      });
  Check(session->Delete({arr}));
  b.rows.push_back({"fetch_256mib", "GB/s", kFetchBytes / t_fetch / 1e9, kFetchBytes / t_bare / 1e9,
                    0.9, true,
                    "Fetch, read from the worker directly, vs bare gRPC stream, 1 MiB messages"});
}

// 2b. Put 256 MiB vs a bare client stream.
void Put256(Bench& b) {
  tessel::Session* session = b.session.get();
  tessel::v1::Worker::Stub* bstub = b.baseline.get();
  HostArray big(ArrayType{DType::kF32, {kFetchBytes / 4}});
  std::memset(big.mutable_data(), 1, big.size_bytes());
  Check(session->Delete({Check(session->Put(big))}));
  auto [t_put, t_bare] = TimeAlternating(
      7, [&] { Check(session->Delete({Check(session->Put(big))})); },
      [&] {
        grpc::ClientContext ctx;
        tessel::v1::PutShardResponse resp;
        auto writer = bstub->PutShard(&ctx, &resp);
        tessel::v1::PutShardRequest msg;
        const int64_t chunk = 1 << 20;
        for (int64_t off = 0; off < kFetchBytes; off += chunk) {
          msg.set_data(big.data() + off, chunk);
          if (!writer->Write(msg)) break;
        }
        writer->WritesDone();
        (void)writer->Finish();
      });
  b.rows.push_back(
      {"put_256mib", "GB/s", kFetchBytes / t_put / 1e9, kFetchBytes / t_bare / 1e9, 0.9, true,
       "Put, written to the worker directly, vs bare gRPC client stream, 1 MiB messages"});
}

// 3. Fused 4-op chain over 2^26 f32 vs a copy loop.
void FusedChain(Bench& b) {
  tessel::Session* session = b.session.get();
  const int64_t n = int64_t{1} << 26;
  GraphBuilder g("chain4");
  auto x = g.Parameter({DType::kF32, {n}}, "x");
  auto c = [&](double v) { return g.Broadcast(g.Scalar(DType::kF32, v), {n}); };
  auto y = g.Mul(g.Max(g.Add(g.Mul(x, c(1.5)), c(-0.25)), c(0.0)), c(0.5));
  auto exe = Check(session->Compile(Check(g.Build({y}))));
  HostArray hx(ArrayType{DType::kF32, {n}});
  for (int64_t i = 0; i < n; ++i) hx.as_mutable<float>()[i] = float(i % 1000) * 1e-3f;
  auto xa = Check(session->Put(hx));
  auto run = [&] {
    auto outs = Check(session->Execute(exe, {xa}, {tessel::Placement::Device(0), true}));
    Check(session->Delete(outs));
  };
  run();
  double t_chain = TimeIt(10, run);
  std::vector<float> src(hx.as<float>().begin(), hx.as<float>().end()), dst(n);
  auto copy = [&] {
    const float* s = src.data();
    float* d = dst.data();
    for (int64_t i = 0; i < n; ++i) d[i] = s[i];
    asm volatile("" : : "r"(d) : "memory");
  };
  copy();
  double t_copy = TimeIt(10, copy);
  const double bytes = 2.0 * n * 4;
  Check(session->Delete({xa}));
  b.rows.push_back({"fused_chain", "GB/s", bytes / t_chain / 1e9, bytes / t_copy / 1e9, 0.8, true,
                    "mul-add-max-mul over 2^26 f32 (incl. Execute round trip) vs plain copy loop"});
}

// 4. dot 2048^3 vs sgemm.
void Dot2048(Bench& b) {
  tessel::Session* session = b.session.get();
  const int64_t m = 2048;
  GraphBuilder g("dot2048");
  auto a = g.Parameter({DType::kF32, {m, m}}, "a");
  auto rhs = g.Parameter({DType::kF32, {m, m}}, "b");
  auto exe = Check(session->Compile(Check(g.Build({g.MatMul(a, rhs)}))));
  HostArray ha(ArrayType{DType::kF32, {m, m}}), hb(ArrayType{DType::kF32, {m, m}});
  for (int64_t i = 0; i < m * m; ++i) {
    ha.as_mutable<float>()[i] = float(i % 17) * 0.01f;
    hb.as_mutable<float>()[i] = float(i % 13) * 0.02f;
  }
  auto aa = Check(session->Put(ha));
  auto ba = Check(session->Put(hb));
  auto run = [&] {
    auto outs = Check(session->Execute(exe, {aa, ba}, {tessel::Placement::Device(0), true}));
    Check(session->Delete(outs));
  };
  run();
  double t_dot = TimeIt(5, run);
  std::vector<float> c(m * m);
  auto direct = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.f, ha.as<float>().data(), m,
                hb.as<float>().data(), m, 0.f, c.data(), m);
  };
  direct();
  double t_blas = TimeIt(5, direct);
  const double flops = 2.0 * m * m * m;
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  b.rows.push_back(
      {"dot_2048", "GFLOP/s", flops / t_dot / 1e9, flops / t_blas / 1e9, 0.9, true,
       absl::StrCat("vs cblas_sgemm in-process, OPENBLAS_CORETYPE=", core ? core : "(unset)")});
}

// 5. The seed loop (state = f1(state); state = f2(state), state donated,
//    every transfer disallowed) with a tiny state on both workers,
//    pipelined: steps per second vs bare unary round trips per second.
// 6. The same loop with a 256 MiB state on one device: its peak memory vs
//    one state.
void SeedLoop(Bench& b) {
  tessel::Session* session = b.session.get();
  tessel::v1::Worker::Stub* bstub = b.baseline.get();
  auto want = [&](const char* name) { return b.want(name); };
  auto step = [&](const std::string& name, int64_t n, bool second) {
    GraphBuilder g(name);
    auto s = g.Parameter({DType::kF32, {n}}, "state");
    auto c = g.Parameter({DType::kS32, {}}, "count");
    auto one = g.Broadcast(g.Scalar(DType::kF32, 1.0), {n});
    auto out = second ? g.Add(g.Tanh(s), one)
                      : g.Add(g.Mul(s, g.Broadcast(g.Scalar(DType::kF32, 0.5), {n})), one);
    auto count = second ? g.Add(c, g.Scalar(DType::kS32, 1)) : c;
    return Check(session->Compile(Check(g.Build({out, count})),
                                  {.donate = {0, 1}, .strict_donation = true}));
  };
  auto loop = [&](int64_t n, tessel::Placement where, int pairs) {
    auto f1 = step("f1", n, false), f2 = step("f2", n, true);
    HostArray init(ArrayType{DType::kF32, {n}});
    std::memset(init.mutable_data(), 0, init.size_bytes());
    std::vector<tessel::Array> state{Check(session->Put(init, where)),
                                     Check(session->Put(HostArray::From<int32_t>({}, {0}), where))};
    Check(session->Await(state));
    tessel::SessionOptions guarded;
    guarded.transfer_guard = tessel::TransferGuard::All(tessel::TransferLevel::kDisallow);
    guarded.forbid_compiles = true;
    Check(session->SetOptions(guarded));
    const tessel::ExecuteOptions opts{.placement = where};
    auto run = [&](int k) {
      for (int i = 0; i < k; ++i) {
        auto a = Check(session->Execute(f1, state, opts));
        state = Check(session->Execute(f2, a, opts));
      }
      Check(session->Await(state));
    };
    run(pairs / 10 + 1);  // warm: programs loaded, buffers cached
    // The median of 5 rounds: one round is a few tens of milliseconds,
    // where this machine's scheduling noise is +-30%.
    std::vector<double> rounds;
    for (int round = 0; round < 5; ++round) {
      const absl::Time start = absl::Now();
      run(pairs);
      rounds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    }
    const double seconds = Median(rounds);
    Check(session->Delete(state));
    Check(session->SetOptions({}));
    return seconds;
  };
  auto bare = [&] {
    grpc::ClientContext ctx;
    tessel::v1::GetVersionResponse r;
    if (!bstub->GetVersion(&ctx, tessel::v1::GetVersionRequest(), &r).ok())
      Check(absl::UnavailableError("bare"));
  };
  const int pairs = 10000;
  if (want("seed_loop_steps") || want("seed_loop_2w")) {
    const double t_one = loop(16, tessel::Placement::Device(0), pairs);
    const double t_both = loop(16, tessel::Placement::Replicated(), pairs);
    const double t_unary = TimePerCall(2000, bare);
    b.rows.push_back({"seed_loop_steps", "steps/s", 2.0 * pairs / t_one, 1.0 / t_unary, 1.0, true,
                      "f1/f2 donated, guard disallow, 16-float state, one device, pipelined, vs "
                      "unary calls/s"});
    b.rows.push_back({"seed_loop_2w", "steps/s", 2.0 * pairs / t_both, 1.0 / t_unary, 1.0, true,
                      "the same loop replicated on both workers (each step runs on 2 devices)"});
  }

  if (want("seed_loop_traced")) {
    // The one-device loop while a trace records on every process (each
    // step's span, kernels and memory counter on the worker, each dispatch
    // on the coordinator) vs the same loop untraced, alternated.
    auto admin = tessel::v1::Admin::NewStub(
        grpc::CreateChannel(b.cluster->address(), grpc::InsecureChannelCredentials()));
    std::vector<double> off, on;
    for (int round = 0; round < 3; ++round) {
      off.push_back(loop(16, tessel::Placement::Device(0), pairs));
      grpc::ClientContext start_ctx;
      tessel::v1::StartTraceRequest start;
      start.set_duration_ms(600'000);
      tessel::v1::StartTraceResponse started;
      if (!admin->StartTrace(&start_ctx, start, &started).ok())
        Check(absl::UnavailableError("StartTrace"));
      on.push_back(loop(16, tessel::Placement::Device(0), pairs));
      grpc::ClientContext stop_ctx;
      auto reader = admin->StopTrace(&stop_ctx, tessel::v1::StopTraceRequest());
      tessel::v1::TraceChunk chunk;
      while (reader->Read(&chunk)) {
      }
      if (!reader->Finish().ok()) Check(absl::UnavailableError("StopTrace"));
    }
    b.rows.push_back({"seed_loop_traced", "steps/s", 2.0 * pairs / Median(on),
                      2.0 * pairs / Median(off), 0.95, true,
                      "the one-device seed loop while a trace records on every process vs the "
                      "same loop untraced, alternated"});
  }

  if (want("loop_peak_256mib")) {
    const int64_t n = int64_t{1} << 26;  // 256 MiB
    const int device = 1;  // untouched by the benchmarks above: its peak is this loop's
    (void)loop(n, tessel::Placement::Device(device), 10);
    int64_t peak = 0;
    for (const auto& d : Check(session->Stats()).devices) {
      if (d.device == device) peak = d.peak_bytes_in_use;
    }
    b.rows.push_back({"loop_peak_256mib", "MiB", peak / 1048576.0, n * 4 / 1048576.0, 1.1, false,
                      "peak device memory during the 256 MiB donated loop vs one state"});
  }
}

// 7. all_reduce through Tessel vs Gloo called directly.
void AllReduce(Bench& b) {
  tessel::Session* session = b.session.get();
  std::vector<int64_t> reduce_sizes;
  for (int64_t mib : {1, 16, 256}) {
    if (b.want(absl::StrCat("all_reduce_", mib, "mib"))) reduce_sizes.push_back(mib << 20);
  }
  // This machine's loopback bandwidth swings between runs (2x at 1 MiB), so
  // the two alternate: rounds of K back-to-back Gloo allreduces (a fresh
  // tessel-gloo-bench pair, median per call) and K pipelined Tessel steps
  // (mean per step); each side's figure is its median round.
  for (int64_t bytes : reduce_sizes) {
    const tessel::bench::PsumPrograms psum = Check(tessel::bench::CompilePsum(*session, bytes / 4));
    const tessel::Executable& exe = psum.step;
    std::vector<tessel::Array> state = Check(session->Execute(psum.init, {}));
    auto run = [&](int k) {
      for (int i = 0; i < k; ++i) state = Check(session->Execute(exe, state));
      Check(session->Await(state));
    };
    const int k = bytes >= (int64_t{256} << 20) ? 4 : bytes >= (int64_t{16} << 20) ? 16 : 64;
    run(2);  // warm: programs loaded, the group connected
    std::vector<double> t_tessel, t_gloo;
    for (int round = 0; round < 5; ++round) {
      t_gloo.push_back(GlooOnce(b, bytes, k));
      const absl::Time start = absl::Now();
      run(k);
      t_tessel.push_back(absl::ToDoubleSeconds(absl::Now() - start) / k);
    }
    Check(session->Delete(state));
    // Two ranks: the ring's bus bandwidth equals bytes / time.
    b.rows.push_back(
        {absl::StrCat("all_reduce_", bytes >> 20, "mib"), "GB/s", bytes / Median(t_tessel) / 1e9,
         bytes / Median(t_gloo) / 1e9, 0.9, true,
         "psum over 2 workers, donated, pipelined, vs gloo::allreduce ring by 2 processes"});
  }
}

// 7b. reshard: device 0 to device 1, worker to worker, vs Gloo send/recv.
void Reshard(Bench& b) {
  tessel::Session* session = b.session.get();
  const int64_t bytes = int64_t{256} << 20;
  HostArray host(ArrayType{DType::kF32, {bytes / 4}});
  for (float& v : host.as_mutable<float>()) v = 1.f;
  tessel::Array src = Check(session->Put(host, tessel::Placement::Device(0)));
  auto once = [&] {
    tessel::Array copy = Check(session->Reshard(src, tessel::Placement::Device(1)));
    Check(session->Await({copy}));
    Check(session->Delete({copy}));
  };
  once();  // warm: the pair's group connected, buffers cached
  const int k = 3;
  std::vector<double> t_tessel, t_gloo;
  for (int round = 0; round < 5; ++round) {
    t_gloo.push_back(GlooOnce(b, bytes, k, true));
    const absl::Time start = absl::Now();
    for (int i = 0; i < k; ++i) once();
    t_tessel.push_back(absl::ToDoubleSeconds(absl::Now() - start) / k);
  }
  Check(session->Delete({src}));
  b.rows.push_back(
      {"reshard_256mib", "GB/s", bytes / Median(t_tessel) / 1e9, bytes / Median(t_gloo) / 1e9, 0.8,
       true,
       "device_put device 0 -> device 1 (2 workers), awaited, vs Gloo send/recv by 2 processes"});
}

// 8. Sharded elementwise + sum over 2^26 f32: 2 workers vs 1.
void ShardedSum(Bench& b) {
  tessel::Session* session = b.session.get();
  const tessel::Mesh pair({{"x", 2}});
  const tessel::Sharding split = tessel::Sharding::Split({"x"});
  const int64_t n = int64_t{1} << 26;
  GraphBuilder g("tanh_sum");
  auto x = g.Parameter({DType::kF32, {n}}, "x");
  auto y = g.Add(g.Mul(g.Tanh(x), g.Broadcast(g.Scalar(DType::kF32, 2.0), {n})),
                 g.Broadcast(g.Scalar(DType::kF32, 1.0), {n}));
  auto graph = Check(g.Build({g.Reduce(y, tessel::ReduceKind::kSum, {0})}));
  auto one = Check(session->Compile(graph));
  auto two = Check(session->Compile(graph, {.mesh = pair, .parameter_shardings = {split}}));
  HostArray hx(ArrayType{DType::kF32, {n}});
  for (int64_t i = 0; i < n; ++i) hx.as_mutable<float>()[i] = float(i % 1000) * 1e-3f - 0.5f;
  auto on_one = Check(session->Put(hx, tessel::Placement::Device(0)));
  auto on_two = Check(session->Put(hx, tessel::Placement::Sharded(pair, split)));
  hx = HostArray();
  auto time = [&](const tessel::Executable& exe, const tessel::Array& arg) {
    auto run = [&] {
      auto outs = Check(session->Execute(exe, {arg}, {.wait = true}));
      Check(session->Delete(outs));
    };
    run();
    return TimeIt(7, run);
  };
  const double t_one = time(one, on_one), t_two = time(two, on_two);
  Check(session->Delete({on_one, on_two}));
  b.rows.push_back({"sharded_sum", "GB/s", n * 4 / t_two / 1e9, n * 4 / t_one / 1e9, 1.0, true,
                    "tanh*2+1 summed over 2^26 f32 split over 2 workers vs whole on 1 (one "
                    "all_reduce of 4 B)"});
}

// while_tiny: a 10,000-iteration loop with a 1-element body run on the
// device, per iteration, vs the same step dispatched from here (donated,
// pipelined, waited for at the end).
void WhileTiny(Bench& b) {
  tessel::Session* session = b.session.get();
  const int kIters = 10000;
  GraphBuilder g("while_tiny");
  auto x = g.Parameter({DType::kF32, {1}}, "x");
  auto out = g.While(
      {g.Scalar(DType::kS32, 0), x},
      [&](GraphBuilder& f, const std::vector<Value>& c) {
        return std::vector<Value>{
            f.Compare(c[0], f.Scalar(DType::kS32, kIters), tessel::Comparison::kLt)};
      },
      [](GraphBuilder& f, const std::vector<Value>& c) {
        auto v = f.Add(f.Mul(c[1], f.Broadcast(f.Scalar(DType::kF32, 0.5), {1})),
                       f.Broadcast(f.Scalar(DType::kF32, 1), {1}));
        return std::vector<Value>{f.Add(c[0], f.Scalar(DType::kS32, 1)), v};
      });
  auto loop = Check(session->Compile(Check(g.Build({out[1]}))));
  GraphBuilder h("step_tiny");
  auto y = h.Parameter({DType::kF32, {1}}, "y");
  auto step = Check(
      session->Compile(Check(h.Build({h.Add(h.Mul(y, h.Broadcast(h.Scalar(DType::kF32, 0.5), {1})),
                                            h.Broadcast(h.Scalar(DType::kF32, 1), {1}))})),
                       {.donate = {0}, .strict_donation = true}));
  auto x0 = Check(session->Put(HostArray::From<float>({1}, {0.f}), tessel::Placement::Device(0)));
  const tessel::ExecuteOptions on0{.placement = tessel::Placement::Device(0)};
  auto device_loop = [&] {
    auto r = Check(session->Execute(loop, {x0}, on0));
    Check(session->Await(r));
    Check(session->Delete(r));
  };
  auto host_loop = [&](int n) {
    std::vector<tessel::Array> v{
        Check(session->Put(HostArray::From<float>({1}, {0.f}), tessel::Placement::Device(0)))};
    for (int i = 0; i < n; ++i) v = Check(session->Execute(step, v, on0));
    Check(session->Await(v));
    Check(session->Delete(v));
  };
  device_loop();
  host_loop(100);
  std::vector<double> t_dev, t_host;
  for (int round = 0; round < 5; ++round) {
    absl::Time t = absl::Now();
    device_loop();
    t_dev.push_back(absl::ToDoubleSeconds(absl::Now() - t) / kIters);
    t = absl::Now();
    host_loop(kIters / 5);
    t_host.push_back(absl::ToDoubleSeconds(absl::Now() - t) / (kIters / 5));
  }
  Check(session->Delete({x0}));
  b.rows.push_back(
      {"while_tiny", "us/iter", Median(t_dev) * 1e6, Median(t_host) * 1e6, 0.05, false,
       "10k-iteration on-device while, 1-element body, vs the step dispatched from the client "
       "(donated, pipelined); python_bench's py_while_tiny compares jax.lax.while_loop"});
}

// mlp_grad_step: the autodiff step vs the hand-written one, on device 0.
void MlpGradStep(Bench& b) {
  tessel::Session* session = b.session.get();
  const tessel::mlp::Shape shape{
      .batch = 2048, .in = 128, .hidden = 256, .out = 8, .learning_rate = 0.01f};
  const tessel::CompileOptions donate{.donate = {0, 1, 2, 3}, .strict_donation = true};
  auto by_grad = Check(session->Compile(Check(tessel::mlp::TrainStep(shape)), donate));
  auto by_hand = Check(session->Compile(Check(tessel::mlp::HandWrittenTrainStep(shape)), donate));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto random = [&](std::vector<int64_t> dims, float scale) {
    HostArray a(tessel::mlp::F32(std::move(dims)));
    for (float& v : a.as_mutable<float>()) v = normal(rng) * scale;
    return Check(session->Put(a, tessel::Placement::Device(0)));
  };
  auto x = random({shape.batch, shape.in}, 1.f), y = random({shape.batch, shape.out}, 1.f);
  const tessel::ExecuteOptions on0{.placement = tessel::Placement::Device(0)};
  auto steps = [&](const tessel::Executable& exe, int n) {
    std::vector<tessel::Array> p = {
        random({shape.in, shape.hidden}, 0.1f), random({shape.hidden}, 0.f),
        random({shape.hidden, shape.out}, 0.1f), random({shape.out}, 0.f)};
    const absl::Time start = absl::Now();
    for (int i = 0; i < n; ++i) {
      std::vector<tessel::Array> args = p;
      args.push_back(x);
      args.push_back(y);
      auto outs = Check(session->Execute(exe, args, on0));
      Check(session->Delete({outs[0]}));
      p.assign(outs.begin() + 1, outs.end());
    }
    Check(session->Await(p));
    const double t = absl::ToDoubleSeconds(absl::Now() - start) / n;
    Check(session->Delete(p));
    return t;
  };
  steps(by_grad, 3);
  steps(by_hand, 3);
  std::vector<double> t_grad, t_hand;
  for (int round = 0; round < 7; ++round) {  // interleaved: the machine's noise hits both
    t_grad.push_back(steps(by_grad, 20));
    t_hand.push_back(steps(by_hand, 20));
  }
  Check(session->Delete({x, y}));
  b.rows.push_back(
      {"mlp_grad_step", "ms/step", Median(t_grad) * 1e3, Median(t_hand) * 1e3, 1.1, false,
       "SGD step of a 2048x128->256->8 MLP, gradients from ValueAndGrad vs written by hand"});
}

// 11. Fan-out: one replicated 1-element step over N single-device
// workers, Execute(wait) p50 and pipelined steps/s, N = 2, 16, 64 (each
// cluster started for the row; 64 workers share this machine's cores).
void Fanout(Bench& b) {
  const tessel::LocalCluster::Options& opts = b.options;
  std::vector<std::pair<int, std::pair<double, double>>> curve;  // workers -> (p50 s, steps/s)
  for (int workers : {2, 16, 64}) {
    tessel::LocalCluster::Options fopts = opts;
    fopts.workers = workers;
    fopts.heartbeat_timeout_ms = 10000;  // 64 workers starting at once on 2 cores
    auto fc = Check(tessel::LocalCluster::Start(fopts));
    auto fs = Check(tessel::Session::Connect(fc->address()));
    GraphBuilder g("add1");
    auto x = g.Parameter({DType::kF32, {1}}, "x");
    auto exe = Check(fs->Compile(Check(g.Build({g.Add(x, x)}))));
    const tessel::ExecuteOptions everywhere{.placement = tessel::Placement::Replicated()};
    auto xa = Check(fs->Put(HostArray::From<float>({1}, {1.f}), tessel::Placement::Replicated()));
    std::vector<tessel::Array> garbage;
    auto keep = [&](std::vector<tessel::Array> outs) {
      garbage.insert(garbage.end(), outs.begin(), outs.end());
      if (garbage.size() >= 256) {
        Check(fs->Delete(garbage));
        garbage.clear();
      }
    };
    const tessel::ExecuteOptions wait{.placement = tessel::Placement::Replicated(), .wait = true};
    for (int i = 0; i < 50; ++i) keep(Check(fs->Execute(exe, {xa}, wait)));  // loaded everywhere
    std::vector<double> calls;
    for (int i = 0; i < 400; ++i) {
      const absl::Time start = absl::Now();
      keep(Check(fs->Execute(exe, {xa}, wait)));
      calls.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    }
    const int k = 1000;
    const absl::Time start = absl::Now();
    std::vector<tessel::Array> last;
    for (int i = 0; i < k; ++i) {
      last = Check(fs->Execute(exe, {xa}, everywhere));
      keep(last);
    }
    Check(fs->Await(last));
    const double rate = k / absl::ToDoubleSeconds(absl::Now() - start);
    Check(fs->Delete(garbage));
    curve.push_back({workers, {Median(calls), rate}});
    std::fprintf(stderr, "fanout: %d workers: Execute(wait) p50 %.0f us, pipelined %.0f steps/s\n",
                 workers, Median(calls) * 1e6, rate);
  }
  const double p50_2 = curve[0].second.first;
  for (size_t i = 1; i < curve.size(); ++i) {
    b.rows.push_back(
        {absl::StrCat("fanout_", curve[i].first, "w"), "us", curve[i].second.first * 1e6,
         p50_2 * 1e6, 5.0, false,
         absl::StrCat("replicated 1-element step over ", curve[i].first,
                      " single-device workers, Execute(wait) p50, vs 2 workers; pipelined ",
                      int(curve[i].second.second),
                      " steps/s (2 workers: ", int(curve[0].second.second), ")")});
  }
}

// 10. A secured cluster beside the plaintext one.
void Secured(Bench& b) {
  tessel::Session* session = b.session.get();
  tessel::LocalCluster* cluster = b.cluster.get();
  const int bport = b.baseline_port;
  const std::string& dir = b.dir;
  const tessel::LocalCluster::Options& opts = b.options;
  auto want = [&](const char* name) { return b.want(name); };
  const std::string pki = dir + "/pki";
  if (!MakeTestPki(pki)) {
    std::fprintf(
        stderr,
        "tessel-bench: the openssl command could not make test certificates; TLS rows skipped\n");
  } else {
    const std::vector<std::string> tls = {
        "--tls_cert=" + pki + "/d.pem", "--tls_key=" + pki + "/d.key",
        "--tls_ca=" + pki + "/ca.pem", "--join_token_file=" + pki + "/join"};
    tessel::LocalCluster::Options sopts = opts;
    sopts.coordinator_flags = tls;
    sopts.coordinator_flags.push_back("--auth_tokens_file=" + pki + "/tokens");
    sopts.worker_flags = tls;
    sopts.token = "bench-token";
    sopts.tls_ca_file = pki + "/ca.pem";
    auto secured = Check(tessel::LocalCluster::Start(sopts));
    tessel::ConnectOptions sconnect;
    sconnect.token = "bench-token";
    sconnect.tls_ca_file = pki + "/ca.pem";
    // The workers' port takes only certified clients: direct fetches
    // present the client's certificate.
    sconnect.tls_cert_file = pki + "/d.pem";
    sconnect.tls_key_file = pki + "/d.key";
    auto ssession = Check(tessel::Session::Connect(secured->address(), sconnect));
    if (want("exec_roundtrip_tls")) {
      const double t_plain = ExecSeconds(*session, 2000), t_tls = ExecSeconds(*ssession, 2000);
      b.rows.push_back({"exec_roundtrip_tls", "us", t_tls * 1e6, t_plain * 1e6, 1.1, false,
                        "Execute(wait) of a 1-element add: TLS + token vs plaintext"});
    }
    if (want("fetch_256mib_tls")) {
      HostArray big(ArrayType{DType::kF32, {kFetchBytes / 4}});
      std::memset(big.mutable_data(), 1, big.size_bytes());
      auto plain = Check(session->Put(big));
      auto sec = Check(ssession->Put(big));
      big = HostArray();
      const double t_plain = TimeIt(3, [&] { (void)Check(session->Fetch(plain)); });
      const double t_tls = TimeIt(3, [&] { (void)Check(ssession->Fetch(sec)); });
      Check(session->Delete({plain}));
      Check(ssession->Delete({sec}));
      b.rows.push_back({"fetch_256mib_tls", "GB/s", kFetchBytes / t_tls / 1e9,
                        kFetchBytes / t_plain / 1e9, 0.5, true,
                        "Fetch of 256 MiB from the workers: TLS vs plaintext"});
    }
    if (want("load_8x2000_tls")) {
      // Alternating rounds, the median of each side: the machine's noise
      // falls on both.
      std::vector<double> plain_runs, sec_runs;
      for (int round = 0; round < 3; ++round) {
        plain_runs.push_back(
            LoadStepsPerSecond(cluster->address(), tessel::ConnectOptions(), 8, 2000));
        sec_runs.push_back(LoadStepsPerSecond(secured->address(), sconnect, 8, 2000));
      }
      const double plain = Median(plain_runs), sec = Median(sec_runs);
      b.rows.push_back({"load_8x2000_tls", "steps/s", sec, plain, 0.9, true,
                        "8 clients x 2,000 Execute(wait) steps: TLS + token vs plaintext"});
    }
    if (want("grpc_load_tls")) {
      // The transport's own ratio under the same load: what TLS costs gRPC
      // here before Tessel does anything.
      pid_t tls_pid;
      const int tls_port = StartBaseline(dir + "/baseline-tls.port", pki, &tls_pid);
      if (tls_port != 0) {
        tessel::TlsFiles client_tls = BenchTls(pki);
        const auto plain_creds = grpc::InsecureChannelCredentials();
        const auto tls_creds = tessel::ChannelCredentials(client_tls);
        std::vector<double> plain_runs, sec_runs;
        for (int round = 0; round < 3; ++round) {
          plain_runs.push_back(BarePairsPerSecond(bport, plain_creds, 8, 2000));
          sec_runs.push_back(BarePairsPerSecond(tls_port, tls_creds, 8, 2000));
        }
        kill(tls_pid, SIGTERM);
        waitpid(tls_pid, nullptr, 0);
        b.rows.push_back(
            {"grpc_load_tls", "pairs/s", Median(sec_runs), Median(plain_runs), 0.9, true,
             "8 threads x 2,000 pairs of bare gRPC unary calls: mutual TLS vs plaintext"});
      }
    }
  }
}

// The entries: the rows each reports, and the function that measures them.
// An entry runs when any of its rows is asked for.
struct Entry {
  std::vector<std::string> rows;
  void (*run)(Bench&);
};

const Entry kEntries[] = {
    {{"exec_roundtrip"}, ExecRoundtrip},
    {{"fetch_256mib"}, Fetch256},
    {{"put_256mib"}, Put256},
    {{"fused_chain"}, FusedChain},
    {{"dot_2048"}, Dot2048},
    {{"seed_loop_steps", "seed_loop_2w", "seed_loop_traced", "loop_peak_256mib"}, SeedLoop},
    {{"all_reduce_1mib", "all_reduce_16mib", "all_reduce_256mib"}, AllReduce},
    {{"reshard_256mib"}, Reshard},
    {{"sharded_sum"}, ShardedSum},
    {{"while_tiny"}, WhileTiny},
    {{"mlp_grad_step"}, MlpGradStep},
    {{"fanout_16w", "fanout_64w"}, Fanout},
    {{"exec_roundtrip_tls", "fetch_256mib_tls", "load_8x2000_tls", "grpc_load_tls"}, Secured},
};

}  // namespace

int main(int argc, char** argv) {
  bool json = false, list = false;
  std::string only;  // run the benchmarks whose name contains this
  std::string serve_baseline, baseline_tls;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--only=", 0) == 0) only = a.substr(7);
    if (a.rfind("--serve-baseline=", 0) == 0) serve_baseline = a.substr(17);
    if (a.rfind("--baseline-tls=", 0) == 0) baseline_tls = a.substr(15);
    if (a == "--json") json = true;
    if (a == "--list") list = true;
    if (a == "--help" || a == "-h") {
      std::printf(
          "tessel-bench [--json] [--only=SUBSTR] [--list]: runs Tessel beside its baselines on a "
          "local cluster\nand prints ratios. --only runs the benchmarks whose name contains "
          "SUBSTR; --list names them.\n");
      return 0;
    }
  }
  if (list) {
    for (const Entry& e : kEntries) {
      for (const std::string& row : e.rows) std::printf("%s\n", row.c_str());
    }
    return 0;
  }
  if (!serve_baseline.empty()) return ServeBaseline(serve_baseline, baseline_tls);
  tessel::TuneAllocatorForStreaming();
  tessel::SkipMutexCycleDetection();

  Bench b;
  char tmpl[] = "/tmp/tessel-bench-XXXXXX";
  b.dir = mkdtemp(tmpl);
  b.self = std::filesystem::read_symlink("/proc/self/exe").string();
  pid_t baseline_pid;
  b.baseline_port = StartBaseline(b.dir + "/baseline.port", "", &baseline_pid);
  if (b.baseline_port == 0) return 1;
  grpc::ChannelArguments cargs;
  cargs.SetMaxReceiveMessageSize(64 << 20);
  b.baseline = tessel::v1::Worker::NewStub(grpc::CreateCustomChannel(
      absl::StrCat("127.0.0.1:", b.baseline_port), grpc::InsecureChannelCredentials(), cargs));
  b.options.workers = 2;
  b.options.devices_per_worker = 1;
  b.cluster = Check(tessel::LocalCluster::Start(b.options));
  b.session = Check(tessel::Session::Connect(b.cluster->address()));
  b.want = [&](const std::string& name) {
    return only.empty() || name.find(only) != std::string::npos;
  };

  for (const Entry& e : kEntries) {
    if (std::any_of(e.rows.begin(), e.rows.end(), b.want)) e.run(b);
  }

  b.session.reset();
  b.cluster.reset();
  kill(baseline_pid, SIGTERM);
  waitpid(baseline_pid, nullptr, 0);
  std::filesystem::remove_all(b.dir);
  Print(b.rows, json);
  return 0;
}
