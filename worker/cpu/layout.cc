#include "worker/cpu/layout.h"

#include <cstring>

#include "core/dtype.h"
#include "worker/cpu/elementwise.h"

namespace tessel::cpu {
namespace {

template <int E>
void RowCopy(const char* src, int64_t ss, char* dst, int64_t ds, int64_t n) {
  if (ss == 1 && ds == 1) {
    std::memcpy(dst, src, n * E);
    return;
  }
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * ds * E, src + i * ss * E, E);
}

}  // namespace

std::vector<int64_t> RowMajorStrides(const google::protobuf::RepeatedField<int64_t>& dims) {
  std::vector<int64_t> s(dims.size());
  int64_t acc = 1;
  for (int i = dims.size() - 1; i >= 0; --i) {
    s[i] = acc;
    acc *= dims[i];
  }
  return s;
}

void CopyStrided(int esize, const std::vector<int64_t>& dims, const char* src,
                 const std::vector<int64_t>& src_strides, char* dst,
                 const std::vector<int64_t>& dst_strides) {
  const int rank = dims.size();
  for (int64_t d : dims) {
    if (d == 0) return;
  }
  if (rank == 0) {
    std::memcpy(dst, src, esize);
    return;
  }
  const int64_t inner = dims[rank - 1];
  const int64_t ss = src_strides[rank - 1], ds = dst_strides[rank - 1];
  std::vector<int64_t> idx(rank, 0);
  int64_t so = 0, dof = 0;  // element offsets of the current row
  while (true) {
    const char* s = src + so * esize;
    char* d = dst + dof * esize;
    switch (esize) {
      case 1: RowCopy<1>(s, ss, d, ds, inner); break;
      case 2: RowCopy<2>(s, ss, d, ds, inner); break;
      case 4: RowCopy<4>(s, ss, d, ds, inner); break;
      default: RowCopy<8>(s, ss, d, ds, inner); break;
    }
    int k = rank - 2;
    for (; k >= 0; --k) {
      if (++idx[k] < dims[k]) {
        so += src_strides[k];
        dof += dst_strides[k];
        break;
      }
      so -= src_strides[k] * (dims[k] - 1);
      dof -= dst_strides[k] * (dims[k] - 1);
      idx[k] = 0;
    }
    if (k < 0) return;
  }
}

void Transpose(const v1::TensorType& in_type, const void* in, const v1::TransposeAttrs& a,
               const v1::TensorType& out_type, void* out) {
  std::vector<int64_t> in_strides = RowMajorStrides(in_type.dims());
  std::vector<int64_t> src_strides;
  for (int64_t p : a.permutation()) src_strides.push_back(in_strides[p]);
  CopyStrided(DTypeSize(in_type.dtype()),
              std::vector<int64_t>(out_type.dims().begin(), out_type.dims().end()),
              static_cast<const char*>(in), src_strides, static_cast<char*>(out),
              RowMajorStrides(out_type.dims()));
}

void Slice(const v1::TensorType& in_type, const void* in, const v1::SliceAttrs& a,
           const v1::TensorType& out_type, void* out) {
  const int esize = DTypeSize(in_type.dtype());
  std::vector<int64_t> in_strides = RowMajorStrides(in_type.dims());
  std::vector<int64_t> src_strides(in_strides.size());
  int64_t base = 0;
  for (size_t i = 0; i < in_strides.size(); ++i) {
    int64_t stride = a.strides().empty() ? 1 : a.strides(i);
    src_strides[i] = in_strides[i] * stride;
    base += a.start(i) * in_strides[i];
  }
  CopyStrided(esize, std::vector<int64_t>(out_type.dims().begin(), out_type.dims().end()),
              static_cast<const char*>(in) + base * esize, src_strides, static_cast<char*>(out),
              RowMajorStrides(out_type.dims()));
}

void Reverse(const v1::TensorType& type, const void* in, const v1::ReverseAttrs& a, void* out) {
  const int esize = DTypeSize(type.dtype());
  const std::vector<int64_t> strides = RowMajorStrides(type.dims());
  std::vector<int64_t> src_strides = strides;
  int64_t base = 0;  // the source element of the first result element
  for (int64_t d : a.dimensions()) {
    if (type.dims(d) == 0) return;
    src_strides[d] = -strides[d];
    base += (type.dims(d) - 1) * strides[d];
  }
  CopyStrided(esize, std::vector<int64_t>(type.dims().begin(), type.dims().end()),
              static_cast<const char*>(in) + base * esize, src_strides, static_cast<char*>(out),
              strides);
}

void BroadcastInDim(const v1::TensorType& in_type, const void* in, const v1::BroadcastInDimAttrs& a,
                    const v1::TensorType& out_type, void* out) {
  std::vector<int64_t> in_strides = RowMajorStrides(in_type.dims());
  std::vector<int64_t> src_strides(out_type.dims_size(), 0);
  for (int i = 0; i < a.broadcast_dimensions_size(); ++i) {
    if (in_type.dims(i) != 1) src_strides[a.broadcast_dimensions(i)] = in_strides[i];
  }
  CopyStrided(DTypeSize(in_type.dtype()),
              std::vector<int64_t>(out_type.dims().begin(), out_type.dims().end()),
              static_cast<const char*>(in), src_strides, static_cast<char*>(out),
              RowMajorStrides(out_type.dims()));
}

void Concatenate(const std::vector<const v1::TensorType*>& in_types,
                 const std::vector<const void*>& ins, int64_t dimension,
                 const v1::TensorType& out_type, void* out) {
  const int esize = DTypeSize(out_type.dtype());
  std::vector<int64_t> out_strides = RowMajorStrides(out_type.dims());
  int64_t offset = 0;
  for (size_t i = 0; i < ins.size(); ++i) {
    const v1::TensorType& t = *in_types[i];
    CopyStrided(esize, std::vector<int64_t>(t.dims().begin(), t.dims().end()),
                static_cast<const char*>(ins[i]), RowMajorStrides(t.dims()),
                static_cast<char*>(out) + offset * out_strides[dimension] * esize, out_strides);
    offset += t.dims(dimension);
  }
}

void Pad(const v1::TensorType& in_type, const void* in, const void* pad_value,
         const v1::PadAttrs& a, const v1::TensorType& out_type, void* out) {
  const int esize = DTypeSize(in_type.dtype());
  const int rank = in_type.dims_size();
  SplatKernel(esize, pad_value, out, NumElementsUnchecked(out_type));
  std::vector<int64_t> in_strides = RowMajorStrides(in_type.dims());
  std::vector<int64_t> out_strides = RowMajorStrides(out_type.dims());
  std::vector<int64_t> count(rank), src_strides(rank), dst_strides(rank);
  int64_t src_base = 0, dst_base = 0;
  for (int i = 0; i < rank; ++i) {
    const int64_t step = 1 + (a.interior().empty() ? 0 : a.interior(i));
    const int64_t lo = a.low(i), d = in_type.dims(i), od = out_type.dims(i);
    // Operand element j lands at lo + j*step; keep those inside [0, od).
    int64_t first = lo >= 0 ? 0 : (-lo + step - 1) / step;
    int64_t last = d - 1;  // inclusive
    if (od <= 0) {
      count[i] = 0;
    } else {
      int64_t max_j = (od - 1 - lo) < 0 ? -1 : (od - 1 - lo) / step;
      last = std::min(last, max_j);
      count[i] = std::max<int64_t>(0, last - first + 1);
    }
    src_base += first * in_strides[i];
    dst_base += (lo + first * step) * out_strides[i];
    src_strides[i] = in_strides[i];
    dst_strides[i] = out_strides[i] * step;
  }
  CopyStrided(esize, count, static_cast<const char*>(in) + src_base * esize, src_strides,
              static_cast<char*>(out) + dst_base * esize, dst_strides);
}

}  // namespace tessel::cpu
