#include "scheduler/compiler.h"

#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "absl/container/flat_hash_map.h"
#include "scheduler/test_graphs.h"

namespace tessel::scheduler {
namespace {

constexpr char kChain[] = R"pb(
  name: "chain"
  nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 8 } }
  nodes { name: "two" op: CONSTANT constant { fill { f: 2 } } type { dtype: F32 } }
  nodes { name: "twos" op: BROADCAST_IN_DIM operands: "two" broadcast_in_dim { dims: 8 } }
  nodes { name: "a" op: MUL operands: ["x", "twos"] }
  nodes { name: "b" op: TANH operands: "a" }
  nodes { name: "c" op: MAX operands: ["b", "x"] }
  nodes { name: "s" op: REDUCE operands: "c" reduce { kind: SUM dims: 0 } }
  outputs: "s"
  outputs: "b"
)pb";

TEST(Compiler, FusesElementwiseChainIntoOneInstruction) {
  auto c = Compile(Parse(kChain));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->program.instructions_size(), 2);
  const v1::Fusion& f = c->program.instructions(0).fusion();
  EXPECT_EQ(f.nodes_size(), 5);
  ASSERT_EQ(f.inputs_size(), 1);
  EXPECT_EQ(f.inputs(0), "x");
  // b is a graph output and c feeds the reduce: both leave the fusion.
  ASSERT_EQ(f.outputs_size(), 2);
  EXPECT_EQ(f.outputs(0), "b");
  EXPECT_EQ(f.outputs(1), "c");
  EXPECT_EQ(c->program.instructions(1).node().op(), v1::REDUCE);
  // c dies after the reduce reads it; b is an output and stays.
  ASSERT_EQ(c->program.instructions(1).release_size(), 1);
  EXPECT_EQ(c->program.instructions(1).release(0), "c");
  EXPECT_EQ(c->output_types[0].dims_size(), 0);
}

// A fill or an iota read by later instructions is never written out whole:
// each fusion that reads it makes its own, and a reader that is not a
// fusion (the reduce) gets it once, written just before it.
TEST(Compiler, FillsAndIotasAreMadeWhereTheyAreReadNotWrittenOut) {
  auto c = Compile(Parse(R"pb(
    name: "generators"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 64 } }
    nodes { name: "half" op: CONSTANT constant { fill { f: 0.5 } } type { dtype: F32 dims: 64 } }
    nodes { name: "i" op: CONSTANT constant { iota { dimension: 0 } } type { dtype: F32 dims: 64 } }
    nodes { name: "a" op: MUL operands: [ "x", "half" ] }
    nodes { name: "b" op: ADD operands: [ "a", "i" ] }
    nodes { name: "s" op: REDUCE operands: "b" reduce { kind: SUM dims: 0 } }
    nodes { name: "sb" op: BROADCAST_IN_DIM operands: "s" broadcast_in_dim { dims: 64 } }
    nodes { name: "c" op: MUL operands: [ "sb", "half" ] }
    nodes { name: "d" op: ADD operands: [ "c", "i" ] }
    nodes { name: "r" op: REDUCE operands: "half" reduce { kind: SUM dims: 0 } }
    nodes { name: "e" op: ADD operands: [ "d", "b" ] }
    outputs: [ "e", "r" ]
  )pb"));
  ASSERT_TRUE(c.ok()) << c.status();
  int fusions = 0, standalone_half = 0;
  for (const v1::Instruction& ins : c->program.instructions()) {
    if (ins.has_fusion()) {
      ++fusions;
      for (const std::string& o : ins.fusion().outputs()) {
        EXPECT_NE(o, "half") << "a fill written out";
        EXPECT_NE(o, "i") << "an iota written out";
      }
    } else if (ins.node().name() == "half") {
      ++standalone_half;
    }
  }
  EXPECT_GE(fusions, 2);
  EXPECT_EQ(standalone_half, 1);  // for the reduce r, once
}

// A cheap node a later fusion reads is made again there when that reads no
// more than reading it would (b = a * a, a being written out anyway); one
// whose making reads two arrays (a = x + y) or is not cheap (tanh) is
// written out.
TEST(Compiler, ACheapValueIsMadeAgainWhereReadingItWouldCostAsMuch) {
  auto c = Compile(Parse(R"pb(
    name: "remade"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 64 } }
    nodes { name: "y" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: 64 } }
    nodes { name: "a" op: ADD operands: [ "x", "y" ] }
    nodes { name: "b" op: MUL operands: [ "a", "a" ] }
    nodes { name: "t" op: TANH operands: "b" }
    nodes { name: "s" op: REDUCE operands: "t" reduce { kind: SUM dims: 0 } }
    nodes { name: "sb" op: BROADCAST_IN_DIM operands: "s" broadcast_in_dim { dims: 64 } }
    nodes { name: "d" op: MUL operands: [ "sb", "b" ] }
    nodes { name: "e" op: ADD operands: [ "d", "t" ] }
    nodes { name: "f" op: ADD operands: [ "e", "a" ] }
    outputs: "f"
  )pb"));
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<const v1::Fusion*> fusions;
  for (const v1::Instruction& ins : c->program.instructions()) {
    if (ins.has_fusion()) fusions.push_back(&ins.fusion());
  }
  ASSERT_EQ(fusions.size(), 2u);
  std::vector<std::string> first(fusions[0]->outputs().begin(), fusions[0]->outputs().end());
  EXPECT_THAT(first, ::testing::UnorderedElementsAre("a", "t"));
  std::vector<std::string> second_inputs(fusions[1]->inputs().begin(), fusions[1]->inputs().end());
  EXPECT_THAT(second_inputs, ::testing::UnorderedElementsAre("s", "a", "t"));
  EXPECT_EQ(fusions[1]->nodes(0).name(), "b");  // made again, first
}

// dot(transpose(a), b) reads a in place, with a's dimension numbers, where
// that keeps the product's layout; a transpose something else reads stays.
TEST(Compiler, TransposedDotOperandsAreReadInPlace) {
  auto c = Compile(Parse(R"pb(
    name: "folds"
    nodes { name: "a" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [ 4, 3 ] } }
    nodes { name: "b" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: [ 4, 5 ] } }
    nodes { name: "c" op: PARAMETER parameter { index: 2 } type { dtype: F32 dims: [ 2, 5, 4 ] } }
    nodes { name: "d" op: PARAMETER parameter { index: 3 } type { dtype: F32 dims: [ 2, 5, 6 ] } }
    nodes { name: "at" op: TRANSPOSE operands: "a" transpose { permutation: [ 1, 0 ] } }
    nodes { name: "p" op: DOT_GENERAL operands: [ "at", "b" ] dot_general { lhs_contracting: 1 rhs_contracting: 0 } }
    nodes { name: "ct" op: TRANSPOSE operands: "c" transpose { permutation: [ 0, 2, 1 ] } }
    nodes { name: "q" op: DOT_GENERAL operands: [ "ct", "d" ]
            dot_general { lhs_batch: 0 rhs_batch: 0 lhs_contracting: 2 rhs_contracting: 1 } }
    nodes { name: "cs" op: TRANSPOSE operands: "c" transpose { permutation: [ 2, 1, 0 ] } }
    nodes { name: "r" op: DOT_GENERAL operands: [ "cs", "cs" ]
            dot_general { lhs_contracting: 1 rhs_contracting: 1 } }
    outputs: [ "p", "q", "r", "at" ]
  )pb"));
  ASSERT_TRUE(c.ok()) << c.status();
  absl::flat_hash_map<std::string, const v1::Node*> nodes;
  for (const v1::Instruction& i : c->program.instructions()) {
    if (i.has_node()) nodes[i.node().name()] = &i.node();
  }
  ASSERT_TRUE(nodes.contains("p") && nodes.contains("q") && nodes.contains("r"));
  EXPECT_EQ(nodes["p"]->operands(0), "a");
  EXPECT_EQ(nodes["p"]->dot_general().lhs_contracting(0), 0);
  EXPECT_EQ(nodes["q"]->operands(0), "c");
  EXPECT_EQ(nodes["q"]->dot_general().lhs_batch(0), 0);
  EXPECT_EQ(nodes["q"]->dot_general().lhs_contracting(0), 1);
  EXPECT_FALSE(nodes.contains("ct"));  // read by nothing else: gone
  // The free dimensions of cs (0 and 2, from c's 2 and 0) would swap: kept.
  EXPECT_EQ(nodes["r"]->operands(0), "cs");
  EXPECT_TRUE(nodes.contains("cs"));
  EXPECT_TRUE(nodes.contains("at"));  // an output too
  EXPECT_EQ(c->output_types[0].dims(0), 3);
  EXPECT_EQ(c->output_types[1].dims(1), 4);
}

TEST(Compiler, FingerprintIsStableAndDistinguishesGraphs) {
  v1::Graph g = Parse(kChain);
  EXPECT_EQ(Fingerprint(g), Fingerprint(Parse(kChain)));
  g.mutable_nodes(1)->mutable_constant()->mutable_fill()->set_f(3);
  EXPECT_NE(Fingerprint(g), Fingerprint(Parse(kChain)));
}

TEST(Compiler, ErrorsNameTheNodeAndOp) {
  auto c = Compile(Parse(R"pb(
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 2 } }
    nodes { name: "y" op: PARAMETER parameter { index: 1 } type { dtype: S32 dims: 2 } }
    nodes { name: "z" op: ADD operands: ["x", "y"] }
    outputs: "z")pb"));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("node 'z'"), absl::string_view::npos) << c.status();
  EXPECT_NE(c.status().message().find("add"), absl::string_view::npos);
  EXPECT_NE(c.status().message().find("expected f32[2], got s32[2]"), absl::string_view::npos);
}

TEST(Compiler, RejectsCyclesDanglingOperandsAndBadParameters) {
  auto cycle = Compile(Parse(R"pb(
    nodes { name: "a" op: NEG operands: "b" }
    nodes { name: "b" op: NEG operands: "a" }
    outputs: "b")pb"));
  ASSERT_FALSE(cycle.ok());
  EXPECT_NE(cycle.status().message().find("not defined before"), absl::string_view::npos);
  auto dangling = Compile(Parse(R"pb(
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 2 } }
    nodes { name: "a" op: NEG operands: "nope" }
    outputs: "a")pb"));
  ASSERT_FALSE(dangling.ok());
  EXPECT_NE(dangling.status().message().find("'nope'"), absl::string_view::npos);
  auto params = Compile(Parse(R"pb(
    nodes { name: "x" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: 2 } }
    outputs: "x")pb"));
  ASSERT_FALSE(params.ok());
  EXPECT_NE(params.status().message().find("numbered 0..n-1"), absl::string_view::npos);
  auto unknown = Compile(Parse(R"pb(
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 2 } }
    nodes { name: "y" op: 7 operands: "x" }
    outputs: "y")pb"));
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("unknown op"), absl::string_view::npos)
      << unknown.status();
}

}  // namespace
}  // namespace tessel::scheduler

namespace tessel::scheduler {
namespace {

TEST(Compiler, IdenticalNodesAreComputedOnce) {
  auto c = Compile(Parse(R"pb(
    name: "twice"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [4, 4] } }
    nodes { name: "a" op: DOT_GENERAL operands: ["x", "x"] dot_general { lhs_contracting: 1 rhs_contracting: 0 } }
    nodes { name: "b" op: DOT_GENERAL operands: ["x", "x"] dot_general { lhs_contracting: 1 rhs_contracting: 0 } }
    nodes { name: "c" op: DOT_GENERAL operands: ["x", "x"] dot_general { lhs_contracting: 0 rhs_contracting: 0 } }
    nodes { name: "s" op: ADD operands: ["a", "b"] }
    nodes { name: "t" op: ADD operands: ["s", "c"] }
    outputs: ["t", "b"])pb"));
  ASSERT_TRUE(c.ok()) << c.status();
  int dots = 0;
  for (const v1::Instruction& ins : c->program.instructions()) {
    dots += ins.has_node() && ins.node().op() == v1::DOT_GENERAL;
  }
  EXPECT_EQ(dots, 2) << c->plan_text;  // a and b are one; c contracts other dimensions
}

}  // namespace
}  // namespace tessel::scheduler
