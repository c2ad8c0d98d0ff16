// Linear algebra on the CPU: LAPACK (through LAPACKE, on OpenBLAS) and
// OpenBLAS's trsm, one call per matrix of the batch (the leading
// dimensions). f32 and f64. Stateless; any thread.
#pragma once

#include "tessel/v1/ir.pb.h"

namespace tessel::cpu {

// CHOLESKY: potrf; the other triangle zeroed; NaN in the factor's
// triangle where a is not positive definite (as XLA's).
void Cholesky(const v1::TensorType& type, const void* a, bool lower, void* out);
// TRIANGULAR_SOLVE: trsm over a copy of b.
void TriangularSolve(const v1::TensorType& a_type, const void* a, const v1::TensorType& b_type,
                     const void* b, const v1::LinalgAttrs& attrs, void* out);
// LU: getrf, packed with its pivots and permutation as the IR describes.
void Lu(const v1::TensorType& a_type, const void* a, void* out);
// EIGH: syevd, packed with the eigenvalues as the IR describes; NaN where
// it does not converge.
void Eigh(const v1::TensorType& a_type, const void* a, bool lower, void* out);

// QR: geqrf and orgqr (the reduced factors), packed as the IR describes.
void Qr(const v1::TensorType& a_type, const void* a, void* out);
// SVD: gesdd (the reduced factors), packed as the IR describes; NaN where
// it does not converge.
void Svd(const v1::TensorType& a_type, const void* a, void* out);

}  // namespace tessel::cpu
