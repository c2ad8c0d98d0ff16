// The reductions against a naive loop written here, for every dtype and op:
// wrapping integer sums and products, NaN-propagating float max and min,
// pred as logic, and the half types rounded from float.
#include "worker/collectives/reduce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "core/half.h"

namespace tessel::worker {
namespace {

constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMax, ReduceOp::kMin};

template <typename T>
T Naive(ReduceOp op, T a, T b) {
  switch (op) {
    case ReduceOp::kSum: return T(uint64_t(a) + uint64_t(b));
    case ReduceOp::kProd: return T(uint64_t(a) * uint64_t(b));
    case ReduceOp::kMax: return a > b ? a : b;
    case ReduceOp::kMin: return a < b ? a : b;
  }
  return T{};
}

template <typename T>
void ExpectIntegers(v1::DType dtype) {
  const std::vector<T> a = {std::numeric_limits<T>::max(), std::numeric_limits<T>::min(), T(7),
                            T(0), T(-3)};
  const std::vector<T> b = {T(1), T(-1), T(9), T(5), T(100)};
  for (ReduceOp op : kOps) {
    ReduceFn f = GetReduceFn(dtype, op);
    ASSERT_NE(f, nullptr) << DTypeName(dtype) << " " << ReduceOpName(op);
    std::vector<T> out(a.size());
    f(out.data(), a.data(), b.data(), a.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(out[i], Naive(op, a[i], b[i]))
          << DTypeName(dtype) << " " << ReduceOpName(op) << " " << i;
    // In place: out aliases a.
    std::vector<T> acc = a;
    f(acc.data(), acc.data(), b.data(), a.size());
    EXPECT_EQ(acc, out);
  }
}

TEST(CollectiveReductions, IntegersWrapAndCompareAsANaiveLoop) {
  ExpectIntegers<int8_t>(v1::S8);
  ExpectIntegers<int16_t>(v1::S16);
  ExpectIntegers<int32_t>(v1::S32);
  ExpectIntegers<int64_t>(v1::S64);
  ExpectIntegers<uint8_t>(v1::U8);
  ExpectIntegers<uint16_t>(v1::U16);
  ExpectIntegers<uint32_t>(v1::U32);
  ExpectIntegers<uint64_t>(v1::U64);
}

TEST(CollectiveReductions, FloatMaxAndMinPropagateNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> a = {1.5f, nan, 2.0f, -0.0f}, b = {2.5f, 3.0f, nan, 4.0f};
  for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
    std::vector<float> out(a.size());
    GetReduceFn(v1::F32, op)(out.data(), a.data(), b.data(), a.size());
    EXPECT_EQ(out[0], op == ReduceOp::kMax ? 2.5f : 1.5f);
    EXPECT_TRUE(std::isnan(out[1])) << ReduceOpName(op);
    EXPECT_TRUE(std::isnan(out[2])) << ReduceOpName(op);
    EXPECT_EQ(out[3], op == ReduceOp::kMax ? 4.0f : -0.0f);
  }
  std::vector<double> x = {0.1, 1e300}, y = {0.2, 1e300}, sum(2), prod(2);
  GetReduceFn(v1::F64, ReduceOp::kSum)(sum.data(), x.data(), y.data(), 2);
  GetReduceFn(v1::F64, ReduceOp::kProd)(prod.data(), x.data(), y.data(), 2);
  EXPECT_EQ(sum[0], 0.1 + 0.2);
  EXPECT_EQ(sum[1], 2e300);
  EXPECT_EQ(prod[0], 0.1 * 0.2);
  EXPECT_TRUE(std::isinf(prod[1]));
}

TEST(CollectiveReductions, PredSumAndMaxAreOrProdAndMinAreAnd) {
  const std::vector<uint8_t> a = {0, 0, 1, 1}, b = {0, 1, 0, 1};
  for (ReduceOp op : kOps) {
    std::vector<uint8_t> out(4);
    GetReduceFn(v1::PRED, op)(out.data(), a.data(), b.data(), 4);
    const bool is_or = op == ReduceOp::kSum || op == ReduceOp::kMax;
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(out[i], is_or ? (a[i] | b[i]) : (a[i] & b[i])) << ReduceOpName(op) << " " << i;
  }
}

TEST(CollectiveReductions, HalfTypesComputeInFloatAndRoundOnce) {
  // 2049 is not an f16: 2048 + 1 rounds to nearest even (2048); 1.5 * 3 is exact.
  const std::vector<f16> a = {ToF16(2048.0f), ToF16(1.5f)}, b = {ToF16(1.0f), ToF16(3.0f)};
  std::vector<f16> sum(2), prod(2);
  GetReduceFn(v1::F16, ReduceOp::kSum)(sum.data(), a.data(), b.data(), 2);
  GetReduceFn(v1::F16, ReduceOp::kProd)(prod.data(), a.data(), b.data(), 2);
  EXPECT_EQ(ToFloat(sum[0]), 2048.0f);
  EXPECT_EQ(ToFloat(sum[1]), 4.5f);
  EXPECT_EQ(ToFloat(prod[1]), 4.5f);
  const std::vector<bf16> c = {ToBf16(256.0f)}, d = {ToBf16(1.0f)};
  std::vector<bf16> out(1);
  GetReduceFn(v1::BF16, ReduceOp::kSum)(out.data(), c.data(), d.data(), 1);
  EXPECT_EQ(ToFloat(out[0]), ToFloat(ToBf16(257.0f)));
}

TEST(CollectiveReductions, DTypesWithoutArithmeticHaveNone) {
  EXPECT_EQ(GetReduceFn(v1::DTYPE_INVALID, ReduceOp::kSum), nullptr);
}

}  // namespace
}  // namespace tessel::worker
