// REDUCE_WITH_BODY and SORT_WITH_COMPARATOR: typed against their bodies,
// lowered into elementwise nodes before any other pass, and refused with
// the function and the types named. Their values are checked against JAX
// on real daemons (client/python/tests/test_bodies.py).
#include "scheduler/bodies.h"

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "scheduler/compiler.h"
#include "scheduler/test_graphs.h"

namespace tessel::scheduler {
namespace {

// argmax over dimension 1 of f32[4,5], as (value, index) pairs.
constexpr char kArgmax[] = R"pb(
  name: "argmax"
  nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [ 4, 5 ] } }
  nodes { name: "i" op: CONSTANT constant { iota { dimension: 1 } } type { dtype: S32 dims: [ 4, 5 ] } }
  nodes { name: "lo" op: CONSTANT constant { fill { f: -1e30 } } type { dtype: F32 } }
  nodes { name: "zero" op: CONSTANT constant { fill { i: 0 } } type { dtype: S32 } }
  nodes { name: "r" op: REDUCE_WITH_BODY operands: [ "x", "i", "lo", "zero" ]
          body { function: "pick" dims: 1 } }
  nodes { name: "v" op: TUPLE_ELEMENT operands: "r" tuple_element { index: 0 } }
  nodes { name: "k" op: TUPLE_ELEMENT operands: "r" tuple_element { index: 1 } }
  outputs: [ "v", "k" ]
  functions {
    name: "pick"
    nodes { name: "av" op: PARAMETER parameter { index: 0 } type { dtype: F32 } }
    nodes { name: "ai" op: PARAMETER parameter { index: 1 } type { dtype: S32 } }
    nodes { name: "bv" op: PARAMETER parameter { index: 2 } type { dtype: F32 } }
    nodes { name: "bi" op: PARAMETER parameter { index: 3 } type { dtype: S32 } }
    nodes { name: "ge" op: COMPARE operands: [ "av", "bv" ] compare { direction: GE } }
    nodes { name: "v" op: SELECT operands: [ "ge", "av", "bv" ] }
    nodes { name: "k" op: SELECT operands: [ "ge", "ai", "bi" ] }
    outputs: [ "v", "k" ]
  }
)pb";

TEST(Bodies, AReductionIsTypedByItsOperandsAndLoweredAway) {
  auto typed = ValidateGraph(Parse(kArgmax));
  ASSERT_TRUE(typed.ok()) << typed.status();
  const v1::Node& r = typed->graph.nodes(typed->index_of.at("r"));
  ASSERT_EQ(r.results_size(), 2);
  EXPECT_EQ(r.results(0).dtype(), v1::F32);
  EXPECT_EQ(r.results(1).dtype(), v1::S32);
  EXPECT_EQ(r.results(1).dims_size(), 1);
  EXPECT_EQ(r.results(1).dims(0), 4);
  ASSERT_TRUE(HasBodies(typed->graph));
  auto lowered = LowerBodies(*typed);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  EXPECT_FALSE(HasBodies(*lowered));
  // 5 columns: halves of 2 (one left over), of 1 and 2, then one into the init values.
  int selects = 0;
  for (const v1::Node& n : lowered->nodes()) selects += n.op() == v1::SELECT;
  EXPECT_EQ(selects, 2 * 3 + 2);
  auto again = ValidateGraph(*lowered);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(TypeString(again->graph.nodes(again->outputs[1]).type()), "s32[4]");
  EXPECT_TRUE(Compile(Parse(kArgmax)).ok());
}

TEST(Bodies, ABodyOfOtherTypesIsRefusedNamingIt) {
  v1::Graph g = Parse(kArgmax);
  // A valid function, of s64 indices where the operands are s32.
  g.mutable_functions(0)->mutable_nodes(1)->mutable_type()->set_dtype(v1::S64);
  g.mutable_functions(0)->mutable_nodes(3)->mutable_type()->set_dtype(v1::S64);
  auto typed = ValidateGraph(g);
  ASSERT_FALSE(typed.ok());
  EXPECT_NE(typed.status().message().find("function 'pick' parameter 1 is s64[]; expected s32[]"),
            std::string::npos)
      << typed.status();
}

TEST(Bodies, AnInitValueOfAnotherDtypeIsRefused) {
  v1::Graph g = Parse(kArgmax);
  g.mutable_nodes(3)->mutable_type()->set_dtype(v1::S64);
  auto typed = ValidateGraph(g);
  ASSERT_FALSE(typed.ok());
  EXPECT_NE(typed.status().message().find("init value 1 (operand 3) is s64[]; expected s32[]"),
            std::string::npos)
      << typed.status();
}

TEST(Bodies, ASortIsStableAndItsComparatorReturnsPred) {
  v1::Graph g = Parse(R"pb(
    name: "sort"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: S32 dims: [ 3, 6 ] } }
    nodes { name: "y" op: PARAMETER parameter { index: 1 } type { dtype: F64 dims: [ 3, 6 ] } }
    nodes { name: "s" op: SORT_WITH_COMPARATOR operands: [ "x", "y" ] body { function: "lt" dimension: 1 } }
    nodes { name: "a" op: TUPLE_ELEMENT operands: "s" tuple_element { index: 0 } }
    nodes { name: "b" op: TUPLE_ELEMENT operands: "s" tuple_element { index: 1 } }
    outputs: [ "a", "b" ]
    functions {
      name: "lt"
      nodes { name: "xa" op: PARAMETER parameter { index: 0 } type { dtype: S32 } }
      nodes { name: "xb" op: PARAMETER parameter { index: 1 } type { dtype: S32 } }
      nodes { name: "ya" op: PARAMETER parameter { index: 2 } type { dtype: F64 } }
      nodes { name: "yb" op: PARAMETER parameter { index: 3 } type { dtype: F64 } }
      nodes { name: "p" op: COMPARE operands: [ "xa", "xb" ] compare { direction: LT } }
      outputs: "p"
    }
  )pb");
  auto typed = ValidateGraph(g);
  ASSERT_TRUE(typed.ok()) << typed.status();
  auto lowered = LowerBodies(*typed);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  EXPECT_TRUE(ValidateGraph(*lowered).ok());
  // 6 positions pad to 8: 6 compare-exchange steps of the network.
  int reverses = 0;
  for (const v1::Node& n : lowered->nodes()) reverses += n.op() == v1::REVERSE;
  EXPECT_EQ(reverses, 3 * 2 * 3);  // each merge's first step reverses x, y and the positions twice
  g.mutable_functions(0)->mutable_nodes(4)->set_op(v1::SUB);
  g.mutable_functions(0)->mutable_nodes(4)->clear_compare();
  auto bad = ValidateGraph(g);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("function 'lt' result 0 is s32[]; expected pred[]"),
            std::string::npos)
      << bad.status();
}

TEST(Bodies, ABodyThatIsNotElementwiseIsRefusedByName) {
  v1::Graph g = Parse(kArgmax);
  v1::Node* v = g.mutable_functions(0)->mutable_nodes(5);
  v->set_op(v1::REDUCE);
  v->clear_operands();
  v->add_operands("av");
  v->mutable_reduce()->set_kind(v1::SUM);
  auto c = Compile(g);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("function 'pick' holds node 'v' (reduce)"), std::string::npos)
      << c.status();
}

}  // namespace
}  // namespace tessel::scheduler
