// The CUDA device on a real GPU, against the CPU device on the same
// programs. Without a GPU (or a driver) every test skips, saying why.
#include "worker/cuda/cuda_device.h"

#include <gloo/rendezvous/hash_store.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/dtype.h"
#include "worker/cpu/cpu_device.h"
#include "worker/cpu/elementwise.h"

namespace tessel::cuda {
namespace {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const CudaProbe probe = ProbeCuda();
    if (probe.count == 0) GTEST_SKIP() << "no CUDA device: " << probe.reason;
  }
  std::unique_ptr<CudaDevice> MakeDevice(int64_t limit = 0) {
    auto d = CudaDevice::Create({.local_index = 0, .ordinal = 0, .memory_limit_bytes = limit});
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? std::move(*d) : nullptr;
  }
};

std::vector<float> Random(int64_t n, int seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

TEST_F(CudaDeviceTest, CopiesRoundTripThroughPinnedStaging) {
  auto dev = MakeDevice();
  ASSERT_NE(dev, nullptr);
  const int64_t n = (int64_t{21} << 20) + 7;  // several staging chunks and a ragged tail
  std::vector<char> src(n), back(n);
  for (int64_t i = 0; i < n; ++i) src[i] = char(i * 131 + 7);
  auto buf = dev->Allocate(n + 100);
  ASSERT_TRUE(buf.ok()) << buf.status();
  ASSERT_TRUE(dev->CopyFromHost(**buf, 100, src.data(), n).ok());
  ASSERT_TRUE(dev->CopyToHost(**buf, 100, back.data(), n).ok());
  EXPECT_EQ(src, back);
  EXPECT_EQ(dev->CopyToHost(**buf, 200, back.data(), n).code(), absl::StatusCode::kOutOfRange);
}

TEST_F(CudaDeviceTest, OutOfMemoryIsResourceExhaustedNamingTheDevice) {
  auto dev = MakeDevice(int64_t{64} << 20);
  ASSERT_NE(dev, nullptr);
  auto big = dev->Allocate(int64_t{128} << 20);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("cuda:0"), std::string::npos) << big.status();
  // Past the physical memory too: cudaMalloc fails, the device says so and keeps working.
  auto unlimited = MakeDevice(int64_t{1} << 50);
  auto huge = unlimited->Allocate(int64_t{1} << 49);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(unlimited->Allocate(1 << 20).ok());
}

// y = sum(tanh(x @ w) * 2 + 1, axis 1), and the product itself.
constexpr char kProgram[] = R"pb(
  executable_id: "gpu-test"
  parameters { name: "x" op: PARAMETER type { dtype: F32 dims: 64 dims: 96 } }
  parameters { name: "w" op: PARAMETER type { dtype: F32 dims: 96 dims: 40 } }
  instructions { node { name: "xw" op: DOT_GENERAL operands: "x" operands: "w" type { dtype: F32 dims: 64 dims: 40 }
                        dot_general { lhs_contracting: 1 rhs_contracting: 0 } } }
  instructions { fusion {
    inputs: "xw"
    nodes { name: "t" op: TANH operands: "xw" type { dtype: F32 dims: 64 dims: 40 } }
    nodes { name: "two" op: CONSTANT type { dtype: F32 } constant { fill { f: 2 } } }
    nodes { name: "two_b" op: BROADCAST_IN_DIM operands: "two" type { dtype: F32 dims: 64 dims: 40 }
            broadcast_in_dim { dims: 64 dims: 40 } }
    nodes { name: "m" op: MUL operands: "t" operands: "two_b" type { dtype: F32 dims: 64 dims: 40 } }
    outputs: "m" } }
  instructions { node { name: "y" op: REDUCE operands: "m" type { dtype: F32 dims: 64 } reduce { kind: SUM dims: 1 } }
                 release: "m" }
  outputs: "y"
  outputs: "xw"
)pb";

std::vector<float> RunOn(worker::Device& dev, const v1::Program& p,
                         const std::vector<std::vector<float>>& ins, int output,
                         worker::BufferPtr* out_buffer = nullptr) {
  auto exe = dev.Load(p);
  EXPECT_TRUE(exe.ok()) << exe.status();
  if (!exe.ok()) return {};
  std::vector<worker::BufferPtr> args;
  for (const auto& v : ins) {
    auto b = dev.Allocate(v.size() * 4);
    EXPECT_TRUE(b.ok());
    EXPECT_TRUE(dev.CopyFromHost(**b, 0, v.data(), v.size() * 4).ok());
    args.push_back(*b);
  }
  auto outs = (*exe)->Run(args, {}, worker::StepContext{});
  EXPECT_TRUE(outs.ok()) << outs.status();
  if (!outs.ok()) return {};
  const worker::BufferPtr& o = (*outs)[output];
  std::vector<float> host(o->size() / 4);
  EXPECT_TRUE(dev.CopyToHost(*o, 0, host.data(), o->size()).ok());
  if (out_buffer != nullptr) *out_buffer = o;
  return host;
}

TEST_F(CudaDeviceTest, ProgramMatchesTheCpuDevice) {
  auto dev = MakeDevice();
  ASSERT_NE(dev, nullptr);
  v1::Program p;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kProgram, &p));
  cpu::CpuDevice host({});
  const std::vector<std::vector<float>> ins = {Random(64 * 96, 1), Random(96 * 40, 2)};
  for (int out : {0, 1}) {
    std::vector<float> want = RunOn(host, p, ins, out), got = RunOn(*dev, p, ins, out);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-4 * (1 + std::fabs(want[i]))) << out << ":" << i;
  }
}

TEST_F(CudaDeviceTest, SteadyStateStepsAllocateNothingNew) {
  auto dev = MakeDevice();
  ASSERT_NE(dev, nullptr);
  v1::Program p;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kProgram, &p));
  const std::vector<std::vector<float>> ins = {Random(64 * 96, 1), Random(96 * 40, 2)};
  RunOn(*dev, p, ins, 0);
  ASSERT_TRUE(dev->Synchronize().ok());
  const worker::MemoryStats before = dev->memory_stats();
  for (int i = 0; i < 50; ++i) RunOn(*dev, p, ins, 0);
  ASSERT_TRUE(dev->Synchronize().ok());
  const worker::MemoryStats after = dev->memory_stats();
  EXPECT_EQ(after.bytes_in_use + after.bytes_cached, before.bytes_in_use + before.bytes_cached);
}

// NCCL on the GPU: a one-rank communicator runs every collective kind for
// real (NCCL's kernels and grouped send/recv on the device's stream,
// bracketed by the watchdog's markers), and the step's fence gives its
// verdict. One rank makes every collective the identity (a permutation with
// no pair into the rank, zeros); several ranks need one GPU each.
TEST_F(CudaDeviceTest, NcclRunsEveryCollectiveOnTheStreamAndTheFenceGivesItsVerdict) {
  auto dev = MakeDevice();
  ASSERT_NE(dev, nullptr);
  NcclGroups groups({});
  gloo::rendezvous::HashStore store;
  worker::ResolvedGroup g;
  g.spec.key = "devices:0@cuda-device-test.1";
  g.spec.rank_devices = {0};
  const int64_t n = 4096;
  int64_t op = 0;
  using Kind = NcclCall::Kind;
  for (const v1::DType dt :
       {v1::F32, v1::BF16, v1::S32, v1::S64, v1::U8, v1::S16, v1::PRED, v1::F64}) {
    for (const Kind kind : {Kind::kAllReduce, Kind::kAllGather, Kind::kReduceScatter,
                            Kind::kAllToAll, Kind::kPermute}) {
      for (const bool zeroed : {false, true}) {
        if (zeroed && kind != Kind::kPermute) continue;
        const bool reduces = kind == Kind::kAllReduce || kind == Kind::kReduceScatter;
        const int64_t bytes = n * DTypeSize(dt);
        std::vector<char> src(bytes), got(bytes, 7);
        for (int64_t i = 0; i < bytes; ++i)
          src[i] = dt == v1::PRED ? char(i % 3 == 0) : char(i * 37 + 11);
        if (dt == v1::F32 || dt == v1::F64 ||
            dt == v1::BF16) {  // finite values: NaN bit patterns compare unequal
          for (int64_t i = 0; i < bytes; i += DTypeSize(dt)) src[i + DTypeSize(dt) - 1] = 0x3f;
        }
        auto in = dev->Allocate(bytes);
        auto out = dev->Allocate(bytes);
        ASSERT_TRUE(in.ok() && out.ok());
        ASSERT_TRUE(dev->CopyFromHost(**in, 0, src.data(), bytes).ok());
        NcclCall call{
            .kind = kind, .in = (*in)->opaque(), .out = (*out)->opaque(), .count = n, .dtype = dt};
        call.op = worker::ReduceOp::kMax;
        if (kind == Kind::kPermute && !zeroed) call.pairs = {{0, 0}};
        auto check = groups.Run(g, {1, int32_t(++op), 0}, call, dev->nccl_device(), &store);
        if (dt == v1::S16 && reduces) {
          EXPECT_EQ(check.status().code(), absl::StatusCode::kUnimplemented) << check.status();
          continue;
        }
        ASSERT_TRUE(check.ok()) << DTypeName(dt) << " " << int(kind) << ": " << check.status();
        dev->AddFenceCheck(std::move(*check));
        const absl::Status verdict = dev->Fence()();
        ASSERT_TRUE(verdict.ok()) << verdict;
        ASSERT_TRUE(dev->CopyToHost(**out, 0, got.data(), bytes).ok());
        EXPECT_EQ(got, zeroed ? std::vector<char>(bytes, 0) : src)
            << DTypeName(dt) << " " << int(kind);
      }
    }
  }
  EXPECT_EQ(groups.num_groups(), 1);
}

}  // namespace
}  // namespace tessel::cuda
