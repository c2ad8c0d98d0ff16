"""Reductions: sum, prod, max/min, any/all, mean, arg-reductions,
statistics, the NaN-ignoring forms and cumulative sums and products.
"""

import builtins

import numpy as _np

from tessel import _dtypes
from tessel.v1 import ir_pb2
from tessel.numpy._core import _b, _convert, float64, _op, _tracer
from tessel.numpy._elementwise import (
    add,
    astype,
    divide,
    isnan,
    logical_not,
    multiply,
    not_equal,
    sqrt,
    subtract,
    where,
)
from tessel.numpy._layout import _axis_list, broadcast_to, pad, ravel, reshape


# ---------------------------------------------------------------- reductions


def _axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of bounds for an array of dimension {ndim}")
        out.append(a % ndim)
    return tuple(sorted(set(out)))


def _reduce(kind, x, axis, keepdims, d=None):
    t = _tracer(x)
    if d is not None:
        t = _convert(t, d)
    axes = _axes(axis, t.ndim)
    shape = tuple(s for i, s in enumerate(t.shape) if i not in axes)

    def attrs(n):
        n.reduce.kind = kind
        n.reduce.dims.extend(axes)

    out = _b().node(ir_pb2.REDUCE, [t], shape, t.dtype, set_attrs=attrs)
    if keepdims:
        out = reshape(out, tuple(1 if i in axes else s for i, s in enumerate(t.shape)))
    return out


def _sum_dtype(t, dtype):
    if dtype is not None:
        return _np.dtype(dtype)
    # numpy's add.reduce: integers and bools accumulate in 64 bits of their signedness.
    return {"b": _np.dtype(_np.int64), "i": _np.dtype(_np.int64), "u": _np.dtype(_np.uint64)}.get(t.dtype.kind, t.dtype)


def _masked(t, where_, identity):
    """numpy's where= of a reduction: elements where it is False count as
    the reduction's identity."""
    if where_ is None or where_ is True:
        return t
    mask = broadcast_to(_tracer(where_), t.shape)
    return globals()["where"](mask, t, _np.array(identity, t.dtype))


@_op
def sum(a, axis=None, dtype=None, keepdims=False, where=None):
    t = _tracer(a)
    d = _sum_dtype(t, dtype)
    return _reduce(ir_pb2.SUM, _masked(t, where, 0), axis, keepdims, d)


@_op
def prod(a, axis=None, dtype=None, keepdims=False, where=None):
    t = _tracer(a)
    d = _sum_dtype(t, dtype)
    return _reduce(ir_pb2.PROD, _masked(t, where, 1), axis, keepdims, d)


def _check_nonempty(t, axis, message):
    """numpy (and jax.numpy) refuse a max, min, argmax or argmin over no
    elements: there is no answer to give, where XLA would give the identity
    (-inf for a max)."""
    if 0 in [t.shape[i] for i in _axes(axis, t.ndim)]:
        raise ValueError(message)


def _extremum(kind, a, axis, keepdims, name=None):
    t = _tracer(a)
    if name is not None:
        _check_nonempty(t, axis, f"zero-size array to reduction operation {name} which has no identity")
    if t.dtype == _np.bool_:  # the IR reduces numbers; bools go through u8 and back
        return _convert(_reduce(kind, _convert(t, _np.uint8), axis, keepdims), _np.bool_)
    return _reduce(kind, t, axis, keepdims)


@_op
def max(a, axis=None, keepdims=False):
    return _extremum(ir_pb2.REDUCE_MAX, a, axis, keepdims, "maximum")


@_op
def min(a, axis=None, keepdims=False):
    return _extremum(ir_pb2.REDUCE_MIN, a, axis, keepdims, "minimum")


@_op
def any(a, axis=None, keepdims=False):
    return _extremum(ir_pb2.REDUCE_MAX, not_equal(a, 0), axis, keepdims)  # False over no elements


@_op
def all(a, axis=None, keepdims=False):
    return _extremum(ir_pb2.REDUCE_MIN, not_equal(a, 0), axis, keepdims)  # True over no elements


amax, amin = max, min


@_op
def mean(a, axis=None, dtype=None, keepdims=False, where=None):
    """numpy.mean: summed in `dtype` (float64 for integers by default),
    over the elements `where` selects."""
    t = _tracer(a)
    d = _np.dtype(dtype) if dtype is not None else t.dtype if _dtypes.is_float(t.dtype) else _np.dtype(_np.float64)
    axes = _axes(axis, t.ndim)
    if where is None or where is True:
        count = int(_np.prod([t.shape[i] for i in axes], dtype=_np.int64))
        return divide(_reduce(ir_pb2.SUM, t, axis, keepdims, d), d.type(count))
    mask = broadcast_to(_tracer(where), t.shape)
    total = _reduce(ir_pb2.SUM, _masked(astype(t, d), mask, 0), axis, keepdims, d)
    return divide(total, _reduce(ir_pb2.SUM, mask, axis, keepdims, d))


def _argreduce(op, a, axis):
    t = _tracer(a)
    _check_nonempty(t, axis, f"attempt to get {'argmax' if op == ir_pb2.ARGMAX else 'argmin'} of an empty sequence")
    if t.dtype == _np.bool_:  # the IR compares numbers: bools go through u8
        t = _convert(t, _np.uint8)
    if axis is None:
        t = reshape(t, (t.size,))
        axis = 0
    axis = _axes(axis, t.ndim)[0]
    shape = tuple(s for i, s in enumerate(t.shape) if i != axis)

    def attrs(n):
        n.arg_reduce.dimension = axis
        n.arg_reduce.index_dtype = ir_pb2.S64

    return _b().node(op, [t], shape, _np.int64, set_attrs=attrs)


def _keep_arg_dims(r, t, axis, keepdims):
    if not keepdims:
        return r
    if axis is None:
        return reshape(r, (1,) * t.ndim)
    ax = _axes(axis, t.ndim)[0]
    return reshape(r, tuple(1 if i == ax else n for i, n in enumerate(t.shape)))


@_op
def argmax(a, axis=None, keepdims=False):
    return _keep_arg_dims(_argreduce(ir_pb2.ARGMAX, a, axis), _tracer(a), axis, keepdims)


@_op
def argmin(a, axis=None, keepdims=False):
    return _keep_arg_dims(_argreduce(ir_pb2.ARGMIN, a, axis), _tracer(a), axis, keepdims)


# ---------------------------------------------------------------- statistics


@_op
def var(a, axis=None, dtype=None, ddof=0, keepdims=False, *, correction=None):
    """numpy's var: the mean of squared deviations from the mean (in float64
    for integer input), divided by N - ddof (`correction`, the Array API's
    name for it)."""
    if correction is not None:
        ddof = correction
    t = _tracer(a)
    d = _np.dtype(dtype) if dtype is not None else (t.dtype if _dtypes.is_float(t.dtype) else _np.dtype(float64))
    x = astype(t, d)
    axes = tuple(range(t.ndim)) if axis is None else tuple(_axis_list(axis, t.ndim, "var"))
    n = int(_np.prod([t.shape[i] for i in axes], dtype=_np.int64))
    dev = subtract(x, divide(sum(x, axes, keepdims=True), d.type(n)))
    return divide(sum(multiply(dev, dev), axes, keepdims=keepdims), d.type(builtins.max(n - ddof, 0)))


@_op
def std(a, axis=None, dtype=None, ddof=0, keepdims=False, *, correction=None):
    return sqrt(var(a, axis=axis, dtype=dtype, ddof=ddof, keepdims=keepdims, correction=correction))


# ---------------------------------------------------------------- NaN-ignoring reductions


def _nan_filled(a, value):
    t = _tracer(a)
    if not _dtypes.is_float(t.dtype):
        return t, None
    nans = isnan(t)
    return where(nans, t.dtype.type(value), t), nans


@_op
def nansum(a, axis=None, dtype=None, keepdims=False):
    t, _ = _nan_filled(a, 0)
    return sum(t, axis=axis, dtype=dtype, keepdims=keepdims)


@_op
def nanprod(a, axis=None, dtype=None, keepdims=False):
    t, _ = _nan_filled(a, 1)
    return prod(t, axis=axis, dtype=dtype, keepdims=keepdims)


@_op
def nanmean(a, axis=None, keepdims=False):
    """The mean of the non-NaN elements; NaN where there are none (numpy
    warns there, and gives NaN)."""
    t, nans = _nan_filled(a, 0)
    if nans is None:
        return mean(t, axis=axis, keepdims=keepdims)
    count = sum(logical_not(nans), axis=axis, keepdims=keepdims)
    return divide(sum(t, axis=axis, keepdims=keepdims), astype(count, t.dtype))


def _nan_extremum(fn, fill, a, axis, keepdims):
    t, nans = _nan_filled(a, fill)
    if nans is None:
        return fn(t, axis=axis, keepdims=keepdims)
    out = fn(t, axis=axis, keepdims=keepdims)
    return where(all(nans, axis=axis, keepdims=keepdims), t.dtype.type(_np.nan), out)


@_op
def nanmax(a, axis=None, keepdims=False):
    return _nan_extremum(max, -_np.inf, a, axis, keepdims)


@_op
def nanmin(a, axis=None, keepdims=False):
    return _nan_extremum(min, _np.inf, a, axis, keepdims)


# ---------------------------------------------------------------- cumulative


def _cumulative(combine, identity, a, axis, d, name):
    """An inclusive scan along one axis in log2(n) steps: each step combines
    every element with the one 2**k before it (Hillis and Steele). Floating
    sums associate differently from numpy's running sum, within rounding."""
    t = _tracer(a)
    if axis is None:
        t, axis = ravel(t), 0
    ax = _axis_list(axis, t.ndim, name)[0]
    t = astype(t, d)
    n = t.shape[ax]
    k = 1
    while k < n:
        widths = [(0, 0)] * t.ndim
        widths[ax] = (k, 0)
        head = (slice(None),) * ax + (slice(0, n),)
        t = combine(t, pad(t, widths, constant_values=identity)[head])
        k *= 2
    return t


@_op
def cumsum(a, axis=None, dtype=None):
    t = _tracer(a)
    return _cumulative(add, 0, t, axis, _sum_dtype(t, dtype), "cumsum")


@_op
def cumprod(a, axis=None, dtype=None):
    t = _tracer(a)
    return _cumulative(multiply, 1, t, axis, _sum_dtype(t, dtype), "cumprod")


def _cumulative_api(scan, identity, name):
    """The Array API's cumulative_sum / cumulative_prod (numpy 2.1's):
    `axis` required past one dimension; `include_initial` puts the
    identity first, so the result is one longer along the axis."""

    @_op
    def f(x, axis=None, dtype=None, include_initial=False):
        t = _tracer(x)
        if axis is None and t.ndim > 1:
            raise ValueError(f"{name}: axis is required for an array of {t.ndim} dimensions")
        r = scan(t, 0 if axis is None else axis, dtype)
        if not include_initial:
            return r
        ax = 0 if axis is None else _axis_list(axis, r.ndim, name)[0]
        widths = [(0, 0)] * r.ndim
        widths[ax] = (1, 0)
        return pad(r, widths, constant_values=identity)

    f.__name__ = f.__wrapped__.__name__ = name
    return f


cumulative_sum = _cumulative_api(cumsum, 0, "cumulative_sum")
cumulative_prod = _cumulative_api(cumprod, 1, "cumulative_prod")
