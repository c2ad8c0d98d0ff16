#include "core/half.h"

#include <gtest/gtest.h>

#include <cmath>

namespace tessel {
namespace {

TEST(Half, F16RoundTripsEveryValue) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    f16 h{uint16_t(b)};
    float f = ToFloat(h);
    if (std::isnan(f)) continue;
    EXPECT_EQ(ToF16(f).bits, h.bits) << b;
  }
}

TEST(Half, F16RoundsToNearestEven) {
  EXPECT_EQ(ToFloat(ToF16(1.0f + 1.0f / 2048)), 1.0f);  // tie -> even
  EXPECT_EQ(ToFloat(ToF16(1.0f + 3.0f / 2048)), 1.0f + 2.0f / 1024);
  EXPECT_TRUE(std::isinf(ToFloat(ToF16(70000.f))));
  EXPECT_EQ(ToFloat(ToF16(5.9604644775390625e-8f)), 5.9604644775390625e-8f);  // smallest subnormal
}

TEST(Half, Bf16RoundTripsAndRounds) {
  for (uint32_t b = 0; b < 0x10000; b += 7) {
    bf16 h{uint16_t(b)};
    float f = ToFloat(h);
    if (std::isnan(f)) continue;
    EXPECT_EQ(ToBf16(f).bits, h.bits) << b;
  }
  EXPECT_EQ(ToFloat(ToBf16(1.00390625f)), 1.0f);  // tie -> even
  EXPECT_TRUE(std::isnan(ToFloat(ToBf16(NAN))));
}

// A value just above a tie must round up even though the nearest float is the
// tie itself (double rounding would round it down to even).
TEST(Half, WideSourcesRoundOnce) {
  const double above_f16_tie = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
  EXPECT_EQ(float(above_f16_tie), 1.0f + 1.0f / 2048);  // the float is the tie
  EXPECT_EQ(ToFloat(F16FromDouble(above_f16_tie)), 1.0f + 1.0f / 1024);
  EXPECT_EQ(ToFloat(F16FromDouble(1.0 + std::ldexp(1.0, -11))), 1.0f);  // exact tie -> even
  const double above_bf16_tie = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);
  EXPECT_EQ(ToFloat(Bf16FromDouble(above_bf16_tie)), 1.0f + 1.0f / 128);
  const double below_bf16_tie = 1.0 + std::ldexp(1.0, -8) - std::ldexp(1.0, -30);
  EXPECT_EQ(ToFloat(Bf16FromDouble(below_bf16_tie)), 1.0f);
  // 2^60 * (1 + 2^-8) + 1: one above a bf16 tie, lost by an int64 -> double cast.
  const int64_t big = (int64_t{1} << 60) + (int64_t{1} << 52) + 1;
  EXPECT_EQ(double(ToFloat(Bf16FromInt(big))), std::ldexp(1.0 + 1.0 / 128, 60));
  EXPECT_EQ(double(ToFloat(Bf16FromInt(-big))), -std::ldexp(1.0 + 1.0 / 128, 60));
  EXPECT_EQ(ToFloat(F16FromInt(2049)), 2048.0f);  // tie -> even
  EXPECT_EQ(ToFloat(F16FromInt(2051)), 2052.0f);
  // uint64 past 2^63: 2^63 + 2^55 is a bf16 tie (-> even, 2^63); one above it
  // rounds up, which a uint64 -> double cast (to the tie) would lose.
  const uint64_t top = uint64_t{1} << 63;
  EXPECT_EQ(double(ToFloat(Bf16FromInt(top + (uint64_t{1} << 55)))), std::ldexp(1.0, 63));
  EXPECT_EQ(double(ToFloat(Bf16FromInt(top + (uint64_t{1} << 55) + 1))),
            std::ldexp(1.0 + 1.0 / 128, 63));
  EXPECT_EQ(double(ToFloat(Bf16FromInt(~uint64_t{0}))), std::ldexp(1.0, 64));
  EXPECT_TRUE(std::isinf(ToFloat(F16FromInt(uint16_t{65535}))));
  EXPECT_EQ(ToFloat(F16FromInt(int8_t{-128})), -128.0f);
  EXPECT_TRUE(std::isinf(ToFloat(F16FromDouble(1e300))));
  EXPECT_TRUE(std::isnan(ToFloat(F16FromDouble(NAN))));
}

}  // namespace
}  // namespace tessel
