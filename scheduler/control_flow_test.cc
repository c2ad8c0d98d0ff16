// Control flow in the compiler: functions validated against their call
// sites, each control-flow node planned as one instruction of several
// results, bodies fused and planned, carries updated in place.
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "scheduler/compiler.h"
#include "scheduler/test_graphs.h"

namespace tessel::scheduler {
namespace {

// while (i < n) { i += 1; v = v * 2 + x }: x is read by the body, so it is a
// carry too.
constexpr char kLoop[] = R"pb(
  name: "loop"
  nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 8 } }
  nodes { name: "zero" op: CONSTANT constant { fill { i: 0 } } type { dtype: S32 } }
  nodes { name: "w" op: WHILE operands: ["zero", "x", "x"] control { cond: "c" body: "b" } }
  nodes { name: "i" op: TUPLE_ELEMENT operands: "w" tuple_element { index: 0 } }
  nodes { name: "v" op: TUPLE_ELEMENT operands: "w" tuple_element { index: 1 } }
  outputs: ["i", "v"]
  functions {
    name: "c"
    nodes { name: "i" op: PARAMETER parameter { index: 0 } type { dtype: S32 } }
    nodes { name: "v" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: 8 } }
    nodes { name: "x" op: PARAMETER parameter { index: 2 } type { dtype: F32 dims: 8 } }
    nodes { name: "n" op: CONSTANT constant { fill { i: 5 } } type { dtype: S32 } }
    nodes { name: "p" op: COMPARE operands: ["i", "n"] compare { direction: LT } }
    outputs: "p"
  }
  functions {
    name: "b"
    nodes { name: "i" op: PARAMETER parameter { index: 0 } type { dtype: S32 } }
    nodes { name: "v" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: 8 } }
    nodes { name: "x" op: PARAMETER parameter { index: 2 } type { dtype: F32 dims: 8 } }
    nodes { name: "one" op: CONSTANT constant { fill { i: 1 } } type { dtype: S32 } }
    nodes { name: "i1" op: ADD operands: ["i", "one"] }
    nodes { name: "two" op: CONSTANT constant { fill { f: 2 } } type { dtype: F32 } }
    nodes { name: "twos" op: BROADCAST_IN_DIM operands: "two" broadcast_in_dim { dims: 8 } }
    nodes { name: "v2" op: MUL operands: ["v", "twos"] }
    nodes { name: "v3" op: ADD operands: ["v2", "x"] }
    outputs: ["i1", "v3", "x"]
  }
)pb";

TEST(ControlFlow, WhilePlansOneInstructionWithItsResultsAndFusedBody) {
  auto c = Compile(Parse(kLoop));
  ASSERT_TRUE(c.ok()) << c.status();
  const v1::Program& p = c->program;
  ASSERT_EQ(p.instructions_size(), 2);  // the constant, the loop
  const v1::Instruction& loop = p.instructions(1);
  EXPECT_EQ(loop.node().op(), v1::WHILE);
  ASSERT_EQ(loop.results_size(), 3);
  EXPECT_EQ(loop.results(0), "i");
  EXPECT_EQ(loop.results(1), "v");
  EXPECT_EQ(loop.results(2), "w#2");  // nobody reads it: released at once
  ASSERT_EQ(p.functions_size(), 2);
  const v1::Program& body = p.functions(1);
  EXPECT_EQ(body.executable_id(), "b");
  int fusions = 0;
  for (const v1::Instruction& ins : body.instructions()) fusions += ins.has_fusion();
  EXPECT_EQ(fusions, 2);  // i + 1 (a scalar shape), and v * 2 + x in one pass
  // The body writes v in place; i is a scalar computed fresh; x passes through.
  ASSERT_EQ(body.parameter_aliases_size(), 3);
  EXPECT_EQ(body.parameter_aliases(1), 1);
  EXPECT_NE(c->plan_text.find("function b {"), std::string::npos) << c->plan_text;
  EXPECT_NE(c->plan_text.find("carry %v -> output 1 'v3' (in place)"), std::string::npos)
      << c->plan_text;
  EXPECT_NE(c->plan_text.find("(%i, %v, %w#2) = while(%zero, %x, %x) {cond=c body=b}"),
            std::string::npos)
      << c->plan_text;
}

TEST(ControlFlow, DonatedCarryIsUpdatedInPlace) {
  CompileOptions o;
  o.donated_parameters = {0};
  v1::Graph g = Parse(kLoop);
  // Return the carry that starts from x: v.
  g.clear_outputs();
  g.add_outputs("v");
  auto c = Compile(g, o);
  ASSERT_TRUE(c.ok()) << c.status();
  // x is operand 1 and 2 of the loop: not in place (two carries would share it).
  ASSERT_EQ(c->declared_aliases.size(), 1u);
  EXPECT_EQ(c->declared_aliases[0].output, -1);
  EXPECT_NE(c->declared_aliases[0].reason.find("operand 2 reads 'x' too"), std::string::npos)
      << c->declared_aliases[0].reason;
}

TEST(ControlFlow, BodyThatChangesACarriedShapeNamesFunctionAndTypes) {
  std::string bad = kLoop;
  bad.replace(bad.find(R"(outputs: ["i1", "v3", "x"])"), 26, R"(outputs: ["i1", "i1", "x"])");
  const std::string e = ErrorOf(bad);
  EXPECT_NE(e.find("function 'b' result 1 is s32[]; expected f32[8]"), std::string::npos) << e;
  EXPECT_NE(e.find("a body may not change a carried type"), std::string::npos) << e;
}

TEST(ControlFlow, MismatchedCarryTypesAndMissingFunctionsAreNamed) {
  std::string bad = kLoop;
  bad.replace(bad.find(R"(operands: ["zero", "x", "x"])"), 28, R"(operands: ["x", "x", "x"])");
  std::string e = ErrorOf(bad);
  EXPECT_NE(e.find("node 'w'"), std::string::npos) << e;
  EXPECT_NE(e.find("function 'c' parameter 0 is s32[]; expected f32[8] (the carries 0)"),
            std::string::npos)
      << e;
  bad = kLoop;
  bad.replace(bad.find(R"(body: "b")"), 9, R"(body: "nope")");
  e = ErrorOf(bad);
  EXPECT_NE(e.find("function 'nope' is not defined (the graph's functions: 'b', 'c')"),
            std::string::npos)
      << e;
  bad = kLoop;
  bad.replace(bad.find(R"(name: "v" op: TUPLE_ELEMENT operands: "w")"), 41,
              R"(name: "v" op: NEG operands: "w")");
  e = ErrorOf(bad);
  EXPECT_NE(e.find("has 3 results; read one with tuple_element"), std::string::npos) << e;
}

TEST(ControlFlow, RecursionIsAnError) {
  std::string bad = kLoop;
  // The body runs the loop again.
  bad.replace(bad.find(R"(outputs: ["i1", "v3", "x"])"), 26, R"(
    nodes { name: "again" op: WHILE operands: ["i1", "v3", "x"] control { cond: "c" body: "b" } }
    nodes { name: "a0" op: TUPLE_ELEMENT operands: "again" tuple_element { index: 0 } }
    outputs: ["a0", "v3", "x"])");
  const std::string e = ErrorOf(bad);
  EXPECT_NE(e.find("function 'b' calls itself"), std::string::npos) << e;
}

}  // namespace
}  // namespace tessel::scheduler
