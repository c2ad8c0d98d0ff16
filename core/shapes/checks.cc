#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/shapes/shape_rules.h"
#include "core/status.h"

namespace tessel::shapes {

std::string Dims(const std::vector<int64_t>& d) { return StrCat("[", absl::StrJoin(d, ","), "]"); }

TensorType Make(v1::DType dt, const std::vector<int64_t>& dims) {
  TensorType t;
  t.set_dtype(dt);
  for (int64_t d : dims) t.add_dims(d);
  return t;
}

absl::Status CheckArity(size_t have, size_t want) {
  if (have != want) {
    return InvalidArgumentError(
        StrCat("expected ", want, " operand", want == 1 ? "" : "s", ", got ", have));
  }
  return absl::OkStatus();
}

absl::Status CheckAttrs(const v1::Node& n, v1::Node::AttrsCase want, absl::string_view name) {
  if (n.attrs_case() != want)
    return InvalidArgumentError(StrCat("missing attributes '", name, "'"));
  return absl::OkStatus();
}

namespace {

bool AdmitsDType(Admits a, v1::DType t) {
  switch (a) {
    case Admits::kAny: return true;
    case Admits::kNumeric: return !IsPred(t);
    case Admits::kSigned: return IsSigned(t);
    case Admits::kFloat: return IsFloat(t);
    case Admits::kIntOrPred: return IsInteger(t) || IsPred(t);
    case Admits::kFloatOrInt: return IsFloat(t) || IsInteger(t);
  }
  return false;
}

absl::string_view AdmitsName(Admits a) {
  switch (a) {
    case Admits::kAny: return "any dtype";
    case Admits::kNumeric: return "a numeric dtype (not pred)";
    case Admits::kSigned: return "a signed dtype (f32, f64, f16, bf16, s8, s16, s32, s64)";
    case Admits::kFloat: return "a floating dtype (f32, f64, f16, bf16)";
    case Admits::kIntOrPred:
      return "an integer or pred dtype (s8, s16, s32, s64, u8, u16, u32, u64, pred)";
    case Admits::kFloatOrInt: return "a numeric dtype (not pred)";
  }
  return "";
}

}  // namespace

absl::Status CheckDType(absl::string_view what, Admits a, const TensorType& t) {
  if (!AdmitsDType(a, t.dtype())) {
    return InvalidArgumentError(
        StrCat(what, ": expected ", AdmitsName(a), ", got ", TypeString(t)));
  }
  return absl::OkStatus();
}

absl::Status CheckDimIndex(absl::string_view what, int64_t d, int64_t rank) {
  if (d < 0 || d >= rank) {
    return InvalidArgumentError(StrCat(what, " ", d, " out of range: expected 0 <= dim < ", rank));
  }
  return absl::OkStatus();
}

absl::Status CheckUniqueDims(absl::string_view what, const std::vector<int64_t>& dims,
                             int64_t rank) {
  std::set<int64_t> seen;
  for (int64_t d : dims) {
    TESSEL_RETURN_IF_ERROR(CheckDimIndex(what, d, rank));
    if (!seen.insert(d).second) {
      return InvalidArgumentError(StrCat(what, " ", Dims(dims), " names dimension ", d, " twice"));
    }
  }
  return absl::OkStatus();
}

}  // namespace tessel::shapes
