// tm_expf, tm_logf and tm_tanhf against libm in double precision (an
// independent reference), over every 61st float bit pattern and the
// special values.
#include "worker/vector_math.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace tessel::worker {
namespace {

// The distance in ulps between `got` and the double `want` rounded to
// float; 0 when both are the same NaN class or infinity.
double Ulps(float got, double want) {
  const float w = float(want);
  if (std::isnan(w) || std::isnan(got)) return std::isnan(w) && std::isnan(got) ? 0 : 1e9;
  if (std::isinf(w) || std::isinf(got)) return w == got ? 0 : 1e9;
  const double ulp =
      std::nextafter(std::fabs(w), std::numeric_limits<float>::infinity()) - double(std::fabs(w));
  return std::fabs(double(got) - want) / ulp;
}

template <typename F, typename R>
void ExpectWithinUlps(const char* name, F f, R ref, double max_ulps) {
  double worst = 0;
  float at = 0;
  for (uint64_t bits = 0; bits <= 0xffffffffull; bits += 61) {
    const float x = std::bit_cast<float>(uint32_t(bits));
    const double e = Ulps(f(x), ref(double(x)));
    if (e > worst) {
      worst = e;
      at = x;
    }
  }
  EXPECT_LE(worst, max_ulps) << name << " at " << at << ": got " << f(at) << ", want "
                             << ref(double(at));
}

TEST(VectorMath, ExpIsWithinTwoUlpsOfLibmInDouble) {
  ExpectWithinUlps(
      "exp", tm_expf, [](double x) { return std::exp(x); }, 2);
  EXPECT_EQ(tm_expf(0.0f), 1.0f);
  EXPECT_EQ(tm_expf(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(tm_expf(std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
  EXPECT_EQ(tm_expf(89.0f), std::numeric_limits<float>::infinity());
  EXPECT_GT(tm_expf(-100.0f), 0.0f);  // a subnormal, not flushed
  EXPECT_TRUE(std::isnan(tm_expf(std::nanf(""))));
}

TEST(VectorMath, LogIsWithinTwoUlpsOfLibmInDouble) {
  ExpectWithinUlps(
      "log", tm_logf, [](double x) { return std::log(x); }, 2);
  EXPECT_EQ(tm_logf(1.0f), 0.0f);
  EXPECT_EQ(tm_logf(0.0f), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(tm_logf(-0.0f), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(tm_logf(-1.0f)));
  EXPECT_EQ(tm_logf(std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
  EXPECT_NEAR(tm_logf(std::numeric_limits<float>::denorm_min()),
              std::log(double(std::numeric_limits<float>::denorm_min())), 1e-5);
}

TEST(VectorMath, TanhIsWithinSixUlpsOfLibmInDouble) {
  ExpectWithinUlps(
      "tanh", tm_tanhf, [](double x) { return std::tanh(x); }, 6);
  EXPECT_EQ(tm_tanhf(100.0f), 1.0f);
  EXPECT_EQ(tm_tanhf(-100.0f), -1.0f);
  EXPECT_TRUE(std::signbit(tm_tanhf(-0.0f)));
  EXPECT_TRUE(std::isnan(tm_tanhf(std::nanf(""))));
}

}  // namespace
}  // namespace tessel::worker
