// Elementwise ops: one layout for all (the most split operand's), one
// batching rule, and each op's derivative written once, as the product of
// a cotangent or tangent with the partial derivative, which reverse and
// forward mode both use.
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/sharding.h"
#include "scheduler/ops/op_rules.h"

namespace tessel::scheduler::ops {
namespace {

using absl::StrCat;

// Ops a partial sum passes through unchanged: sum_d f(x_d) is f(sum_d x_d)
// in floating point too. Not a conversion: a narrower float overflows on a
// device whose part is large where the sum fits (and a wider one need not
// overflow where the narrow sum does).
bool IsLinearUnary(const v1::Node& n) { return n.op() == v1::NEG; }

void LayoutElementwise(const LayoutQuery& q, Layout& l) {
  const v1::Node& n = q.node;
  const int rank = n.type().dims_size();
  int best = -1, best_split = -1;
  for (int i = 0; i < n.operands_size(); ++i) {
    if (q.generated[i]) continue;
    int split = 0;
    for (const auto& d : q.current[i].dims()) split += d.axes_size() > 0;
    if (split > best_split) best = i, best_split = split;
  }
  v1::Sharding t = best >= 0 ? Complete(q.current[best]) : Replicated(rank);
  std::optional<v1::Sharding> partial;
  auto all_partial_same = [&] {
    for (int i = 0; i < n.operands_size(); ++i) {
      const v1::Sharding& c = q.current[i];
      if (q.generated[i] || !IsPartial(c) || c.partial_kind() != v1::SUM) return false;
      if (PartialAxes(c) != PartialAxes(q.current[0])) return false;
    }
    return true;
  };
  if ((n.op() == v1::ADD || n.op() == v1::SUB) && all_partial_same()) {
    partial = q.current[0];
  } else if (n.operands_size() == 1 && IsLinearUnary(n) && IsPartial(q.current[0]) &&
             q.current[0].partial_kind() == v1::SUM) {
    partial = q.current[0];
  }
  // Not through MUL or DIV: sum_d(x_d * y) is (sum_d x_d) * y only for a
  // finite y (a device whose x_d is 0 meets an infinite y with NaN, where
  // the complete sum would give an infinity).
  if (partial) {
    for (const std::string& a : partial->partial()) t.add_partial(a);
  }
  for (int i = 0; i < n.operands_size(); ++i) {
    l.want[i] = t;
    if (IsPartial(t) && !IsPartial(q.current[i])) l.want[i] = Complete(t);
    if (q.types[i]->dims_size() != rank)
      l.want[i] = Replicated(q.types[i]->dims_size());  // clamp's scalar bounds
  }
  l.result = t;
}

absl::StatusOr<std::string> BatchElementwise(Batching& b, const v1::Node& n) {
  const std::vector<int64_t> dims = Dims(n.type());
  std::vector<std::string> ops;
  for (const std::string& o : n.operands()) ops.push_back(b.BatchedTo(o, dims));
  return b.Emit(n, std::move(ops));
}

// d op(x)/dx of the trigonometric, hyperbolic and special unary ops, as
// nodes of `e` (x the operand, y = op(x)); empty for every other op.
std::string ElementaryDerivative(Emitter& e, v1::Op op, const std::string& x,
                                 const std::string& y) {
  auto one = [&] { return e.Like(x, 1.0); };
  auto sq = [&](const std::string& v) { return e.Binary(v1::MUL, v, v); };
  switch (op) {
    case v1::SIN: return e.Unary(v1::COS, x);
    case v1::COS: return e.Unary(v1::NEG, e.Unary(v1::SIN, x));
    case v1::TAN: return e.Binary(v1::ADD, one(), sq(y));
    case v1::ASIN: return e.Unary(v1::RSQRT, e.Binary(v1::SUB, one(), sq(x)));
    case v1::ACOS: return e.Unary(v1::NEG, e.Unary(v1::RSQRT, e.Binary(v1::SUB, one(), sq(x))));
    case v1::ATAN: return e.Binary(v1::DIV, one(), e.Binary(v1::ADD, one(), sq(x)));
    case v1::SINH: return e.Unary(v1::COSH, x);
    case v1::COSH: return e.Unary(v1::SINH, x);
    case v1::ASINH: return e.Unary(v1::RSQRT, e.Binary(v1::ADD, sq(x), one()));
    case v1::ACOSH: return e.Unary(v1::RSQRT, e.Binary(v1::SUB, sq(x), one()));
    case v1::ATANH: return e.Binary(v1::DIV, one(), e.Binary(v1::SUB, one(), sq(x)));
    case v1::EXPM1: return e.Binary(v1::ADD, y, one());
    case v1::ERF:  // 2/sqrt(pi) exp(-x^2)
      return e.Binary(v1::MUL, e.Like(x, 1.1283791670955126),
                      e.Unary(v1::EXP, e.Unary(v1::NEG, sq(x))));
    default: return "";
  }
}

// `by` times d out / d operand k: the share of a cotangent `by` of the
// result that operand k takes, and the tangent of the result that a
// tangent `by` of operand k contributes (the partial derivative is a
// scalar). `a`: the operands' forward values; `out`: the result's.
std::string Scaled(Emitter& e, v1::Op op, int k, const std::vector<std::string>& a,
                   const std::string& out, const std::string& by) {
  auto one = [&] { return e.Like(by, 1.0); };
  auto mul = [&](const std::string& x) { return e.Binary(v1::MUL, by, x); };
  if (a.size() == 1 && op >= v1::SIN && op <= v1::ERF)
    return mul(ElementaryDerivative(e, op, a[0], out));
  switch (op) {
    case v1::ATAN2: {  // d atan2(y, x) = (x dy - y dx) / (x^2 + y^2)
      const std::string r2 =
          e.Binary(v1::ADD, e.Binary(v1::MUL, a[1], a[1]), e.Binary(v1::MUL, a[0], a[0]));
      return mul(k == 0 ? e.Binary(v1::DIV, a[1], r2)
                        : e.Unary(v1::NEG, e.Binary(v1::DIV, a[0], r2)));
    }
    case v1::ADD: return by;
    case v1::SUB: return k == 0 ? by : e.Unary(v1::NEG, by);
    case v1::MUL: return mul(a[1 - k]);
    case v1::DIV:
      return k == 0 ? e.Binary(v1::DIV, by, a[1])
                    : e.Unary(v1::NEG, e.Binary(v1::DIV, e.Binary(v1::MUL, by, out), a[1]));
    case v1::NEG: return e.Unary(v1::NEG, by);
    case v1::ABS: return mul(e.Unary(v1::SIGN, a[0]));
    case v1::EXP: return mul(out);
    case v1::LOG: return e.Binary(v1::DIV, by, a[0]);
    case v1::LOG1P: return e.Binary(v1::DIV, by, e.Binary(v1::ADD, a[0], one()));
    case v1::TANH: return mul(e.Binary(v1::SUB, one(), e.Binary(v1::MUL, out, out)));
    case v1::CBRT:
      return mul(
          e.Binary(v1::DIV, e.Like(by, 1.0 / 3.0), e.Binary(v1::MUL, out, out)));  // 1 / (3 y^2)
    case v1::LOGISTIC: return mul(e.Binary(v1::MUL, out, e.Binary(v1::SUB, one(), out)));
    case v1::SQRT: return e.Binary(v1::DIV, e.Binary(v1::MUL, by, e.Like(by, 0.5)), out);
    case v1::RSQRT:
      return mul(
          e.Binary(v1::DIV, e.Binary(v1::MUL, out, e.Like(by, -0.5)), a[0]));  // -x^-1/2 / (2x)
    case v1::POW: {
      // As JAX: d/dx is 0 where y is 0; d/dy is 0 where x is 0.
      const std::string zero = e.Like(by, 0.0);
      if (k == 0) {
        const std::string dx =
            e.Binary(v1::MUL, a[1], e.Binary(v1::POW, a[0], e.Binary(v1::SUB, a[1], one())));
        return mul(e.Select(e.Compare(v1::EQ, a[1], zero), zero, dx));
      }
      const std::string safe_x = e.Select(e.Compare(v1::EQ, a[0], zero), one(), a[0]);
      return mul(e.Binary(v1::MUL, out, e.Unary(v1::LOG, safe_x)));
    }
    case v1::MAX:
    case v1::MIN: {
      // As JAX: the operand equal to the result takes it; a tie splits it.
      const std::string zero = e.Like(by, 0.0), half = e.Like(by, 0.5);
      const std::string &x = a[k], &other = a[1 - k];
      return mul(e.Select(e.Compare(v1::EQ, x, out),
                          e.Select(e.Compare(v1::EQ, other, out), half, one()), zero));
    }
    case v1::REM: {  // x - y * trunc(x / y)
      if (k == 0) return by;
      const std::string q = e.Binary(v1::DIV, a[0], a[1]);
      const std::string trunc =
          e.Binary(v1::MUL, e.Unary(v1::SIGN, q), e.Unary(v1::FLOOR, e.Unary(v1::ABS, q)));
      return e.Unary(v1::NEG, mul(trunc));
    }
    default: return "";
  }
}

std::vector<std::string> Operands(ReverseMode& m, const v1::Node& n) {
  std::vector<std::string> a;
  for (int k = 0; k < n.operands_size(); ++k) a.push_back(m.Operand(n, k));
  return a;
}

absl::Status VjpSmooth(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  const std::vector<std::string> a = Operands(m, n);
  const std::string out = m.Result(n);
  for (int k = 0; k < n.operands_size(); ++k) m.Into(n, k, Scaled(m.e(), n.op(), k, a, out, ct));
  return absl::OkStatus();
}

absl::StatusOr<std::string> JvpSmooth(ForwardMode& m, const v1::Node& n) {
  std::vector<std::string> a;
  for (int k = 0; k < n.operands_size(); ++k) a.push_back(m.Operand(n, k));
  const std::string out = m.Result(n);
  std::string sum;
  for (int k = 0; k < n.operands_size(); ++k) {
    const std::string t = m.Tangent(n, k);
    if (t.empty()) continue;
    const std::string term = Scaled(m.e(), n.op(), k, a, out, t);
    sum = sum.empty() ? term : m.e().Binary(v1::ADD, sum, term);
  }
  return sum;
}

absl::Status VjpSelect(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  Emitter& e = m.e();
  const std::string p = m.Operand(n, 0), zero = e.Like(ct, 0.0);
  m.Into(n, 1, e.Select(p, ct, zero));
  m.Into(n, 2, e.Select(p, zero, ct));
  return absl::OkStatus();
}

absl::StatusOr<std::string> JvpSelect(ForwardMode& m, const v1::Node& n) {
  if (m.Tangent(n, 1).empty() && m.Tangent(n, 2).empty()) return std::string();
  return m.e().Select(m.Operand(n, 0), m.TangentOrZeros(n, 1), m.TangentOrZeros(n, 2));
}

// clamp(lo, x, hi), as JAX: x inside (lo, hi) takes the derivative; a
// bound takes it where x is past it (lo where it is below hi). The bounds
// may be scalars.
struct ClampMasks {
  std::string x, lo, hi, inside, at_lo, at_hi;
};
ClampMasks Masks(Emitter& e, const std::string& lo0, const std::string& x, const std::string& hi0) {
  auto like_x = [&](const std::string& v) {
    return e.type(v).dims_size() == e.type(x).dims_size() ? v : e.Broadcast(v, Dims(e.type(x)), {});
  };
  ClampMasks c{x, like_x(lo0), like_x(hi0), "", "", ""};
  c.inside = e.Binary(v1::AND, e.Compare(v1::GT, x, c.lo), e.Compare(v1::LT, x, c.hi));
  c.at_lo = e.Binary(v1::AND, e.Compare(v1::GT, c.lo, x), e.Compare(v1::LT, c.lo, c.hi));
  c.at_hi = e.Compare(v1::LT, c.hi, x);
  return c;
}

absl::Status VjpClamp(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  Emitter& e = m.e();
  const std::string x = m.Operand(n, 1);
  const ClampMasks c = Masks(e, m.Operand(n, 0), x, m.Operand(n, 2));
  const std::string zero = e.Like(ct, 0.0);
  m.Into(n, 1, e.Select(c.inside, ct, zero));
  auto bound = [&](int k, const std::string& mask) {
    const std::string g = e.Select(mask, ct, zero);
    m.Into(n, k, e.type(m.Operand(n, k)).dims_size() == e.type(x).dims_size() ? g : e.SumAll(g));
  };
  bound(0, c.at_lo);
  bound(2, c.at_hi);
  return absl::OkStatus();
}

absl::StatusOr<std::string> JvpClamp(ForwardMode& m, const v1::Node& n) {
  Emitter& e = m.e();
  const std::string x = m.Operand(n, 1), zero = e.Like(m.Result(n), 0.0);
  const ClampMasks c = Masks(e, m.Operand(n, 0), x, m.Operand(n, 2));
  auto like_x = [&](const std::string& v) {
    return e.type(v).dims_size() == e.type(x).dims_size() ? v : e.Broadcast(v, Dims(e.type(x)), {});
  };
  std::string r;
  auto add = [&](const std::string& mask, const std::string& t) {
    if (t.empty()) return;
    const std::string term = e.Select(mask, like_x(t), zero);
    r = r.empty() ? term : e.Binary(v1::ADD, r, term);
  };
  add(c.inside, m.Tangent(n, 1));
  add(c.at_lo, m.Tangent(n, 0));
  add(c.at_hi, m.Tangent(n, 2));
  return r;
}

// A bitcast's derivative is zero (JAX's): no cotangent, no tangent.
absl::Status VjpConvert(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  const v1::DType from = m.OperandType(n, 0).dtype();
  if (IsFloat(from) && !n.convert().bitcast()) m.Into(n, 0, m.e().Convert(ct, from));
  return absl::OkStatus();
}

absl::StatusOr<std::string> JvpConvert(ForwardMode& m, const v1::Node& n) {
  if (!IsFloat(m.OperandType(n, 0).dtype()) || n.convert().bitcast()) return std::string();
  return m.Same(n, {m.Tangent(n, 0)});
}

}  // namespace

void ElementwiseRows(Rows& rows) {
  const OpRules base{.layout = LayoutElementwise, .batch = BatchElementwise};
  auto add = [&](v1::Op op, VjpRule vjp, JvpRule jvp) {
    OpRules r = base;
    r.vjp = vjp;
    r.jvp = jvp;
    rows.emplace_back(op, r);
  };
  for (v1::Op op :
       {v1::ADD,   v1::SUB,   v1::MUL,      v1::DIV,   v1::NEG,   v1::ABS,   v1::EXP,  v1::LOG,
        v1::LOG1P, v1::TANH,  v1::LOGISTIC, v1::SQRT,  v1::RSQRT, v1::POW,   v1::MAX,  v1::MIN,
        v1::REM,   v1::ATAN2, v1::SIN,      v1::COS,   v1::TAN,   v1::ASIN,  v1::ACOS, v1::ATAN,
        v1::SINH,  v1::COSH,  v1::ASINH,    v1::ACOSH, v1::ATANH, v1::EXPM1, v1::ERF,  v1::CBRT}) {
    add(op, VjpSmooth, JvpSmooth);
  }
  // Piecewise constant: no cotangent or tangent flows.
  for (v1::Op op : {v1::SIGN, v1::FLOOR, v1::CEIL, v1::ROUND, v1::COMPARE})
    add(op, NoCotangent, NoTangent);
  // Integers and predicates only: never differentiated.
  for (v1::Op op : {v1::NOT, v1::AND, v1::OR, v1::XOR}) add(op, nullptr, nullptr);
  add(v1::SELECT, VjpSelect, JvpSelect);
  add(v1::CLAMP, VjpClamp, JvpClamp);
  add(v1::CONVERT, VjpConvert, JvpConvert);
}

}  // namespace tessel::scheduler::ops
