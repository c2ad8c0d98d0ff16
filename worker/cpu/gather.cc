#include "worker/cpu/gather.h"

#include <cstring>
#include <type_traits>

#include "core/dtype.h"
#include "worker/cpu/traits.h"

namespace tessel::cpu {
namespace {

int64_t IndexAt(v1::DType dt, const void* indices, int64_t j) {
  switch (dt) {
    case v1::S32: return static_cast<const int32_t*>(indices)[j];
    case v1::S64: return static_cast<const int64_t*>(indices)[j];
    case v1::U8: return static_cast<const uint8_t*>(indices)[j];
    case v1::S8: return static_cast<const int8_t*>(indices)[j];
    case v1::S16: return static_cast<const int16_t*>(indices)[j];
    case v1::U16: return static_cast<const uint16_t*>(indices)[j];
    case v1::U32: return static_cast<const uint32_t*>(indices)[j];
    case v1::U64: {  // past int64 is out of range all the same
      const uint64_t v = static_cast<const uint64_t*>(indices)[j];
      return v > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(v);
    }
    default: return 0;  // validation admits integer indices only
  }
}

// The operand as [batch, outer, extent, inner] around `axis` (inner in
// elements), the indices as [batch, count].
struct Around {
  int64_t batch = 1, outer = 1, extent = 0, inner = 1, count = 1;
};

Around AroundAxis(const v1::TensorType& t, const v1::TensorType& indices_type, int64_t axis,
                  int64_t batch_dims) {
  Around a;
  for (int d = 0; d < batch_dims; ++d) a.batch *= t.dims(d);
  for (int d = int(batch_dims); d < axis; ++d) a.outer *= t.dims(d);
  for (int d = int(axis) + 1; d < t.dims_size(); ++d) a.inner *= t.dims(d);
  a.extent = t.dims(int(axis));
  for (int d = int(batch_dims); d < indices_type.dims_size(); ++d) a.count *= indices_type.dims(d);
  return a;
}

template <v1::DType D>
void Combine(v1::ReduceKind k, const void* src, void* dst, int64_t n) {
  using T = Traits<D>;
  using C = typename T::C;
  auto* u = static_cast<const typename T::S*>(src);
  auto* o = static_cast<typename T::S*>(dst);
  for (int64_t e = 0; e < n; ++e) {
    const C x = T::Load(o[e]), y = T::Load(u[e]);
    C r;
    if constexpr (kIsInt<C>) {  // integers wrap, as the elementwise ops
      using U = WrapUnsigned<C>;
      if (k == v1::SUM)
        r = C(U(x) + U(y));
      else if (k == v1::PROD)
        r = C(U(x) * U(y));
      else
        r = k == v1::REDUCE_MAX ? Max(x, y) : Min(x, y);
    } else if constexpr (kIsBool<C>) {
      r = k == v1::REDUCE_MAX ? (x || y) : (x && y);
    } else {
      if (k == v1::SUM)
        r = x + y;
      else if (k == v1::PROD)
        r = x * y;
      else
        r = k == v1::REDUCE_MAX ? Max(x, y) : Min(x, y);
    }
    o[e] = T::Store(r);
  }
}

}  // namespace

void Gather(const v1::TensorType& operand_type, const void* operand,
            const v1::TensorType& indices_type, const void* indices, const v1::GatherAttrs& attrs,
            void* out) {
  const Around a = AroundAxis(operand_type, indices_type, attrs.axis(), attrs.batch_dims());
  const int64_t row = a.inner * DTypeSize(operand_type.dtype());
  const char* src = static_cast<const char*>(operand);
  char* dst = static_cast<char*>(out);
  if (a.extent == 0 || row == 0)
    return;  // no slices to pick (validation: then no indices either, or empty rows)
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t o = 0; o < a.outer; ++o) {
      const int64_t slab = b * a.outer + o;
      for (int64_t j = 0; j < a.count; ++j) {
        int64_t i = IndexAt(indices_type.dtype(), indices, b * a.count + j);
        i = i < 0 ? 0 : i >= a.extent ? a.extent - 1 : i;
        std::memcpy(dst + (slab * a.count + j) * row, src + (slab * a.extent + i) * row, row);
      }
    }
  }
}

void Scatter(const v1::TensorType& operand_type, const void* operand,
             const v1::TensorType& indices_type, const void* indices, const void* updates,
             const v1::ScatterAttrs& attrs, void* out) {
  const Around a = AroundAxis(operand_type, indices_type, attrs.axis(), attrs.batch_dims());
  const int64_t esize = DTypeSize(operand_type.dtype()), row = a.inner * esize;
  if (out != operand) std::memcpy(out, operand, a.batch * a.outer * a.extent * row);
  const char* upd = static_cast<const char*>(updates);
  char* dst = static_cast<char*>(out);
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t o = 0; o < a.outer; ++o) {
      const int64_t slab = b * a.outer + o;
      for (int64_t j = 0; j < a.count; ++j) {
        const int64_t i = IndexAt(indices_type.dtype(), indices, b * a.count + j);
        if (i < 0 || i >= a.extent) continue;
        const char* u = upd + (slab * a.count + j) * row;
        char* d = dst + (slab * a.extent + i) * row;
        if (attrs.combine() == v1::REDUCE_INVALID) {
          std::memcpy(d, u, row);
        } else {
          TESSEL_DISPATCH(operand_type.dtype(), D, Combine<D>(attrs.combine(), u, d, a.inner));
        }
      }
    }
  }
}

}  // namespace tessel::cpu
