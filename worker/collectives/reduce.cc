#include "worker/collectives/reduce.h"

#include <type_traits>

#include "core/half.h"

namespace tessel::worker {
namespace {

// Integer sums and products wrap (two's complement), as in the kernels.
struct AddOp {
  template <typename T>
  static T Apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<decltype(T() + T())>;  // no promotion to int
      return T(U(a) + U(b));
    } else {
      return a + b;
    }
  }
};
struct MulOp {
  template <typename T>
  static T Apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<decltype(T() + T())>;  // no promotion to int
      return T(U(a) * U(b));
    } else {
      return a * b;
    }
  }
};
// Floating max and min propagate NaN.
struct MaxOp {
  template <typename T>
  static T Apply(T a, T b) {
    return (a > b || a != a) ? a : b;
  }
};
struct MinOp {
  template <typename T>
  static T Apply(T a, T b) {
    return (a < b || a != a) ? a : b;
  }
};
// pred: sum and max are a logical or, prod and min a logical and.
struct OrOp {
  static uint8_t Apply(uint8_t a, uint8_t b) { return (a | b) != 0; }
};
struct AndOp {
  static uint8_t Apply(uint8_t a, uint8_t b) { return a != 0 && b != 0; }
};

template <typename T, typename Op>
void ReduceLoop(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = Op::Apply(x[i], y[i]);
}

// f16 and bf16 compute in float and round back to nearest even. One
// operation on two half values is exact in float or, where it is not, far
// from a tie, so the single rounding to the half type is correct.
inline f16 FromFloat(float f, f16) { return ToF16(f); }
inline bf16 FromFloat(float f, bf16) { return ToBf16(f); }

template <typename H, typename Op>
void HalfReduceLoop(void* out, const void* a, const void* b, size_t n) {
  H* o = static_cast<H*>(out);
  const H* x = static_cast<const H*>(a);
  const H* y = static_cast<const H*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = FromFloat(Op::Apply(ToFloat(x[i]), ToFloat(y[i])), H{});
}

template <typename T>
ReduceFn PickReduce(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return &ReduceLoop<T, AddOp>;
    case ReduceOp::kProd: return &ReduceLoop<T, MulOp>;
    case ReduceOp::kMax: return &ReduceLoop<T, MaxOp>;
    case ReduceOp::kMin: return &ReduceLoop<T, MinOp>;
  }
  return nullptr;
}

template <typename H>
ReduceFn PickHalfReduce(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return &HalfReduceLoop<H, AddOp>;
    case ReduceOp::kProd: return &HalfReduceLoop<H, MulOp>;
    case ReduceOp::kMax: return &HalfReduceLoop<H, MaxOp>;
    case ReduceOp::kMin: return &HalfReduceLoop<H, MinOp>;
  }
  return nullptr;
}

}  // namespace

ReduceFn GetReduceFn(v1::DType dtype, ReduceOp op) {
  switch (dtype) {
    case v1::F32: return PickReduce<float>(op);
    case v1::F64: return PickReduce<double>(op);
    case v1::F16: return PickHalfReduce<f16>(op);
    case v1::BF16: return PickHalfReduce<bf16>(op);
    case v1::S32: return PickReduce<int32_t>(op);
    case v1::S64: return PickReduce<int64_t>(op);
    case v1::U8: return PickReduce<uint8_t>(op);
    case v1::S8: return PickReduce<int8_t>(op);
    case v1::S16: return PickReduce<int16_t>(op);
    case v1::U16: return PickReduce<uint16_t>(op);
    case v1::U32: return PickReduce<uint32_t>(op);
    case v1::U64: return PickReduce<uint64_t>(op);
    case v1::PRED:
      return (op == ReduceOp::kSum || op == ReduceOp::kMax) ? &ReduceLoop<uint8_t, OrOp>
                                                            : &ReduceLoop<uint8_t, AndOp>;
    default: return nullptr;
  }
}

}  // namespace tessel::worker
