// CPU kernels against naive loops written independently here.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "worker/cpu/dot.h"
#include "worker/cpu/fused_loop.h"
#include "worker/cpu/gather.h"
#include "worker/cpu/layout.h"
#include "worker/cpu/native_loop.h"
#include "worker/cpu/parallel.h"
#include "worker/cpu/reduce.h"

namespace tessel::cpu {
namespace {

std::vector<float> Random(int64_t n, int seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

TEST(Dot, GemmMatchesNaiveLoopForEveryOperandLayout) {
  const int64_t m = 13, k = 7, n = 9;
  // lhs stored [k, m] (transposed), rhs stored [n, k] (transposed), and plain.
  for (bool lt : {false, true}) {
    for (bool rt : {false, true}) {
      auto l = Random(m * k, 1), r = Random(k * n, 2);
      v1::TensorType ltype = lt ? MakeType(v1::F32, {k, m}) : MakeType(v1::F32, {m, k});
      v1::TensorType rtype = rt ? MakeType(v1::F32, {n, k}) : MakeType(v1::F32, {k, n});
      v1::DotGeneralAttrs a;
      a.add_lhs_contracting(lt ? 0 : 1);
      a.add_rhs_contracting(rt ? 1 : 0);
      std::vector<float> out(m * n);
      DotGeneral(ltype, l.data(), rtype, r.data(), a, MakeType(v1::F32, {m, n}), out.data());
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double want = 0;
          for (int64_t p = 0; p < k; ++p) {
            want += double(lt ? l[p * m + i] : l[i * k + p]) * (rt ? r[j * k + p] : r[p * n + j]);
          }
          ASSERT_NEAR(out[i * n + j], want, 1e-5) << lt << rt << " at " << i << "," << j;
        }
      }
    }
  }
}

TEST(Dot, BatchedIntegerDotWraps) {
  const int64_t b = 3, m = 2, k = 4, n = 2;
  std::vector<int32_t> l(b * m * k), r(b * k * n);
  for (size_t i = 0; i < l.size(); ++i) l[i] = int32_t(i) * 1000003;
  for (size_t i = 0; i < r.size(); ++i) r[i] = int32_t(i) - 5;
  v1::DotGeneralAttrs a;
  a.add_lhs_batch(0);
  a.add_rhs_batch(0);
  a.add_lhs_contracting(2);
  a.add_rhs_contracting(1);
  std::vector<int32_t> out(b * m * n);
  DotGeneral(MakeType(v1::S32, {b, m, k}), l.data(), MakeType(v1::S32, {b, k, n}), r.data(), a,
             MakeType(v1::S32, {b, m, n}), out.data());
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        uint32_t want = 0;
        for (int64_t p = 0; p < k; ++p)
          want += uint32_t(l[(bi * m + i) * k + p]) * uint32_t(r[(bi * k + p) * n + j]);
        EXPECT_EQ(out[(bi * m + i) * n + j], int32_t(want));
      }
    }
  }
}

// Operand [B=2, M=3, N=4, R=2], indices [B=2, K=5] along axis 2 with one
// batch dim: each batch element picks from its own slab; out-of-range
// indices clamp (gather) or drop (scatter).
TEST(GatherScatter, BatchDimsPickFromEachElementsOwnOperand) {
  const int64_t B = 2, M = 3, N = 4, R = 2, K = 5;
  std::vector<float> x = Random(B * M * N * R, 3);
  const std::vector<int32_t> idx = {0, 3, -1, 9, 2, 1, 1, 3, 0, 2};
  const v1::TensorType xt = MakeType(v1::F32, {B, M, N, R}), it = MakeType(v1::S32, {B, K});
  v1::GatherAttrs g;
  g.set_axis(2);
  g.set_batch_dims(1);
  std::vector<float> out(B * M * K * R);
  Gather(xt, x.data(), it, idx.data(), g, out.data());
  auto at = [&](int64_t b, int64_t m, int64_t n, int64_t r) {
    return ((b * M + m) * N + n) * R + r;
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t r = 0; r < R; ++r) {
          const int64_t i = std::clamp<int64_t>(idx[b * K + k], 0, N - 1);
          ASSERT_EQ(out[((b * M + m) * K + k) * R + r], x[at(b, m, i, r)]) << b << m << k << r;
        }
  v1::ScatterAttrs s;
  s.set_axis(2);
  s.set_batch_dims(1);
  s.set_combine(v1::SUM);
  std::vector<float> upd = Random(B * M * K * R, 4), got(x.size());
  Scatter(xt, x.data(), it, idx.data(), upd.data(), s, got.data());
  std::vector<float> want = x;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t r = 0; r < R; ++r) {
          const int64_t i = idx[b * K + k];
          if (i >= 0 && i < N) want[at(b, m, i, r)] += upd[((b * M + m) * K + k) * R + r];
        }
  for (size_t e = 0; e < want.size(); ++e) ASSERT_FLOAT_EQ(got[e], want[e]) << e;
}

TEST(Layout, TransposeAndPadMatchNaiveIndexing) {
  const int64_t d0 = 3, d1 = 4, d2 = 5;
  auto x = Random(d0 * d1 * d2, 3);
  v1::TransposeAttrs t;
  for (int64_t p : {2, 0, 1}) t.add_permutation(p);
  std::vector<float> out(x.size());
  Transpose(MakeType(v1::F32, {d0, d1, d2}), x.data(), t, MakeType(v1::F32, {d2, d0, d1}),
            out.data());
  for (int64_t i = 0; i < d0; ++i)
    for (int64_t j = 0; j < d1; ++j)
      for (int64_t k = 0; k < d2; ++k)
        ASSERT_EQ(out[(k * d0 + i) * d1 + j], x[(i * d1 + j) * d2 + k]);

  // pad [3,4] with low (1,-1), high (0,2), interior (1,0) -> [6,5]
  v1::PadAttrs p;
  for (int64_t v : {1, -1}) p.add_low(v);
  for (int64_t v : {0, 2}) p.add_high(v);
  for (int64_t v : {1, 0}) p.add_interior(v);
  std::vector<float> in(12);
  for (int i = 0; i < 12; ++i) in[i] = i + 1;
  float pad = -7;
  std::vector<float> po(30, 0);
  Pad(MakeType(v1::F32, {3, 4}), in.data(), &pad, p, MakeType(v1::F32, {6, 5}), po.data());
  for (int64_t r = 0; r < 6; ++r) {
    for (int64_t c = 0; c < 5; ++c) {
      float want = pad;
      // out row r = 1 + 2*i ; out col c = -1 + j
      if ((r - 1) >= 0 && (r - 1) % 2 == 0 && (r - 1) / 2 < 3 && c + 1 < 4)
        want = in[((r - 1) / 2) * 4 + (c + 1)];
      EXPECT_EQ(po[r * 5 + c], want) << r << "," << c;
    }
  }
}

TEST(Reduce, FloatSumsArePairwise) {
  // 1e6 x float32(0.1): a sequential float sum drifts to 100958.3 (1e-2
  // relative error); numpy's pairwise sum gives 100000.0. Checked against a
  // double-precision sum of the same floats at sizes around the 128-element
  // blocks and far beyond.
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{127}, int64_t{129}, int64_t{1000},
                    int64_t{1000000}, int64_t{1} << 22}) {
    std::vector<float> x(n, 0.1f);
    v1::ReduceAttrs r;
    r.set_kind(v1::SUM);
    r.add_dims(0);
    v1::TensorType out_t;
    out_t.set_dtype(v1::F32);
    float got = 0;
    Reduce(MakeType(v1::F32, {n}), x.data(), r, out_t, &got);
    const double want = double(0.1f) * double(n);
    // Pairwise: a few ulps times log2(n); sequential would be ~n ulps.
    EXPECT_LE(std::fabs(got - want) / want, 1e-6) << n << " elements: " << got << " vs " << want;
  }
}

TEST(Reduce, SumOverLeadingAndTrailingDims) {
  const int64_t a = 4, b = 3, c = 5;
  auto x = Random(a * b * c, 4);
  for (std::vector<int64_t> dims : std::vector<std::vector<int64_t>>{{0}, {2}, {0, 2}, {0, 1, 2}}) {
    v1::ReduceAttrs r;
    r.set_kind(v1::SUM);
    std::vector<int64_t> kept;
    for (int64_t d : dims) r.add_dims(d);
    v1::TensorType out_t;
    out_t.set_dtype(v1::F32);
    std::vector<int64_t> full = {a, b, c};
    for (int d = 0; d < 3; ++d) {
      if (std::find(dims.begin(), dims.end(), d) == dims.end()) out_t.add_dims(full[d]);
    }
    std::vector<float> out(NumElementsUnchecked(out_t));
    Reduce(MakeType(v1::F32, {a, b, c}), x.data(), r, out_t, out.data());
    std::vector<double> want(out.size(), 0);
    for (int64_t i = 0; i < a; ++i)
      for (int64_t j = 0; j < b; ++j)
        for (int64_t k = 0; k < c; ++k) {
          int64_t idx[3] = {i, j, k}, o = 0;
          for (int d = 0; d < 3; ++d) {
            if (std::find(dims.begin(), dims.end(), d) == dims.end()) o = o * full[d] + idx[d];
          }
          want[o] += x[(i * b + j) * c + k];
        }
    for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], want[i], 1e-5);
  }
}

// Small loops run on one thread; large ones split their blocks over threads
// (3 here, an uneven split, with a ragged last block). Both equal the
// step-by-step reference, iota included (it depends on the block offset).
// Appends an f32[n] node to `f`.
v1::Node* AddNode(v1::Fusion& f, int64_t n, const char* name, v1::Op op,
                  std::vector<std::string> operands) {
  v1::Node* nd = f.add_nodes();
  nd->set_name(name);
  nd->set_op(op);
  for (auto& o : operands) nd->add_operands(o);
  *nd->mutable_type() = MakeType(v1::F32, {n});
  return nd;
}

// `offset` elements before each output: a target that is not 16-byte aligned.
void CheckChain(int64_t n, int threads, int64_t offset = 0) {
  v1::Fusion f;
  f.add_inputs("x");
  auto node = [&](const char* name, v1::Op op, std::vector<std::string> operands) {
    return AddNode(f, n, name, op, std::move(operands));
  };
  v1::Node* c = f.add_nodes();
  c->set_name("half");
  c->set_op(v1::CONSTANT);
  c->mutable_constant()->mutable_fill()->set_f(0.5);
  *c->mutable_type() = MakeType(v1::F32, {});
  v1::Node* b = node("halves", v1::BROADCAST_IN_DIM, {"half"});
  b->mutable_broadcast_in_dim()->add_dims(n);
  node("m", v1::MUL, {"x", "halves"});
  node("t", v1::TANH, {"m"});
  v1::Node* io = node("i", v1::CONSTANT, {});
  io->mutable_constant()->mutable_iota()->set_dimension(0);
  node("y", v1::ADD, {"t", "i"});
  f.add_outputs("y");
  f.add_outputs("m");
  auto loop = FusedLoop::Build(f, {MakeType(v1::F32, {n})});
  ASSERT_TRUE(loop.ok()) << loop.status();
  if (!loop.ok()) return;
  auto x = Random(n, 5);
  std::vector<float> y_buf(n + offset + 1, -7.0f), m_buf(n + offset + 1, -7.0f);
  float* y = y_buf.data() + offset;
  float* m = m_buf.data() + offset;
  std::vector<const void*> ins = {x.data()};
  std::vector<void*> outs = {y, m};
  loop->Run(ins, outs, threads);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_FLOAT_EQ(m[i], x[i] * 0.5f);
    ASSERT_FLOAT_EQ(y[i], std::tanh(x[i] * 0.5f) + float(i));
  }
  // Nothing outside the outputs is written.
  for (int64_t i = 0; i < offset; ++i) ASSERT_EQ(y_buf[i], -7.0f);
  ASSERT_EQ(y_buf[n + offset], -7.0f);
  ASSERT_EQ(m_buf[n + offset], -7.0f);
}

// A compiled fusion (NativeFusion) gives the interpreter's bits: exp, log,
// tanh and logistic, a division, max with NaN, a comparison and a select,
// conversions to int and back, an iota and a one-element constant output;
// over threads (ranges that end inside a block), and in place (an output
// written over the input it reads, as a donated buffer is).
TEST(NativeFusion, GivesTheInterpretersBitsOverThreadsAndInPlace) {
  const int64_t n = FusedLoop::kBlock * 3 + 17;
  v1::Fusion f;
  f.add_inputs("x");
  f.add_inputs("w");
  auto node = [&](const char* name, v1::Op op, std::vector<std::string> operands) {
    return AddNode(f, n, name, op, std::move(operands));
  };
  node("e", v1::EXP, {"x"});
  node("a", v1::ABS, {"x"});
  node("l", v1::LOG, {"a"});
  node("t", v1::TANH, {"l"});
  node("s", v1::LOGISTIC, {"w"});
  node("q", v1::DIV, {"e", "w"});
  node("mx", v1::MAX, {"q", "t"});
  v1::Node* lt = node("lt", v1::COMPARE, {"x", "w"});
  lt->mutable_compare()->set_direction(v1::LT);
  *lt->mutable_type() = MakeType(v1::PRED, {n});
  node("sel", v1::SELECT, {"lt", "mx", "s"});
  v1::Node* toi = node("toi", v1::CONVERT, {"q"});
  toi->mutable_convert()->set_dtype(v1::S32);
  *toi->mutable_type() = MakeType(v1::S32, {n});
  v1::Node* tof = node("tof", v1::CONVERT, {"toi"});
  tof->mutable_convert()->set_dtype(v1::F32);
  v1::Node* io = node("i", v1::CONSTANT, {});
  io->mutable_constant()->mutable_iota()->set_dimension(0);
  node("y", v1::ADD, {"sel", "i"});
  node("z", v1::SUB, {"tof", "y"});
  v1::Node* c = f.add_nodes();
  c->set_name("c");
  c->set_op(v1::CONSTANT);
  c->mutable_constant()->mutable_fill()->set_f(0.25);
  *c->mutable_type() = MakeType(v1::F32, {});
  f.add_outputs("z");
  f.add_outputs("c");
  f.add_outputs("lt");
  const std::vector<v1::TensorType> types = {MakeType(v1::F32, {n}), MakeType(v1::F32, {n})};
  auto loop = FusedLoop::Build(f, types);
  ASSERT_TRUE(loop.ok()) << loop.status();
  std::string why;
  auto native = NativeFusion::Start(f, types, &why);
  ASSERT_NE(native, nullptr) << why;
  ASSERT_TRUE(native->AwaitReady(absl::Seconds(60))) << "the fusion did not compile";
  std::vector<float> x = Random(n, 7), w = Random(n, 8);
  for (int64_t i = 0; i < n; i += 97) x[i] = std::nanf("");  // NaN through every op
  for (int64_t i = 5; i < n; i += 89) w[i] = 0.0f;           // division by zero
  auto run = [&](bool compiled, int threads, std::vector<float>& z, float& c,
                 std::vector<uint8_t>& lt, const std::vector<float>& xin) {
    std::vector<const void*> ins = {xin.data(), w.data()};
    std::vector<void*> outs = {z.data(), &c, lt.data()};
    if (compiled) {
      loop->RunRanges(native->fn(), ins, outs, threads);
    } else {
      loop->Run(ins, outs, threads);
    }
  };
  std::vector<float> z0(n), z1(n);
  std::vector<uint8_t> lt0(n), lt1(n);
  float c0 = 0, c1 = 0;
  run(false, 1, z0, c0, lt0, x);
  for (int threads : {1, 3}) {
    run(true, threads, z1, c1, lt1, x);
    EXPECT_EQ(std::memcmp(z0.data(), z1.data(), n * 4), 0) << threads << " threads";
    EXPECT_EQ(lt0, lt1);
    EXPECT_EQ(c1, 0.25f);
  }
  std::vector<float> inplace = x;
  run(true, 3, inplace, c1, lt1, inplace);
  EXPECT_EQ(std::memcmp(z0.data(), inplace.data(), n * 4), 0);
}

TEST(FusedLoop, ChainAcrossManyBlocksEqualsStepByStep) {
  CheckChain(FusedLoop::kBlock * 3 + 17, 1);
}

// A size-0 run with a scalar constant in it (numpy's `3 + arange(0)`) has
// no elements: the loop must not run over the scalar's one (an iota over an
// empty dimension divided by zero and killed the worker).
TEST(FusedLoop, ASizeZeroRunWithAScalarConstantWritesNothing) { CheckChain(0, 1); }

TEST(FusedLoop, LargeLoopsSplitOverThreadsEqualStepByStep) {
  CheckChain(FusedLoop::kParallelElements + FusedLoop::kBlock * 5 + 3, 3);
}

// Outputs past kStreamBytes are staged per block and streamed out with
// non-temporal stores: aligned and unaligned targets, one thread and two.
TEST(ParallelFor, EveryPieceRunsOnceWhileOtherCallersShareThePool) {
  // Four callers (as four devices' step threads would) each run 300 calls
  // of 1..8 pieces over 1..3 threads at once; every piece runs exactly once,
  // and each call returns only after all of its pieces have.
  constexpr int kCallers = 4, kCalls = 300;
  std::atomic<int> wrong{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int call = 0; call < kCalls; ++call) {
        const int n = 1 + (call + c) % 8;
        std::vector<std::atomic<int>> runs(n);
        tessel::cpu::ParallelFor(n, 1 + call % 3, [&](int i) { runs[i].fetch_add(1); });
        for (int i = 0; i < n; ++i) {
          if (runs[i].load() != 1) wrong.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(wrong.load(), 0);
  int none = 0;
  tessel::cpu::ParallelFor(0, 2, [&](int) { ++none; });
  EXPECT_EQ(none, 0);
}

TEST(FusedLoop, StreamedOutputsEqualStepByStep) {
  const int64_t n = FusedLoop::kStreamBytes / 4 + FusedLoop::kBlock * 2 + 5;
  CheckChain(n, 1);
  CheckChain(n, 2, 3);
}

// A fusion of f32[n] nodes over inputs x (f32[n]) and s (one element),
// starting sb = broadcast(s), m = x * sb; tests add the rest.
struct ScaleFusion {
  explicit ScaleFusion(int64_t n) : n(n) {
    f.add_inputs("x");
    f.add_inputs("s");
    Add("sb", v1::BROADCAST_IN_DIM, {"s"})->mutable_broadcast_in_dim()->add_dims(n);
    Add("m", v1::MUL, {"x", "sb"});
  }
  v1::Node* Add(const char* name, v1::Op op, std::vector<std::string> operands) {
    return AddNode(f, n, name, op, std::move(operands));
  }
  const int64_t n;
  v1::Fusion f;
};

// A broadcast of a one-element value reads the value's splatted block in
// place; one that is also an output is still written out, every block.
TEST(FusedLoop, BroadcastsOfOneElementValuesReadInPlaceAndAreWrittenWhenOutputs) {
  const int64_t n = FusedLoop::kBlock * 2 + 9;
  ScaleFusion sf(n);
  sf.Add("sb2", v1::BROADCAST_IN_DIM, {"s"})->mutable_broadcast_in_dim()->add_dims(n);
  sf.Add("y", v1::ADD, {"m", "sb2"});
  v1::Fusion& f = sf.f;
  f.add_outputs("y");
  f.add_outputs("sb2");
  auto loop = FusedLoop::Build(f, {MakeType(v1::F32, {n}), MakeType(v1::F32, {})});
  ASSERT_TRUE(loop.ok()) << loop.status();
  auto x = Random(n, 9);
  const float s = -1.75f;
  std::vector<float> y(n, 0.0f), sb(n, 0.0f);
  loop->Run({x.data(), &s}, {y.data(), sb.data()}, 2);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_FLOAT_EQ(y[i], x[i] * s + s) << i;
    ASSERT_EQ(sb[i], s) << i;
  }
}

// A fusion bound to fixed buffers (a device-side loop's form): constants
// written once at bind, a one-element input splatted on every run from
// wherever it now points, inputs re-pointed between runs.
TEST(FusedLoop, ABoundFusionRereadsItsInputsEveryRunAndFollowsRePointing) {
  const int64_t n = 37;
  ScaleFusion sf(n);
  sf.Add("i", v1::CONSTANT, {})->mutable_constant()->mutable_iota()->set_dimension(0);
  sf.Add("y", v1::SUB, {"m", "i"});
  v1::Fusion& f = sf.f;
  f.add_outputs("y");
  f.add_outputs("m");
  auto loop = FusedLoop::Build(f, {MakeType(v1::F32, {n}), MakeType(v1::F32, {})});
  ASSERT_TRUE(loop.ok()) << loop.status();
  auto x1 = Random(n, 7), x2 = Random(n, 8);
  float s1 = 3, s2 = -0.25f;
  std::vector<float> y(n), m(n);
  auto bound = loop->Bind({x1.data(), &s1}, {y.data(), m.data()});
  ASSERT_TRUE(bound.ok()) << bound.status();
  auto check = [&](const std::vector<float>& x, float s) {
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_FLOAT_EQ(m[i], x[i] * s) << i;
      ASSERT_FLOAT_EQ(y[i], x[i] * s - float(i)) << i;
    }
  };
  bound->Run();
  check(x1, s1);
  s1 = 5;  // the same address, a new value
  x1[3] = 100;
  bound->Run();
  check(x1, s1);
  bound->SetInput(0, x2.data());
  bound->SetInput(1, &s2);
  bound->Run();
  check(x2, s2);

  v1::Fusion big = f;
  for (v1::Node& nd : *big.mutable_nodes())
    *nd.mutable_type() = MakeType(v1::F32, {FusedLoop::kBlock + 1});
  big.mutable_nodes(0)->mutable_broadcast_in_dim()->set_dims(0, FusedLoop::kBlock + 1);
  auto large =
      FusedLoop::Build(big, {MakeType(v1::F32, {FusedLoop::kBlock + 1}), MakeType(v1::F32, {})});
  ASSERT_TRUE(large.ok()) << large.status();
  EXPECT_FALSE(large->Bind({x1.data(), &s1}, {y.data(), m.data()}).ok())
      << "more than one block must not bind";
}

}  // namespace
}  // namespace tessel::cpu
