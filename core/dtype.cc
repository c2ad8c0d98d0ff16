#include "core/dtype.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessel {

int DTypeSize(v1::DType t) {
  switch (t) {
    case v1::F32: return 4;
    case v1::F64: return 8;
    case v1::F16: return 2;
    case v1::BF16: return 2;
    case v1::S32: return 4;
    case v1::S64: return 8;
    case v1::U8: return 1;
    case v1::PRED: return 1;
    case v1::S8: return 1;
    case v1::S16: return 2;
    case v1::U16: return 2;
    case v1::U32: return 4;
    case v1::U64: return 8;
    default: return 0;
  }
}

absl::string_view DTypeName(v1::DType t) {
  switch (t) {
    case v1::F32: return "f32";
    case v1::F64: return "f64";
    case v1::F16: return "f16";
    case v1::BF16: return "bf16";
    case v1::S32: return "s32";
    case v1::S64: return "s64";
    case v1::U8: return "u8";
    case v1::PRED: return "pred";
    case v1::S8: return "s8";
    case v1::S16: return "s16";
    case v1::U16: return "u16";
    case v1::U32: return "u32";
    case v1::U64: return "u64";
    default: return "invalid";
  }
}

absl::StatusOr<v1::DType> ParseDType(absl::string_view name) {
  for (v1::DType t : kAllDTypes) {
    if (DTypeName(t) == name) return t;
  }
  std::vector<absl::string_view> names;
  for (v1::DType t : kAllDTypes) names.push_back(DTypeName(t));
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "': expected one of ", absl::StrJoin(names, ", ")));
}

bool IsFloat(v1::DType t) { return t == v1::F32 || t == v1::F64 || t == v1::F16 || t == v1::BF16; }
bool IsInteger(v1::DType t) {
  switch (t) {
    case v1::S8:
    case v1::S16:
    case v1::S32:
    case v1::S64:
    case v1::U8:
    case v1::U16:
    case v1::U32:
    case v1::U64: return true;
    default: return false;
  }
}
bool IsSigned(v1::DType t) {
  return IsFloat(t) || t == v1::S8 || t == v1::S16 || t == v1::S32 || t == v1::S64;
}

std::string DimsString(const google::protobuf::RepeatedField<int64_t>& dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ","), "]");
}

std::string TypeString(const v1::TensorType& t) {
  return absl::StrCat(DTypeName(t.dtype()), DimsString(t.dims()));
}

absl::StatusOr<int64_t> NumElements(const v1::TensorType& t) {
  int64_t n = 1;
  for (int i = 0; i < t.dims_size(); ++i) {
    int64_t d = t.dims(i);
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat("dimension ", i, " of ", TypeString(t),
                                                     " is negative: expected >= 0, got ", d));
    }
    if (d != 0 && n > INT64_MAX / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("type ", TypeString(t), " overflows: more than 2^63 elements"));
    }
    n *= d;
  }
  return n;
}

absl::StatusOr<int64_t> ByteSize(const v1::TensorType& t) {
  if (DTypeSize(t.dtype()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("type ", TypeString(t), " has no valid dtype"));
  }
  auto n = NumElements(t);
  if (!n.ok()) return n.status();
  int64_t size = DTypeSize(t.dtype());
  if (*n > INT64_MAX / size) {
    return absl::InvalidArgumentError(
        absl::StrCat("type ", TypeString(t), " overflows 2^63 bytes"));
  }
  return *n * size;
}

int64_t NumElementsUnchecked(const v1::TensorType& t) {
  int64_t n = 1;
  for (int64_t d : t.dims()) n *= d;
  return n;
}
int64_t ByteSizeUnchecked(const v1::TensorType& t) {
  return NumElementsUnchecked(t) * DTypeSize(t.dtype());
}

bool SameType(const v1::TensorType& a, const v1::TensorType& b) {
  if (a.dtype() != b.dtype() || a.dims_size() != b.dims_size()) return false;
  for (int i = 0; i < a.dims_size(); ++i) {
    if (a.dims(i) != b.dims(i)) return false;
  }
  return true;
}

v1::TensorType MakeType(v1::DType dtype, std::initializer_list<int64_t> dims) {
  v1::TensorType t;
  t.set_dtype(dtype);
  for (int64_t d : dims) t.add_dims(d);
  return t;
}

std::string OpName(v1::Op op) { return absl::AsciiStrToLower(v1::Op_Name(op)); }

}  // namespace tessel
