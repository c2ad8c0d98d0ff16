#include "worker/cpu/reduce.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "worker/cpu/layout.h"
#include "worker/cpu/traits.h"

namespace tessel::cpu {
namespace {

// Accumulator type: floats in at least float, integers in 64-bit unsigned
// (sum and product are modular, so truncating at the end equals wrapping).
template <typename C>
using Acc = std::conditional_t<kIsFloat<C>, C, std::conditional_t<kIsBool<C>, bool, uint64_t>>;

template <typename C, typename A>
A Identity(v1::ReduceKind k) {
  switch (k) {
    case v1::SUM: return A(0);
    case v1::PROD: return A(1);
    case v1::REDUCE_MAX:
      if constexpr (kIsFloat<C>)
        return -std::numeric_limits<C>::infinity();
      else
        return A(std::numeric_limits<C>::lowest());
    default:
      if constexpr (kIsFloat<C>)
        return std::numeric_limits<C>::infinity();
      else
        return A(std::numeric_limits<C>::max());
  }
}

template <typename C, typename A>
inline A Combine(v1::ReduceKind k, A acc, C x) {
  switch (k) {
    case v1::SUM: return acc + A(x);
    case v1::PROD: return acc * A(x);
    case v1::REDUCE_MAX:
      if constexpr (kIsFloat<C>)
        return Max<A>(acc, x);
      else
        return A(Max<C>(C(acc), x));
    default:
      if constexpr (kIsFloat<C>)
        return Min<A>(acc, x);
      else
        return A(Min<C>(C(acc), x));
  }
}

// dst[j] = dst[j] (k) src[j] over a row, the reduction's kind fixed
// outside the loop so that the loop vectorizes.
template <typename T, typename C, typename A>
void CombineRow(v1::ReduceKind k, A* dst, const typename T::S* src, int64_t n) {
  switch (k) {
    case v1::SUM:
      for (int64_t j = 0; j < n; ++j) dst[j] = Combine<C, A>(v1::SUM, dst[j], T::Load(src[j]));
      break;
    case v1::PROD:
      for (int64_t j = 0; j < n; ++j) dst[j] = Combine<C, A>(v1::PROD, dst[j], T::Load(src[j]));
      break;
    case v1::REDUCE_MAX:
      for (int64_t j = 0; j < n; ++j)
        dst[j] = Combine<C, A>(v1::REDUCE_MAX, dst[j], T::Load(src[j]));
      break;
    default:
      for (int64_t j = 0; j < n; ++j)
        dst[j] = Combine<C, A>(v1::REDUCE_MIN, dst[j], T::Load(src[j]));
  }
}

// Pairwise (cascade) summation of a contiguous run, as numpy sums: the
// rounding error grows as O(log n) ulps instead of O(n). Runs of up to 128
// are summed with 8 interleaved accumulators (which also vectorize).
template <typename T, typename A>
A PairwiseSum(const typename T::S* src, int64_t n) {
  if (n < 8) {
    A r = A(0);
    for (int64_t i = 0; i < n; ++i) r += A(T::Load(src[i]));
    return r;
  }
  if (n <= 128) {
    if constexpr (std::is_same_v<typename T::S, float> && std::is_same_v<A, float>) {
      // The same eight lanes in one vector register, for compilers that
      // would not keep the array below in one.
      typedef float V8 __attribute__((vector_size(32)));
      V8 v;
      std::memcpy(&v, src, sizeof(V8));
      int64_t i = 8;
      for (; i + 8 <= n; i += 8) {
        V8 x;
        std::memcpy(&x, src + i, sizeof(V8));
        v += x;
      }
      A res = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
      for (; i < n; ++i) res += src[i];
      return res;
    }
    A r[8];
    for (int j = 0; j < 8; ++j) r[j] = A(T::Load(src[j]));
    int64_t i = 8;
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j) r[j] += A(T::Load(src[i + j]));
    }
    A res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += A(T::Load(src[i]));
    return res;
  }
  int64_t half = n / 2;
  half -= half % 8;
  return PairwiseSum<T, A>(src, half) + PairwiseSum<T, A>(src + half, n - half);
}

template <v1::DType D>
void ReduceTyped(const v1::TensorType& in_type, const void* in_v, const v1::ReduceAttrs& a,
                 const v1::TensorType& out_type, void* out_v) {
  using T = Traits<D>;
  using C = typename T::C;
  using A = Acc<C>;
  const auto* in = static_cast<const typename T::S*>(in_v);
  auto* out = static_cast<typename T::S*>(out_v);
  const v1::ReduceKind k = a.kind();
  const int rank = in_type.dims_size();
  const int64_t out_n = NumElementsUnchecked(out_type);
  std::vector<A> acc(out_n, Identity<C, A>(k));
  const int64_t in_n = NumElementsUnchecked(in_type);
  if (in_n > 0) {
    // Stride of each input dimension in the output (0 where reduced).
    std::vector<bool> reduced(rank, false);
    for (int64_t d : a.dims()) reduced[d] = true;
    std::vector<int64_t> ostride(rank, 0);
    int64_t s = 1;
    for (int i = rank - 1; i >= 0; --i) {
      if (!reduced[i]) {
        ostride[i] = s;
        s *= in_type.dims(i);
      }
    }
    const int64_t inner = rank == 0 ? 1 : in_type.dims(rank - 1);
    const bool inner_reduced = rank > 0 && reduced[rank - 1];
    std::vector<int64_t> idx(rank, 0);
    int64_t obase = 0;
    for (int64_t row = 0; row < in_n / inner; ++row) {
      const auto* src = in + row * inner;
      if (inner_reduced) {
        bool pairwise = false;
        if constexpr (kIsFloat<C>) pairwise = k == v1::SUM;
        if (pairwise) {
          acc[obase] += PairwiseSum<T, A>(src, inner);
        } else {
          A r = acc[obase];
          for (int64_t j = 0; j < inner; ++j) r = Combine<C, A>(k, r, T::Load(src[j]));
          acc[obase] = r;
        }
      } else {
        CombineRow<T, C, A>(k, acc.data() + obase, src, inner);
      }
      for (int d = rank - 2; d >= 0; --d) {
        if (++idx[d] < in_type.dims(d)) {
          obase += ostride[d];
          break;
        }
        obase -= ostride[d] * (in_type.dims(d) - 1);
        idx[d] = 0;
      }
    }
  }
  for (int64_t i = 0; i < out_n; ++i) out[i] = T::Store(C(acc[i]));
}

template <v1::DType D, typename I>
void ArgTyped(bool is_max, const v1::TensorType& in_type, const void* in_v, int64_t dim,
              void* out_v) {
  using T = Traits<D>;
  using C = typename T::C;
  const auto* in = static_cast<const typename T::S*>(in_v);
  auto* out = static_cast<I*>(out_v);
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; ++i) outer *= in_type.dims(i);
  for (int i = dim + 1; i < in_type.dims_size(); ++i) inner *= in_type.dims(i);
  const int64_t extent = in_type.dims(dim);
  std::vector<C> best(inner);
  for (int64_t o = 0; o < outer; ++o) {
    const auto* base = in + o * extent * inner;
    I* idx = out + o * inner;
    for (int64_t j = 0; j < inner; ++j) {
      best[j] = T::Load(base[j]);
      idx[j] = 0;
    }
    for (int64_t e = 1; e < extent; ++e) {
      for (int64_t j = 0; j < inner; ++j) {
        C v = T::Load(base[e * inner + j]);
        C b = best[j];
        bool take;
        if constexpr (kIsFloat<C>) {
          take = b == b && (v != v || (is_max ? v > b : v < b));
        } else {
          take = is_max ? v > b : v < b;
        }
        if (take) {
          best[j] = v;
          idx[j] = I(e);
        }
      }
    }
  }
}

}  // namespace

void Reduce(const v1::TensorType& in_type, const void* in, const v1::ReduceAttrs& a,
            const v1::TensorType& out_type, void* out) {
  TESSEL_DISPATCH(in_type.dtype(), D, {
    if constexpr (D != v1::PRED) ReduceTyped<D>(in_type, in, a, out_type, out);
  });
}

void ArgReduce(bool is_max, const v1::TensorType& in_type, const void* in,
               const v1::ArgReduceAttrs& a, const v1::TensorType& out_type, void* out) {
  TESSEL_DISPATCH(in_type.dtype(), D, {
    if constexpr (D != v1::PRED) {
      if (out_type.dtype() == v1::S64) {
        ArgTyped<D, int64_t>(is_max, in_type, in, a.dimension(), out);
      } else {
        ArgTyped<D, int32_t>(is_max, in_type, in, a.dimension(), out);
      }
    }
  });
}

}  // namespace tessel::cpu
