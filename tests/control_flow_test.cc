// Control flow through the C++ SDK and the CLI against real daemons:
// GraphBuilder's While, Cond and Scan, checked against the same loops run
// here in plain C++.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "tessel/graph.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"

namespace tessel {
namespace {

class ControlFlowTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    LocalCluster::Options o;
    o.workers = 1;
    o.devices_per_worker = 1;
    auto c = LocalCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = c->release();
  }
  static void TearDownTestSuite() { delete cluster_; }
  void SetUp() override {
    ASSERT_NE(cluster_, nullptr);
    auto s = Session::Connect(cluster_->address());
    ASSERT_TRUE(s.ok()) << s.status();
    session_ = std::move(*s);
  }
  std::vector<HostArray> Run(const Graph& g, const std::vector<HostArray>& inputs) {
    auto exe = session_->Compile(g);
    EXPECT_TRUE(exe.ok()) << exe.status();
    if (!exe.ok()) return {};
    std::vector<Array> args;
    for (const HostArray& h : inputs) args.push_back(*session_->Put(h, Placement::Device(0)));
    auto outs = session_->Execute(*exe, args, {Placement::Device(0)});
    EXPECT_TRUE(outs.ok()) << outs.status();
    if (!outs.ok()) return {};
    std::vector<HostArray> got;
    for (const Array& o : *outs) got.push_back(*session_->Fetch(o));
    return got;
  }
  static LocalCluster* cluster_;
  std::unique_ptr<Session> session_;
};
LocalCluster* ControlFlowTest::cluster_ = nullptr;

TEST_F(ControlFlowTest, WhileWithARunTimeTripCountMatchesTheSameLoopInCpp) {
  GraphBuilder g("newton");
  Value a = g.Parameter({DType::kF32, {3}}, "a");
  Value n = g.Parameter({DType::kS32, {}}, "n");
  std::vector<Value> out = g.While(
      {g.Scalar(DType::kS32, 0), n, a, a},
      [](GraphBuilder& f, const std::vector<Value>& c) {
        return std::vector<Value>{f.Compare(c[0], c[1], Comparison::kLt)};
      },
      [](GraphBuilder& f, const std::vector<Value>& c) {
        Value x =
            f.Mul(f.Add(c[3], f.Div(c[2], c[3])), f.Broadcast(f.Scalar(DType::kF32, 0.5), {3}));
        return std::vector<Value>{f.Add(c[0], f.Scalar(DType::kS32, 1)), c[1], c[2], x};
      });
  auto graph = g.Build({out[0], out[3]});
  ASSERT_TRUE(graph.ok()) << graph.status();
  const std::vector<float> av = {2.0f, 9.0f, 1e4f};
  for (int trips : {0, 1, 3, 25}) {
    auto got =
        Run(*graph, {HostArray::From<float>({3}, av), HostArray::From<int32_t>({}, {trips})});
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0].as<int32_t>()[0], trips);
    for (int k = 0; k < 3; ++k) {
      float x = av[k];
      for (int i = 0; i < trips; ++i) x = (x + av[k] / x) * 0.5f;
      EXPECT_EQ(got[1].as<float>()[k], x) << "trips " << trips << " element " << k;
      if (trips == 25) {
        EXPECT_NEAR(x, std::sqrt(av[k]), 1e-3f * std::sqrt(av[k]));
      }
    }
  }
}

TEST_F(ControlFlowTest, ScanStacksOutputsForwardAndReverse) {
  for (bool reverse : {false, true}) {
    GraphBuilder g("cumsum");
    Value xs = g.Parameter({DType::kF32, {5, 2}}, "xs");
    std::vector<Value> out = g.Scan(
        {g.Broadcast(g.Scalar(DType::kF32, 0), {2})}, {xs}, 5,
        [](GraphBuilder& f, const std::vector<Value>& p) {
          Value c = f.Add(f.Mul(p[0], f.Broadcast(f.Scalar(DType::kF32, 0.5), {2})), p[1]);
          return std::vector<Value>{c, f.Reduce(c, ReduceKind::kSum, {0})};
        },
        reverse);
    auto graph = g.Build(out);
    ASSERT_TRUE(graph.ok()) << graph.status();
    std::vector<float> x(10);
    for (int i = 0; i < 10; ++i) x[i] = float(i * i % 7) - 2.5f;
    auto got = Run(*graph, {HostArray::From<float>({5, 2}, x)});
    ASSERT_EQ(got.size(), 2u);
    ASSERT_EQ(got[1].type().dims, (std::vector<int64_t>{5}));
    float c[2] = {0, 0};
    for (int s = 0; s < 5; ++s) {
      const int t = reverse ? 4 - s : s;
      for (int j = 0; j < 2; ++j) c[j] = c[j] * 0.5f + x[t * 2 + j];
      EXPECT_EQ(got[1].as<float>()[t], c[0] + c[1]) << "step " << t;
    }
    EXPECT_EQ(got[0].as<float>()[0], c[0]);
    EXPECT_EQ(got[0].as<float>()[1], c[1]);
  }
}

TEST_F(ControlFlowTest, CondRunsOneBranchAndAnIndexOutOfRangeRunsTheLast) {
  GraphBuilder g("switch");
  Value k = g.Parameter({DType::kS32, {}}, "k");
  Value x = g.Parameter({DType::kF32, {2}}, "x");
  std::vector<GraphBuilder::Function> branches = {
      [](GraphBuilder& f, const std::vector<Value>& p) { return std::vector<Value>{f.Neg(p[0])}; },
      [](GraphBuilder& f, const std::vector<Value>& p) { return std::vector<Value>{f.Exp(p[0])}; },
      [](GraphBuilder& f, const std::vector<Value>& p) {
        return std::vector<Value>{f.Add(p[0], p[0])};
      },
  };
  auto graph = g.Build(g.Cond(k, {x}, branches));
  ASSERT_TRUE(graph.ok()) << graph.status();
  const std::vector<float> xv = {1.5f, -2.0f};
  for (int index : {0, 1, 2, 3, -1}) {
    auto got =
        Run(*graph, {HostArray::From<int32_t>({}, {index}), HostArray::From<float>({2}, xv)});
    ASSERT_EQ(got.size(), 1u);
    const int b = index < 0 || index > 2 ? 2 : index;  // XLA: out of range runs the last branch
    for (int i = 0; i < 2; ++i) {
      const float want = b == 0 ? -xv[i] : b == 1 ? std::exp(xv[i]) : xv[i] + xv[i];
      EXPECT_FLOAT_EQ(got[0].as<float>()[i], want) << "index " << index;
    }
  }
}

TEST(ControlFlowBuilder, ABodyThatChangesACarriedTypeFailsWhereItIsBuilt) {
  GraphBuilder g("bad");
  Value x = g.Parameter({DType::kF32, {2}}, "x");
  std::vector<Value> out = g.While(
      {x},
      [](GraphBuilder& f, const std::vector<Value>& c) {
        return std::vector<Value>{f.Compare(f.Reduce(c[0], ReduceKind::kSum, {0}),
                                            f.Scalar(DType::kF32, 0), Comparison::kLt)};
      },
      [](GraphBuilder& f, const std::vector<Value>& c) {
        return std::vector<Value>{f.Convert(c[0], DType::kF64)};
      });
  EXPECT_TRUE(out.empty());
  auto built = g.Build({x});
  ASSERT_FALSE(built.ok());
  EXPECT_NE(built.status().message().find("returns (f64[2]); expected the carries (f32[2])"),
            std::string::npos)
      << built.status();
  // The compare in cond gives pred[2], not a scalar predicate.
  GraphBuilder h("bad_pred");
  Value y = h.Parameter({DType::kF32, {2}}, "y");
  h.While(
      {y},
      [](GraphBuilder& f, const std::vector<Value>& c) {
        return std::vector<Value>{f.Compare(c[0], c[0], Comparison::kLt)};
      },
      [](GraphBuilder&, const std::vector<Value>& c) { return c; });
  EXPECT_NE(h.status().message().find("expected the loop predicate (pred[])"), std::string::npos)
      << h.status();
}

TEST_F(ControlFlowTest, GradientsAndTangentsFromTheBuilderMatchTheSameInCpp) {
  // f(w, x) = sum_i tanh((x w)_i): df/dw_j = sum_i (1 - tanh^2((x w)_i)) x_ij.
  GraphBuilder g("grad");
  Value w = g.Parameter({DType::kF64, {3}}, "w");
  Value x = g.Parameter({DType::kF64, {4, 3}}, "x");
  Value tw = g.Parameter({DType::kF64, {3}}, "tw");
  GraphBuilder::Function f = [](GraphBuilder& b, const std::vector<Value>& p) {
    Value y = b.DotGeneral(p[1], p[0], {.lhs_contracting = {1}, .rhs_contracting = {0}});
    return std::vector<Value>{b.Reduce(b.Tanh(y), ReduceKind::kSum, {0})};
  };
  std::vector<Value> vg = g.ValueAndGrad(f, {w, x}, {0});
  std::vector<Value> jv = g.Jvp(f, {w, x}, {tw}, {0});
  auto graph = g.Build({vg[0], vg[1], jv[1]});
  ASSERT_TRUE(graph.ok()) << graph.status();
  const std::vector<double> wv = {0.3, -0.2, 0.5}, tv = {1.0, 0.5, -2.0};
  std::vector<double> xv(12);
  for (int i = 0; i < 12; ++i) xv[i] = std::sin(i * 0.7);
  auto got = Run(*graph, {HostArray::From<double>({3}, wv), HostArray::From<double>({4, 3}, xv),
                          HostArray::From<double>({3}, tv)});
  ASSERT_EQ(got.size(), 3u);
  double value = 0, tangent = 0, grad[3] = {0, 0, 0};
  for (int i = 0; i < 4; ++i) {
    double y = 0, ty = 0;
    for (int j = 0; j < 3; ++j) y += xv[i * 3 + j] * wv[j], ty += xv[i * 3 + j] * tv[j];
    const double t = std::tanh(y);
    value += t;
    tangent += (1 - t * t) * ty;
    for (int j = 0; j < 3; ++j) grad[j] += (1 - t * t) * xv[i * 3 + j];
  }
  EXPECT_NEAR(got[0].as<double>()[0], value, 1e-12);
  for (int j = 0; j < 3; ++j) EXPECT_NEAR(got[1].as<double>()[j], grad[j], 1e-12) << j;
  EXPECT_NEAR(got[2].as<double>()[0], tangent, 1e-12);
}

TEST_F(ControlFlowTest, VmapFromTheBuilderMatchesTheSameLoopInCpp) {
  // f(x, w) = tanh(x . w) for each of 5 rows x (mapped along axis 1 of xs,
  // [3, 5]), w the same for every row; the results stacked along axis 1.
  GraphBuilder g("vmap");
  Value xs = g.Parameter({DType::kF64, {3, 5}}, "xs");
  Value w = g.Parameter({DType::kF64, {3}}, "w");
  GraphBuilder::Function f = [](GraphBuilder& b, const std::vector<Value>& p) {
    Value y = b.DotGeneral(p[0], p[1], {.lhs_contracting = {0}, .rhs_contracting = {0}});
    return std::vector<Value>{b.Tanh(y), b.Mul(p[1], p[1])};
  };
  std::vector<Value> r =
      g.Vmap(f, {xs, w}, {1, GraphBuilder::kNotMapped}, {0, GraphBuilder::kNotMapped});
  ASSERT_TRUE(g.status().ok()) << g.status();
  EXPECT_EQ(r[0].type().ToString(), "f64[5]");
  EXPECT_EQ(r[1].type().ToString(), "f64[3]");
  auto graph = g.Build({r[0], r[1]});
  ASSERT_TRUE(graph.ok()) << graph.status();
  std::vector<double> xv(15);
  for (int i = 0; i < 15; ++i) xv[i] = std::sin(i * 0.7);
  const std::vector<double> wv = {0.3, -0.2, 0.5};
  auto got = Run(*graph, {HostArray::From<double>({3, 5}, xv), HostArray::From<double>({3}, wv)});
  ASSERT_EQ(got.size(), 2u);
  for (int b = 0; b < 5; ++b) {
    double y = 0;
    for (int k = 0; k < 3; ++k) y += xv[k * 5 + b] * wv[k];
    EXPECT_NEAR(got[0].as<double>()[b], std::tanh(y), 1e-12) << b;
  }
  for (int k = 0; k < 3; ++k) EXPECT_EQ(got[1].as<double>()[k], wv[k] * wv[k]);
  // A mapped result asked for as not mapped fails at compile, saying why.
  GraphBuilder h("vmap_none");
  Value hx = h.Parameter({DType::kF64, {3, 5}}, "xs");
  std::vector<Value> bad = h.Vmap(f, {hx, h.Parameter({DType::kF64, {3}}, "w")},
                                  {1, GraphBuilder::kNotMapped}, {GraphBuilder::kNotMapped, 0});
  auto bad_graph = h.Build({bad[0]});
  ASSERT_TRUE(bad_graph.ok()) << bad_graph.status();
  auto exe = session_->Compile(*bad_graph);
  ASSERT_FALSE(exe.ok());
  EXPECT_NE(exe.status().message().find("depends on the batch"), absl::string_view::npos)
      << exe.status();
}

TEST_F(ControlFlowTest, CustomRulesFromTheBuilderReplaceTheDerivativesTheyDefine) {
  // t(x) = tanh(x) elementwise; its rules scale the true derivative on
  // purpose (2x in the VJP, 3x in the JVP), so the result shows which ran.
  GraphBuilder g("custom");
  Value x = g.Parameter({DType::kF64, {4}}, "x");
  Value tx = g.Parameter({DType::kF64, {4}}, "tx");
  auto tanh = [](GraphBuilder& b, const std::vector<Value>& p) {
    return std::vector<Value>{b.Tanh(p[0])};
  };
  auto dtanh = [](GraphBuilder& b, Value y, Value scale) {  // scale * (1 - y^2)
    return b.Mul(b.Broadcast(scale, {4}),
                 b.Sub(b.Broadcast(b.Scalar(DType::kF64, 1.0), {4}), b.Mul(y, y)));
  };
  GraphBuilder::Function by_vjp = [&](GraphBuilder& b, const std::vector<Value>& p) {
    auto fwd = [](GraphBuilder& f, const std::vector<Value>& q) {
      Value y = f.Tanh(q[0]);
      return std::vector<Value>{y, y};
    };
    auto bwd = [&](GraphBuilder& f, const std::vector<Value>& q) {
      return std::vector<Value>{f.Mul(q[1], dtanh(f, q[0], f.Scalar(DType::kF64, 2.0)))};
    };
    return std::vector<Value>{
        b.Reduce(b.CustomVjp(tanh, fwd, bwd, {p[0]})[0], ReduceKind::kSum, {0})};
  };
  GraphBuilder::Function by_jvp = [&](GraphBuilder& b, const std::vector<Value>& p) {
    auto rule = [&](GraphBuilder& f, const std::vector<Value>& q) {
      Value y = f.Tanh(q[0]);
      return std::vector<Value>{y, f.Mul(q[1], dtanh(f, y, f.Scalar(DType::kF64, 3.0)))};
    };
    return std::vector<Value>{b.Reduce(b.CustomJvp(tanh, rule, {p[0]})[0], ReduceKind::kSum, {0})};
  };
  std::vector<Value> vjp = g.ValueAndGrad(by_vjp, {x}, {0});
  std::vector<Value> jvp_grad = g.ValueAndGrad(by_jvp, {x}, {0});
  std::vector<Value> jvp = g.Jvp(by_jvp, {x}, {tx}, {0});
  auto graph = g.Build({vjp[0], vjp[1], jvp_grad[1], jvp[1]});
  ASSERT_TRUE(graph.ok()) << graph.status();
  const std::vector<double> xv = {-1.0, -0.25, 0.5, 2.0}, tv = {1.0, -2.0, 0.5, 3.0};
  auto got = Run(*graph, {HostArray::From<double>({4}, xv), HostArray::From<double>({4}, tv)});
  ASSERT_EQ(got.size(), 4u);
  double value = 0, tangent = 0;
  for (int i = 0; i < 4; ++i) {
    const double y = std::tanh(xv[i]), d = 1 - y * y;
    value += y;
    tangent += 3 * d * tv[i];
    EXPECT_NEAR(got[1].as<double>()[i], 2 * d, 1e-12) << i;  // the VJP rule
    EXPECT_NEAR(got[2].as<double>()[i], 3 * d, 1e-12) << i;  // the JVP rule, transposed
  }
  EXPECT_NEAR(got[0].as<double>()[0], value, 1e-12);
  EXPECT_NEAR(got[3].as<double>()[0], tangent, 1e-12);
  // A rule of the wrong type fails where it is built, naming it.
  GraphBuilder h("bad");
  Value z = h.Parameter({DType::kF64, {4}}, "z");
  h.CustomJvp(tanh,
              [](GraphBuilder& f, const std::vector<Value>& q) { return std::vector<Value>{q[0]}; },
              {z});
  EXPECT_NE(h.status().message().find("custom_jvp"), std::string::npos) << h.status();
}

std::string RunCommand(const std::string& cmd, int* rc) {
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  if (f == nullptr) return out;
  char buf[512];
  while (fgets(buf, sizeof buf, f)) out += buf;
  *rc = pclose(f);
  return out;
}

TEST_F(ControlFlowTest, CliRunsATextprotoWithFunctions) {
  const std::string graph =
      std::string(TESSEL_SOURCE_DIR) + "/examples/graphs/newton_sqrt.textproto";
  const std::string tessel =
      "TESSEL_COORDINATOR=" + cluster_->address() + " " + TESSEL_BIN_DIR + "/tessel";
  int rc = -1;
  std::string out = RunCommand(tessel + " compile " + graph, &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("= while(%zero, %n, %a, %a) {cond=more body=step}"), std::string::npos) << out;
  EXPECT_NE(out.find("function step {"), std::string::npos) << out;
  const std::string dir = ::testing::TempDir();
  ASSERT_TRUE(WriteNpy(dir + "/a.npy", HostArray::From<float>({4}, {1, 2, 16, 1e6})).ok());
  ASSERT_TRUE(WriteNpy(dir + "/n.npy", HostArray::From<int32_t>({}, {30})).ok());
  out = RunCommand(tessel + " run " + graph + " --input a=" + dir + "/a.npy --input n=" + dir +
                       "/n.npy --fetch x=" + dir + "/x.npy --device 0",
                   &rc);
  ASSERT_EQ(rc, 0) << out;
  auto x = ReadNpy(dir + "/x.npy");
  ASSERT_TRUE(x.ok()) << x.status();
  const float want[4] = {1.0f, std::sqrt(2.0f), 4.0f, 1000.0f};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(x->as<float>()[i], want[i], 1e-5f * want[i]);
}

}  // namespace
}  // namespace tessel
