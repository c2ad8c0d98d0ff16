// linalg (CHOLESKY, TRIANGULAR_SOLVE, LU, EIGH, QR, SVD): the batch stays
// split, the matrix is gathered; derivatives as JAX's (the
// factorizations' transposed from their tangents; triangular_solve's in
// each operand).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "core/status.h"
#include "scheduler/ops/op_rules.h"

namespace tessel::scheduler::ops {
namespace {

using Dims = std::vector<int64_t>;

Dims Leading(int rank) {  // the batch dimensions
  Dims d(rank - 2);
  for (int i = 0; i < rank - 2; ++i) d[i] = i;
  return d;
}
int RankOf(Emitter& e, const std::string& v) { return e.type(v).dims_size(); }

// The last two dimensions swapped.
std::string Mt(Emitter& e, const std::string& x) {
  const int r = RankOf(e, x);
  Dims perm = Leading(r);
  perm.push_back(r - 1);
  perm.push_back(r - 2);
  return e.Transpose(x, perm);
}

// op(a) op(b) over the batch, op a transpose where asked.
std::string MatMul(Emitter& e, const std::string& a, bool ta, const std::string& b, bool tb) {
  const int r = RankOf(e, a);
  return e.Dot(a, b, Leading(r), Leading(r), {ta ? r - 2 : r - 1}, {tb ? r - 1 : r - 2});
}

// x times a triangular mask: below the diagonal kept (`lower`, else above),
// the diagonal scaled by `diagonal`.
std::string Triangle(Emitter& e, const std::string& x, bool lower, double diagonal) {
  const v1::TensorType t = e.type(x);
  const int r = t.dims_size();
  const std::string row = e.Iota(t, r - 2), col = e.Iota(t, r - 1);
  const std::string off = e.Compare(lower ? v1::GT : v1::LT, row, col);
  const std::string on = e.Compare(v1::EQ, row, col);
  const std::string zero = e.Fill(t, 0);
  const std::string mask =
      e.Select(off, e.Fill(t, 1), diagonal == 0 ? zero : e.Select(on, e.Fill(t, diagonal), zero));
  return e.Binary(v1::MUL, x, mask);
}

std::string Solve(Emitter& e, const std::string& a, const std::string& b, bool left, bool lower,
                  bool transpose, bool unit = false) {
  v1::Node n = e.Op(v1::TRIANGULAR_SOLVE, {a, b});
  v1::LinalgAttrs& x = *n.mutable_linalg();
  x.set_left_side(left);
  x.set_lower(lower);
  x.set_transpose_a(transpose);
  x.set_unit_diagonal(unit);
  return e.Emit(std::move(n), "linalg");
}

// The identity matrix in every matrix of type `t`.
std::string Eye(Emitter& e, const v1::TensorType& t) {
  const int r = t.dims_size();
  return e.Select(e.Compare(v1::EQ, e.Iota(t, r - 2), e.Iota(t, r - 1)), e.Fill(t, 1),
                  e.Fill(t, 0));
}

// Rows [from, to) of the last-but-one dimension.
std::string RowsOf(Emitter& e, const std::string& x, int64_t from, int64_t to) {
  const v1::TensorType t = e.type(x);
  const int r = t.dims_size();
  Dims start(r, 0), limit(t.dims().begin(), t.dims().end()), strides(r, 1);
  start[r - 2] = from;
  limit[r - 2] = to;
  return e.Slice(x, start, limit, strides);
}

std::string ConcatRows(Emitter& e, const std::string& a, const std::string& b) {
  v1::Node n = e.Op(v1::CONCATENATE, {a, b});
  n.mutable_concatenate()->set_dimension(RankOf(e, a) - 2);
  return e.Emit(std::move(n), "linalg");
}

// A row [..., 1, n] as [..., n].
std::string Flat(Emitter& e, const std::string& row) {
  const v1::TensorType t = e.type(row);
  Dims shape(t.dims().begin(), t.dims().end());
  shape.erase(shape.end() - 2);
  return e.Reshape(row, shape);
}
// Broadcast dimensions placing [..., n] along dimension `d` of a rank-`r` matrix.
Dims Along(int r, int d) {
  Dims dims = Leading(r);
  dims.push_back(d);
  return dims;
}

// ---------------------------------------------------------------- layout

// The batch dimensions keep operand 0's split (or b's); the matrix is
// gathered, except the columns of a left-side solve's b (or the rows of a
// right-side one), which are solved independently.
void LayoutLinalg(const LayoutQuery& q, Layout& layout) {
  const int n_ops = int(q.current.size());
  auto axes = [&](int k, int d) {
    return q.generated[k] ? Axes{} : DimAxes(Complete(q.current[k]), d);
  };
  const int rank = q.types[0]->dims_size();
  for (int k = 0; k < n_ops; ++k) layout.want[k] = Replicated(rank);
  layout.result = Replicated(rank);
  for (int d = 0; d + 2 < rank; ++d) {
    Axes a = axes(0, d);
    if (a.empty() && n_ops > 1) a = axes(1, d);
    for (int k = 0; k < n_ops; ++k) SetDimAxes(layout.want[k], d, a);
    SetDimAxes(layout.result, d, a);
  }
  if (q.node.op() != v1::TRIANGULAR_SOLVE) return;
  const int free = q.node.linalg().left_side() ? rank - 1 : rank - 2;
  const Axes f = axes(1, free);
  for (int d = 0; d + 2 < rank; ++d) {
    for (const std::string& x : DimAxes(layout.result, d)) {
      if (std::find(f.begin(), f.end(), x) != f.end()) return;
    }
  }
  SetDimAxes(layout.want[1], free, f);
  SetDimAxes(layout.result, free, f);
}

// ---------------------------------------------------------------- cholesky

// The lower factor L and a tangent or cotangent in L's terms.
std::string LowerFactor(const v1::Node& n, Emitter& e, const std::string& result) {
  return n.linalg().lower() ? result : Mt(e, result);
}

// JAX's rule (Murray 2016): dL = L Φ(L⁻¹ dA L⁻ᵀ), Φ the lower triangle
// with the diagonal halved.
absl::StatusOr<std::string> JvpCholesky(ForwardMode& m, const v1::Node& n) {
  const std::string t = m.Tangent(n, 0);
  if (t.empty()) return std::string();
  Emitter& e = m.e();
  const std::string l = LowerFactor(n, e, m.Result(n));
  const std::string right = Solve(e, l, t, /*left=*/false, /*lower=*/true, /*transpose=*/true);
  const std::string inner = Solve(e, l, right, true, true, false);
  const std::string dl = MatMul(e, l, false, Triangle(e, inner, true, 0.5), false);
  return n.linalg().lower() ? dl : Mt(e, dl);
}

// The transpose of that tangent: dA = L⁻ᵀ Φ(Lᵀ dL) L⁻¹.
absl::Status VjpCholesky(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  if (!m.Active(n, 0)) return absl::OkStatus();
  Emitter& e = m.e();
  const std::string l = LowerFactor(n, e, m.Result(n));
  const std::string cl = n.linalg().lower() ? ct : Mt(e, ct);
  const std::string p = Triangle(e, MatMul(e, l, true, cl, false), true, 0.5);
  const std::string y = Solve(e, l, p, true, true, true);
  m.Into(n, 0, Solve(e, l, y, false, true, false));
  return absl::OkStatus();
}

// ---------------------------------------------------------------- triangular_solve

// a's tangent or cotangent kept to the triangle the solve reads.
std::string ReadTriangle(Emitter& e, const v1::LinalgAttrs& x, const std::string& v) {
  return Triangle(e, v, x.lower(), x.unit_diagonal() ? 0 : 1);
}

// d x = op(a)⁻¹ (db - op(da) x), or (db - x op(da)) op(a)⁻¹ on the right.
absl::StatusOr<std::string> JvpTriangularSolve(ForwardMode& m, const v1::Node& n) {
  const v1::LinalgAttrs& x = n.linalg();
  const std::string ta = m.Tangent(n, 0), tb = m.Tangent(n, 1);
  if (ta.empty() && tb.empty()) return std::string();
  Emitter& e = m.e();
  std::string rhs = tb;
  if (!ta.empty()) {
    std::string d = ReadTriangle(e, x, ta);
    if (x.transpose_a()) d = Mt(e, d);
    const std::string r = m.Result(n);
    const std::string prod =
        x.left_side() ? MatMul(e, d, false, r, false) : MatMul(e, r, false, d, false);
    rhs = rhs.empty() ? e.Unary(v1::NEG, prod) : e.Binary(v1::SUB, rhs, prod);
  }
  return m.Same(n, {m.Operand(n, 0), rhs});
}

// b̄ = op(a)⁻ᵀ x̄ (or x̄ op(a)⁻ᵀ); ā = -b̄ xᵀ (or -xᵀ b̄) back through op,
// kept to the triangle read (JAX's).
absl::Status VjpTriangularSolve(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  const v1::LinalgAttrs& x = n.linalg();
  if (!m.Active(n, 0) && !m.Active(n, 1)) return absl::OkStatus();
  Emitter& e = m.e();
  const std::string a = m.Operand(n, 0);
  const std::string bbar =
      Solve(e, a, ct, x.left_side(), x.lower(), !x.transpose_a(), x.unit_diagonal());
  if (m.Active(n, 1)) m.Into(n, 1, bbar);
  if (m.Active(n, 0)) {
    const std::string r = m.Result(n);
    std::string g =
        x.left_side() ? MatMul(e, bbar, false, r, true) : MatMul(e, r, true, bbar, false);
    if (x.transpose_a()) g = Mt(e, g);
    m.Into(n, 0, e.Unary(v1::NEG, ReadTriangle(e, x, g)));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- lu

// L (unit lower), U and the permutation as a matrix P (P a = L U) of a
// packed LU result.
struct Factors {
  std::string l, u, p;
};

Factors FactorsOf(Emitter& e, const std::string& packed) {
  const v1::TensorType t = e.type(packed);
  const int r = t.dims_size();
  const int64_t size = t.dims(r - 1);
  Factors f;
  const std::string lu = RowsOf(e, packed, 0, size);
  const v1::TensorType mt = e.type(lu);
  const std::string eye = Eye(e, mt);
  f.l = e.Binary(v1::ADD, Triangle(e, lu, true, 0), eye);
  f.u = Triangle(e, lu, false, 1);
  // P[i][j] = 1 where permutation[i] == j.
  const Dims shape(mt.dims().begin(), mt.dims().end());
  const std::string perm =
      e.Broadcast(Flat(e, RowsOf(e, packed, size + 1, size + 2)), shape, Along(r, r - 2));
  const std::string col = e.Convert(e.Iota(mt, r - 1), mt.dtype());
  f.p = e.Select(e.Compare(v1::EQ, perm, col), e.Fill(mt, 1), e.Fill(mt, 0));
  return f;
}

// JAX's rule: with X = L⁻¹ P da U⁻¹, d(LU) = L tril(X, -1) + triu(X) U;
// the pivots and the permutation do not move.
absl::StatusOr<std::string> JvpLu(ForwardMode& m, const v1::Node& n) {
  const std::string t = m.Tangent(n, 0);
  if (t.empty()) return std::string();
  Emitter& e = m.e();
  const Factors f = FactorsOf(e, m.Result(n));
  const std::string la = Solve(e, f.l, MatMul(e, f.p, false, t, false), true, true, false, true);
  const std::string x = Solve(e, f.u, la, false, false, false);
  const std::string d = e.Binary(v1::ADD, MatMul(e, f.l, false, Triangle(e, x, true, 0), false),
                                 MatMul(e, Triangle(e, x, false, 1), false, f.u, false));
  v1::TensorType z = e.type(d);
  z.set_dims(z.dims_size() - 2, 2);
  return ConcatRows(e, d, e.Fill(z, 0));
}

// Its transpose: X̄ = tril(Lᵀ C, -1) + triu(C Uᵀ); da = Pᵀ L⁻ᵀ X̄ U⁻ᵀ.
absl::Status VjpLu(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  if (!m.Active(n, 0)) return absl::OkStatus();
  Emitter& e = m.e();
  const Factors f = FactorsOf(e, m.Result(n));
  const std::string c = RowsOf(e, ct, 0, e.type(f.l).dims(e.type(f.l).dims_size() - 1));
  const std::string xbar = e.Binary(v1::ADD, Triangle(e, MatMul(e, f.l, true, c, false), true, 0),
                                    Triangle(e, MatMul(e, c, false, f.u, true), false, 1));
  const std::string la = Solve(e, f.u, xbar, false, false, true);
  const std::string pa = Solve(e, f.l, la, true, true, true, true);
  m.Into(n, 0, MatMul(e, f.p, true, pa, false));
  return absl::OkStatus();
}

// ---------------------------------------------------------------- eigh

// V, w (as a row [..., 1, n]) and F, with F[i][j] = 1 / (w[j] - w[i]) off
// the diagonal and 0 on it (JAX's Fmat); 0 too where two eigenvalues are
// equal, so that a repeated eigenvalue adds nothing (JAX's gives inf or
// NaN there, and nothing when only the eigenvalues are differentiated).
struct Eigen {
  std::string v, w, f;
};

Eigen EigenOf(Emitter& e, const std::string& packed) {
  const v1::TensorType t = e.type(packed);
  const int r = t.dims_size();
  const int64_t size = t.dims(r - 1);
  Eigen g;
  g.v = RowsOf(e, packed, 0, size);
  g.w = RowsOf(e, packed, size, size + 1);
  const v1::TensorType vt = e.type(g.v);
  const Dims shape(vt.dims().begin(), vt.dims().end());
  const std::string w = Flat(e, g.w);
  const std::string wj = e.Broadcast(w, shape, Along(r, r - 1));  // w[j] across each row
  const std::string wi = e.Broadcast(w, shape, Along(r, r - 2));  // w[i] down each column
  const std::string gap = e.Binary(v1::SUB, wj, wi);
  g.f = e.Select(e.Compare(v1::EQ, wj, wi), e.Fill(vt, 0), e.Binary(v1::DIV, e.Fill(vt, 1), gap));
  return g;
}

std::string Diagonal(Emitter& e, const std::string& m) {  // as a row [..., 1, n]
  const int r = RankOf(e, m);
  // The diagonal kept (a mask with ones on it), then summed down the columns.
  const v1::TensorType t = e.type(m);
  const std::string eye = Eye(e, t);
  const std::string summed = e.Reduce(e.Binary(v1::MUL, m, eye), v1::SUM, {int64_t(r - 2)});
  Dims shape(t.dims().begin(), t.dims().end());
  shape[r - 2] = 1;
  return e.Reshape(summed, shape);
}

// JAX's rule: M = Vᵀ dA V; dV = V (F ∘ M), dw = diag(M).
absl::StatusOr<std::string> JvpEigh(ForwardMode& m, const v1::Node& n) {
  const std::string t = m.Tangent(n, 0);
  if (t.empty()) return std::string();
  Emitter& e = m.e();
  const Eigen g = EigenOf(e, m.Result(n));
  const std::string mid = MatMul(e, MatMul(e, g.v, true, t, false), false, g.v, false);
  const std::string dv = MatMul(e, g.v, false, e.Binary(v1::MUL, g.f, mid), false);
  return ConcatRows(e, dv, Diagonal(e, mid));
}

// Its transpose: dA = V (F ∘ (Vᵀ V̄) + diag(w̄)) Vᵀ.
absl::Status VjpEigh(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  if (!m.Active(n, 0)) return absl::OkStatus();
  Emitter& e = m.e();
  const Eigen g = EigenOf(e, m.Result(n));
  const v1::TensorType vt = e.type(g.v);
  const int r = vt.dims_size();
  const int64_t size = vt.dims(r - 1);
  const std::string vbar = RowsOf(e, ct, 0, size), wbar = RowsOf(e, ct, size, size + 1);
  const Dims shape(vt.dims().begin(), vt.dims().end());
  const std::string eye = Eye(e, vt);
  const std::string diag =
      e.Binary(v1::MUL, eye, e.Broadcast(Flat(e, wbar), shape, Along(r, r - 1)));
  const std::string mid =
      e.Binary(v1::ADD, e.Binary(v1::MUL, g.f, MatMul(e, g.v, true, vbar, false)), diag);
  m.Into(n, 0, MatMul(e, MatMul(e, g.v, false, mid, false), false, g.v, true));
  return absl::OkStatus();
}

// ---------------------------------------------------------------- qr, svd

// Columns [from, to) of the last dimension.
std::string ColsOf(Emitter& e, const std::string& x, int64_t from, int64_t to) {
  const v1::TensorType t = e.type(x);
  const int r = t.dims_size();
  Dims start(r, 0), limit(t.dims().begin(), t.dims().end()), strides(r, 1);
  start[r - 1] = from;
  limit[r - 1] = to;
  return e.Slice(x, start, limit, strides);
}

// x with zero columns after it, to `cols` columns.
std::string PadCols(Emitter& e, const std::string& x, int64_t cols) {
  const v1::TensorType t = e.type(x);
  const int r = t.dims_size();
  if (t.dims(r - 1) == cols) return x;
  Dims low(r, 0), high(r, 0), interior(r, 0);
  high[r - 1] = cols - t.dims(r - 1);
  v1::TensorType scalar;
  scalar.set_dtype(t.dtype());
  return e.Pad(x, e.Fill(scalar, 0), low, high, interior);
}

// The last dimension of x ([..., k]) scaled by s ([..., k]) along `d`.
std::string ScaleAlong(Emitter& e, const std::string& x, const std::string& s, int d) {
  const v1::TensorType t = e.type(x);
  const Dims shape(t.dims().begin(), t.dims().end());
  return e.Binary(v1::MUL, x, e.Broadcast(s, shape, Along(t.dims_size(), d)));
}

// Q [..., m, n] and R [..., n, n] of a packed QR result (or of its
// cotangent), where a derivative is defined: m >= n, as in JAX.
struct QrParts {
  std::string q, r;
};

absl::StatusOr<QrParts> QrOf(Emitter& e, const v1::TensorType& a, const std::string& packed,
                             const std::string& where) {
  const int rank = a.dims_size();
  const int64_t rows = a.dims(rank - 2), cols = a.dims(rank - 1);
  if (rows < cols) {
    return absl::UnimplementedError(
        absl::StrCat(where, ": the derivative of a QR factorization of a wide matrix (", rows, "x",
                     cols, ", fewer rows than columns) is not defined here, as in JAX"));
  }
  return QrParts{ColsOf(e, RowsOf(e, packed, 0, rows), 0, cols),
                 RowsOf(e, packed, rows, rows + cols)};
}

// JAX's rule (m >= n): B = dA R⁻¹, C = Qᵀ B, Ω = tril(C, -1) - tril(C, -1)ᵀ;
// dQ = Q (Ω - C) + B, dR = (C - Ω) R.
absl::StatusOr<std::string> JvpQr(ForwardMode& m, const v1::Node& n) {
  const std::string t = m.Tangent(n, 0);
  if (t.empty()) return std::string();
  Emitter& e = m.e();
  TESSEL_ASSIGN_OR_RETURN(const QrParts f, QrOf(e, m.OperandType(n, 0), m.Result(n), m.Where()));
  const std::string b = Solve(e, f.r, t, false, false, false);
  const std::string c = MatMul(e, f.q, true, b, false);
  const std::string low = Triangle(e, c, true, 0);
  const std::string omega = e.Binary(v1::SUB, low, Mt(e, low));
  const std::string dq =
      e.Binary(v1::ADD, MatMul(e, f.q, false, e.Binary(v1::SUB, omega, c), false), b);
  const std::string dr = MatMul(e, e.Binary(v1::SUB, c, omega), false, f.r, false);
  return ConcatRows(e, dq, dr);
}

// Its transpose: Ω̄ = Qᵀ Q̄ - R̄ Rᵀ; C̄ = -Qᵀ Q̄ + R̄ Rᵀ + tril(Ω̄ - Ω̄ᵀ, -1);
// B̄ = Q̄ + Q C̄; dA = B̄ R⁻ᵀ.
absl::Status VjpQr(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  if (!m.Active(n, 0)) return absl::OkStatus();
  Emitter& e = m.e();
  const v1::TensorType a = m.OperandType(n, 0);
  TESSEL_ASSIGN_OR_RETURN(const QrParts f, QrOf(e, a, m.Result(n), m.Where()));
  TESSEL_ASSIGN_OR_RETURN(const QrParts bar, QrOf(e, a, ct, m.Where()));
  const std::string qtq = MatMul(e, f.q, true, bar.q, false);
  const std::string rrt = MatMul(e, bar.r, false, f.r, true);
  const std::string obar = e.Binary(v1::SUB, qtq, rrt);
  const std::string cbar = e.Binary(v1::ADD, e.Binary(v1::SUB, rrt, qtq),
                                    Triangle(e, e.Binary(v1::SUB, obar, Mt(e, obar)), true, 0));
  const std::string bbar = e.Binary(v1::ADD, bar.q, MatMul(e, f.q, false, cbar, false));
  m.Into(n, 0, Solve(e, f.r, bbar, false, false, true));
  return absl::OkStatus();
}

struct SvdParts {
  std::string u, s, v;  // [..., m, k], [..., k], [..., n, k]
  std::string f;        // F[i][j] = 1 / (s_j² - s_i²), 0 where s_i = s_j
  std::string s_inv;    // 1 / s, 0 where s = 0
  int64_t rows, cols, k;
};

SvdParts SvdOf(Emitter& e, const v1::TensorType& a, const std::string& packed) {
  SvdParts p;
  const int r = a.dims_size();
  p.rows = a.dims(r - 2);
  p.cols = a.dims(r - 1);
  p.k = std::min(p.rows, p.cols);
  p.u = ColsOf(e, RowsOf(e, packed, 0, p.rows), 0, p.k);
  p.s = Flat(e, ColsOf(e, RowsOf(e, packed, p.rows, p.rows + 1), 0, p.k));
  p.v = Mt(e, RowsOf(e, packed, p.rows + 1, p.rows + 1 + p.k));
  v1::TensorType sq = e.type(p.u);
  sq.set_dims(r - 2, p.k);
  const Dims shape(sq.dims().begin(), sq.dims().end());
  const std::string s2 = e.Binary(v1::MUL, p.s, p.s);
  const std::string sj = e.Broadcast(s2, shape, Along(r, r - 1));
  const std::string si = e.Broadcast(s2, shape, Along(r, r - 2));
  p.f = e.Select(e.Compare(v1::EQ, sj, si), e.Fill(sq, 0),
                 e.Binary(v1::DIV, e.Fill(sq, 1), e.Binary(v1::SUB, sj, si)));
  const v1::TensorType st = e.type(p.s);
  const std::string zero = e.Fill(st, 0);
  p.s_inv = e.Select(e.Compare(v1::EQ, p.s, zero), zero, e.Binary(v1::DIV, e.Fill(st, 1), p.s));
  return p;
}

// x (I - Y Yᵀ)-projected: x - Y (Yᵀ x).
std::string Project(Emitter& e, const std::string& y, const std::string& x) {
  return e.Binary(v1::SUB, x, MatMul(e, y, false, MatMul(e, y, true, x, false), false));
}

// JAX's rule for real matrices: dS = Uᵀ dA V, ds = diag(dS);
// dU = U (F ∘ (dS S + S dSᵀ)) [+ (I - U Uᵀ) dA V S⁻¹ when m > n];
// dV = V (F ∘ (S dS + dSᵀ S)) [+ (I - V Vᵀ) dAᵀ U S⁻¹ when n > m].
absl::StatusOr<std::string> JvpSvd(ForwardMode& m, const v1::Node& n) {
  const std::string t = m.Tangent(n, 0);
  if (t.empty()) return std::string();
  Emitter& e = m.e();
  const v1::TensorType a = m.OperandType(n, 0);
  const int r = a.dims_size();
  const SvdParts p = SvdOf(e, a, m.Result(n));
  const std::string ds = MatMul(e, MatMul(e, p.u, true, t, false), false, p.v, false);
  const std::string dss = ScaleAlong(e, ds, p.s, r - 1);  // dS S
  const std::string sds = ScaleAlong(e, ds, p.s, r - 2);  // S dS
  std::string du =
      MatMul(e, p.u, false, e.Binary(v1::MUL, p.f, e.Binary(v1::ADD, dss, Mt(e, dss))), false);
  std::string dv =
      MatMul(e, p.v, false, e.Binary(v1::MUL, p.f, e.Binary(v1::ADD, sds, Mt(e, sds))), false);
  if (p.rows > p.cols) {
    du = e.Binary(v1::ADD, du,
                  ScaleAlong(e, Project(e, p.u, MatMul(e, t, false, p.v, false)), p.s_inv, r - 1));
  }
  if (p.cols > p.rows) {
    dv = e.Binary(v1::ADD, dv,
                  ScaleAlong(e, Project(e, p.v, MatMul(e, t, true, p.u, false)), p.s_inv, r - 1));
  }
  return ConcatRows(e, ConcatRows(e, PadCols(e, du, p.cols), PadCols(e, Diagonal(e, ds), p.cols)),
                    Mt(e, dv));
}

// Its transpose: Y = F ∘ (Uᵀ Ū), W = F ∘ (Vᵀ V̄);
// dA = U (diag(s̄) + (Y + Yᵀ) S + S (W + Wᵀ)) Vᵀ
//      [+ (I - U Uᵀ) Ū S⁻¹ Vᵀ when m > n] [+ U S⁻¹ V̄ᵀ (I - V Vᵀ) when n > m].
absl::Status VjpSvd(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  if (!m.Active(n, 0)) return absl::OkStatus();
  Emitter& e = m.e();
  const v1::TensorType a = m.OperandType(n, 0);
  const int r = a.dims_size();
  const SvdParts p = SvdOf(e, a, m.Result(n));
  const std::string ubar = ColsOf(e, RowsOf(e, ct, 0, p.rows), 0, p.k);
  const std::string sbar = Flat(e, ColsOf(e, RowsOf(e, ct, p.rows, p.rows + 1), 0, p.k));
  const std::string vbar = Mt(e, RowsOf(e, ct, p.rows + 1, p.rows + 1 + p.k));
  const std::string y = e.Binary(v1::MUL, p.f, MatMul(e, p.u, true, ubar, false));
  const std::string w = e.Binary(v1::MUL, p.f, MatMul(e, p.v, true, vbar, false));
  const v1::TensorType sq = e.type(y);
  const Dims shape(sq.dims().begin(), sq.dims().end());
  std::string mid = e.Binary(v1::MUL, Eye(e, sq), e.Broadcast(sbar, shape, Along(r, r - 1)));
  mid = e.Binary(v1::ADD, mid, ScaleAlong(e, e.Binary(v1::ADD, y, Mt(e, y)), p.s, r - 1));
  mid = e.Binary(v1::ADD, mid, ScaleAlong(e, e.Binary(v1::ADD, w, Mt(e, w)), p.s, r - 2));
  std::string da = MatMul(e, MatMul(e, p.u, false, mid, false), false, p.v, true);
  if (p.rows > p.cols) {
    const std::string g = Project(e, p.u, ScaleAlong(e, ubar, p.s_inv, r - 1));
    da = e.Binary(v1::ADD, da, MatMul(e, g, false, p.v, true));
  }
  if (p.cols > p.rows) {
    const std::string g = Project(e, p.v, ScaleAlong(e, vbar, p.s_inv, r - 1));
    da = e.Binary(v1::ADD, da, MatMul(e, p.u, false, g, true));
  }
  m.Into(n, 0, da);
  return absl::OkStatus();
}

// ---------------------------------------------------------------- batching

// Every operand batch-first: the batch is one more leading dimension.
absl::StatusOr<std::string> BatchLinalg(Batching& b, const v1::Node& n) {
  std::vector<std::string> ops;
  for (const std::string& o : n.operands()) ops.push_back(b.Batched(o));
  return b.Emit(n, ops);
}

}  // namespace

void LinalgRows(Rows& rows) {
  rows.emplace_back(
      v1::CHOLESKY,
      OpRules{
          .layout = LayoutLinalg, .vjp = VjpCholesky, .jvp = JvpCholesky, .batch = BatchLinalg});
  rows.emplace_back(v1::TRIANGULAR_SOLVE, OpRules{.layout = LayoutLinalg,
                                                  .vjp = VjpTriangularSolve,
                                                  .jvp = JvpTriangularSolve,
                                                  .batch = BatchLinalg});
  rows.emplace_back(
      v1::LU, OpRules{.layout = LayoutLinalg, .vjp = VjpLu, .jvp = JvpLu, .batch = BatchLinalg});
  rows.emplace_back(
      v1::EIGH,
      OpRules{.layout = LayoutLinalg, .vjp = VjpEigh, .jvp = JvpEigh, .batch = BatchLinalg});
  rows.emplace_back(
      v1::QR, OpRules{.layout = LayoutLinalg, .vjp = VjpQr, .jvp = JvpQr, .batch = BatchLinalg});
  rows.emplace_back(
      v1::SVD, OpRules{.layout = LayoutLinalg, .vjp = VjpSvd, .jvp = JvpSvd, .batch = BatchLinalg});
}

}  // namespace tessel::scheduler::ops
