"""The Array API standard's names (2024.12) where numpy's differ or are
missing elsewhere here: creation (empty, full_like, meshgrid), layout
(concat, permute_dims, unstack, broadcast_arrays, matrix_transpose),
vecdot and diff, the data-dependent searches (nonzero, count_nonzero,
unique_*), the dtype queries (can_cast, isdtype, result_type), the
elementwise aliases, and __array_namespace_info__.

nonzero and unique_* have shapes that depend on the values. Inside a trace
they take `size=` (and `fill_value=`), as jax.numpy's do; called at once on
Arrays without a size, they first fetch the count (an explicit transfer of
one integer, which a transfer guard sees), as jax.numpy's eager calls do.
"""

import builtins
import collections
import functools

import numpy as _np

from tessel import _dtypes
from tessel._trace import Tracer, current_builder
from tessel.numpy._core import (
    _b,
    _bitcast,
    _op,
    _result_dtype,
    _tracer,
    float64,
    full,
    int64,
    zeros,
    zeros_like,
)
from tessel.numpy._elementwise import equal as _equal
from tessel.numpy._elementwise import (
    abs,
    add,
    astype,
    bitwise_and,
    bitwise_or,
    divide,
    equal,
    invert,
    isinf,
    isnan,
    less,
    logical_and,
    logical_not,
    logical_or,
    maximum,
    minimum,
    multiply,
    not_equal,
    power,
    sqrt,
    subtract,
    where,
)
from tessel.numpy._indexing import _scatter, take
from tessel.numpy._layout import (
    _axis_list,
    broadcast_to,
    concatenate,
    moveaxis,
    ravel,
    reshape,
    stack,
    swapaxes,
    transpose,
)
from tessel.numpy._reductions import any, cumsum, sum
from tessel.numpy._sorting import argsort

__array_api_version__ = "2024.12"
e, pi, inf, nan, newaxis = _np.e, _np.pi, _np.inf, _np.nan, None

# Placement lives in layers above this one (tessel.device_put, devices,
# with_sharding_constraint); tessel/__init__.py hands them in through install.
_placement = {}


def install(*, device_put, devices, with_sharding_constraint):
    _placement.update(device_put=device_put, devices=devices, with_sharding_constraint=with_sharding_constraint)


# ---------------------------------------------------------------- creation


def placed(fn):
    """`fn`, a creation function, with the Array API's `device=` keyword:
    called at once, the result is put there (tessel.device_put: a device, a
    tessel.Device or a sharding, such as another array's .device); inside a
    trace, a sharding constraint (tessel.with_sharding_constraint)."""

    @functools.wraps(fn)
    def wrapper(*args, device=None, **kwargs):
        out = fn(*args, **kwargs)
        if device is None:
            return out
        if current_builder() is not None:
            return _placement["with_sharding_constraint"](out, device)
        return _placement["device_put"](out, device)

    return wrapper


@_op
def empty(shape, dtype=None):
    """Array API empty: zeros (an array's contents are defined here)."""
    return zeros(shape, dtype)


@_op
def empty_like(x, dtype=None):
    return zeros_like(x, dtype)


@_op
def full_like(x, fill_value, dtype=None):
    t = _tracer(x)
    return full(t.shape, fill_value, dtype or t.dtype)


@_op
def meshgrid(*arrays, indexing="xy", sparse=False, copy=True):
    """numpy.meshgrid of 1-D arrays: 'xy' (the first two axes swapped) or
    'ij'; `sparse` keeps each array along its own axis, unbroadcast."""
    if indexing not in ("xy", "ij"):
        raise ValueError(f"meshgrid: indexing must be 'xy' or 'ij', got {indexing!r}")
    ts = [ravel(_tracer(a)) for a in arrays]
    n = len(ts)
    lengths = [t.shape[0] for t in ts]
    order = list(range(n))
    if indexing == "xy" and n >= 2:
        order[0], order[1] = 1, 0
    shape = tuple(lengths[i] for i in order)
    out = []
    for i, t in enumerate(ts):
        at = order.index(i)
        r = reshape(t, tuple(lengths[i] if k == at else 1 for k in range(n)))
        out.append(r if sparse else broadcast_to(r, shape))
    return tuple(out)


# ---------------------------------------------------------------- layout


@_op
def concat(arrays, axis=0):
    """Array API concat: numpy.concatenate; axis=None joins them flattened."""
    if axis is None:
        return concatenate([ravel(_tracer(a)) for a in arrays], axis=0)
    return concatenate(arrays, axis=axis)


@_op
def permute_dims(x, axes):
    return transpose(x, tuple(axes))


@_op
def matrix_transpose(x):
    t = _tracer(x)
    if t.ndim < 2:
        raise ValueError(f"matrix_transpose: expected an array of at least 2 dimensions, got {t!r}")
    return swapaxes(t, -1, -2)


@_op
def unstack(x, axis=0):
    """The slices of x along `axis`, as a tuple."""
    t = _tracer(x)
    if t.ndim == 0:
        raise ValueError("unstack: expected an array of at least 1 dimension, got a 0-d array")
    moved = moveaxis(t, _axis_list(axis, t.ndim, "unstack")[0], 0)
    return tuple(moved[i] for i in range(moved.shape[0]))


@_op
def broadcast_arrays(*arrays):
    ts = [_tracer(a) for a in arrays]
    shape = _np.broadcast_shapes(*(t.shape for t in ts))
    return tuple(broadcast_to(t, shape) for t in ts)


# ---------------------------------------------------------------- products and differences


@_op
def vecdot(x1, x2, axis=-1):
    """Array API vecdot: the sum of x1 * x2 along `axis` after broadcasting,
    in their common dtype (booleans: any of the ands), as numpy.vecdot."""
    a, b = _tracer(x1), _tracer(x2)
    d = _result_dtype(a, b)
    shape = _np.broadcast_shapes(a.shape, b.shape)
    if not shape:
        raise ValueError("vecdot: expected arrays of at least 1 dimension, got 0-d")
    ax = _axis_list(axis, len(shape), "vecdot")[0]
    if a.ndim and b.ndim and a.shape[ax - len(shape) + a.ndim] != b.shape[ax - len(shape) + b.ndim]:
        raise ValueError(
            f"vecdot: the contracted axis {axis} has {a.shape[ax - len(shape) + a.ndim]} elements in x1, "
            f"{b.shape[ax - len(shape) + b.ndim]} in x2"
        )
    if d == _np.bool_:
        return any(logical_and(a, b), axis=ax)
    return sum(multiply(astype(a, d), astype(b, d)), axis=ax, dtype=d)


@_op
def diff(a, n=1, axis=-1, prepend=None, append=None):
    """numpy.diff: the n-th differences along `axis` (booleans: not_equal),
    with `prepend` and `append` joined first (scalars broadcast to one
    slice)."""
    t = _tracer(a)
    if n < 0:
        raise ValueError(f"diff: order must be non-negative, got {n}")
    if t.ndim == 0:
        raise ValueError("diff: requires input that is at least one dimensional")
    ax = _axis_list(axis, t.ndim, "diff")[0]
    if n == 0:
        return t
    parts = []
    for extra in (prepend, t, append):
        if extra is None:
            continue
        x = _tracer(extra)
        if x.ndim == 0:
            x = broadcast_to(x, t.shape[:ax] + (1,) + t.shape[ax + 1 :])
        parts.append(x)
    t = concatenate(parts, axis=ax) if len(parts) > 1 else t
    for _ in range(n):
        k = t.shape[ax]
        hi = take(t, _np.arange(1, k), axis=ax)
        lo = take(t, _np.arange(0, builtins.max(k - 1, 0)), axis=ax)
        t = not_equal(hi, lo) if t.dtype == _np.bool_ else subtract(hi, lo)
    return t


# ---------------------------------------------------------------- elementwise


pow = power
bitwise_invert = invert


@_op
def positive(x):
    t = _tracer(x)
    if t.dtype == _np.bool_:
        raise TypeError("positive: not defined for bool arrays (numpy has no bool loop for it)")
    return t


@_op
def hypot(x1, x2):
    """numpy.hypot: sqrt(x1^2 + x2^2) without overflow (the larger scaled
    out), inf when either is infinite, even beside a NaN."""
    d = _result_dtype(x1, x2)
    if not _dtypes.is_float(d):
        d = _np.result_type(d, _np.float16)  # the smallest float holding the ints, as numpy's loops
    a, b = abs(astype(_tracer(x1), d)), abs(astype(_tracer(x2), d))
    hi, lo = maximum(a, b), minimum(a, b)
    safe = where(equal(hi, 0), d.type(1), hi)
    ratio = divide(lo, safe)
    r = multiply(hi, sqrt(add(multiply(ratio, ratio), d.type(1))))
    return where(logical_or(isinf(a), isinf(b)), d.type(_np.inf), r)


def _float_operands(*xs):
    """The operands in their float result dtype (integers: the smallest
    float holding them, as numpy's loops), with the unsigned integer of its
    width and its sign bit."""
    d = _result_dtype(*xs)
    if not _dtypes.is_float(d):
        d = _np.result_type(d, _np.float16)
    u = _np.dtype(f"u{d.itemsize}")
    return d, u, u.type(1 << (8 * d.itemsize - 1)), [astype(_tracer(x), d) for x in xs]


@_op
def signbit(x):
    """numpy.signbit: whether the sign bit is set (-0.0 and -nan included)."""
    t = _tracer(x)
    if not _dtypes.is_float(t.dtype):
        return t < 0 if t.dtype.kind == "i" else full(t.shape, False, _np.bool_)
    return _bitcast(t, _np.dtype(f"i{t.dtype.itemsize}")) < 0


@_op
def copysign(x1, x2):
    """numpy.copysign: x1's magnitude with x2's sign bit (NaNs too)."""
    d, u, sign, (a, b) = _float_operands(x1, x2)
    shape = _np.broadcast_shapes(a.shape, b.shape)
    ua, ub = _bitcast(broadcast_to(a, shape), u), _bitcast(broadcast_to(b, shape), u)
    return _bitcast(bitwise_or(bitwise_and(ua, u.type(int(sign) - 1)), bitwise_and(ub, sign)), d)


def nextafter(x1, x2):
    """numpy.nextafter: the next float after x1 toward x2 (NaN where either
    is; from zero, the smallest subnormal of x2's sign). Where they are
    equal, x2, as C's; numpy's float16 loop gives x1 there (0.0 toward
    -0.0 stays 0.0), and so does this."""
    return _nextafter(x1, x2, "numpy")


@_op
def _nextafter(x1, x2, equal="c"):
    """nextafter; `equal`: "c" gives x2 where they are equal (C's, XLA's
    chlo.next_after), "numpy" numpy's (x1 for float16)."""
    d, u, sign, (a, b) = _float_operands(x1, x2)
    shape = _np.broadcast_shapes(a.shape, b.shape)
    a, b = broadcast_to(a, shape), broadcast_to(b, shape)
    ua = _bitcast(a, u)
    # Away from zero (toward x2 past x1's magnitude) the bits grow by one, else shrink.
    away = logical_and(not_equal(a, d.type(0)), _equal(less(a, b), less(d.type(0), a)))
    step = where(away, add(ua, u.type(1)), subtract(ua, u.type(1)))
    tiny = where(signbit(b), u.type(int(sign) | 1), u.type(1))
    out = _bitcast(where(_equal(a, d.type(0)), tiny, step), d)
    same = a if equal == "numpy" and d == _np.float16 else b
    out = where(_equal(a, b), same, out)
    return where(logical_or(isnan(a), isnan(b)), d.type(_np.nan), out)


@_op
def real(x):
    """The real part: x itself (real dtypes only)."""
    return _tracer(x)


@_op
def imag(x):
    return zeros_like(x)


@_op
def conj(x):
    return _tracer(x)


conjugate = conj


# ---------------------------------------------------------------- value-dependent shapes


def _eager_size(what, count, size):
    """The size to use: `size`, or, in an eager call, the count fetched."""
    if size is not None:
        return int(size)
    if current_builder() is not None:
        raise ValueError(
            f"{what}: the size of its result depends on the values, which a trace does not know: "
            f"pass size= (and fill_value=), as jax.numpy asks"
        )
    return int(count().fetch())


@_op
def count_nonzero(a, axis=None, keepdims=False):
    t = _tracer(a)
    return sum(not_equal(t, t.dtype.type(0)), axis=axis, keepdims=keepdims, dtype=int64)


@_op
def _nonzero(a, size, fill_value):
    t = _tracer(a)
    if t.ndim == 0:
        raise ValueError("nonzero: calling nonzero on 0d arrays is not allowed; use atleast_1d(a).nonzero()")
    flat = not_equal(ravel(t), t.dtype.type(0))
    n = flat.shape[0]
    # The nonzero positions first, in order (a stable sort of "is zero").
    order = argsort(logical_not(flat))
    if size > n:
        order = concatenate([order, zeros(size - n, int64)])
    idx = take(order, _np.arange(size)) if size != n else order
    valid = _b().iota((size,), _np.dtype(int64), 0) < sum(flat, dtype=int64)
    fills = fill_value if isinstance(fill_value, tuple) else (fill_value,) * t.ndim
    if len(fills) != t.ndim:
        raise ValueError(f"nonzero: fill_value has {len(fills)} entries, expected one per dimension ({t.ndim})")
    out, stride = [], 1
    strides = []
    for s in reversed(t.shape):
        strides.append(stride)
        stride *= s
    for dim, (s, st) in enumerate(zip(t.shape, reversed(strides))):
        coord = idx // st % s if s else idx
        out.append(where(valid, coord, int64(fills[dim] or 0)))
    return tuple(out)


def nonzero(a, *, size=None, fill_value=None):
    """numpy.nonzero: per dimension, the indices of the nonzero elements in
    row-major order (int64). With `size` (jax.numpy's), exactly that many,
    padded with `fill_value` (default 0; a tuple gives one per dimension)."""
    return _nonzero(a, _eager_size("nonzero", lambda: count_nonzero(a), size), fill_value)


def argwhere(a, *, size=None, fill_value=None):
    """numpy.argwhere: the nonzero elements' indices, one row each."""
    parts = nonzero(a, size=size, fill_value=fill_value)
    return stack(parts, axis=-1) if parts else zeros((0, 0), int64)


UniqueAllResult = collections.namedtuple("UniqueAllResult", "values indices inverse_indices counts")
UniqueCountsResult = collections.namedtuple("UniqueCountsResult", "values counts")
UniqueInverseResult = collections.namedtuple("UniqueInverseResult", "values inverse_indices")


def _firsts(t):
    """A stable sort of x's elements: the order, the sorted values and
    whether each starts a run of equal ones (every NaN its own run)."""
    flat = ravel(t)
    order = argsort(flat)
    s = take(flat, order)
    n = s.shape[0]
    if n == 0:
        return order, s, s
    head = full((1,), True, _np.bool_)
    rest = not_equal(take(s, _np.arange(1, n)), take(s, _np.arange(0, n - 1)))
    return order, s, concatenate([head, rest])


@_op
def _unique(x, size, fill_value, want):
    t = _tracer(x)
    order, s, first = _firsts(t)
    n = s.shape[0]
    pos = subtract(cumsum(first, dtype=int64), int64(1)) if n else zeros((0,), int64)
    slot = where(first, pos, int64(size))  # the later elements of a run, and those past `size`, are dropped
    lowest = take(s, _np.zeros(1, _np.int64)) if n else full((1,), 0, t.dtype)
    fill = broadcast_to(lowest, (size,)) if fill_value is None else full((size,), fill_value, t.dtype)
    out = {"values": _scatter(fill, slot, s, 0, "set")}
    if "indices" in want:
        first_index = take(order, _np.zeros(1, _np.int64)) if n else zeros((1,), int64)
        out["indices"] = _scatter(broadcast_to(first_index, (size,)), slot, order, 0, "set")
    if "inverse_indices" in want:
        out["inverse_indices"] = reshape(_scatter(zeros((n,), int64), order, pos, 0, "set"), t.shape)
    if "counts" in want:
        out["counts"] = _scatter(zeros((size,), int64), pos, full((n,), 1, int64), 0, "add")
    return tuple(out[k] for k in want)


@_op
def _distinct_count(x):
    return sum(_firsts(_tracer(x))[2], dtype=int64)


def _unique_call(what, x, size, fill_value, fields):
    return _unique(x, _eager_size(what, lambda: _distinct_count(x), size), fill_value, fields)


def unique_values(x, *, size=None, fill_value=None):
    """The sorted distinct values of x (NaNs each distinct, as the Array
    API and numpy.unique_values). With `size` (jax.numpy's): that many,
    padded with `fill_value` (default: the smallest value)."""
    return _unique_call("unique_values", x, size, fill_value, ("values",))[0]


def unique_counts(x, *, size=None, fill_value=None):
    """The distinct values and how often each occurs (counts past them: 0)."""
    return UniqueCountsResult(*_unique_call("unique_counts", x, size, fill_value, UniqueCountsResult._fields))


def unique_inverse(x, *, size=None, fill_value=None):
    """The distinct values and each element's position among them (x's shape)."""
    return UniqueInverseResult(*_unique_call("unique_inverse", x, size, fill_value, UniqueInverseResult._fields))


def unique_all(x, *, size=None, fill_value=None):
    """values, the index of each one's first occurrence, each element's
    position among the values (x's shape), and how often each occurs."""
    return UniqueAllResult(*_unique_call("unique_all", x, size, fill_value, UniqueAllResult._fields))


# ---------------------------------------------------------------- dtypes


def _dtype_of(x):
    if isinstance(x, (bool, int, float, complex)) and not isinstance(x, _np.generic):
        return x
    if hasattr(x, "dtype") and not isinstance(x, type):
        return _np.dtype(x.dtype)
    return _np.dtype(x)


def result_type(*arrays_and_dtypes):
    """numpy.result_type over arrays (Tracers, Arrays, numpy), dtypes and
    Python scalars (weak, NEP 50), bfloat16 included."""
    parts = []
    for x in arrays_and_dtypes:
        if isinstance(x, Tracer) or isinstance(x, (bool, int, float)) and not isinstance(x, _np.generic):
            parts.append(x)
        else:
            parts.append(_np.empty((), _dtype_of(x)))
    return _np.dtype(_result_dtype(*parts))


def can_cast(from_, to, casting="safe"):
    """numpy.can_cast of a dtype (or an array's) to a dtype."""
    f, t = _dtype_of(from_), _np.dtype(to)
    bf16 = _dtypes.BFLOAT16
    if bf16 is not None and bf16 in (f, t):
        # bfloat16 casts safely to float32 and float64 only, and from bool and 8-bit integers.
        if f == t:
            return True
        if f == bf16:
            return t in (_np.dtype(_np.float32), _np.dtype(_np.float64)) or casting == "unsafe"
        return f in (_np.dtype(_np.bool_), _np.dtype(_np.int8), _np.dtype(_np.uint8)) or casting == "unsafe"
    return bool(_np.can_cast(f, t, casting))


_KINDS = {
    "bool": lambda d: d == _np.bool_,
    "signed integer": lambda d: d.kind == "i",
    "unsigned integer": lambda d: d.kind == "u",
    "integral": lambda d: d.kind in "iu",
    "real floating": lambda d: _dtypes.is_float(d),
    "complex floating": lambda d: d.kind == "c",
    "numeric": lambda d: d != _np.bool_,
}


def isdtype(dtype, kind):
    """Array API isdtype: whether `dtype` is `kind` (a dtype, one of the
    standard's kind names, or a tuple of either). bfloat16 is real floating."""
    d = _np.dtype(dtype)
    if isinstance(kind, tuple):
        return builtins.any(isdtype(d, k) for k in kind)
    if isinstance(kind, str):
        if kind not in _KINDS:
            raise ValueError(f"isdtype: unknown kind {kind!r}; expected a dtype or one of {sorted(_KINDS)}")
        return _KINDS[kind](d)
    return d == _np.dtype(kind)


class _Info:
    """What __array_namespace_info__() tells: tessel.numpy's dtypes, and
    the cluster's devices."""

    def capabilities(self):
        # Boolean indexing by a traced mask and nonzero without a size have
        # value-dependent shapes, which a trace does not know.
        return {"boolean indexing": False, "data-dependent shapes": False, "max dimensions": None}

    def default_device(self):
        return _placement["devices"]()[0]

    def devices(self):
        return _placement["devices"]()

    def default_dtypes(self, *, device=None):
        return {
            "real floating": _np.dtype(float64),
            "complex floating": None,
            "integral": _np.dtype(int64),
            "indexing": _np.dtype(int64),
        }

    def dtypes(self, *, device=None, kind=None):
        names = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
        names += ["float16", "float32", "float64"]
        out = {n: _np.dtype(n) for n in names}
        if _dtypes.BFLOAT16 is not None:
            out["bfloat16"] = _dtypes.BFLOAT16
        return out if kind is None else {n: d for n, d in out.items() if isdtype(d, kind)}


def __array_namespace_info__():
    return _Info()
