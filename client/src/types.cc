#include "tessel/types.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/src/convert_internal.h"
#include "core/dtype.h"

namespace tessel {

int DTypeBytes(DType t) { return DTypeSize(ToProto(t)); }
std::string DTypeString(DType t) { return std::string(DTypeName(ToProto(t))); }
absl::StatusOr<DType> DTypeFromString(const std::string& name) {
  auto t = ParseDType(name);
  if (!t.ok()) return t.status();
  return FromProto(*t);
}

int64_t ArrayType::elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}
int64_t ArrayType::bytes() const { return elements() * DTypeBytes(dtype); }
std::string ArrayType::ToString() const {
  return absl::StrCat(DTypeString(dtype), "[", absl::StrJoin(dims, ","), "]");
}

}  // namespace tessel
