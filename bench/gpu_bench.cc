// tessel-gpu-bench: the CUDA backend beside the libraries it stands on, on
// one GPU, in one run, as ratios.
//
//   elementwise_1gib  mul-add-max-mul over 2^28 f32, the array donated and
//                     updated in place, 50 steps pipelined as a loop issues
//                     them; GB/s counting bytes read and written, vs
//                     cudaMemcpyAsync device to device of the same bytes.
//                     Goal >= 0.8x.
//   dot_bf16_8192     bf16 8192^3 dot_general (f32 accumulation), 50 steps
//                     pipelined, vs cublasLtMatmul called directly with the
//                     heuristic's first algorithm and the same workspace;
//                     TFLOP/s. Goal >= 0.95x.
//   all_reduce_256mib psum of 256 MiB of f32 per device in a manual region
//                     over {x: 2}, GPUs 0 and 1 of one worker, donated, 8
//                     steps pipelined, vs ncclAllReduce called directly on
//                     the same two GPUs (one process, grouped calls); bus
//                     bandwidth. Goal >= 0.9x. Needs 2 GPUs: with one, the
//                     row says so.
//
// Tessel's time runs from the first Execute until a one-element fetch of
// the last result returns (the fetch is queued behind every step), so it
// includes every Execute's round trip through the coordinator. The
// baselines run in this process on the same GPU, timed with CUDA events.
//
//   tessel-gpu-bench [--json] [--only=SUBSTR]
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/bench_support.h"
#include "bench/psum_programs.h"
#include "core/process_tuning.h"
#include "tessel/graph.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"

namespace {

using tessel::ArrayType;
using tessel::DType;
using tessel::GraphBuilder;
using tessel::HostArray;
using tessel::bench::Check;
using tessel::bench::Print;
using tessel::bench::Row;

void Cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "tessel-gpu-bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void Nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) {
    std::fprintf(stderr, "tessel-gpu-bench: %s: %s\n", what, ncclGetErrorString(r));
    std::exit(1);
  }
}
void Lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "tessel-gpu-bench: %s: cublas status %d\n", what, int(s));
    std::exit(1);
  }
}

// Seconds per call of `f` queued on `stream`, over `reps` calls, by CUDA events.
template <typename F>
double EventTime(cudaStream_t stream, int reps, F&& f) {
  cudaEvent_t start, stop;
  Cuda(cudaEventCreate(&start), "cudaEventCreate");
  Cuda(cudaEventCreate(&stop), "cudaEventCreate");
  f();  // warm-up
  Cuda(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int i = 0; i < reps; ++i) f();
  Cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
  Cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  Cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / 1e3 / reps;
}

// One element of `x` (the first), fetched: returns once every step queued
// before it on the device has run.
class Sync {
 public:
  Sync(tessel::Session& s, ArrayType type) : s_(s) {
    GraphBuilder g("first");
    auto x = g.Parameter(type, "x");
    std::vector<int64_t> start(type.dims.size(), 0), limit(type.dims.size(), 1);
    exe_ = Check(s.Compile(Check(g.Build({g.Slice(x, start, limit)}))));
  }
  void operator()(const tessel::Array& x) {
    auto one = Check(s_.Execute(exe_, {x}));
    Check(s_.Fetch(one[0]).status());
    Check(s_.Delete(one));
  }

 private:
  tessel::Session& s_;
  tessel::Executable exe_;
};

uint16_t Bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// mul-add-max-mul over 2^28 f32 in place vs cudaMemcpyAsync D2D.
Row Elementwise(tessel::Session* session, cudaStream_t stream) {
  const int64_t n = int64_t{1} << 28;
  const int steps = 50;
  ArrayType t{DType::kF32, {n}};
  GraphBuilder init("init");
  auto x0 = init.Mul(init.Convert(init.Iota(ArrayType{DType::kS32, {n}}, 0), DType::kF32),
                     init.Broadcast(init.Scalar(DType::kF32, 1e-9), {n}));
  auto make = Check(session->Compile(Check(init.Build({x0}))));
  GraphBuilder g("chain4");
  auto x = g.Parameter(t, "x");
  auto c = [&](double v) { return g.Broadcast(g.Scalar(DType::kF32, v), {n}); };
  auto y = g.Mul(g.Max(g.Add(g.Mul(x, c(1.5)), c(-0.25)), c(0.0)), c(0.5));
  auto exe = Check(session->Compile(Check(g.Build({y})), {.donate = {0}, .strict_donation = true}));
  Sync sync(*session, t);
  auto xa = Check(session->Execute(make, {}));
  xa = Check(session->Execute(exe, xa));  // warm-up: load and compile
  sync(xa[0]);
  const absl::Time start = absl::Now();
  for (int i = 0; i < steps; ++i) xa = Check(session->Execute(exe, xa));
  sync(xa[0]);
  const double t_tessel = absl::ToDoubleSeconds(absl::Now() - start) / steps;
  Check(session->Delete(xa));

  void *src, *dst;
  Cuda(cudaMalloc(&src, n * 4), "cudaMalloc");
  Cuda(cudaMalloc(&dst, n * 4), "cudaMalloc");
  const double t_copy = EventTime(stream, steps, [&] {
    Cuda(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  });
  cudaFree(src);
  cudaFree(dst);
  const double bytes = 2.0 * n * 4;
  return Row{"elementwise_1gib",
             "GB/s",
             bytes / t_tessel / 1e9,
             bytes / t_copy / 1e9,
             0.8,
             true,
             "mul-add-max-mul over 2^28 f32 in place, 50 steps pipelined, vs cudaMemcpyAsync D2D"};
}

// A bf16 8192^3 product vs cublasLtMatmul called directly.
Row DotBf16(tessel::Session* session, cudaStream_t stream) {
  const int64_t m = 8192;
  const int steps = 50;
  std::vector<uint16_t> ha(m * m), hb(m * m);
  for (int64_t i = 0; i < m * m; ++i) {
    ha[i] = Bf16(std::sin(float(i % 9973) * 0.37f));
    hb[i] = Bf16(std::cos(float(i % 7919) * 0.11f));
  }
  ArrayType t{DType::kBF16, {m, m}};
  auto bytes_of = [](const std::vector<uint16_t>& v) {
    return std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(v.data()),
                                reinterpret_cast<const uint8_t*>(v.data()) + v.size() * 2);
  };
  auto aa = Check(session->Put(HostArray(t, bytes_of(ha))));
  auto ba = Check(session->Put(HostArray(t, bytes_of(hb))));
  GraphBuilder g("dot_bf16");
  auto a = g.Parameter(t, "a");
  auto b = g.Parameter(t, "b");
  auto exe = Check(session->Compile(Check(g.Build({g.MatMul(a, b)}))));
  Sync sync(*session, t);
  auto warm = Check(session->Execute(exe, {aa, ba}));
  sync(warm[0]);
  Check(session->Delete(warm));
  const absl::Time start = absl::Now();
  std::vector<tessel::Array> last;
  for (int i = 0; i < steps; ++i) {
    if (!last.empty()) Check(session->Delete(last));
    last = Check(session->Execute(exe, {aa, ba}));
  }
  sync(last[0]);
  const double t_tessel = absl::ToDoubleSeconds(absl::Now() - start) / steps;
  Check(session->Delete(last));
  Check(session->Delete({aa, ba}));

  // cuBLASLt directly: row-major C = A B is column-major C^T = B^T A^T.
  void *da, *db, *dc, *ws;
  const size_t bytes = size_t(m) * m * 2, ws_bytes = size_t{32} << 20;
  Cuda(cudaMalloc(&da, bytes), "cudaMalloc");
  Cuda(cudaMalloc(&db, bytes), "cudaMalloc");
  Cuda(cudaMalloc(&dc, bytes), "cudaMalloc");
  Cuda(cudaMalloc(&ws, ws_bytes), "cudaMalloc");
  Cuda(cudaMemcpy(da, ha.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  Cuda(cudaMemcpy(db, hb.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  cublasLtHandle_t lt;
  Lt(cublasLtCreate(&lt), "cublasLtCreate");
  cublasLtMatmulDesc_t desc;
  Lt(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  cublasLtMatrixLayout_t la, lb, lc;
  Lt(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, m, m, m), "layout");
  Lt(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, m, m, m), "layout");
  Lt(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, m, m, m), "layout");
  cublasLtMatmulPreference_t pref;
  Lt(cublasLtMatmulPreferenceCreate(&pref), "preference");
  Lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                          sizeof(ws_bytes)),
     "preference");
  cublasLtMatmulHeuristicResult_t heuristic;
  int found = 0;
  Lt(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &heuristic, &found),
     "heuristic");
  if (found == 0) Check(absl::InternalError("cuBLASLt has no algorithm for a bf16 8192^3 product"));
  const float alpha = 1, beta = 0;
  const double t_lt = EventTime(stream, steps, [&] {
    Lt(cublasLtMatmul(lt, desc, &alpha, db, lb, da, la, &beta, dc, lc, dc, lc, &heuristic.algo, ws,
                      ws_bytes, stream),
       "cublasLtMatmul");
  });
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(lt);
  for (void* p : {da, db, dc, ws}) cudaFree(p);
  const double flops = 2.0 * m * m * m;
  return Row{"dot_bf16_8192",
             "TFLOP/s",
             flops / t_tessel / 1e12,
             flops / t_lt / 1e12,
             0.95,
             true,
             "bf16 8192^3, f32 accumulation, 50 steps pipelined, vs cublasLtMatmul directly"};
}

// psum over GPUs 0 and 1 vs ncclAllReduce called directly.
Row AllReduce(tessel::Session* session) {
  const int64_t bytes = int64_t{256} << 20, n = bytes / 4;  // per device
  const int steps = 8;
  const tessel::bench::PsumPrograms psum = Check(tessel::bench::CompilePsum(*session, n));
  const tessel::Executable& exe = psum.step;
  std::vector<tessel::Array> state = Check(session->Execute(psum.init, {}));
  auto run = [&](int k) {
    for (int i = 0; i < k; ++i) state = Check(session->Execute(exe, state));
    Check(session->Await(state));
  };
  run(2);  // warm: programs loaded, the communicators joined
  absl::Time start = absl::Now();
  run(steps);
  const double t_tessel = absl::ToDoubleSeconds(absl::Now() - start) / steps;
  Check(session->Delete(state));
  // NCCL directly: both GPUs from this process, one grouped call per step.
  ncclComm_t comms[2];
  int devs[2] = {0, 1};
  Nccl(ncclCommInitAll(comms, 2, devs), "ncclCommInitAll");
  void* buf[2];
  cudaStream_t streams[2];
  for (int d = 0; d < 2; ++d) {
    Cuda(cudaSetDevice(d), "cudaSetDevice");
    Cuda(cudaMalloc(&buf[d], bytes), "cudaMalloc");
    Cuda(cudaMemset(buf[d], 0, bytes), "cudaMemset");
    Cuda(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking), "cudaStreamCreate");
  }
  auto nccl_steps = [&](int k) {
    for (int i = 0; i < k; ++i) {
      Nccl(ncclGroupStart(), "ncclGroupStart");
      for (int d = 0; d < 2; ++d) {
        Nccl(ncclAllReduce(buf[d], buf[d], n, ncclFloat32, ncclSum, comms[d], streams[d]),
             "ncclAllReduce");
      }
      Nccl(ncclGroupEnd(), "ncclGroupEnd");
    }
    for (int d = 0; d < 2; ++d) Cuda(cudaStreamSynchronize(streams[d]), "cudaStreamSynchronize");
  };
  nccl_steps(2);
  start = absl::Now();
  nccl_steps(steps);
  const double t_nccl = absl::ToDoubleSeconds(absl::Now() - start) / steps;
  for (int d = 0; d < 2; ++d) {
    cudaSetDevice(d);
    cudaFree(buf[d]);
    cudaStreamDestroy(streams[d]);
    ncclCommDestroy(comms[d]);
  }
  // Two ranks: the ring's bus bandwidth equals bytes / time.
  return Row{"all_reduce_256mib",
             "GB/s",
             bytes / t_tessel / 1e9,
             bytes / t_nccl / 1e9,
             0.9,
             true,
             "psum over GPUs 0 and 1, donated, 8 steps pipelined, vs ncclAllReduce directly"};
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--only=", 0) == 0) only = a.substr(7);
    if (a == "--json") json = true;
    if (a == "--help" || a == "-h") {
      std::printf(
          "tessel-gpu-bench [--json] [--only=SUBSTR]: the CUDA backend beside cudaMemcpy and "
          "cuBLASLt on\n"
          "GPU 0, as ratios. Needs a GPU.\n");
      return 0;
    }
  }
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::fprintf(stderr, "tessel-gpu-bench: no CUDA device (%s)\n",
                 cudaGetErrorString(cudaGetLastError()));
    return 2;
  }
  tessel::TuneAllocatorForStreaming();
  tessel::SkipMutexCycleDetection();
  tessel::LocalCluster::Options opts;
  opts.workers = 1;
  opts.worker_flags = {"--device_kind=cuda"};
  auto cluster = Check(tessel::LocalCluster::Start(opts));
  auto session = Check(tessel::Session::Connect(cluster->address()));
  std::vector<Row> rows;
  auto want = [&](const char* name) {
    return only.empty() || std::string(name).find(only) != std::string::npos;
  };
  Cuda(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream;
  Cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  if (want("elementwise_1gib")) rows.push_back(Elementwise(session.get(), stream));
  if (want("dot_bf16_8192")) rows.push_back(DotBf16(session.get(), stream));
  cudaStreamDestroy(stream);

  if (want("all_reduce_256mib") && gpus < 2) {
    std::fprintf(stderr, "tessel-gpu-bench: all_reduce_256mib needs 2 GPUs; this machine has %d\n",
                 gpus);
  } else if (want("all_reduce_256mib")) {
    rows.push_back(AllReduce(session.get()));
  }
  cluster.reset();
  Print(rows, json);
  return 0;
}
