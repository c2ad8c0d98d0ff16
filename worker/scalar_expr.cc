#include "worker/scalar_expr.h"

#include <cctype>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"

namespace tessel::worker {

namespace {

using C = ScalarClass;

constexpr ScalarRule kRules[] = {
    // Floats: libm, as the interpreter calls it.
    {v1::NEG, C::kFloat, 1, "(-$0)"},
    {v1::ABS, C::kFloat, 1, "@fabs($0)"},
    {v1::EXP, C::kFloat, 1, "@exp($0)"},
    {v1::EXPM1, C::kFloat, 1, "@expm1($0)"},
    {v1::LOG, C::kFloat, 1, "@log($0)"},
    {v1::LOG1P, C::kFloat, 1, "@log1p($0)"},
    {v1::TANH, C::kFloat, 1, "@tanh($0)"},
    {v1::LOGISTIC, C::kFloat, 1, "(($T)1 / (($T)1 + @exp(-$0)))"},
    {v1::SQRT, C::kFloat, 1, "@sqrt($0)"},
    {v1::RSQRT, C::kFloat, 1, "(($T)1 / @sqrt($0))"},
    {v1::FLOOR, C::kFloat, 1, "@floor($0)"},
    {v1::CEIL, C::kFloat, 1, "@ceil($0)"},
    {v1::ROUND, C::kFloat, 1, "@round($0)"},
    {v1::SIN, C::kFloat, 1, "@sin($0)"},
    {v1::COS, C::kFloat, 1, "@cos($0)"},
    {v1::TAN, C::kFloat, 1, "@tan($0)"},
    {v1::ASIN, C::kFloat, 1, "@asin($0)"},
    {v1::ACOS, C::kFloat, 1, "@acos($0)"},
    {v1::ATAN, C::kFloat, 1, "@atan($0)"},
    {v1::SINH, C::kFloat, 1, "@sinh($0)"},
    {v1::COSH, C::kFloat, 1, "@cosh($0)"},
    {v1::ASINH, C::kFloat, 1, "@asinh($0)"},
    {v1::ACOSH, C::kFloat, 1, "@acosh($0)"},
    {v1::ATANH, C::kFloat, 1, "@atanh($0)"},
    {v1::ERF, C::kFloat, 1, "@erf($0)"},
    {v1::CBRT, C::kFloat, 1, "@cbrt($0)"},
    {v1::SIGN, C::kFloat, 1, "($0 != $0 ? $0 : $0 > 0 ? ($T)1 : $0 < 0 ? ($T)-1 : $0)"},
    {v1::ADD, C::kFloat, 2, "($0 + $1)"},
    {v1::SUB, C::kFloat, 2, "($0 - $1)"},
    {v1::MUL, C::kFloat, 2, "($0 * $1)"},
    {v1::DIV, C::kFloat, 2, "($0 / $1)"},
    {v1::REM, C::kFloat, 2, "@fmod($0, $1)"},
    {v1::POW, C::kFloat, 2, "@pow($0, $1)"},
    {v1::ATAN2, C::kFloat, 2, "@atan2($0, $1)"},
    {v1::MAX, C::kFloat, 2, "#max($0, $1)"},
    {v1::MIN, C::kFloat, 2, "#min($0, $1)"},
    {v1::CLAMP, C::kFloat, 3, "#min(#max($1, $0), $2)"},
    // Integers wrap: computed in the unsigned type of their width.
    {v1::NEG, C::kSigned, 1, "(($T)(($U)0 - ($U)$0))"},
    {v1::NEG, C::kUnsigned, 1, "(($T)(($U)0 - ($U)$0))"},
    {v1::ABS, C::kSigned, 1, "($0 < 0 ? ($T)(($U)0 - ($U)$0) : $0)"},
    {v1::ABS, C::kUnsigned, 1, "$0"},
    {v1::SIGN, C::kSigned, 1, "(($T)(($0 > 0) - ($0 < 0)))"},
    {v1::SIGN, C::kUnsigned, 1, "(($T)($0 > 0))"},
    {v1::NOT, C::kSigned, 1, "(($T)~$0)"},
    {v1::NOT, C::kUnsigned, 1, "(($T)~$0)"},
    {v1::ADD, C::kSigned, 2, "(($T)(($U)$0 + ($U)$1))"},
    {v1::ADD, C::kUnsigned, 2, "(($T)(($U)$0 + ($U)$1))"},
    {v1::SUB, C::kSigned, 2, "(($T)(($U)$0 - ($U)$1))"},
    {v1::SUB, C::kUnsigned, 2, "(($T)(($U)$0 - ($U)$1))"},
    // 1u first: a product of narrow unsigned values is computed unsigned,
    // never in the int C promotes them to (65535 * 65535 overflows int).
    {v1::MUL, C::kSigned, 2, "(($T)(1u * ($U)$0 * ($U)$1))"},
    {v1::MUL, C::kUnsigned, 2, "(($T)(1u * ($U)$0 * ($U)$1))"},
    // x / 0 is -1 and x % 0 is x, as in XLA; MIN / -1 wraps, MIN % -1 is 0.
    {v1::DIV, C::kSigned, 2,
     "($1 == 0 ? ($T)-1 : $1 == -1 ? ($T)(($U)0 - ($U)$0) : ($T)($0 / $1))"},
    {v1::DIV, C::kUnsigned, 2, "($1 == 0 ? ($T)-1 : ($T)($0 / $1))"},
    {v1::REM, C::kSigned, 2, "($1 == 0 ? $0 : $1 == -1 ? ($T)0 : ($T)($0 % $1))"},
    {v1::REM, C::kUnsigned, 2, "($1 == 0 ? $0 : ($T)($0 % $1))"},
    {v1::POW, C::kSigned, 2, "#ipow($0, $1)"},
    {v1::POW, C::kUnsigned, 2, "#ipow($0, $1)"},
    {v1::MAX, C::kSigned, 2, "#max($0, $1)"},
    {v1::MAX, C::kUnsigned, 2, "#max($0, $1)"},
    {v1::MIN, C::kSigned, 2, "#min($0, $1)"},
    {v1::MIN, C::kUnsigned, 2, "#min($0, $1)"},
    {v1::CLAMP, C::kSigned, 3, "#min(#max($1, $0), $2)"},
    {v1::CLAMP, C::kUnsigned, 3, "#min(#max($1, $0), $2)"},
    {v1::AND, C::kSigned, 2, "(($T)($0 & $1))"},
    {v1::AND, C::kUnsigned, 2, "(($T)($0 & $1))"},
    {v1::OR, C::kSigned, 2, "(($T)($0 | $1))"},
    {v1::OR, C::kUnsigned, 2, "(($T)($0 | $1))"},
    {v1::XOR, C::kSigned, 2, "(($T)($0 ^ $1))"},
    {v1::XOR, C::kUnsigned, 2, "(($T)($0 ^ $1))"},
    // Preds: computed as 0 or 1.
    {v1::NOT, C::kPred, 1, "(!$0)"},
    {v1::AND, C::kPred, 2, "($0 && $1)"},
    {v1::OR, C::kPred, 2, "($0 || $1)"},
    {v1::XOR, C::kPred, 2, "($0 != $1)"},
};

const char* ClassName(ScalarClass c) {
  switch (c) {
    case C::kFloat: return "float";
    case C::kSigned: return "signed integer";
    case C::kUnsigned: return "unsigned integer";
    default: return "pred";
  }
}

}  // namespace

ScalarClass ClassOf(v1::DType dt) {
  switch (dt) {
    case v1::F16:
    case v1::BF16:
    case v1::F32:
    case v1::F64: return C::kFloat;
    case v1::S8:
    case v1::S16:
    case v1::S32:
    case v1::S64: return C::kSigned;
    case v1::PRED: return C::kPred;
    default: return C::kUnsigned;
  }
}

std::string MathFunction(v1::DType dt, absl::string_view name) {
  if (dt == v1::F64) return std::string(name);
  if (name == "exp" || name == "log" || name == "tanh") return absl::StrCat("tm_", name, "f");
  return absl::StrCat(name, "f");
}

absl::Span<const ScalarRule> ScalarRules() { return kRules; }

absl::StatusOr<std::string> ScalarExpr(v1::Op op, v1::DType dt, absl::Span<const std::string> args,
                                       const ScalarDialect& dialect) {
  const ScalarClass cls = ClassOf(dt);
  const ScalarRule* rule = nullptr;
  for (const ScalarRule& r : kRules) {
    if (r.op == op && r.cls == cls) {
      rule = &r;
      break;
    }
  }
  if (rule == nullptr) {
    return absl::UnimplementedError(absl::StrCat("no scalar expression for ", OpName(op), " on ",
                                                 DTypeName(dt), " (", ClassName(cls), ")"));
  }
  if (int(args.size()) != rule->arity) {
    return absl::InvalidArgumentError(
        absl::StrCat(OpName(op), " takes ", rule->arity, " operands, got ", args.size()));
  }
  std::string out;
  for (const char* p = rule->pattern; *p != '\0'; ++p) {
    if (*p == '$') {
      ++p;
      if (*p == 'T') {
        absl::StrAppend(&out, dialect.compute_type(dt));
      } else if (*p == 'U') {
        absl::StrAppend(&out, dialect.unsigned_type(dt));
      } else {
        absl::StrAppend(&out, args[*p - '0']);
      }
    } else if (*p == '@' || *p == '#') {
      const bool math = *p == '@';
      const char* name = p + 1;
      while (std::isalnum(static_cast<unsigned char>(p[1])) || p[1] == '_') ++p;
      const absl::string_view fn(name, p + 1 - name);
      absl::StrAppend(&out, math ? dialect.math(dt, fn) : dialect.helper(dt, fn));
    } else {
      out.push_back(*p);
    }
  }
  return out;
}

}  // namespace tessel::worker
