#include "worker/cpu/elementwise.h"

#include <array>
#include <cstring>
#include <utility>

#include "worker/cpu/traits.h"
#include "worker/vector_math.h"

namespace tessel::cpu {
namespace {

// exp, log and tanh: in float (f32, f16, bf16) the vectorizing ones every
// backend shares (worker/vector_math.inc); libm's in double.
template <typename C>
C Exp(C x) {
  if constexpr (std::is_same_v<C, float>) return worker::tm_expf(x);
  return std::exp(x);
}
template <typename C>
C Log(C x) {
  if constexpr (std::is_same_v<C, float>) return worker::tm_logf(x);
  return std::log(x);
}
template <typename C>
C Tanh(C x) {
  if constexpr (std::is_same_v<C, float>) return worker::tm_tanhf(x);
  return std::tanh(x);
}

template <v1::DType D, typename F>
void Map1(const void* in, void* out, int64_t n, F f) {
  using T = Traits<D>;
  auto* a = static_cast<const typename T::S*>(in);
  auto* o = static_cast<typename T::S*>(out);
  for (int64_t i = 0; i < n; ++i) o[i] = T::Store(f(T::Load(a[i])));
}

template <v1::DType D, typename F>
void Map2(const void* in0, const void* in1, void* out, int64_t n, F f) {
  using T = Traits<D>;
  auto* a = static_cast<const typename T::S*>(in0);
  auto* b = static_cast<const typename T::S*>(in1);
  auto* o = static_cast<typename T::S*>(out);
  for (int64_t i = 0; i < n; ++i) o[i] = T::Store(f(T::Load(a[i]), T::Load(b[i])));
}

template <typename C>
using Unsigned = WrapUnsigned<C>;

template <v1::DType D>
[[gnu::always_inline]] inline void Unary(v1::Op op, const void* in, void* out, int64_t n) {
  using C = typename Traits<D>::C;
  if constexpr (kIsFloat<C>) {
    switch (op) {
      case v1::NEG: return Map1<D>(in, out, n, [](C x) { return -x; });
      case v1::ABS: return Map1<D>(in, out, n, [](C x) { return std::abs(x); });
      case v1::EXP: return Map1<D>(in, out, n, [](C x) { return Exp(x); });
      case v1::LOG: return Map1<D>(in, out, n, [](C x) { return Log(x); });
      case v1::LOG1P: return Map1<D>(in, out, n, [](C x) { return std::log1p(x); });
      case v1::TANH: return Map1<D>(in, out, n, [](C x) { return Tanh(x); });
      case v1::LOGISTIC: return Map1<D>(in, out, n, [](C x) { return C(1) / (C(1) + Exp(-x)); });
      case v1::SQRT: return Map1<D>(in, out, n, [](C x) { return std::sqrt(x); });
      case v1::RSQRT: return Map1<D>(in, out, n, [](C x) { return C(1) / std::sqrt(x); });
      case v1::FLOOR: return Map1<D>(in, out, n, [](C x) { return std::floor(x); });
      case v1::CEIL: return Map1<D>(in, out, n, [](C x) { return std::ceil(x); });
      case v1::ROUND: return Map1<D>(in, out, n, [](C x) { return std::round(x); });
      case v1::SIGN:
        return Map1<D>(in, out, n, [](C x) {
          return x != x ? x : x > 0 ? C(1) : x < 0 ? C(-1) : x;
        });
      case v1::SIN: return Map1<D>(in, out, n, [](C x) { return std::sin(x); });
      case v1::COS: return Map1<D>(in, out, n, [](C x) { return std::cos(x); });
      case v1::TAN: return Map1<D>(in, out, n, [](C x) { return std::tan(x); });
      case v1::ASIN: return Map1<D>(in, out, n, [](C x) { return std::asin(x); });
      case v1::ACOS: return Map1<D>(in, out, n, [](C x) { return std::acos(x); });
      case v1::ATAN: return Map1<D>(in, out, n, [](C x) { return std::atan(x); });
      case v1::SINH: return Map1<D>(in, out, n, [](C x) { return std::sinh(x); });
      case v1::COSH: return Map1<D>(in, out, n, [](C x) { return std::cosh(x); });
      case v1::ASINH: return Map1<D>(in, out, n, [](C x) { return std::asinh(x); });
      case v1::ACOSH: return Map1<D>(in, out, n, [](C x) { return std::acosh(x); });
      case v1::ATANH: return Map1<D>(in, out, n, [](C x) { return std::atanh(x); });
      case v1::EXPM1: return Map1<D>(in, out, n, [](C x) { return std::expm1(x); });
      case v1::ERF: return Map1<D>(in, out, n, [](C x) { return std::erf(x); });
      case v1::CBRT: return Map1<D>(in, out, n, [](C x) { return std::cbrt(x); });
      default: return;
    }
  } else if constexpr (kIsInt<C>) {
    switch (op) {
      case v1::NEG:
        return Map1<D>(in, out, n, [](C x) { return C(Unsigned<C>(0) - Unsigned<C>(x)); });
      case v1::ABS:
        return Map1<D>(in, out, n,
                       [](C x) { return x < 0 ? C(Unsigned<C>(0) - Unsigned<C>(x)) : x; });
      case v1::SIGN: return Map1<D>(in, out, n, [](C x) { return C((x > 0) - (x < 0)); });
      case v1::NOT: return Map1<D>(in, out, n, [](C x) { return C(~x); });
      default: return;
    }
  } else {
    if (op == v1::NOT) Map1<D>(in, out, n, [](C x) { return !x; });
  }
}

// Integer power by squaring; a negative exponent gives 0 except for bases 1
// and -1 (XLA's semantics).
template <typename C>
C IntPow(C base, C exp) {
  if constexpr (std::is_signed_v<C>) {
    if (exp < 0) return base == 1 ? C(1) : base == -1 ? ((exp & 1) ? C(-1) : C(1)) : C(0);
  }
  Unsigned<C> result = 1, b = Unsigned<C>(base);
  Unsigned<C> e = Unsigned<C>(exp);
  while (e) {
    if (e & 1) result *= b;
    b *= b;
    e >>= 1;
  }
  return C(result);
}

template <v1::DType D>
[[gnu::always_inline]] inline void Binary(v1::Op op, const void* a, const void* b, void* out,
                                          int64_t n) {
  using C = typename Traits<D>::C;
  if constexpr (kIsFloat<C>) {
    switch (op) {
      case v1::ADD: return Map2<D>(a, b, out, n, [](C x, C y) { return x + y; });
      case v1::SUB: return Map2<D>(a, b, out, n, [](C x, C y) { return x - y; });
      case v1::MUL: return Map2<D>(a, b, out, n, [](C x, C y) { return x * y; });
      case v1::DIV: return Map2<D>(a, b, out, n, [](C x, C y) { return x / y; });
      case v1::REM: return Map2<D>(a, b, out, n, [](C x, C y) { return std::fmod(x, y); });
      case v1::POW: return Map2<D>(a, b, out, n, [](C x, C y) { return std::pow(x, y); });
      case v1::MAX: return Map2<D>(a, b, out, n, [](C x, C y) { return Max(x, y); });
      case v1::MIN: return Map2<D>(a, b, out, n, [](C x, C y) { return Min(x, y); });
      case v1::ATAN2: return Map2<D>(a, b, out, n, [](C x, C y) { return std::atan2(x, y); });
      default: return;
    }
  } else if constexpr (kIsInt<C>) {
    using U = Unsigned<C>;
    switch (op) {
      case v1::ADD: return Map2<D>(a, b, out, n, [](C x, C y) { return C(U(x) + U(y)); });
      case v1::SUB: return Map2<D>(a, b, out, n, [](C x, C y) { return C(U(x) - U(y)); });
      case v1::MUL: return Map2<D>(a, b, out, n, [](C x, C y) { return C(U(x) * U(y)); });
      // Division by zero gives -1 (all ones) and x % 0 gives x, as in XLA;
      // MIN / -1 wraps instead of trapping.
      case v1::DIV:
        return Map2<D>(a, b, out, n, [](C x, C y) {
          if (y == 0) return C(-1);
          if constexpr (std::is_signed_v<C>) {
            if (y == -1) return C(U(0) - U(x));
          }
          return C(x / y);
        });
      case v1::REM:
        return Map2<D>(a, b, out, n, [](C x, C y) {
          if (y == 0) return x;
          if constexpr (std::is_signed_v<C>) {
            if (y == -1) return C(0);
          }
          return C(x % y);
        });
      case v1::POW: return Map2<D>(a, b, out, n, [](C x, C y) { return IntPow(x, y); });
      case v1::MAX: return Map2<D>(a, b, out, n, [](C x, C y) { return Max(x, y); });
      case v1::MIN: return Map2<D>(a, b, out, n, [](C x, C y) { return Min(x, y); });
      case v1::AND: return Map2<D>(a, b, out, n, [](C x, C y) { return C(x & y); });
      case v1::OR: return Map2<D>(a, b, out, n, [](C x, C y) { return C(x | y); });
      case v1::XOR: return Map2<D>(a, b, out, n, [](C x, C y) { return C(x ^ y); });
      default: return;
    }
  } else {
    switch (op) {
      case v1::AND: return Map2<D>(a, b, out, n, [](C x, C y) { return x && y; });
      case v1::OR: return Map2<D>(a, b, out, n, [](C x, C y) { return x || y; });
      case v1::XOR: return Map2<D>(a, b, out, n, [](C x, C y) { return x != y; });
      default: return;
    }
  }
}

template <v1::DType D, typename F>
void CompareLoop(const void* a, const void* b, void* out, int64_t n, F f) {
  using T = Traits<D>;
  auto* x = static_cast<const typename T::S*>(a);
  auto* y = static_cast<const typename T::S*>(b);
  auto* o = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < n; ++i) o[i] = f(T::Load(x[i]), T::Load(y[i]));
}

template <v1::DType D>
[[gnu::always_inline]] inline void Compare(v1::CompareDirection dir, const void* a, const void* b,
                                           void* out, int64_t n) {
  using C = typename Traits<D>::C;
  switch (dir) {
    case v1::EQ: return CompareLoop<D>(a, b, out, n, [](C x, C y) { return x == y; });
    case v1::NE: return CompareLoop<D>(a, b, out, n, [](C x, C y) { return x != y; });
    case v1::LT: return CompareLoop<D>(a, b, out, n, [](C x, C y) { return x < y; });
    case v1::LE: return CompareLoop<D>(a, b, out, n, [](C x, C y) { return x <= y; });
    case v1::GT: return CompareLoop<D>(a, b, out, n, [](C x, C y) { return x > y; });
    case v1::GE: return CompareLoop<D>(a, b, out, n, [](C x, C y) { return x >= y; });
    default: return;
  }
}

template <v1::DType From, v1::DType To>
void ConvertLoop(const void* in, void* out, int64_t n) {
  using F = Traits<From>;
  using T = Traits<To>;
  auto* a = static_cast<const typename F::S*>(in);
  auto* o = static_cast<typename T::S*>(out);
  for (int64_t i = 0; i < n; ++i) {
    o[i] = StoreConverted<To>(F::Load(a[i]));
  }
}

template <v1::DType From>
void ConvertFrom(v1::DType to, const void* in, void* out, int64_t n) {
  TESSEL_DISPATCH(to, To, ConvertLoop<From, To>(in, out, n));
}

// One instantiation per (dtype, op): the op is a constant, so the inlined
// switch folds away and each entry is a bare loop.
template <v1::DType D, int O>
void UnaryAt(const void* in, void* out, int64_t n) {
  Unary<D>(v1::Op(O), in, out, n);
}
template <v1::DType D, int O>
void BinaryAt(const void* a, const void* b, void* out, int64_t n) {
  Binary<D>(v1::Op(O), a, b, out, n);
}
template <v1::DType D, int O>
void CompareAt(const void* a, const void* b, void* out, int64_t n) {
  Compare<D>(v1::CompareDirection(O), a, b, out, n);
}

// The entry for `key` in [First, Last] of dtype `dt`'s table, built once
// per dtype from `Entry::template At<D, K>`; nullptr outside the range.
template <typename Fn, int First, int Last, typename Entry>
Fn KernelFor(int key, v1::DType dt) {
  if (key < First || key > Last) return nullptr;
  Fn f = nullptr;
  TESSEL_DISPATCH(dt, D, {
    static constexpr auto table = []<int... I>(std::integer_sequence<int, I...>) {
      return std::array<Fn, sizeof...(I)>{&Entry::template At<D, First + I>...};
    }
    (std::make_integer_sequence<int, Last - First + 1>());
    f = table[key - First];
  });
  return f;
}
struct UnaryEntry {
  template <v1::DType D, int O>
  static void At(const void* in, void* out, int64_t n) {
    UnaryAt<D, O>(in, out, n);
  }
};
struct BinaryEntry {
  template <v1::DType D, int O>
  static void At(const void* a, const void* b, void* out, int64_t n) {
    BinaryAt<D, O>(a, b, out, n);
  }
};
struct CompareEntry {
  template <v1::DType D, int O>
  static void At(const void* a, const void* b, void* out, int64_t n) {
    CompareAt<D, O>(a, b, out, n);
  }
};

}  // namespace

UnaryFn UnaryKernelFor(v1::Op op, v1::DType dt) {
  return KernelFor<UnaryFn, v1::NEG, v1::NOT, UnaryEntry>(op, dt);
}

BinaryFn BinaryKernelFor(v1::Op op, v1::DType dt) {
  return KernelFor<BinaryFn, v1::ADD, v1::XOR, BinaryEntry>(op, dt);
}

BinaryFn CompareKernelFor(v1::CompareDirection dir, v1::DType dt) {
  return KernelFor<BinaryFn, v1::EQ, v1::GE, CompareEntry>(dir, dt);
}

void UnaryKernel(v1::Op op, v1::DType dt, const void* in, void* out, int64_t n) {
  TESSEL_DISPATCH(dt, D, Unary<D>(op, in, out, n));
}

void BinaryKernel(v1::Op op, v1::DType dt, const void* a, const void* b, void* out, int64_t n) {
  TESSEL_DISPATCH(dt, D, Binary<D>(op, a, b, out, n));
}

void CompareKernel(v1::CompareDirection dir, v1::DType dt, const void* a, const void* b, void* out,
                   int64_t n) {
  TESSEL_DISPATCH(dt, D, Compare<D>(dir, a, b, out, n));
}

void SelectKernel(v1::DType dt, const void* pred, const void* a, const void* b, void* out,
                  int64_t n) {
  auto* p = static_cast<const uint8_t*>(pred);
  TESSEL_DISPATCH(dt, D, {
    using S = typename Traits<D>::S;
    auto* x = static_cast<const S*>(a);
    auto* y = static_cast<const S*>(b);
    auto* o = static_cast<S*>(out);
    for (int64_t i = 0; i < n; ++i) o[i] = p[i] ? x[i] : y[i];
  });
}

void ClampKernel(v1::DType dt, const void* lo, const void* x, const void* hi, void* out,
                 int64_t n) {
  TESSEL_DISPATCH(dt, D, {
    using T = Traits<D>;
    using S = typename T::S;
    auto* l = static_cast<const S*>(lo);
    auto* v = static_cast<const S*>(x);
    auto* h = static_cast<const S*>(hi);
    auto* o = static_cast<S*>(out);
    for (int64_t i = 0; i < n; ++i) {
      o[i] = T::Store(Min(Max(T::Load(v[i]), T::Load(l[i])), T::Load(h[i])));
    }
  });
}

void ConvertKernel(v1::DType from, v1::DType to, const void* in, void* out, int64_t n) {
  TESSEL_DISPATCH(from, From, ConvertFrom<From>(to, in, out, n));
}

void FillKernel(v1::DType dt, const v1::Fill& value, void* out, int64_t n) {
  TESSEL_DISPATCH(dt, D, {
    using T = Traits<D>;
    typename T::S s = value.value_case() == v1::Fill::kI ? StoreConverted<D>(value.i())
                                                         : StoreConverted<D>(value.f());
    auto* o = static_cast<typename T::S*>(out);
    for (int64_t i = 0; i < n; ++i) o[i] = s;
  });
}

void IotaKernel(v1::DType dt, const google::protobuf::RepeatedField<int64_t>& dims,
                int64_t dimension, int64_t start, void* out, int64_t n) {
  int64_t inner = 1;
  for (int i = dimension + 1; i < dims.size(); ++i) inner *= dims[i];
  const int64_t extent = dims[dimension];
  if (extent <= 0 || inner <= 0) return;  // an empty shape has no element to write
  TESSEL_DISPATCH(dt, D, {
    using T = Traits<D>;
    auto* o = static_cast<typename T::S*>(out);
    for (int64_t i = 0; i < n; ++i) {
      o[i] = StoreConverted<D>(int64_t(((start + i) / inner) % extent));
    }
  });
}

void SplatKernel(int esize, const void* src, void* out, int64_t n) {
  auto* o = static_cast<char*>(out);
  switch (esize) {
    case 1: std::memset(out, *static_cast<const uint8_t*>(src), n); return;
    case 2: {
      uint16_t v;
      std::memcpy(&v, src, 2);
      std::fill_n(reinterpret_cast<uint16_t*>(o), n, v);
      return;
    }
    case 4: {
      uint32_t v;
      std::memcpy(&v, src, 4);
      std::fill_n(reinterpret_cast<uint32_t*>(o), n, v);
      return;
    }
    case 8: {
      uint64_t v;
      std::memcpy(&v, src, 8);
      std::fill_n(reinterpret_cast<uint64_t*>(o), n, v);
      return;
    }
  }
}

}  // namespace tessel::cpu
