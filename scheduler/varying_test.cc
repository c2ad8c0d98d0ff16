// Varying-axis tracking on its own: what each op does to the axes a value
// varies over, and the error for a loop that devices could leave apart.
#include "scheduler/varying.h"

#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>
#include "scheduler/test_graphs.h"

namespace tessel::scheduler {
namespace {

v1::Mesh DataModel() {
  v1::Mesh m;
  m.add_axis_names("data");
  m.add_axis_names("model");
  m.add_axis_sizes(2);
  m.add_axis_sizes(2);
  return m;
}

std::string Axes(const Varying& v) {
  std::string s;
  for (const char* a : {"data", "model"}) {
    if (v.why.contains(a)) s += std::string(s.empty() ? "" : ",") + a;
    if (v.maybe.contains(a)) s += std::string(s.empty() ? "" : ",") + a + "?";
  }
  return s;
}

// x varies over data (its in_spec), w over nothing.
constexpr char kBody[] = R"pb(
  name: "body"
  nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 4 } }
  nodes { name: "w" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: 4 } }
  nodes { name: "xw" op: MUL operands: ["x", "w"] }
  nodes { name: "summed" op: ALL_REDUCE operands: "xw" collective { axes: "data" kind: SUM } }
  nodes { name: "scattered" op: REDUCE_SCATTER operands: "w" collective { axes: "model" kind: SUM dimension: 0 } }
  nodes { name: "follows" op: CUSTOM_KERNEL operands: ["w", "x"] custom_kernel { name: "k"
    decomposition { nodes { name: "a" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 4 } }
                    nodes { name: "b" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: 4 } }
                    outputs: "a" }
    replication { kind: FOLLOW operand: 0 } } }
  nodes { name: "unknown" op: CUSTOM_KERNEL operands: ["w", "x"] custom_kernel { name: "u"
    decomposition { nodes { name: "a" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 4 } }
                    nodes { name: "b" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: 4 } }
                    outputs: "a" }
    replication { kind: UNKNOWN } } }
  nodes { name: "gathered" op: ALL_GATHER operands: "unknown" collective { axes: "model" dimension: 0 } }
  outputs: "gathered"
)pb";

TEST(Varying, EachOpMovesTheAxesAsItsSemanticsSay) {
  const v1::Graph g = Parse(kBody);
  const v1::Mesh mesh = DataModel();
  google::protobuf::RepeatedPtrField<v1::Graph> none;
  VaryingAnalysis a(mesh, none);
  v1::Sharding split;
  split.add_dims()->add_axes("data");
  auto v = a.OfGraph(g, {SpecVarying(split, "x is split over it"), Varying{}}, "region");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(Axes(v->at("xw")), "data");              // a union
  EXPECT_EQ(Axes(v->at("summed")), "");              // psum: the same on every device of the group
  EXPECT_EQ(Axes(v->at("scattered")), "model");      // each device its own block
  EXPECT_EQ(Axes(v->at("follows")), "");             // the rule: as operand 0
  EXPECT_EQ(Axes(v->at("unknown")), "data,model?");  // no rule: may vary over every axis
  EXPECT_EQ(Axes(v->at("gathered")), "data");
  EXPECT_NE(v->at("unknown").Reason("model").find("custom kernel 'u' has no replication rule"),
            std::string::npos);
  EXPECT_EQ(v->at("xw").Reason("data"), "x is split over it");
}

TEST(Varying, ALoopWhoseConditionVariesRunsPerDeviceUnlessAnIterationMeetsACollective) {
  const v1::Graph top = Parse(R"pb(
    name: "top"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 } }
    outputs: "x"
    functions {
      name: "cond"
      nodes { name: "c" op: PARAMETER parameter { index: 0 } type { dtype: F32 } }
      nodes { name: "zero" op: CONSTANT constant { fill { f: 0 } } type { dtype: F32 } }
      nodes { name: "p" op: COMPARE operands: ["c", "zero"] compare { direction: GT } }
      outputs: "p"
    }
    functions {
      name: "body"
      nodes { name: "c" op: PARAMETER parameter { index: 0 } type { dtype: F32 } }
      nodes { name: "i" op: AXIS_INDEX collective { axes: "model" } }
      nodes { name: "f" op: CONVERT operands: "i" convert { dtype: F32 } }
      nodes { name: "d" op: SUB operands: ["c", "f"] }
      outputs: "d"
    }
    functions {
      name: "body_psum"
      nodes { name: "c" op: PARAMETER parameter { index: 0 } type { dtype: F32 } }
      nodes { name: "i" op: AXIS_INDEX collective { axes: "model" } }
      nodes { name: "f" op: CONVERT operands: "i" convert { dtype: F32 } }
      nodes { name: "d" op: SUB operands: ["c", "f"] }
      nodes { name: "s" op: ALL_REDUCE operands: "d" collective { axes: "data" kind: SUM } }
      outputs: "s"
    })pb");
  const v1::Mesh mesh = DataModel();
  VaryingAnalysis a(mesh, top.functions());
  v1::Node loop;
  loop.set_name("loop");
  loop.set_op(v1::WHILE);
  loop.add_operands("x");
  loop.mutable_control()->set_cond("cond");
  loop.mutable_control()->set_body("body");
  // The carry starts uniform; the body makes it vary over model (a fixed
  // point), so each device stops at its own iteration: no collective in an
  // iteration, so it runs so, and the carry varies over model.
  auto r = a.Of(loop, {Varying{}}, "region 'r'");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Axes(r->at(0)), "model");
  // With a psum in the body, devices of one group would meet in it at
  // different iterations: an error naming the axis and the function.
  loop.mutable_control()->set_body("body_psum");
  auto psum = a.Of(loop, {Varying{}}, "region 'r'");
  ASSERT_FALSE(psum.ok());
  EXPECT_NE(psum.status().message().find(
                "its condition 'cond' varies over mesh axis 'model' (axis_index 'i' over it), "
                "and 'body_psum' runs a collective"),
            std::string::npos)
      << psum.status();
}

}  // namespace
}  // namespace tessel::scheduler
