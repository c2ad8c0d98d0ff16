// The VJP expansion: structure and errors (values are checked end to end
// against jax.grad and finite differences in client/python/tests/test_autodiff.py).
#include "scheduler/autodiff.h"

#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "core/dtype.h"
#include "scheduler/compiler.h"
#include "scheduler/test_graphs.h"

namespace tessel::scheduler {
namespace {

// loss(w, x) = sum(tanh(x . w)); its gradient with respect to w.
constexpr char kGrad[] = R"pb(
  name: "grad"
  nodes { name: "w" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [4, 3] } }
  nodes { name: "x" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: [2, 4] } }
  nodes { name: "one" op: CONSTANT constant { fill { f: 1 } } type { dtype: F32 } }
  nodes { name: "g" op: VJP operands: ["w", "x", "one"] grad { function: "loss" wrt: 0 } }
  nodes { name: "value" op: TUPLE_ELEMENT operands: "g" tuple_element { index: 0 } }
  nodes { name: "dw" op: TUPLE_ELEMENT operands: "g" tuple_element { index: 1 } }
  outputs: ["value", "dw"]
  functions {
    name: "loss"
    nodes { name: "w" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [4, 3] } }
    nodes { name: "x" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: [2, 4] } }
    nodes { name: "y" op: DOT_GENERAL operands: ["x", "w"] dot_general { lhs_contracting: 1 rhs_contracting: 0 } }
    nodes { name: "t" op: TANH operands: "y" }
    nodes { name: "s" op: REDUCE operands: "t" reduce { kind: SUM dims: [0, 1] } }
    outputs: "s"
  }
)pb";

TEST(Autodiff, VjpExpandsIntoForwardAndTransposedNodes) {
  auto typed = ValidateGraph(Parse(kGrad));
  ASSERT_TRUE(typed.ok()) << typed.status();
  ASSERT_EQ(typed->graph.nodes(3).results_size(), 2);
  EXPECT_EQ(TypeString(typed->graph.nodes(3).results(1)), "f32[4,3]");
  auto expanded = ExpandAutodiff(*typed);
  ASSERT_TRUE(expanded.ok()) << expanded.status();
  int dots = 0, vjps = 0;
  for (const v1::Node& n : expanded->nodes()) {
    dots += n.op() == v1::DOT_GENERAL;
    vjps += n.op() == v1::VJP || n.op() == v1::TUPLE_ELEMENT;
  }
  EXPECT_EQ(dots, 2);  // forward x.w, and x^T . dy for dw (no dx: x is not differentiated)
  EXPECT_EQ(vjps, 0);
  auto c = Compile(Parse(kGrad));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(TypeString(c->output_types[1]), "f32[4,3]");
  EXPECT_NE(c->plan_text.find("-- backward pass of vjp 'g' --"), std::string::npos) << c->plan_text;
}

TEST(Autodiff, ErrorsNameTheParameterAndTheOp) {
  std::string bad = kGrad;
  bad.replace(bad.find("wrt: 0"), 6, "wrt: 5");
  EXPECT_NE(ErrorOf(bad).find("with respect to parameter 5: it has 2"), std::string::npos)
      << ErrorOf(bad);
  bad = kGrad;
  bad.replace(bad.find(R"(operands: ["w", "x", "one"])"), 27, R"(operands: ["w", "x"])");
  EXPECT_NE(ErrorOf(bad).find("a cotangent for each of its 1 results"), std::string::npos)
      << ErrorOf(bad);
}

TEST(Autodiff, AWhileLoopInTheBackwardPassIsAnErrorSayingWhy) {
  const std::string g = R"pb(
    name: "g"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 } }
    nodes { name: "one" op: CONSTANT constant { fill { f: 1 } } type { dtype: F32 } }
    nodes { name: "v" op: VJP operands: ["x", "one"] grad { function: "f" wrt: 0 } }
    nodes { name: "d" op: TUPLE_ELEMENT operands: "v" tuple_element { index: 1 } }
    outputs: "d"
    functions {
      name: "f"
      nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 } }
      nodes { name: "w" op: WHILE operands: "x" control { cond: "c" body: "b" } }
      nodes { name: "y" op: TUPLE_ELEMENT operands: "w" tuple_element { index: 0 } }
      outputs: "y"
    }
    functions {
      name: "c"
      nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 } }
      nodes { name: "k" op: CONSTANT constant { fill { f: 10 } } type { dtype: F32 } }
      nodes { name: "p" op: COMPARE operands: ["x", "k"] compare { direction: LT } }
      outputs: "p"
    }
    functions {
      name: "b"
      nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 } }
      nodes { name: "y" op: ADD operands: ["x", "x"] }
      outputs: "y"
    }
  )pb";
  const std::string e = ErrorOf(g);
  EXPECT_NE(e.find("reads while loop 'w': reverse mode needs a trip count known at compile time"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace tessel::scheduler
