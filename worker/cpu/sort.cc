#include "worker/cpu/sort.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/dtype.h"
#include "worker/cpu/traits.h"

namespace tessel::cpu {
namespace {

// Whether key a goes before key b: ascending with NaN last, or descending
// with NaN first. Equal keys (and -0.0 with 0.0) go neither way, so a
// stable sort keeps their order.
template <typename C>
bool Before(C a, C b, bool descending) {
  if constexpr (kIsFloat<C>) {
    const bool a_nan = a != a, b_nan = b != b;
    if (a_nan || b_nan) return descending ? a_nan && !b_nan : !a_nan && b_nan;
  }
  return descending ? b < a : a < b;
}

template <v1::DType D>
void SortTyped(const v1::TensorType& keys_type, const void* keys_data, int esize,
               const void* src_data, const v1::SortAttrs& a, void* out_data) {
  using T = Traits<D>;
  using C = typename T::C;
  const auto* keys = static_cast<const typename T::S*>(keys_data);
  const char* src = static_cast<const char*>(src_data);
  char* out = static_cast<char*>(out_data);
  const int dim = int(a.dimension());
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= keys_type.dims(d);
  for (int d = dim + 1; d < keys_type.dims_size(); ++d) inner *= keys_type.dims(d);
  const int64_t extent = keys_type.dims(dim);
  std::vector<int64_t> order(extent);
  std::vector<C> row(extent);
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t j = 0; j < inner; ++j) {
      const int64_t base = o * extent * inner + j;
      for (int64_t e = 0; e < extent; ++e) row[e] = T::Load(keys[base + e * inner]);
      std::iota(order.begin(), order.end(), int64_t{0});
      std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
        return Before<C>(row[x], row[y], a.descending());
      });
      for (int64_t e = 0; e < extent; ++e) {
        std::memcpy(out + (base + e * inner) * esize, src + (base + order[e] * inner) * esize,
                    esize);
      }
    }
  }
}

}  // namespace

void Sort(const v1::TensorType& keys_type, const void* keys, const v1::TensorType& result_type,
          const void* result_source, const v1::SortAttrs& a, void* result) {
  const int esize = DTypeSize(result_type.dtype());
  TESSEL_DISPATCH(keys_type.dtype(), D,
                  SortTyped<D>(keys_type, keys, esize, result_source, a, result));
}

}  // namespace tessel::cpu
