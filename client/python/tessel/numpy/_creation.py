"""Arrays from values and ranges: asarray, arange, linspace."""

import builtins

import numpy as _np

from tessel.numpy._core import _b, float64, int64, _op, _tracer
from tessel.numpy._elementwise import add, astype, divide, equal, floor, multiply, where


@_op
def arange(start, stop=None, step=None, dtype=None):
    """numpy.arange: start + i * step for i below ceil((stop - start) / step);
    integers unless an argument is a float."""
    if stop is None:
        start, stop = 0, start
    step = 1 if step is None else step
    if step == 0:
        raise ZeroDivisionError("arange: step of zero")
    n = builtins.max(int(_np.ceil((stop - start) / step)), 0)
    d = _np.dtype(dtype) if dtype is not None else _np.result_type(start, stop, step)
    if d == _np.bool_:
        # numpy: [start, start + step] as bools; no fill rule beyond two elements
        if n > 2:
            raise ValueError(f"arange: {n} elements of dtype bool (numpy fills at most 2: [start, start + step])")
        return astype(arange(start, stop, step), d)
    if d.kind == "i":
        d = _np.dtype(int64) if dtype is None else d
    if start == 0 and step == 1:
        return _b().iota((n,), d, 0)
    work = (
        _np.dtype(float64)
        if d.kind == "f" or builtins.any(isinstance(v, float) for v in (start, step))
        else _np.dtype(int64)
    )
    i = _b().iota((n,), work, 0)
    return astype(add(multiply(i, work.type(step)), work.type(start)), d)


# ---------------------------------------------------------------- creation


@_op
def linspace(start, stop, num=50, endpoint=True, retstep=False, dtype=None, axis=0):
    """numpy.linspace for scalar ends: start + i * step, the last element
    `stop` exactly when `endpoint`; an integer dtype floors, as numpy does."""
    num = int(num)
    if num < 0:
        raise ValueError(f"linspace: number of samples, {num}, must be non-negative")
    if not (_np.ndim(start) == 0 and _np.ndim(stop) == 0):
        raise NotImplementedError("linspace: array-valued start and stop are not supported yet; pass scalars")
    start, stop = float(start), float(stop)
    div = (num - 1) if endpoint else num
    step = (stop - start) / div if div > 0 else _np.nan
    i = _b().iota((num,), _np.dtype(float64), 0)
    if div > 0 and step == 0:
        y = add(multiply(divide(i, float(div)), stop - start), start)
    else:
        y = add(multiply(i, step if div > 0 else 0.0), start)
    if endpoint and num > 1:
        y = where(equal(i, float(num - 1)), stop, y)
    out_dtype = _np.dtype(float64) if dtype is None else _np.dtype(dtype)
    if out_dtype.kind in "iu":
        y = floor(y)
    y = astype(y, out_dtype)
    return (y, step) if retstep else y


@_op
def asarray(a, dtype=None, *, copy=None):
    """`a` as an array of `dtype`. `copy` (the Array API's) changes
    nothing: arrays are values, a copy is not observable."""
    t = _tracer(a)
    return t if dtype is None or _np.dtype(dtype) == t.dtype else astype(t, dtype)


array = asarray


@_op
def copy(a, order="K"):
    """numpy.copy: a new array of a's values. Arrays are values here, so
    inside a trace it is `a` itself; outside, a new tessel.Array that
    outlives a's donation."""
    return _tracer(a)
