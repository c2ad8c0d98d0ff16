"""tessel.lax.linalg: jax.lax.linalg's factorizations, each one IR op.

`cholesky`, `triangular_solve`, `lu`, `eigh`, `qr` and `svd` are the IR's
CHOLESKY, TRIANGULAR_SOLVE, LU, EIGH, QR and SVD: LAPACK runs them on the CPU, one call per
matrix of the batch (the leading dimensions). f32 and f64. Their
derivatives are the ops' own rules, as JAX's. A batch split over devices stays split; the matrix dimensions
are gathered first, and the plan says so.
"""

import numpy as np

from tessel.numpy._core import _b, _op, _tracer
from tessel.v1 import ir_pb2

__all__ = ["cholesky", "eigh", "lu", "qr", "svd", "triangular_solve"]


def _matrix(x, what, square=True):
    x = _tracer(x)
    if x.dtype not in (np.float32, np.float64):
        raise TypeError(f"{what}: expected a float32 or float64 matrix, got {x.dtype} {list(x.shape)}")
    if x.ndim < 2 or (square and x.shape[-1] != x.shape[-2]):
        raise ValueError(
            f"{what}: expected a {'square ' if square else ''}matrix [..., n, n], got shape {list(x.shape)}"
        )
    return x


def _node(op, operands, shape, dtype, **attrs):
    def set_attrs(n):
        n.linalg.SetInParent()
        for k, v in attrs.items():
            setattr(n.linalg, k, bool(v))

    return _b().node(op, operands, shape, dtype, set_attrs=set_attrs)


def _symmetrize(x):
    return (x + x.mT) / 2


@_op
def cholesky(x, *, symmetrize_input=True):
    """jax.lax.linalg.cholesky: the lower factor L of x = L Lᵀ (NaN where x
    is not positive definite). With `symmetrize_input` x is first
    (x + xᵀ) / 2; without, only its lower triangle is read."""
    x = _matrix(x, "cholesky")
    if symmetrize_input:
        x = _symmetrize(x)
    return _node(ir_pb2.CHOLESKY, [x], x.shape, x.dtype, lower=True)


@_op
def triangular_solve(a, b, *, left_side=False, lower=False, transpose_a=False, conjugate_a=False, unit_diagonal=False):
    """jax.lax.linalg.triangular_solve: x with op(a) x = b (`left_side`) or
    x op(a) = b, reading a's `lower` (or upper) triangle; op(a) = aᵀ with
    `transpose_a`. `conjugate_a` changes nothing for real types."""
    del conjugate_a  # real types only
    a = _matrix(a, "triangular_solve: a")
    b = _matrix(b, "triangular_solve: b", square=False)
    if a.dtype != b.dtype:
        raise TypeError(f"triangular_solve: a and b need one dtype, got {a.dtype} and {b.dtype}")
    if a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(
            f"triangular_solve: a and b need the same batch dimensions, got {list(a.shape)} and {list(b.shape)}"
        )
    n = a.shape[-1]
    if b.shape[-2 if left_side else -1] != n:
        raise ValueError(
            f"triangular_solve: b needs {n} {'rows' if left_side else 'columns'} for a {n}x{n} a "
            f"({'left_side' if left_side else 'right side'}), got shape {list(b.shape)}"
        )
    return _node(
        ir_pb2.TRIANGULAR_SOLVE,
        [a, b],
        b.shape,
        b.dtype,
        left_side=left_side,
        lower=lower,
        transpose_a=transpose_a,
        unit_diagonal=unit_diagonal,
    )


@_op
def lu(x):
    """jax.lax.linalg.lu: (lu, pivots, permutation) with P x = L U; lu holds
    L below its unit diagonal and U on and above it; pivots (int32) the row
    swaps LAPACK made, permutation (int32) the rows of x in P x's order."""
    x = _matrix(x, "lu")
    n = x.shape[-1]
    packed = _node(ir_pb2.LU, [x], x.shape[:-2] + (n + 2, n), x.dtype)
    factors = packed[..., :n, :]
    pivots = packed[..., n, :].astype(np.int32)
    permutation = packed[..., n + 1, :].astype(np.int32)
    return factors, pivots, permutation


@_op
def eigh(x, *, lower=True, symmetrize_input=True, sort_eigenvalues=True, subset_by_index=None, implementation=None):
    """jax.lax.linalg.eigh: (v, w) with x = v diag(w) vᵀ, the eigenvalues w
    ascending and the eigenvectors the columns of v. With
    `symmetrize_input` x is first (x + xᵀ) / 2; without, only its `lower`
    (or upper) triangle is read. Gradients follow JAX's rule, except that a
    repeated eigenvalue contributes nothing to the eigenvectors' gradient
    where JAX's gives inf or NaN."""
    del sort_eigenvalues, implementation  # LAPACK's syevd, ascending
    if subset_by_index is not None:
        raise NotImplementedError("eigh: subset_by_index is not supported")
    x = _matrix(x, "eigh")
    if symmetrize_input:
        x = _symmetrize(x)
    n = x.shape[-1]
    packed = _node(ir_pb2.EIGH, [x], x.shape[:-2] + (n + 1, n), x.dtype, lower=lower)
    return packed[..., :n, :], packed[..., n, :]


def _refuse_complete(what, x, complete_differs):
    """Complete factors are built only where they are the reduced ones
    (k = min(m, n) fills them)."""
    m, n = x.shape[-2:]
    if complete_differs:
        raise NotImplementedError(
            f"{what}: full_matrices=True of a {m}x{n} matrix (the complete factors) is not supported; "
            "pass full_matrices=False for the reduced ones"
        )


@_op
def qr(x, *, pivoting=False, full_matrices=True, use_magma=None):
    """jax.lax.linalg.qr: (q, r) with x = q r, q [..., m, k] with orthonormal
    columns and r [..., k, n] upper triangular, k = min(m, n) (LAPACK's
    geqrf and orgqr). The complete factors of a tall x are not built.
    Differentiable where m >= n, as JAX's."""
    del use_magma  # a GPU library's choice
    if pivoting:
        raise NotImplementedError("qr: pivoting=True is not supported")
    x = _matrix(x, "qr", square=False)
    m, n = x.shape[-2:]
    _refuse_complete("qr", x, full_matrices and m > n)
    k = min(m, n)
    packed = _node(ir_pb2.QR, [x], x.shape[:-2] + (m + k, n), x.dtype)
    return packed[..., :m, :k], packed[..., m:, :]


@_op
def svd(x, *, full_matrices=True, compute_uv=True, subset_by_index=None, algorithm=None):
    """jax.lax.linalg.svd: (u, s, vh) with x = u diag(s) vh, s descending
    (LAPACK's gesdd), or s alone without `compute_uv`. The complete factors
    of a non-square x are not built. Gradients follow JAX's rule, except
    that equal or zero singular values contribute nothing where JAX's gives
    inf or NaN."""
    del algorithm  # LAPACK's gesdd
    if subset_by_index is not None:
        raise NotImplementedError("svd: subset_by_index is not supported")
    x = _matrix(x, "svd", square=False)
    m, n = x.shape[-2:]
    _refuse_complete("svd", x, compute_uv and full_matrices and m != n)
    k = min(m, n)
    packed = _node(ir_pb2.SVD, [x], x.shape[:-2] + (m + 1 + k, n), x.dtype)
    s = packed[..., m, :k]
    if not compute_uv:
        return s
    return packed[..., :m, :k], s, packed[..., m + 1 :, :]
