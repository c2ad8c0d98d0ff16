// Plan tests: which collectives the partitioner inserts, and the bytes they
// move. Numerical equality of partitioned and whole runs is checked on a
// real cluster (client/python/tests/test_sharding.py).
#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/sharding.h"
#include "scheduler/compiler.h"

namespace tessel::scheduler {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

template <typename T>
T Parse(const std::string& text) {
  T m;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &m)) << text;
  return m;
}

v1::Mesh Mesh2x2() {
  return Parse<v1::Mesh>(R"pb(axis_names: ["data", "model"] axis_sizes: [2, 2])pb");
}

v1::Sharding P(std::vector<std::vector<std::string>> dims, std::vector<std::string> partial = {}) {
  v1::Sharding s;
  for (const auto& d : dims) {
    auto* x = s.add_dims();
    for (const auto& a : d) x->add_axes(a);
  }
  for (const auto& a : partial) s.add_partial(a);
  return s;
}

v1::Sharding Unspecified() {
  v1::Sharding s;
  s.set_unspecified(true);
  return s;
}

int Count(const CompiledProgram& c, v1::Op op) {
  int n = 0;
  for (const PlannedCollective& pc : c.collectives) n += pc.op == op;
  return n;
}

constexpr char kMatmul[] = R"pb(
  name: "matmul"
  nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [8, 4] } }
  nodes { name: "w" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: [4, 6] } }
  nodes { name: "y" op: DOT_GENERAL operands: ["x", "w"] dot_general { lhs_contracting: 1 rhs_contracting: 0 } }
  outputs: "y"
)pb";

CompileOptions Options(std::vector<v1::Sharding> in, std::vector<v1::Sharding> out = {}) {
  CompileOptions o;
  o.mesh = Mesh2x2();
  o.parameter_shardings = std::move(in);
  o.output_shardings = std::move(out);
  return o;
}

TEST(Partitioner, MatmulWithSplitBatchAndColumnsNeedsNoCollective) {
  auto c = Compile(Parse<v1::Graph>(kMatmul), Options({P({{"data"}, {}}), P({{}, {"model"}})}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->collectives.empty()) << c->plan_text;
  EXPECT_EQ(ShardingString(c->output_shardings[0]), "P('data', 'model')");
  EXPECT_EQ(TypeString(c->program.output_types(0)), "f32[4,3]");
  EXPECT_EQ(TypeString(c->global_output_types[0]), "f32[8,6]");
}

TEST(Partitioner, NoCollectiveIsPlannedForAValueNoOutputUses) {
  // unused = x @ x.T over a split contraction; the program returns x + 1.
  constexpr char kDead[] = R"pb(
    name: "dead"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [8, 8] } }
    nodes { name: "unused" op: DOT_GENERAL operands: ["x", "x"] dot_general { lhs_contracting: 1 rhs_contracting: 1 } }
    nodes { name: "one" op: CONSTANT constant { fill { f: 1 } } type { dtype: F32 dims: [8, 8] } }
    nodes { name: "y" op: ADD operands: ["x", "one"] }
    outputs: "y"
  )pb";
  auto c = Compile(Parse<v1::Graph>(kDead),
                   Options({P({{"data"}, {"model"}})}, {P({{"data"}, {"model"}})}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->collectives.empty()) << c->plan_text;
  EXPECT_THAT(c->plan_text, ::testing::Not(HasSubstr("unused"))) << c->plan_text;
}

TEST(Partitioner, NoCollectiveIsPlannedOverAnAxisOfSizeOne) {
  CompileOptions o;
  o.mesh = Parse<v1::Mesh>(R"pb(axis_names: ["a", "b"] axis_sizes: [4, 1])pb");
  o.parameter_shardings = {P({{"b"}, {}}), P({{}, {"b"}})};
  o.output_shardings = {P({{}, {}})};
  // x split over b (size 1) needed whole, and a contraction split over b.
  auto c = Compile(Parse<v1::Graph>(kMatmul), o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->collectives.empty()) << c->plan_text;
}

TEST(Partitioner, SplitContractionIsResolvedByAllReduceWhenTheOutputIsWhole) {
  auto c = Compile(Parse<v1::Graph>(kMatmul), Options({P({{}, {"model"}}), P({{"model"}, {}})}));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->collectives.size(), 1u) << c->plan_text;
  EXPECT_EQ(c->collectives[0].op, v1::ALL_REDUCE);
  EXPECT_EQ(c->collectives[0].axes, std::vector<std::string>{"model"});
  EXPECT_EQ(c->collectives[0].bytes_per_device, 8 * 6 * 4);  // ring: 2(n-1)/n of 192 bytes, n = 2
  EXPECT_THAT(c->collectives[0].reason, HasSubstr("partial result over model"));
  EXPECT_THAT(c->plan_text, HasSubstr("all_reduce over model"));
}

TEST(Partitioner, SplitContractionIsResolvedByReduceScatterWhenTheOutputIsSplit) {
  auto c = Compile(Parse<v1::Graph>(kMatmul),
                   Options({P({{}, {"model"}}), P({{"model"}, {}})}, {P({{"model"}, {}})}));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->collectives.size(), 1u) << c->plan_text;
  EXPECT_EQ(c->collectives[0].op, v1::REDUCE_SCATTER);
  EXPECT_EQ(c->collectives[0].bytes_per_device, 4 * 6 * 4);
  EXPECT_EQ(TypeString(c->program.output_types(0)), "f32[4,6]");
}

TEST(Partitioner, SplitContractionMayStayPartial) {
  auto c = Compile(Parse<v1::Graph>(kMatmul),
                   Options({P({{}, {"model"}}), P({{"model"}, {}})}, {P({{}, {}}, {"model"})}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->collectives.empty()) << c->plan_text;
  EXPECT_EQ(ShardingString(c->output_shardings[0]), "P(None, None) partial(sum: model)");
}

TEST(Partitioner, ElementwiseWithAReplicatedOperandSlicesLocally) {
  auto g = Parse<v1::Graph>(R"pb(
    name: "add"
    nodes { name: "a" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [8, 4] } }
    nodes { name: "b" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: [8, 4] } }
    nodes { name: "c" op: ADD operands: ["a", "b"] }
    outputs: "c"
  )pb");
  auto c = Compile(g, Options({P({{"data"}, {"model"}}), P({})}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->collectives.empty()) << c->plan_text;
  EXPECT_THAT(c->plan_text, HasSubstr("shard_slice"));
  EXPECT_EQ(TypeString(c->program.output_types(0)), "f32[4,2]");
}

TEST(Partitioner, GeneratedConstantsAreMadePerBlock) {
  auto g = Parse<v1::Graph>(R"pb(
    name: "zeros"
    nodes { name: "z" op: CONSTANT constant { fill { f: 0 } } type { dtype: F32 dims: 500000000 } }
    nodes { name: "i" op: CONSTANT constant { iota { dimension: 0 } } type { dtype: S32 dims: 8 } }
    outputs: ["z", "i"]
  )pb");
  CompileOptions o;
  o.mesh = Parse<v1::Mesh>(R"pb(axis_names: "x" axis_sizes: 4)pb");
  o.output_shardings = {P({{"x"}}), P({{"x"}})};
  auto c = Compile(g, o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->collectives.empty()) << c->plan_text;
  EXPECT_EQ(TypeString(c->program.output_types(0)), "f32[125000000]");
  // The fill's and the iota's blocks, and the device's index along x: the
  // iota's block is its own iota plus that index times the block's extent,
  // made in one loop.
  EXPECT_EQ(c->estimated_peak_bytes, 125000000 * 4 + 2 * 4 + 4);
  EXPECT_THAT(c->plan_text, HasSubstr("axis_index() {axes=x} : s32[]"));
  EXPECT_THAT(c->plan_text, HasSubstr("constant() {iota dim=0} : s32[2]"));
  EXPECT_THAT(c->plan_text, HasSubstr("constant() {fill=2} : s32[2]"));
}

// Seed 001's variants: constants made whole and then cut or reshaped. Each
// device's peak stays its block of x plus its block of the result; before,
// every device made the whole iota (64 MiB) and the whole fill.
TEST(Partitioner, ConstantsCutOrReshapedByLayoutOpsAreStillMadePerBlock) {
  auto g = Parse<v1::Graph>(R"pb(
    name: "seed001_variants"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [4096, 4096] } }
    nodes { name: "z" op: CONSTANT constant { fill { f: 0 } } type { dtype: F32 dims: [4096, 4096] } }
    nodes { name: "i" op: CONSTANT constant { iota { dimension: 0 } } type { dtype: S32 dims: 16777216 } }
    nodes { name: "r" op: RESHAPE operands: "i" reshape { dims: [4096, 4096] } type { dtype: S32 dims: [4096, 4096] } }
    nodes { name: "f" op: CONVERT operands: "r" convert { dtype: F32 } type { dtype: F32 dims: [4096, 4096] } }
    nodes { name: "a" op: ADD operands: ["x", "z"] type { dtype: F32 dims: [4096, 4096] } }
    nodes { name: "y" op: ADD operands: ["a", "f"] type { dtype: F32 dims: [4096, 4096] } }
    nodes { name: "big" op: CONSTANT constant { fill { f: 0 } } type { dtype: F32 dims: 67108864 } }
    nodes { name: "cut" op: SLICE operands: "big" slice { start: 0 limit: 16777216 strides: 1 }
            type { dtype: F32 dims: 16777216 } }
    nodes { name: "flat" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: 16777216 } }
    nodes { name: "y2" op: ADD operands: ["cut", "flat"] type { dtype: F32 dims: 16777216 } }
    outputs: ["y", "y2"]
  )pb");
  auto c = Compile(g, Options({P({{"data"}, {"model"}}), P({{"data", "model"}})},
                              {P({{"data"}, {"model"}}), P({{"data", "model"}})}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->collectives.empty()) << c->plan_text;
  const int64_t block = int64_t{4096} * 4096 * 4 / 4;  // 16 MiB of x per device
  // The parameters' and the outputs' blocks (4) and nothing more but the
  // devices' indices: the iotas of the reshaped arange, split, are made
  // inside the fusions that read them (each block's own iota plus its
  // offset). Before: three more blocks (x + zeros, and the two split iotas
  // made on their own); before that, a 64 MiB iota and its convert, and the
  // 256 MiB fill, on every device.
  EXPECT_LE(c->estimated_peak_bytes, 4 * block + 64) << c->plan_text;
  EXPECT_THAT(c->plan_text, Not(HasSubstr("s32[16777216]"))) << c->plan_text;
  EXPECT_THAT(c->plan_text, Not(HasSubstr("f32[67108864]"))) << c->plan_text;
}

TEST(Partitioner, SumOverASplitDimensionAllReducesOnlyForAWholeOutput) {
  auto g = Parse<v1::Graph>(R"pb(
    name: "sum"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [64] } }
    nodes { name: "e" op: EXP operands: "x" }
    nodes { name: "s" op: REDUCE operands: "e" reduce { kind: SUM dims: 0 } }
    outputs: "s"
  )pb");
  CompileOptions o;
  o.mesh = Parse<v1::Mesh>(R"pb(axis_names: "x" axis_sizes: 4)pb");
  o.parameter_shardings = {P({{"x"}})};
  auto c = Compile(g, o);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(Count(*c, v1::ALL_REDUCE), 1) << c->plan_text;
  EXPECT_EQ(c->collectives.size(), 1u);
}

TEST(Partitioner, MovingASplitBetweenDimensionsIsOneAllToAll) {
  auto g = Parse<v1::Graph>(R"pb(
    name: "move"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [8, 8] } }
    nodes { name: "y" op: SHARDING_CONSTRAINT operands: "x" sharding { sharding { dims {} dims { axes: "model" } } } }
    outputs: "y"
  )pb");
  auto c = Compile(g, Options({P({{"model"}, {}})}));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->collectives.size(), 1u) << c->plan_text;
  EXPECT_EQ(c->collectives[0].op, v1::ALL_TO_ALL);
  EXPECT_THAT(c->collectives[0].reason, HasSubstr("sharding constraint 'y'"));
}

TEST(Partitioner, BadShardingsAreInvalidArgumentsNamingTheValue) {
  auto bad = [](std::vector<v1::Sharding> in) {
    auto c = Compile(Parse<v1::Graph>(kMatmul), Options(std::move(in)));
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(c.status().message());
  };
  EXPECT_THAT(bad({P({{"rows"}, {}}), P({})}), HasSubstr("unknown mesh axis 'rows'"));
  EXPECT_THAT(bad({P({{"data"}, {"data"}}), P({})}), HasSubstr("mesh axis 'data' is used twice"));
  EXPECT_THAT(bad({P({{"data"}, {}, {}}), P({})}), HasSubstr("parameter 0 'x'"));
  EXPECT_THAT(bad({P({}), P({{}, {"data", "model"}})}),
              HasSubstr("dimension 1 of size 6 does not split evenly"));
  EXPECT_THAT(bad({P({})}), HasSubstr("2 parameters; 1 parameter shardings"));
}

TEST(Partitioner, CollectiveOutsideAManualRegionIsAnError) {
  auto g = Parse<v1::Graph>(R"pb(
    name: "psum"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [8] } }
    nodes { name: "y" op: ALL_REDUCE operands: "x" collective { axes: "data" } }
    outputs: "y"
  )pb");
  auto c = Compile(g, Options({P({})}));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("collective outside a manual region"));
}

// Seed 002: a copy kernel in a manual region over {data: 2, model: 2} with
// in and out spec P('data', None), forward and its hand-written backward.
std::string Seed002(const std::string& rule, const std::string& bwd_out_partial) {
  const std::string kernel = R"pb(
      op: CUSTOM_KERNEL
      custom_kernel {
        name: "copy"
        cuda_source: "extern \"C\" __global__ void copy(const float* a, float* b, long n) { long i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) b[i] = a[i]; }"
        decomposition {
          nodes { name: "a" op: PARAMETER parameter { index: 0 } type { dtype: BF16 dims: [2, 128] } }
          nodes { name: "b" op: NEG operands: "a" }
          nodes { name: "c" op: NEG operands: "b" }
          outputs: "c"
        }
        replication { )pb" + rule +
                             R"pb( }
      })pb";
  auto region = [&](const std::string& name, const std::string& operand,
                    const std::string& partial) {
    return R"pb(
      nodes {
        name: ")pb" +
           name + R"pb(" op: MANUAL_REGION operands: ")pb" + operand + R"pb("
        type { dtype: BF16 dims: [4, 128] }
        manual_region {
          in_specs { dims { axes: "data" } }
          out_spec { dims { axes: "data" } )pb" +
           partial + R"pb( }
          body {
            nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: BF16 dims: [2, 128] } }
            nodes { name: "k" operands: "x" )pb" +
           kernel + R"pb( }
            outputs: "k"
          }
        }
      })pb";
  };
  return R"pb(name: "seed002"
    nodes { name: "inputs" op: PARAMETER parameter { index: 0 } type { dtype: BF16 dims: [4, 128] } })pb" +
         region("fwd", "inputs", "") + R"pb(
    nodes { name: "loss" op: REDUCE operands: "fwd" reduce { kind: SUM dims: [0, 1] } }
    nodes { name: "one" op: CONSTANT constant { fill { f: 1 } } type { dtype: BF16 dims: [4, 128] } })pb" +
         region("bwd", "one", bwd_out_partial) + R"pb(
    outputs: ["loss", "bwd"])pb";
}

CompileOptions Seed002Options() {
  return Options({P({{"data"}, {}})}, {Unspecified(), P({{"data"}, {}})});
}

TEST(Partitioner, Seed002WithAReplicationRuleHasNoAllReduceInTheBackward) {
  auto c = Compile(Parse<v1::Graph>(Seed002("kind: FOLLOW operand: 0", "")), Seed002Options());
  ASSERT_TRUE(c.ok()) << c.status();
  // The only collective completes the scalar loss; the gradient needs none.
  ASSERT_EQ(c->collectives.size(), 1u) << c->plan_text;
  EXPECT_THAT(c->collectives[0].reason, HasSubstr("output 0 'loss'"));
}

TEST(Partitioner, Seed002KernelVaryingOverModelNeedsItsAxisInTheOutSpec) {
  auto c = Compile(Parse<v1::Graph>(Seed002(R"pb(kind: EXPLICIT axes: ["data", "model"])pb", "")),
                   Seed002Options());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(),
              HasSubstr("manual region 'fwd': output 'k' varies over mesh axis 'model'"));
  EXPECT_THAT(c.status().message(),
              HasSubstr("custom kernel 'copy' declares its result varying over it"));
}

TEST(Partitioner, Seed002KernelVaryingOverModelYieldsExactlyOneAllReduceWithItsReason) {
  auto c = Compile(Parse<v1::Graph>(Seed002(R"pb(kind: EXPLICIT axes: ["data", "model"])pb",
                                            R"pb(partial: "model")pb")),
                   Seed002Options());
  // The forward's out spec has no partial axis: still an error there.
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  auto g = Parse<v1::Graph>(Seed002("kind: FOLLOW operand: 0", ""));
  // Only the backward's kernel declares its result varying over model.
  auto* bwd_kernel = g.mutable_nodes(4)
                         ->mutable_manual_region()
                         ->mutable_body()
                         ->mutable_nodes(1)
                         ->mutable_custom_kernel();
  bwd_kernel->mutable_replication()->set_kind(v1::ReplicationRule::EXPLICIT);
  bwd_kernel->mutable_replication()->add_axes("data");
  bwd_kernel->mutable_replication()->add_axes("model");
  g.mutable_nodes(4)->mutable_manual_region()->mutable_out_spec()->add_partial("model");
  c = Compile(g, Seed002Options());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(Count(*c, v1::ALL_REDUCE), 2) << c->plan_text;  // the loss, and the gradient over model
  const PlannedCollective& grad = c->collectives.back();
  EXPECT_EQ(grad.axes, std::vector<std::string>{"model"});
  EXPECT_THAT(grad.reason, HasSubstr("output 1 'bwd'"));
  EXPECT_THAT(grad.reason, HasSubstr("partial result over model"));
}

// A parameter given no sharding (a client's hidden constant) takes the
// layout of its first reader, and one nothing reads is replicated.
TEST(Partitioner, AnUnspecifiedParameterTakesItsFirstReadersLayout) {
  auto g = Parse<v1::Graph>(R"pb(
    name: "hidden"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [8, 4] } }
    nodes { name: "c" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: [8, 4] } }
    nodes { name: "u" op: PARAMETER parameter { index: 2 } type { dtype: F32 dims: [8, 4] } }
    nodes { name: "two" op: CONSTANT constant { fill { f: 2 } } type { dtype: F32 dims: [8, 4] } }
    nodes { name: "c2" op: MUL operands: ["c", "two"] }
    nodes { name: "y" op: MUL operands: ["x", "c2"] }
    nodes { name: "t" op: TRANSPOSE operands: "c" transpose { permutation: [1, 0] } }
    outputs: ["y", "t"]
  )pb");
  auto c = Compile(g, Options({P({{"data"}, {"model"}}), Unspecified(), Unspecified()},
                              {Unspecified(), P({{}, {}})}));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->parameter_shardings.size(), 3u);
  // c is read first through c * 2, which takes x's layout for the product.
  EXPECT_EQ(ShardingString(c->parameter_shardings[1]), "P('data', 'model')") << c->plan_text;
  EXPECT_EQ(ShardingString(c->parameter_shardings[2]), "P(None, None)") << c->plan_text;
  EXPECT_EQ(TypeString(c->parameter_types[1]), "f32[4,2]");
  // A later reader sees c as any parameter laid out so: the transpose
  // keeps its blocks, and only the whole output asked of it gathers them.
  EXPECT_EQ(Count(*c, v1::ALL_GATHER), 2) << c->plan_text;
  for (const PlannedCollective& pc : c->collectives)
    EXPECT_THAT(pc.reason, HasSubstr("output 1 't' wants P(None, None)"));
}

}  // namespace
}  // namespace tessel::scheduler
