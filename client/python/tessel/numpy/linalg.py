"""tessel.numpy.linalg: numpy.linalg's (and jax.numpy.linalg's) names.

The factorizations are tessel.lax.linalg's ops (LAPACK on the CPU).
`solve`, `inv`, `det` and `slogdet` go through one LU factorization and
differentiate through its rule and the triangular solves' (JAX's), so
they batch and partition as those ops do. Integer and bool operands are
computed in float64, as numpy does; float16 is refused, as numpy does.
"""

import builtins
from typing import NamedTuple

import numpy as np

from tessel import _lax_linalg as lax_linalg
from tessel import numpy as tnp
from tessel.numpy._core import _op, _tracer

__all__ = ["cholesky", "det", "eigh", "eigvalsh", "inv", "norm", "qr", "slogdet", "solve", "svd", "svdvals"]


class EighResult(NamedTuple):
    eigenvalues: object
    eigenvectors: object


class QRResult(NamedTuple):
    Q: object
    R: object


class SVDResult(NamedTuple):
    U: object
    S: object
    Vh: object


class SlogdetResult(NamedTuple):
    sign: object
    logabsdet: object


def _float(x, what, square=True):
    x = _tracer(x)
    if x.dtype in (np.float16,) or str(x.dtype) == "bfloat16":
        raise TypeError(f"linalg.{what}: array type {x.dtype} is unsupported in linalg (use float32 or float64)")
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    if x.ndim < 2 or (square and x.shape[-1] != x.shape[-2]):
        raise ValueError(
            f"linalg.{what}: expected a {'square ' if square else ''}matrix [..., n, n], got shape {list(x.shape)}"
        )
    return x


@_op
def cholesky(a, *, upper=False, symmetrize_input=True):
    """numpy.linalg.cholesky: L with a = L Lᵀ (or U = Lᵀ with `upper`)."""
    factor = lax_linalg.cholesky(_float(a, "cholesky"), symmetrize_input=symmetrize_input)
    return factor.mT if upper else factor


@_op
def eigh(a, UPLO=None, symmetrize_input=True):
    """numpy.linalg.eigh: (eigenvalues ascending, eigenvectors as columns)."""
    if UPLO not in (None, "L", "U"):
        raise ValueError(f"linalg.eigh: UPLO must be 'L' or 'U', got {UPLO!r}")
    v, w = lax_linalg.eigh(_float(a, "eigh"), lower=UPLO != "U", symmetrize_input=symmetrize_input)
    return EighResult(w, v)


@_op
def eigvalsh(a, UPLO="L", *, symmetrize_input=True):
    """numpy.linalg.eigvalsh: the eigenvalues of a symmetric a, ascending."""
    return eigh(a, UPLO, symmetrize_input=symmetrize_input).eigenvalues


def _lu_solve(factors, permutation, b):
    """x with a x = b, from P a = L U: L U x = P b."""
    pb = tnp.take_along_axis(b, tnp.broadcast_to(permutation[..., :, None], b.shape[:-1] + (1,)), axis=-2)
    y = lax_linalg.triangular_solve(factors, pb, left_side=True, lower=True, unit_diagonal=True)
    return lax_linalg.triangular_solve(factors, y, left_side=True, lower=False)


def _solve(a, b):
    factors, _, permutation = lax_linalg.lu(a)
    return _lu_solve(factors, permutation, b)


@_op
def solve(a, b):
    """numpy.linalg.solve: x with a x = b. A b of one dimension less than a
    is a vector (or a batch of them), as jax.numpy.linalg.solve reads it."""
    a = _float(a, "solve")
    b = _tracer(b)
    dtype = np.promote_types(a.dtype, b.dtype if b.dtype != np.bool_ else np.float64)
    if dtype not in (np.float32, np.float64):
        dtype = np.dtype(np.float64)
    a, b = a.astype(dtype), b.astype(dtype)
    n = a.shape[-1]
    vector = b.ndim == 1 or b.ndim == a.ndim - 1
    if vector:
        b = b[..., None]
    if b.ndim < 2 or b.shape[-2] != n:
        raise ValueError(
            f"linalg.solve: b needs {n} rows for a {n}x{n} a, got shape {list(b.shape)[:-1] if vector else list(b.shape)}"
        )
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = tnp.broadcast_to(a, batch + a.shape[-2:])
    b = tnp.broadcast_to(b, batch + b.shape[-2:])
    x = _solve(a, b)
    return x[..., 0] if vector else x


@_op
def inv(a):
    """numpy.linalg.inv."""
    a = _float(a, "inv")
    n = a.shape[-1]
    return solve(a, tnp.broadcast_to(tnp.eye(n, dtype=a.dtype), a.shape))


def _lu_parts(a):
    """(U's diagonal, the permutation's sign) of a's LU factorization."""
    factors, pivots, _ = lax_linalg.lu(a)
    n = a.shape[-1]
    swaps = tnp.sum(pivots != tnp.arange(n, dtype=np.int32), axis=-1)
    sign = tnp.where(swaps % 2 == 1, -1, 1).astype(a.dtype)
    return tnp.diagonal(factors, axis1=-2, axis2=-1), sign


@_op
def det(a):
    """numpy.linalg.det (a singular a's derivative is NaN)."""
    diag, sign = _lu_parts(_float(a, "det"))
    return sign * tnp.prod(diag, axis=-1)


@_op
def slogdet(a, *, method=None):
    """numpy.linalg.slogdet: (sign, log |det a|), through LU (jax.numpy's
    `method` "lu"; "qr" is not offered)."""
    if method not in (None, "lu"):
        raise NotImplementedError(f"linalg.slogdet: method {method!r} (only 'lu')")
    diag, sign = _lu_parts(_float(a, "slogdet"))
    return SlogdetResult(sign * tnp.prod(tnp.sign(diag), axis=-1), tnp.sum(tnp.log(tnp.abs(diag)), axis=-1))


@_op
def qr(a, mode="reduced"):
    """numpy.linalg.qr: mode 'reduced' (Q [..., m, k], R [..., k, n]), 'r'
    (R alone), or 'complete' where m <= n (the same factors)."""
    a = _float(a, "qr", square=False)
    if mode not in ("reduced", "r", "complete"):
        raise ValueError(f"linalg.qr: mode must be 'reduced', 'r' or 'complete', got {mode!r}")
    q, r = lax_linalg.qr(a, full_matrices=mode == "complete")
    return r if mode == "r" else QRResult(q, r)


@_op
def svd(a, full_matrices=True, compute_uv=True, hermitian=False, subset_by_index=None):
    """numpy.linalg.svd: (U, S, Vh), S descending; or S alone without
    `compute_uv`. Only the reduced factors of a non-square a
    (full_matrices=False)."""
    del hermitian  # the general factorization serves both
    if subset_by_index is not None:
        raise NotImplementedError("linalg.svd: subset_by_index is not supported")
    a = _float(a, "svd", square=False)
    if not compute_uv:
        return lax_linalg.svd(a, compute_uv=False)
    return SVDResult(*lax_linalg.svd(a, full_matrices=full_matrices))


@_op
def svdvals(x):
    """numpy.linalg.svdvals: the singular values, descending."""
    return lax_linalg.svd(_float(x, "svdvals", square=False), compute_uv=False)


@_op
def norm(x, ord=None, axis=None, keepdims=False):
    """numpy.linalg.norm: vector norms (any ord) over one axis, matrix norms
    ('fro', 'nuc', ±1, ±2, ±inf) over two (the 2-norms and the nuclear norm
    from the singular values)."""
    x = _tracer(x)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    if axis is None:
        if ord is None or (ord in ("f", "fro") and x.ndim == 2):
            r = tnp.sqrt(tnp.sum(x * x))
            return tnp.reshape(r, (1,) * x.ndim) if keepdims else r
        if x.ndim not in (1, 2):
            raise ValueError(
                f"linalg.norm: ord={ord!r} needs a vector or a matrix (or an axis), got shape {list(x.shape)}"
            )
        axis = tuple(range(x.ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(a % x.ndim for a in axes)
    if len(axes) == 1:
        (ax,) = axes
        ab = tnp.abs(x)
        if ord is None or ord == 2:
            return tnp.sqrt(tnp.sum(x * x, axis=ax, keepdims=keepdims))
        if ord == np.inf:
            return tnp.max(ab, axis=ax, keepdims=keepdims)
        if ord == -np.inf:
            return tnp.min(ab, axis=ax, keepdims=keepdims)
        if ord == 0:
            return tnp.sum((x != 0).astype(x.dtype), axis=ax, keepdims=keepdims)
        if isinstance(ord, str):
            raise ValueError(f"linalg.norm: ord {ord!r} is for matrices; a vector takes a number")
        return tnp.sum(ab**ord, axis=ax, keepdims=keepdims) ** (1.0 / ord)
    if len(axes) != 2 or axes[0] == axes[1]:
        raise ValueError(f"linalg.norm: axis must be one axis or two different ones, got {axis!r}")
    r, c = axes
    if ord in (None, "fro", "f"):
        return tnp.sqrt(tnp.sum(x * x, axis=axes, keepdims=keepdims))
    if x.shape[r] == 0 or x.shape[c] == 0:
        if ord in (1, np.inf, 2, "nuc"):  # numpy's: an empty matrix's norm is 0
            return tnp.sum(x, axis=axes, keepdims=keepdims)
        raise ValueError(f"linalg.norm: ord={ord!r} of an empty matrix {list(x.shape)} has no value")
    ab = tnp.abs(x)
    if ord in (1, -1, np.inf, -np.inf):
        summed_over, then = (r, c) if ord in (1, -1) else (c, r)
        sums = tnp.sum(ab, axis=summed_over, keepdims=True)
        pick = tnp.max if ord > 0 else tnp.min
        out = pick(sums, axis=then, keepdims=True)
    elif ord in (2, -2, "nuc"):
        moved = tnp.moveaxis(x, (r, c), (-2, -1))
        s = svdvals(moved)
        out = s[..., 0] if ord == 2 else s[..., -1] if ord == -2 else tnp.sum(s, axis=-1)
        out = tnp.expand_dims(tnp.expand_dims(out, builtins.min(r, c)), builtins.max(r, c))
    else:
        raise ValueError(f"linalg.norm: ord {ord!r} is not a matrix norm ('fro', 'nuc', 1, -1, 2, -2, inf, -inf)")
    if keepdims:
        return out
    return tnp.squeeze(out, axis=axes)
