#include "core/shape_inference.h"

#include <gtest/gtest.h>

#include <string>

#include "core/dtype.h"

namespace tessel {
namespace {

v1::Node Op(v1::Op op) {
  v1::Node n;
  n.set_name("n");
  n.set_op(op);
  return n;
}

TEST(ShapeInference, BinaryRequiresSameType) {
  auto a = MakeType(v1::F32, {2, 3});
  auto b = MakeType(v1::F32, {3, 2});
  auto t = InferType(Op(v1::ADD), {&a, &a});
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(TypeString(*t), "f32[2,3]");
  auto bad = InferType(Op(v1::ADD), {&a, &b});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("expected f32[2,3], got f32[3,2]"),
            absl::string_view::npos);
}

TEST(ShapeInference, ABitcastKeepsTheShapeAndTheWidth) {
  auto a = MakeType(v1::F32, {2, 3});
  v1::Node n = Op(v1::CONVERT);
  n.mutable_convert()->set_dtype(v1::S32);
  n.mutable_convert()->set_bitcast(true);
  auto t = InferType(n, {&a});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(TypeString(*t), "s32[2,3]");
  n.mutable_convert()->set_dtype(v1::S16);
  auto narrow = InferType(n, {&a});
  ASSERT_FALSE(narrow.ok());
  EXPECT_NE(
      narrow.status().message().find(
          "bitcast_convert: f32 (4 bytes) to s16 (2 bytes): expected dtypes of the same width"),
      absl::string_view::npos)
      << narrow.status();
  auto p = MakeType(v1::PRED, {4});
  n.mutable_convert()->set_dtype(v1::U8);
  auto pred = InferType(n, {&p});
  ASSERT_FALSE(pred.ok());
  EXPECT_NE(pred.status().message().find("pred has no bits"), absl::string_view::npos);
}

TEST(ShapeInference, ArityAndDtypeRules) {
  auto a = MakeType(v1::S32, {4});
  EXPECT_FALSE(InferType(Op(v1::ADD), {&a}).ok());
  auto exp = InferType(Op(v1::EXP), {&a});
  ASSERT_FALSE(exp.ok());
  EXPECT_NE(exp.status().message().find("floating"), absl::string_view::npos);
  auto p = MakeType(v1::PRED, {4});
  EXPECT_TRUE(InferType(Op(v1::NOT), {&p}).ok());
  EXPECT_FALSE(InferType(Op(v1::ADD), {&p, &p}).ok());
}

TEST(ShapeInference, DotGeneralBatchAndContracting) {
  auto l = MakeType(v1::F32, {5, 2, 3});
  auto r = MakeType(v1::F32, {5, 3, 7});
  v1::Node n = Op(v1::DOT_GENERAL);
  auto* d = n.mutable_dot_general();
  d->add_lhs_batch(0);
  d->add_rhs_batch(0);
  d->add_lhs_contracting(2);
  d->add_rhs_contracting(1);
  auto t = InferType(n, {&l, &r});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(TypeString(*t), "f32[5,2,7]");
  d->set_rhs_contracting(0, 2);
  auto bad = InferType(n, {&l, &r});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("3 vs 7"), absl::string_view::npos) << bad.status();
}

TEST(ShapeInference, ConvolutionFollowsStableHlo) {
  // NHWC x HWIO -> NHWC, stride 2 with padding 1/1 over 7: (7 + 2 - 3) / 2 + 1 = 4;
  // input dilation 2 and kernel dilation 2 over 5 with a 2-wide window: 9 - 3 + 1 = 7.
  auto l = MakeType(v1::F32, {2, 7, 5, 6});
  auto r = MakeType(v1::F32, {3, 2, 3, 8});
  v1::Node n = Op(v1::CONVOLUTION);
  auto* c = n.mutable_convolution();
  c->set_input_batch_dimension(0);
  c->set_input_feature_dimension(3);
  c->set_kernel_input_feature_dimension(2);
  c->set_kernel_output_feature_dimension(3);
  c->set_output_batch_dimension(0);
  c->set_output_feature_dimension(3);
  for (int64_t d : {1, 2}) {
    c->add_input_spatial_dimensions(d);
    c->add_output_spatial_dimensions(d);
    c->add_kernel_spatial_dimensions(d - 1);
  }
  for (int64_t v : {2, 1}) c->add_window_strides(v);
  for (int64_t v : {1, 0}) c->add_padding_low(v);
  for (int64_t v : {1, 0}) c->add_padding_high(v);
  for (int64_t v : {1, 2}) c->add_lhs_dilation(v);
  for (int64_t v : {1, 2}) c->add_rhs_dilation(v);
  c->set_feature_group_count(2);
  auto t = InferType(n, {&l, &r});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(TypeString(*t), "f32[2,4,7,8]");
  // Groups must divide the features: 6 / 4 is not rhs's 3.
  c->set_feature_group_count(4);
  auto bad = InferType(n, {&l, &r});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("feature_group_count (4)"), absl::string_view::npos)
      << bad.status();
  c->set_feature_group_count(2);
  c->add_window_strides(1);
  bad = InferType(n, {&l, &r});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("window_strides must have one entry per spatial "
                                        "dimension (2): got 3"),
            absl::string_view::npos)
      << bad.status();
}

TEST(ShapeInference, LinalgPacksItsResultsAndNamesBadOperands) {
  auto a = MakeType(v1::F64, {3, 4, 4});
  auto check = [&](v1::Op op, const v1::TensorType& x, const std::string& want) {
    auto t = InferType(Op(op), {&x});
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(TypeString(*t), want);
  };
  check(v1::CHOLESKY, a, "f64[3,4,4]");
  check(v1::LU, a, "f64[3,6,4]");    // factors, pivots, permutation
  check(v1::EIGH, a, "f64[3,5,4]");  // eigenvectors, eigenvalues
  auto tall = MakeType(v1::F32, {6, 4}), wide = MakeType(v1::F32, {4, 6});
  check(v1::QR, tall, "f32[10,4]");   // Q [6, 4] (padded), R [4, 4]
  check(v1::QR, wide, "f32[8,6]");    // Q [4, 4] (padded), R [4, 6]
  check(v1::SVD, tall, "f32[11,4]");  // U [6, 4], s, Vt [4, 4]
  check(v1::SVD, wide, "f32[9,6]");   // U [4, 4] (padded), s, Vt [4, 6]
  auto rect = MakeType(v1::F32, {4, 5});
  auto bad = InferType(Op(v1::CHOLESKY), {&rect});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("expected a square matrix [..., n, n], got f32[4,5]"),
            absl::string_view::npos)
      << bad.status();
  auto ints = MakeType(v1::S32, {4, 4});
  bad = InferType(Op(v1::LU), {&ints});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("expected f32 or f64, got s32[4,4]"),
            absl::string_view::npos)
      << bad.status();

  v1::Node solve = Op(v1::TRIANGULAR_SOLVE);
  solve.mutable_linalg()->set_left_side(true);
  auto b = MakeType(v1::F64, {3, 4, 2});
  auto t = InferType(solve, {&a, &b});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(TypeString(*t), "f64[3,4,2]");
  solve.mutable_linalg()->set_left_side(false);  // x a = b needs b's 4 columns
  bad = InferType(solve, {&a, &b});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("must have 4 columns"), absl::string_view::npos)
      << bad.status();
  auto other_batch = MakeType(v1::F64, {2, 4, 2});
  solve.mutable_linalg()->set_left_side(true);
  bad = InferType(solve, {&a, &other_batch});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("same batch dimensions"), absl::string_view::npos)
      << bad.status();
}

TEST(ShapeInference, ReduceSliceTransposePad) {
  auto x = MakeType(v1::F64, {4, 6});
  v1::Node r = Op(v1::REDUCE);
  r.mutable_reduce()->set_kind(v1::SUM);
  r.mutable_reduce()->add_dims(1);
  EXPECT_EQ(TypeString(*InferType(r, {&x})), "f64[4]");
  r.mutable_reduce()->add_dims(1);
  EXPECT_FALSE(InferType(r, {&x}).ok());  // dimension twice

  v1::Node s = Op(v1::SLICE);
  for (int64_t v : {0, 1}) s.mutable_slice()->add_start(v);
  for (int64_t v : {4, 6}) s.mutable_slice()->add_limit(v);
  for (int64_t v : {2, 2}) s.mutable_slice()->add_strides(v);
  EXPECT_EQ(TypeString(*InferType(s, {&x})), "f64[2,3]");
  s.mutable_slice()->set_limit(1, 7);
  EXPECT_FALSE(InferType(s, {&x}).ok());

  v1::Node t = Op(v1::TRANSPOSE);
  t.mutable_transpose()->add_permutation(1);
  t.mutable_transpose()->add_permutation(0);
  EXPECT_EQ(TypeString(*InferType(t, {&x})), "f64[6,4]");

  auto pv = MakeType(v1::F64, {});
  v1::Node p = Op(v1::PAD);
  for (int64_t v : {1, -1}) p.mutable_pad()->add_low(v);
  for (int64_t v : {0, 2}) p.mutable_pad()->add_high(v);
  for (int64_t v : {1, 0}) p.mutable_pad()->add_interior(v);
  EXPECT_EQ(TypeString(*InferType(p, {&x, &pv})), "f64[8,7]");

  v1::Node rev = Op(v1::REVERSE);
  EXPECT_FALSE(InferType(rev, {&x}).ok());  // no attrs
  rev.mutable_reverse()->add_dimensions(1);
  EXPECT_EQ(TypeString(*InferType(rev, {&x})), "f64[4,6]");
  rev.mutable_reverse()->add_dimensions(1);
  auto twice = InferType(rev, {&x});
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("names dimension 1 twice"), absl::string_view::npos)
      << twice.status();
  rev.mutable_reverse()->set_dimensions(1, 2);
  auto out_of_range = InferType(rev, {&x});
  ASSERT_FALSE(out_of_range.ok());
  EXPECT_NE(out_of_range.status().message().find("reverse dimension"), absl::string_view::npos)
      << out_of_range.status();
}

TEST(ShapeInference, SortTakesTheMovedOperandsTypeAndChecksItsOperands) {
  auto keys = MakeType(v1::F32, {4, 6});
  auto idx = MakeType(v1::S64, {4, 6});
  auto other = MakeType(v1::S64, {6, 4});
  v1::Node s = Op(v1::SORT);
  s.mutable_sort()->set_dimension(1);
  EXPECT_EQ(TypeString(*InferType(s, {&keys})), "f32[4,6]");
  s.mutable_sort()->set_result_operand(1);
  EXPECT_EQ(TypeString(*InferType(s, {&keys, &idx})), "s64[4,6]");
  auto mismatched = InferType(s, {&keys, &other});
  ASSERT_FALSE(mismatched.ok());
  EXPECT_NE(mismatched.status().message().find("expected the keys' dimensions [4,6], got s64[6,4]"),
            absl::string_view::npos)
      << mismatched.status();
  auto no_operand = InferType(s, {&keys});
  ASSERT_FALSE(no_operand.ok());
  EXPECT_NE(no_operand.status().message().find("result_operand: expected 0 to 0, got 1"),
            absl::string_view::npos)
      << no_operand.status();
  s.mutable_sort()->set_dimension(2);
  EXPECT_FALSE(InferType(s, {&keys, &idx}).ok());
}

TEST(ShapeInference, GatherAndScatterPutTheIndicesInPlaceOfTheAxis) {
  auto x = MakeType(v1::F32, {4, 6, 2});
  auto idx = MakeType(v1::S64, {3, 5});
  auto fidx = MakeType(v1::F32, {3});
  v1::Node g = Op(v1::GATHER);
  g.mutable_gather()->set_axis(1);
  EXPECT_EQ(TypeString(*InferType(g, {&x, &idx})), "f32[4,3,5,2]");
  auto float_indices = InferType(g, {&x, &fidx});
  ASSERT_FALSE(float_indices.ok());
  EXPECT_NE(float_indices.status().message().find("gather indices: expected an integer dtype"),
            absl::string_view::npos)
      << float_indices.status();
  g.mutable_gather()->set_axis(3);
  EXPECT_FALSE(InferType(g, {&x, &idx}).ok());
  auto empty = MakeType(v1::F32, {0, 2});
  g.mutable_gather()->set_axis(0);
  auto from_empty = InferType(g, {&empty, &idx});
  ASSERT_FALSE(from_empty.ok());
  EXPECT_NE(from_empty.status().message().find("the axis is empty"), absl::string_view::npos)
      << from_empty.status();

  v1::Node s = Op(v1::SCATTER);
  s.mutable_scatter()->set_axis(1);
  s.mutable_scatter()->set_combine(v1::SUM);
  auto upd = MakeType(v1::F32, {4, 3, 5, 2});
  auto bad = MakeType(v1::F32, {4, 3, 2});
  EXPECT_EQ(TypeString(*InferType(s, {&x, &idx, &upd})), "f32[4,6,2]");
  auto wrong = InferType(s, {&x, &idx, &bad});
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("scatter updates: expected f32[4,3,5,2]"),
            absl::string_view::npos)
      << wrong.status();
  auto pred = MakeType(v1::PRED, {4, 6, 2}), pupd = MakeType(v1::PRED, {4, 3, 5, 2});
  EXPECT_FALSE(InferType(s, {&pred, &idx, &pupd}).ok());  // pred has no sum
  s.mutable_scatter()->set_combine(v1::REDUCE_MAX);
  EXPECT_TRUE(InferType(s, {&pred, &idx, &pupd}).ok());

  // batch_dims: the leading dims the operand and the indices share.
  v1::Node b = Op(v1::GATHER);
  b.mutable_gather()->set_axis(1);
  b.mutable_gather()->set_batch_dims(1);
  auto bidx = MakeType(v1::S32, {4, 7});
  EXPECT_EQ(TypeString(*InferType(b, {&x, &bidx})), "f32[4,7,2]");
  auto mismatched = InferType(b, {&x, &idx});  // indices [3,5]: their dim 0 is not the operand's 4
  ASSERT_FALSE(mismatched.ok());
  EXPECT_NE(mismatched.status().message().find("gather batch dimension 0"), absl::string_view::npos)
      << mismatched.status();
  b.mutable_gather()->set_batch_dims(2);  // past the axis
  auto past = InferType(b, {&x, &bidx});
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("gather batch_dims: expected 0 to 1"),
            absl::string_view::npos)
      << past.status();
  v1::Node bs = Op(v1::SCATTER);
  bs.mutable_scatter()->set_axis(1);
  bs.mutable_scatter()->set_batch_dims(1);
  auto bupd = MakeType(v1::F32, {4, 7, 2});
  EXPECT_EQ(TypeString(*InferType(bs, {&x, &bidx, &bupd})), "f32[4,6,2]");
}

TEST(ShapeInference, RejectsNegativeAndOverflowingDims) {
  v1::Node n = Op(v1::PARAMETER);
  n.mutable_parameter()->set_index(0);
  *n.mutable_type() = MakeType(v1::F32, {2, -1});
  auto t = InferType(n, {});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("negative"), absl::string_view::npos);
  *n.mutable_type() = MakeType(v1::F32, {int64_t{1} << 40, int64_t{1} << 40});
  t = InferType(n, {});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("overflow"), absl::string_view::npos);
}

TEST(ShapeInference, BroadcastInDim) {
  auto x = MakeType(v1::F32, {3, 1});
  v1::Node b = Op(v1::BROADCAST_IN_DIM);
  for (int64_t v : {2, 3, 4}) b.mutable_broadcast_in_dim()->add_dims(v);
  for (int64_t v : {1, 2}) b.mutable_broadcast_in_dim()->add_broadcast_dimensions(v);
  EXPECT_EQ(TypeString(*InferType(b, {&x})), "f32[2,3,4]");
  b.mutable_broadcast_in_dim()->set_broadcast_dimensions(0, 2);
  b.mutable_broadcast_in_dim()->set_broadcast_dimensions(1, 1);
  EXPECT_FALSE(InferType(b, {&x}).ok());
}

}  // namespace
}  // namespace tessel
