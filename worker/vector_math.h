// tm_expf, tm_logf and tm_tanhf (worker/vector_math.inc) as C++ functions,
// and the text every code generator puts in its prelude
// (kVectorMathSource, in the generated worker/vector_math_source.h).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace tessel::worker {

namespace vector_math_internal {
inline uint32_t tm_bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float tm_float(uint32_t u) { return std::bit_cast<float>(u); }
#define TM inline
#ifdef TESSEL_FMA
#define TM_FMA(a, b, c) std::fma(a, b, c)
#else
#define TM_FMA(a, b, c) ((a) * (b) + (c))
#endif
#include "worker/vector_math.inc"
#undef TM_FMA
#undef TM
}  // namespace vector_math_internal

using vector_math_internal::tm_expf;
using vector_math_internal::tm_logf;
using vector_math_internal::tm_tanhf;

}  // namespace tessel::worker
