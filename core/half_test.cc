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

}  // namespace
}  // namespace tessel
