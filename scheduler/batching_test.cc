// The VMAP expansion: structure and errors (values are checked end to end
// against a numpy loop and jax.vmap in client/python/tests/test_vmap.py).
#include "scheduler/batching.h"

#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "core/dtype.h"
#include "scheduler/autodiff.h"
#include "scheduler/compiler.h"
#include "scheduler/test_graphs.h"

namespace tessel::scheduler {
namespace {

// f(x, w) = tanh(x . (w * 2)) over a batch of 5 x's (mapped along axis 1),
// w the same for every element; the result stacked along axis 1.
constexpr char kVmap[] = R"pb(
  name: "mapped"
  nodes { name: "xs" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [3, 5, 4] } }
  nodes { name: "w" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: [4, 2] } }
  nodes { name: "m" op: VMAP operands: ["xs", "w"] batch { function: "f" in_axes: [1, -1] out_axes: 1 size: 5 } }
  nodes { name: "y" op: TUPLE_ELEMENT operands: "m" tuple_element { index: 0 } }
  outputs: "y"
  functions {
    name: "f"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [3, 4] } }
    nodes { name: "w" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: [4, 2] } }
    nodes { name: "two" op: CONSTANT constant { fill { f: 2 } } type { dtype: F32 dims: [4, 2] } }
    nodes { name: "w2" op: MUL operands: ["w", "two"] }
    nodes { name: "d" op: DOT_GENERAL operands: ["x", "w2"] dot_general { lhs_contracting: 1 rhs_contracting: 0 } }
    nodes { name: "t" op: TANH operands: "d" }
    outputs: "t"
  }
)pb";

TEST(Batching, VmapTypesItsResultsAndExpandsIntoBatchedNodes) {
  auto typed = ValidateGraph(Parse(kVmap));
  ASSERT_TRUE(typed.ok()) << typed.status();
  EXPECT_EQ(TypeString(typed->graph.nodes(2).results(0)), "f32[3,5,2]");
  ASSERT_TRUE(HasAutodiff(typed->graph));
  auto expanded = ExpandAutodiff(*typed);
  ASSERT_TRUE(expanded.ok()) << expanded.status();
  int vmaps = 0, unbatched_muls = 0;
  for (const v1::Node& n : expanded->nodes()) {
    vmaps += n.op() == v1::VMAP || n.op() == v1::TUPLE_ELEMENT;
    // w * 2 does not depend on the batch: computed once, at its own shape.
    unbatched_muls += n.op() == v1::MUL && TypeString(n.type()) == "f32[4,2]";
  }
  EXPECT_EQ(vmaps, 0);
  EXPECT_EQ(unbatched_muls, 1);
  EXPECT_EQ(expanded->functions_size(), 0);  // the mapped function is inlined
  auto c = Compile(Parse(kVmap));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(TypeString(c->output_types[0]), "f32[3,5,2]");
}

std::string Replaced(std::string text, const std::string& from, const std::string& to) {
  text.replace(text.find(from), from.size(), to);
  return text;
}

TEST(Batching, ErrorsNameTheOperandTheAxisAndTheFunction) {
  EXPECT_NE(ErrorOf(Replaced(kVmap, "in_axes: [1, -1]", "in_axes: [0, -1]"))
                .find("operand 0 is f32[3,5,4]; expected f32[5,3,4] (parameter 0, f32[3,4], "
                      "batched at axis 0)"),
            std::string::npos)
      << ErrorOf(Replaced(kVmap, "in_axes: [1, -1]", "in_axes: [0, -1]"));
  EXPECT_NE(
      ErrorOf(Replaced(kVmap, "in_axes: [1, -1]", "in_axes: [1]")).find("2 operands and 1 in_axes"),
      std::string::npos);
  EXPECT_NE(
      ErrorOf(Replaced(kVmap, "out_axes: 1", "out_axes: 3")).find("out_axes[0] = 3: expected -1"),
      std::string::npos);
  const std::string none = ErrorOf(Replaced(kVmap, "out_axes: 1", "out_axes: -1"));
  EXPECT_NE(none.find("result 0 ('t') depends on the batch, but its out_axes is -1"),
            std::string::npos)
      << none;
}

TEST(Batching, AWhileLoopWhoseConditionDependsOnTheBatchIsUnimplementedNamingTheNode) {
  const std::string text = R"pb(
    name: "mapped"
    nodes { name: "xs" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [5, 3] } }
    nodes { name: "m" op: VMAP operands: "xs" batch { function: "f" in_axes: 0 out_axes: 0 size: 5 } }
    nodes { name: "y" op: TUPLE_ELEMENT operands: "m" tuple_element { index: 0 } }
    outputs: "y"
    functions {
      name: "f"
      nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [3] } }
      nodes { name: "loop" op: WHILE operands: "x" control { cond: "small" body: "double" } }
      nodes { name: "r" op: TUPLE_ELEMENT operands: "loop" tuple_element { index: 0 } }
      outputs: "r"
    }
    functions {
      name: "small"
      nodes { name: "c" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [3] } }
      nodes { name: "s" op: REDUCE operands: "c" reduce { kind: SUM dims: 0 } }
      nodes { name: "ten" op: CONSTANT constant { fill { f: 10 } } type { dtype: F32 } }
      nodes { name: "p" op: COMPARE operands: ["s", "ten"] compare { direction: LT } }
      outputs: "p"
    }
    functions {
      name: "double"
      nodes { name: "c" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [3] } }
      nodes { name: "d" op: ADD operands: ["c", "c"] }
      outputs: "d"
    }
  )pb";
  const std::string e = ErrorOf(text);
  EXPECT_NE(e.find("vmap of 'f': node 'loop' (while) has a condition that depends on the batch"),
            std::string::npos)
      << e;
  // The same loop with a condition on an unmapped carry batches: the body
  // runs as a batched copy of itself.
  const std::string counted = Replaced(
      text, R"(nodes { name: "s" op: REDUCE operands: "c" reduce { kind: SUM dims: 0 } })",
      R"(nodes { name: "s" op: CONSTANT constant { fill { f: 0 } } type { dtype: F32 } })");
  auto typed = ValidateGraph(Parse(counted));
  ASSERT_TRUE(typed.ok()) << typed.status();
  auto expanded = ExpandAutodiff(*typed);
  ASSERT_TRUE(expanded.ok()) << expanded.status();
  bool batched_body = false;
  for (const v1::Graph& f : expanded->functions()) {
    batched_body |= f.name() == "double/vmap" && TypeString(f.nodes(0).type()) == "f32[5,3]";
  }
  EXPECT_TRUE(batched_body);
}

}  // namespace
}  // namespace tessel::scheduler
