#include "worker/cuda/kernel_dtypes.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/dtype.h"
#include "worker/scalar_expr.h"

namespace tessel::cuda {

using absl::StrCat;

bool IsHalf(v1::DType dt) { return dt == v1::F16 || dt == v1::BF16; }

// The C name of an integer dtype.
std::string IntName(v1::DType dt) {
  switch (dt) {
    case v1::S8: return "i8";
    case v1::S16: return "i16";
    case v1::S32: return "i32";
    case v1::S64: return "i64";
    case v1::U16: return "u16";
    case v1::U32: return "u32";
    case v1::U64: return "u64";
    default: return "u8";
  }
}

std::string Storage(v1::DType dt) {
  switch (dt) {
    case v1::F32: return "float";
    case v1::F64: return "double";
    case v1::F16:
    case v1::BF16: return "u16";
    case v1::PRED: return "u8";
    default: return IntName(dt);
  }
}

std::string Compute(v1::DType dt) {
  switch (dt) {
    case v1::F32:
    case v1::F16:
    case v1::BF16: return "float";
    case v1::F64: return "double";
    case v1::PRED: return "bool";
    default: return IntName(dt);
  }
}

// The unsigned type integer arithmetic on `dt` wraps in: at least 32 bits,
// since narrower unsigned operands are promoted to int and could overflow.
std::string UnsignedOf(v1::DType dt) { return DTypeSize(dt) == 8 ? "u64" : "u32"; }

// Raw bytes of one element, for data movement.
std::string Bits(int esize) {
  switch (esize) {
    case 1: return "u8";
    case 2: return "u16";
    case 4: return "u32";
    default: return "u64";
  }
}

std::string HalfName(v1::DType dt) { return dt == v1::F16 ? "f16" : "bf16"; }

std::string Load(v1::DType dt, const std::string& e) {
  if (IsHalf(dt)) return StrCat("ld_", HalfName(dt), "(", e, ")");
  if (dt == v1::PRED) return StrCat("(", e, " != 0)");
  return e;
}

std::string Store(v1::DType dt, const std::string& e) {
  if (IsHalf(dt)) return StrCat("st_", HalfName(dt), "(", e, ")");
  return StrCat("(", Storage(dt), ")(", e, ")");
}

// A computed value as its storage would hold it (f16/bf16 round after every op).
std::string Round(v1::DType dt, const std::string& e) {
  return IsHalf(dt) ? Load(dt, Store(dt, e)) : e;
}

// A float math function for the compute type: expf for float, exp for double.
std::string Fn(v1::DType dt, const std::string& name) {
  return worker::MathFunction(dt == v1::F64 ? v1::F64 : v1::F32, name);
}

// The lowest and highest value of an integer dtype, as literals.
std::pair<std::string, std::string> IntRange(v1::DType dt) {
  switch (dt) {
    case v1::S8: return {"(i8)-128", "(i8)127"};
    case v1::S16: return {"(i16)-32768", "(i16)32767"};
    case v1::S32: return {"(i32)(-2147483647 - 1)", "(i32)2147483647"};
    case v1::S64: return {"(i64)(-9223372036854775807ll - 1)", "(i64)9223372036854775807ll"};
    case v1::U16: return {"(u16)0", "(u16)65535"};
    case v1::U32: return {"(u32)0", "(u32)4294967295u"};
    case v1::U64: return {"(u64)0", "(u64)18446744073709551615ull"};
    default: return {"(u8)0", "(u8)255"};
  }
}

// A compute value of `from` as a compute value of `to`, rounding as the CPU backend does.
std::string Convert(v1::DType from, v1::DType to, const std::string& e) {
  if (IsHalf(to)) {
    std::string f;
    if (from == v1::F64)
      f = StrCat("odd_f(", e, ")");
    else if (from == v1::U64)
      f = StrCat("odd_f(odd_m((u64)(", e, "), false))");
    else if (IsInteger(from) && DTypeSize(from) >= 4)
      f = StrCat("odd_f(odd_d((i64)(", e, ")))");
    else
      f = StrCat("(float)(", e, ")");
    return Round(to, f);
  }
  if (to == v1::PRED) return StrCat("((", e, ") != 0)");
  if (IsFloat(from) && IsInteger(to)) {
    const auto [lo, hi] = IntRange(to);
    return StrCat("sat<", Compute(to), ", ", Compute(from), ">(", e, ", ", lo, ", ", hi, ")");
  }
  return StrCat("(", Compute(to), ")(", e, ")");
}

// A compute value of `from` with its storage bits read as `to` (as wide:
// validated), through the unsigned integer of that width.
std::string Bitcast(v1::DType from, v1::DType to, const std::string& e) {
  const std::string bits = Bits(int(DTypeSize(to)));
  std::string b;
  switch (from) {
    case v1::F32: b = StrCat("f2u(", e, ")"); break;
    case v1::F64: b = StrCat("d2u(", e, ")"); break;
    case v1::F16:
    case v1::BF16: b = StrCat("bits_", HalfName(from), "(", e, ")"); break;
    default: b = StrCat("(", Bits(int(DTypeSize(from))), ")(", e, ")"); break;
  }
  switch (to) {
    case v1::F32: return StrCat("u2f(", b, ")");
    case v1::F64: return StrCat("u2d(", b, ")");
    case v1::F16:
    case v1::BF16: return Load(to, StrCat("(u16)(", b, ")"));
    default:
      return StrCat("(", Compute(to), ")(", bits, ")(", b, ")");  // pred: refused by its shape rule
  }
}

// One element of storage bytes as a compute-typed literal.
std::string Literal(v1::DType dt, const void* bytes) {
  uint64_t v = 0;
  std::memcpy(&v, bytes, DTypeSize(dt));
  switch (dt) {
    case v1::F32: return absl::StrFormat("u2f(0x%08xu)", uint32_t(v));
    case v1::F64: return absl::StrFormat("u2d(0x%016xull)", v);
    case v1::F16:
    case v1::BF16: return Load(dt, absl::StrFormat("(u16)0x%04x", uint16_t(v)));
    case v1::S32: return absl::StrFormat("(i32)0x%08xu", uint32_t(v));
    case v1::S64: return absl::StrFormat("(i64)0x%016xull", v);
    case v1::U64: return absl::StrFormat("(u64)0x%016xull", v);
    case v1::S8:
    case v1::S16:
    case v1::U16:
    case v1::U32: return absl::StrFormat("(%s)0x%xu", IntName(dt), v);
    case v1::PRED: return v ? "true" : "false";
    default: return absl::StrFormat("(u8)%u", unsigned(v & 0xff));
  }
}

}  // namespace tessel::cuda
