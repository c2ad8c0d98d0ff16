// IEEE binary16 (f16) and bfloat16 storage types with round-to-nearest-even
// conversions from float. Arithmetic happens in float; these types only store.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace tessel {

struct f16 {
  uint16_t bits;
};
struct bf16 {
  uint16_t bits;
};

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float ToFloat(bf16 h) { return BitsFloat(uint32_t{h.bits} << 16); }

inline bf16 ToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

inline float ToFloat(f16 h) {
  uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t man = h.bits & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return BitsFloat(sign);
    // Subnormal: value = man * 2^-24.
    float v = float(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return BitsFloat(sign | ((exp + 112) << 23) | (man << 13));
}

inline f16 ToF16(float f) {
  uint32_t u = FloatBits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u)};   // NaN
  if (a >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};  // overflow -> inf
  if (a < 0x38800000u) {
    // Subnormal or zero in f16: round a * 2^24 to an integer, ties to even.
    float v = BitsFloat(a) * 16777216.0f;
    uint32_t m = uint32_t(v);
    float frac = v - float(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
    return f16{uint16_t(sign | m)};
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);  // round mantissa to 10 bits
  return f16{uint16_t(sign | ((r - 0x38000000u) >> 13))};
}

// Rounding twice (to float, then to f16/bf16) can land on the wrong side of a
// tie. Rounding to odd first keeps the information the second rounding needs:
// with at least two spare bits (float has 24, f16 11, bf16 8), odd-then-nearest
// equals one rounding to nearest of the exact value.
inline float RoundToOddFloat(double d) {
  float f = static_cast<float>(d);
  if (!(std::fabs(d) < std::numeric_limits<double>::infinity()) || double(f) == d) return f;
  // Truncate toward zero, then make the last bit sticky.
  if (std::fabs(double(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  return BitsFloat(FloatBits(f) | 1u);
}

// |v| as uint64 -> double, rounded to odd (exact below 2^53).
inline double RoundToOddDouble(uint64_t m, bool neg) {
  if (m < (uint64_t{1} << 53)) return neg ? -double(m) : double(m);
  int k = 0;
  while ((m >> k) >= (uint64_t{1} << 53)) ++k;
  const bool sticky = (m & ((uint64_t{1} << k) - 1)) != 0;
  m = (m >> k) | uint64_t(sticky);
  const double r = std::ldexp(double(m), k);
  return neg ? -r : r;
}
inline double RoundToOddDouble(int64_t v) {
  return RoundToOddDouble(v < 0 ? uint64_t(0) - uint64_t(v) : uint64_t(v), v < 0);
}
inline double RoundToOddDouble(uint64_t v) { return RoundToOddDouble(v, false); }

inline f16 F16FromDouble(double d) { return ToF16(RoundToOddFloat(d)); }
inline bf16 Bf16FromDouble(double d) { return ToBf16(RoundToOddFloat(d)); }
// Any integer (up to 64 bits, signed or not) rounded once to f16 / bf16.
template <typename I>
inline double RoundToOddDoubleOf(I v) {
  return RoundToOddDouble(std::conditional_t<std::is_signed_v<I>, int64_t, uint64_t>(v));
}
template <typename I>
inline f16 F16FromInt(I v) {
  return F16FromDouble(RoundToOddDoubleOf(v));
}
template <typename I>
inline bf16 Bf16FromInt(I v) {
  return Bf16FromDouble(RoundToOddDoubleOf(v));
}

}  // namespace tessel
