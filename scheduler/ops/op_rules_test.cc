// The op table's coverage: every op of the IR has a row or is one the
// drivers handle themselves, and rows hold the rules their family needs.
#include "scheduler/ops/op_rules.h"

#include <gtest/gtest.h>

#include "absl/container/flat_hash_set.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/sharding.h"
#include "scheduler/validator.h"

namespace tessel::scheduler::ops {
namespace {

// Structural: handled by the drivers (parameters, regions, control flow,
// custom rules, transforms, partitioner-only collectives).
const absl::flat_hash_set<int> kStructural = {
    v1::PARAMETER, v1::MANUAL_REGION, v1::CUSTOM_KERNEL, v1::MESH_REGION, v1::SHARD_SLICE,
    v1::WHILE, v1::CONDITIONAL, v1::SCAN, v1::TUPLE_ELEMENT, v1::VJP, v1::JVP, v1::CUSTOM_VJP,
    v1::CUSTOM_JVP, v1::VMAP,
    // Lowered into elementwise nodes before the drivers run (scheduler/bodies.h).
    v1::REDUCE_WITH_BODY, v1::SORT_WITH_COMPARATOR};

TEST(OpRules, EveryOpHasARowOrIsStructural) {
  const auto* d = v1::Op_descriptor();
  for (int i = 0; i < d->value_count(); ++i) {
    const v1::Op op = v1::Op(d->value(i)->number());
    if (op == v1::OP_INVALID) continue;
    const bool row = Find(op) != nullptr, structural = kStructural.contains(op);
    EXPECT_NE(row, structural) << OpName(op)
                               << (row ? " has a row and is structural"
                                       : " has no row in scheduler/ops and is not structural");
  }
}

TEST(OpRules, ArrayOpsArePartitionedAndBatched) {
  const auto* d = v1::Op_descriptor();
  for (int i = 0; i < d->value_count(); ++i) {
    const v1::Op op = v1::Op(d->value(i)->number());
    const OpRules* r = Find(op);
    if (r == nullptr || IsCollective(op) || op == v1::AXIS_INDEX || op == v1::SHARDING_CONSTRAINT)
      continue;
    EXPECT_NE(r->layout, nullptr) << OpName(op) << " has no partitioning rule";
    if (op != v1::CONSTANT) {
      EXPECT_NE(r->batch, nullptr) << OpName(op) << " has no batching rule";
    }
  }
}

TEST(OpRules, FloatOpsHaveBothDerivatives) {
  for (v1::Op op :
       {v1::ADD, v1::TANH, v1::ERF, v1::ATAN2, v1::SELECT, v1::CLAMP, v1::CONVERT, v1::DOT_GENERAL,
        v1::REDUCE, v1::GATHER, v1::SCATTER, v1::SORT, v1::PAD, v1::CONCATENATE, v1::SLICE,
        v1::BROADCAST_IN_DIM, v1::RESHAPE, v1::TRANSPOSE, v1::REVERSE}) {
    const OpRules* r = Find(op);
    ASSERT_NE(r, nullptr) << OpName(op);
    EXPECT_NE(r->vjp, nullptr) << OpName(op) << " has no reverse-mode rule";
    EXPECT_NE(r->jvp, nullptr) << OpName(op) << " has no forward-mode rule";
  }
}

v1::Sharding Split(int rank, int d, const std::string& axis) {
  v1::Sharding s = Replicated(rank);
  SetDimAxes(s, d, {axis});
  return s;
}

// A reduction over a split dimension leaves a partial result; a layout rule
// is a plain function of its operands' layouts, testable alone.
TEST(OpRules, ReduceOverASplitDimensionIsPartial) {
  v1::Mesh mesh;
  mesh.add_axis_names("x");
  mesh.add_axis_sizes(2);
  v1::Node n;
  n.set_op(v1::REDUCE);
  n.mutable_reduce()->set_kind(v1::SUM);
  n.mutable_reduce()->add_dims(1);
  n.mutable_type()->set_dtype(v1::F32);
  n.mutable_type()->add_dims(4);
  v1::TensorType x;
  x.set_dtype(v1::F32);
  x.add_dims(4);
  x.add_dims(8);
  LayoutQuery q{
      .node = n, .mesh = mesh, .current = {Split(2, 1, "x")}, .generated = {false}, .types = {&x}};
  Layout l;
  l.want.resize(1);
  l.result = Replicated(1);
  Find(v1::REDUCE)->layout(q, l);
  EXPECT_TRUE(SameSharding(l.want[0], Split(2, 1, "x")));
  EXPECT_EQ(PartialAxes(l.result), Axes{"x"});
  EXPECT_EQ(l.result.partial_kind(), v1::SUM);
  EXPECT_TRUE(DimAxes(l.result, 0).empty());
}

// A dot contracting a dimension split alike on both sides: a partial sum,
// no communication before it.
TEST(OpRules, DotOverASplitContractingDimensionIsPartial) {
  v1::Mesh mesh;
  mesh.add_axis_names("x");
  mesh.add_axis_sizes(2);
  v1::Node n;
  n.set_op(v1::DOT_GENERAL);
  n.mutable_dot_general()->add_lhs_contracting(1);
  n.mutable_dot_general()->add_rhs_contracting(0);
  v1::TensorType a, b;
  a.set_dtype(v1::F32);
  a.add_dims(4);
  a.add_dims(8);
  b = a;
  b.set_dims(0, 8);
  b.set_dims(1, 4);
  LayoutQuery q{.node = n,
                .mesh = mesh,
                .current = {Split(2, 1, "x"), Split(2, 0, "x")},
                .generated = {false, false},
                .types = {&a, &b}};
  Layout l;
  l.want.resize(2);
  l.result = Replicated(2);
  Find(v1::DOT_GENERAL)->layout(q, l);
  EXPECT_TRUE(SameSharding(l.want[0], Split(2, 1, "x")));
  EXPECT_TRUE(SameSharding(l.want[1], Split(2, 0, "x")));
  EXPECT_EQ(PartialAxes(l.result), Axes{"x"});
}

}  // namespace
}  // namespace tessel::scheduler::ops
