// Storage and compute types of each dtype for the CPU kernels, and the
// dispatch macro that turns a runtime dtype into a template argument.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "core/half.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::cpu {

template <v1::DType D>
struct Traits;

#define TESSEL_TRAITS(D, Storage, Compute, LoadExpr, StoreExpr) \
  template <>                                                   \
  struct Traits<v1::D> {                                        \
    using S = Storage;                                          \
    using C = Compute;                                          \
    static C Load(S v) { return LoadExpr; }                     \
    static S Store(C v) { return StoreExpr; }                   \
  };

TESSEL_TRAITS(F32, float, float, v, v)
TESSEL_TRAITS(F64, double, double, v, v)
TESSEL_TRAITS(F16, f16, float, ToFloat(v), ToF16(v))
TESSEL_TRAITS(BF16, bf16, float, ToFloat(v), ToBf16(v))
TESSEL_TRAITS(S32, int32_t, int32_t, v, v)
TESSEL_TRAITS(S64, int64_t, int64_t, v, v)
TESSEL_TRAITS(U8, uint8_t, uint8_t, v, v)
TESSEL_TRAITS(PRED, uint8_t, bool, v != 0, uint8_t(v))
TESSEL_TRAITS(S8, int8_t, int8_t, v, v)
TESSEL_TRAITS(S16, int16_t, int16_t, v, v)
TESSEL_TRAITS(U16, uint16_t, uint16_t, v, v)
TESSEL_TRAITS(U32, uint32_t, uint32_t, v, v)
TESSEL_TRAITS(U64, uint64_t, uint64_t, v, v)
#undef TESSEL_TRAITS

// Calls BODY with `D` bound to the constexpr dtype. BODY is a statement.
#define TESSEL_DTYPE_CASE(dt, D, ...) \
  case v1::dt: {                      \
    constexpr v1::DType D = v1::dt;   \
    __VA_ARGS__;                      \
    break;                            \
  }
#define TESSEL_DISPATCH(dtype, D, ...)      \
  switch (dtype) {                          \
    TESSEL_DTYPE_CASE(F32, D, __VA_ARGS__)  \
    TESSEL_DTYPE_CASE(F64, D, __VA_ARGS__)  \
    TESSEL_DTYPE_CASE(F16, D, __VA_ARGS__)  \
    TESSEL_DTYPE_CASE(BF16, D, __VA_ARGS__) \
    TESSEL_DTYPE_CASE(S32, D, __VA_ARGS__)  \
    TESSEL_DTYPE_CASE(S64, D, __VA_ARGS__)  \
    TESSEL_DTYPE_CASE(U8, D, __VA_ARGS__)   \
    TESSEL_DTYPE_CASE(PRED, D, __VA_ARGS__) \
    TESSEL_DTYPE_CASE(S8, D, __VA_ARGS__)   \
    TESSEL_DTYPE_CASE(S16, D, __VA_ARGS__)  \
    TESSEL_DTYPE_CASE(U16, D, __VA_ARGS__)  \
    TESSEL_DTYPE_CASE(U32, D, __VA_ARGS__)  \
    TESSEL_DTYPE_CASE(U64, D, __VA_ARGS__)  \
    default: break;                         \
  }

template <typename C>
inline constexpr bool kIsFloat = std::is_floating_point_v<C>;
template <typename C>
inline constexpr bool kIsBool = std::is_same_v<C, bool>;
template <typename C>
inline constexpr bool kIsInt = std::is_integral_v<C> && !kIsBool<C>;

// The unsigned type in which integer arithmetic on C wraps without undefined
// behaviour: C's own for 32 and 64 bits, unsigned int for narrower types
// (whose unsigned arithmetic would be promoted to int and could overflow).
template <typename C>
using WrapUnsigned = std::make_unsigned_t<decltype(C() + C())>;

// NaN-propagating max/min (StableHLO semantics).
template <typename C>
inline C Max(C a, C b) {
  if constexpr (kIsFloat<C>)
    return (a != a || a > b) ? a : b;
  else
    return a > b ? a : b;
}
template <typename C>
inline C Min(C a, C b) {
  if constexpr (kIsFloat<C>)
    return (a != a || a < b) ? a : b;
  else
    return a < b ? a : b;
}

// Value conversion between compute types: float -> int truncates toward
// zero and saturates (NaN -> 0); int -> int wraps; anything -> bool is != 0.
template <typename To, typename From>
inline To ConvertValue(From x) {
  if constexpr (kIsBool<To>) {
    return x != From(0);
  } else if constexpr (kIsFloat<From> && kIsInt<To>) {
    if (x != x) return To(0);
    if (x <= From(std::numeric_limits<To>::min())) return std::numeric_limits<To>::min();
    if (x >= From(std::numeric_limits<To>::max())) return std::numeric_limits<To>::max();
    return To(x);
  } else {
    return To(x);
  }
}

// Converts a compute value of any dtype into storage of dtype `To`, rounding
// once: wide sources (f64, s32, s64) reach f16/bf16 without passing through a
// rounded float.
template <v1::DType To, typename From>
inline typename Traits<To>::S StoreConverted(From x) {
  constexpr bool kHalf = To == v1::F16 || To == v1::BF16;
  if constexpr (kHalf && std::is_same_v<From, double>) {
    if constexpr (To == v1::F16)
      return F16FromDouble(x);
    else
      return Bf16FromDouble(x);
  } else if constexpr (kHalf && std::is_integral_v<From> && !std::is_same_v<From, bool> &&
                       sizeof(From) >= 4) {
    if constexpr (To == v1::F16)
      return F16FromInt(x);
    else
      return Bf16FromInt(x);
  } else {
    return Traits<To>::Store(ConvertValue<typename Traits<To>::C>(x));
  }
}

}  // namespace tessel::cpu
