#include "worker/cpu/linalg.h"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "core/dtype.h"

namespace tessel::cpu {
namespace {

// A row-major buffer seen by column-major LAPACK is its transpose: the
// lower triangle of a symmetric matrix is the upper one LAPACK sees, and
// the factors come back transposed the same way.

lapack_int Potrf(char uplo, lapack_int n, float* a) {
  return LAPACKE_spotrf(LAPACK_COL_MAJOR, uplo, n, a, n);
}
lapack_int Potrf(char uplo, lapack_int n, double* a) {
  return LAPACKE_dpotrf(LAPACK_COL_MAJOR, uplo, n, a, n);
}
lapack_int Getrf(lapack_int n, float* a, lapack_int* ipiv) {
  return LAPACKE_sgetrf(LAPACK_ROW_MAJOR, n, n, a, n, ipiv);
}
lapack_int Getrf(lapack_int n, double* a, lapack_int* ipiv) {
  return LAPACKE_dgetrf(LAPACK_ROW_MAJOR, n, n, a, n, ipiv);
}
lapack_int Syevd(char uplo, lapack_int n, float* a, float* w) {
  return LAPACKE_ssyevd(LAPACK_COL_MAJOR, 'V', uplo, n, a, n, w);
}
lapack_int Syevd(char uplo, lapack_int n, double* a, double* w) {
  return LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'V', uplo, n, a, n, w);
}
lapack_int Geqrf(lapack_int m, lapack_int n, float* a, float* tau) {
  return LAPACKE_sgeqrf(LAPACK_ROW_MAJOR, m, n, a, n, tau);
}
lapack_int Geqrf(lapack_int m, lapack_int n, double* a, double* tau) {
  return LAPACKE_dgeqrf(LAPACK_ROW_MAJOR, m, n, a, n, tau);
}
lapack_int Orgqr(lapack_int m, lapack_int k, lapack_int lda, float* a, const float* tau) {
  return LAPACKE_sorgqr(LAPACK_ROW_MAJOR, m, k, k, a, lda, tau);
}
lapack_int Orgqr(lapack_int m, lapack_int k, lapack_int lda, double* a, const double* tau) {
  return LAPACKE_dorgqr(LAPACK_ROW_MAJOR, m, k, k, a, lda, tau);
}
// Column-major: a is (m x n), u (m x k, ld m), vt (k x n, ld k).
lapack_int Gesdd(lapack_int m, lapack_int n, float* a, float* s, float* u, float* vt) {
  return LAPACKE_sgesdd(LAPACK_COL_MAJOR, 'S', m, n, a, m, s, u, m, vt, std::min(m, n));
}
lapack_int Gesdd(lapack_int m, lapack_int n, double* a, double* s, double* u, double* vt) {
  return LAPACKE_dgesdd(LAPACK_COL_MAJOR, 'S', m, n, a, m, s, u, m, vt, std::min(m, n));
}
void Trsm(CBLAS_SIDE side, CBLAS_UPLO uplo, CBLAS_TRANSPOSE trans, CBLAS_DIAG diag, int m, int n,
          const float* a, int lda, float* b) {
  cblas_strsm(CblasRowMajor, side, uplo, trans, diag, m, n, 1.0f, a, lda, b, n);
}
void Trsm(CBLAS_SIDE side, CBLAS_UPLO uplo, CBLAS_TRANSPOSE trans, CBLAS_DIAG diag, int m, int n,
          const double* a, int lda, double* b) {
  cblas_dtrsm(CblasRowMajor, side, uplo, trans, diag, m, n, 1.0, a, lda, b, n);
}

// The number of matrices: the product of the leading dimensions.
int64_t BatchOf(const v1::TensorType& t) {
  int64_t b = 1;
  for (int d = 0; d + 2 < t.dims_size(); ++d) b *= t.dims(d);
  return b;
}
int64_t Rows(const v1::TensorType& t) { return t.dims(t.dims_size() - 2); }
int64_t Cols(const v1::TensorType& t) { return t.dims(t.dims_size() - 1); }

template <typename T>
void CholeskyT(const v1::TensorType& type, const T* a, bool lower, T* out) {
  const int64_t n = Cols(type), batch = BatchOf(type);
  for (int64_t k = 0; k < batch; ++k) {
    T* m = out + k * n * n;
    std::copy(a + k * n * n, a + (k + 1) * n * n, m);
    if (n == 0) continue;
    if (Potrf(lower ? 'U' : 'L', lapack_int(n), m) != 0) {
      std::fill(m, m + n * n, std::numeric_limits<T>::quiet_NaN());
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        if (lower ? j > i : j < i) m[i * n + j] = T(0);
      }
    }
  }
}

template <typename T>
void TriangularSolveT(const v1::TensorType& at, const T* a, const v1::TensorType& bt, const T* b,
                      const v1::LinalgAttrs& x, T* out) {
  const int64_t n = Cols(at), rows = Rows(bt), cols = Cols(bt), batch = BatchOf(bt);
  std::copy(b, b + batch * rows * cols, out);
  if (rows == 0 || cols == 0) return;
  for (int64_t k = 0; k < batch; ++k) {
    Trsm(x.left_side() ? CblasLeft : CblasRight, x.lower() ? CblasLower : CblasUpper,
         x.transpose_a() ? CblasTrans : CblasNoTrans, x.unit_diagonal() ? CblasUnit : CblasNonUnit,
         int(rows), int(cols), a + k * n * n, int(n), out + k * rows * cols);
  }
}

template <typename T>
void LuT(const v1::TensorType& at, const T* a, T* out) {
  const int64_t n = Cols(at), batch = BatchOf(at);
  std::vector<lapack_int> ipiv(n);
  std::vector<int64_t> perm(n);
  for (int64_t k = 0; k < batch; ++k) {
    T* m = out + k * (n + 2) * n;
    std::copy(a + k * n * n, a + (k + 1) * n * n, m);
    if (n == 0) continue;
    // info > 0 marks a zero pivot: the factors are still the answer.
    Getrf(lapack_int(n), m, ipiv.data());
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = ipiv[i] - 1;  // LAPACK counts from 1
      std::swap(perm[i], perm[p]);
      m[n * n + i] = T(p);
    }
    for (int64_t i = 0; i < n; ++i) m[(n + 1) * n + i] = T(perm[i]);
  }
}

template <typename T>
void EighT(const v1::TensorType& at, const T* a, bool lower, T* out) {
  const int64_t n = Cols(at), batch = BatchOf(at);
  std::vector<T> v(n * n);
  for (int64_t k = 0; k < batch; ++k) {
    T* m = out + k * (n + 1) * n;
    if (n == 0) continue;
    std::copy(a + k * n * n, a + (k + 1) * n * n, v.begin());
    if (Syevd(lower ? 'U' : 'L', lapack_int(n), v.data(), m + n * n) != 0) {
      std::fill(m, m + (n + 1) * n, std::numeric_limits<T>::quiet_NaN());
      continue;
    }
    // LAPACK's columns are rows of the row-major buffer: transpose them back.
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) m[i * n + j] = v[j * n + i];
    }
  }
}

template <typename T>
void QrT(const v1::TensorType& at, const T* a, T* out) {
  const int64_t m = Rows(at), n = Cols(at), k = std::min(m, n), batch = BatchOf(at);
  std::vector<T> v(m * n), tau(k);
  for (int64_t b = 0; b < batch; ++b) {
    T* o = out + b * (m + k) * n;
    std::fill(o, o + (m + k) * n, T(0));
    if (k == 0) continue;
    std::copy(a + b * m * n, a + (b + 1) * m * n, v.begin());
    Geqrf(lapack_int(m), lapack_int(n), v.data(), tau.data());
    for (int64_t i = 0; i < k; ++i) {  // R: the upper triangle of the first k rows
      for (int64_t j = i; j < n; ++j) o[(m + i) * n + j] = v[i * n + j];
    }
    Orgqr(lapack_int(m), lapack_int(k), lapack_int(n), v.data(), tau.data());
    for (int64_t i = 0; i < m; ++i) {  // Q: the first k columns
      std::copy(v.begin() + i * n, v.begin() + i * n + k, o + i * n);
    }
  }
}

template <typename T>
void SvdT(const v1::TensorType& at, const T* a, T* out) {
  const int64_t m = Rows(at), n = Cols(at), k = std::min(m, n), batch = BatchOf(at);
  // The row-major a is aᵀ to column-major LAPACK: aᵀ = U' S V'ᵀ gives
  // a = V' S U'ᵀ, and LAPACK's U' (n x k) and V'ᵀ (k x m), read back
  // row-major, are a's Vᵀ (k x n) and U (m x k) as they lie.
  std::vector<T> v(m * n), s(k), vt(k * n), u(m * k);
  for (int64_t b = 0; b < batch; ++b) {
    T* o = out + b * (m + 1 + k) * n;
    std::fill(o, o + (m + 1 + k) * n, T(0));
    if (k == 0) continue;
    std::copy(a + b * m * n, a + (b + 1) * m * n, v.begin());
    if (Gesdd(lapack_int(n), lapack_int(m), v.data(), s.data(), vt.data(), u.data()) != 0) {
      std::fill(o, o + (m + 1 + k) * n, std::numeric_limits<T>::quiet_NaN());
      continue;
    }
    for (int64_t i = 0; i < m; ++i) {
      std::copy(u.begin() + i * k, u.begin() + (i + 1) * k, o + i * n);
    }
    std::copy(s.begin(), s.end(), o + m * n);
    std::copy(vt.begin(), vt.end(), o + (m + 1) * n);
  }
}

}  // namespace

void Qr(const v1::TensorType& a_type, const void* a, void* out) {
  if (a_type.dtype() == v1::F64) {
    QrT(a_type, static_cast<const double*>(a), static_cast<double*>(out));
  } else {
    QrT(a_type, static_cast<const float*>(a), static_cast<float*>(out));
  }
}

void Svd(const v1::TensorType& a_type, const void* a, void* out) {
  if (a_type.dtype() == v1::F64) {
    SvdT(a_type, static_cast<const double*>(a), static_cast<double*>(out));
  } else {
    SvdT(a_type, static_cast<const float*>(a), static_cast<float*>(out));
  }
}

void Cholesky(const v1::TensorType& type, const void* a, bool lower, void* out) {
  if (type.dtype() == v1::F64) {
    CholeskyT(type, static_cast<const double*>(a), lower, static_cast<double*>(out));
  } else {
    CholeskyT(type, static_cast<const float*>(a), lower, static_cast<float*>(out));
  }
}

void TriangularSolve(const v1::TensorType& a_type, const void* a, const v1::TensorType& b_type,
                     const void* b, const v1::LinalgAttrs& attrs, void* out) {
  if (a_type.dtype() == v1::F64) {
    TriangularSolveT(a_type, static_cast<const double*>(a), b_type, static_cast<const double*>(b),
                     attrs, static_cast<double*>(out));
  } else {
    TriangularSolveT(a_type, static_cast<const float*>(a), b_type, static_cast<const float*>(b),
                     attrs, static_cast<float*>(out));
  }
}

void Lu(const v1::TensorType& a_type, const void* a, void* out) {
  if (a_type.dtype() == v1::F64) {
    LuT(a_type, static_cast<const double*>(a), static_cast<double*>(out));
  } else {
    LuT(a_type, static_cast<const float*>(a), static_cast<float*>(out));
  }
}

void Eigh(const v1::TensorType& a_type, const void* a, bool lower, void* out) {
  if (a_type.dtype() == v1::F64) {
    EighT(a_type, static_cast<const double*>(a), lower, static_cast<double*>(out));
  } else {
    EighT(a_type, static_cast<const float*>(a), lower, static_cast<float*>(out));
  }
}

}  // namespace tessel::cpu
