"""The helpers every op builds on: dtype promotion (weak Python scalars),
broadcasting, operands as tracers, the eager-call hook, and the constant
constructors (zeros, ones, full).
"""

import builtins
import functools

import numpy as _np

from tessel import _dtypes
from tessel._trace import Tracer, current_builder
from tessel.v1 import ir_pb2


float32, float64, float16 = _np.float32, _np.float64, _np.float16
bfloat16 = _dtypes.BFLOAT16.type if _dtypes.BFLOAT16 is not None else None
int8, int16, int32, int64, bool_ = _np.int8, _np.int16, _np.int32, _np.int64, _np.bool_
uint8, uint16, uint32, uint64 = _np.uint8, _np.uint16, _np.uint32, _np.uint64
dtype = _np.dtype


# How an op runs outside a trace: registered by tessel._jit (which depends on
# this module, not the other way round).
_eager_call = None


def register_eager(call):
    """Installs `call(fn, args, kwargs)`, which runs op `fn` at once on
    tessel.Arrays; tessel._jit registers its one-op jit here."""
    global _eager_call
    _eager_call = call


def _op(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if current_builder() is None:
            if _eager_call is None:
                raise RuntimeError(f"tessel.numpy.{fn.__name__} outside a trace needs tessel imported")
            return _eager_call(fn, args, kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _b():
    return current_builder()


def _is_pyscalar(x):
    return isinstance(x, (bool, int, float)) and not isinstance(x, _np.generic)


def _weak_value(x):
    """A Python value standing for a weakly typed operand, for np.result_type."""
    if _is_pyscalar(x):
        return x
    if x.dtype == _np.bool_:
        return True
    return 1 if x.dtype.kind in "iu" else 1.0


def _result_dtype(*xs):
    # The common case in a trace: strongly typed tracers of one dtype.
    first = xs[0] if xs else None
    if type(first) is Tracer and not first.weak:
        d = first.dtype
        if builtins.all(type(x) is Tracer and not x.weak and x.dtype == d for x in xs[1:]):
            return d
    strong, weak = [], []
    for x in xs:
        if isinstance(x, Tracer):
            (weak if x.weak else strong).append(x if x.weak else x.dtype)
        elif _is_pyscalar(x):
            weak.append(x)
        else:
            strong.append(_np.asarray(x).dtype)
    # numpy has no promotion rules for bfloat16: it promotes as float16 does
    # (a Python float keeps it bf16; bf16 with f16 is f32, as in JAX).
    bf16 = _dtypes.BFLOAT16 is not None and _dtypes.BFLOAT16 in strong
    if bf16:
        has_f16 = _np.dtype(_np.float16) in strong
        strong = [_np.dtype(_np.float16) if s == _dtypes.BFLOAT16 else s for s in strong]
    d = _np.result_type(*strong, *[_weak_value(w) for w in weak])
    if bf16 and d == _np.dtype(_np.float16):
        d = _np.dtype(_np.float32) if has_f16 else _dtypes.BFLOAT16
    _dtypes.to_proto(d)
    return d


def _tracer(x):
    if isinstance(x, Tracer):
        return x
    if _is_pyscalar(x):
        d = _result_dtype(x)
        t = _b().fill(x, (), d)
        t.weak = True
        return t
    return _b().literal(_np.asarray(x))


asarray_in_trace = _tracer  # a Python or numpy value returned from a traced function


def _convert(t, d):
    d = _np.dtype(d)
    if t.dtype == d:
        return t

    def attrs(n):
        n.convert.dtype = _dtypes.to_proto(d)

    return _b().node(ir_pb2.CONVERT, [t], t.shape, d, set_attrs=attrs)


def _bitcast(t, d):
    """CONVERT with `bitcast`: t's bits read as dtype `d`, as wide."""
    d = _np.dtype(d)
    if t.dtype == d:
        return t
    if d.itemsize != t.dtype.itemsize:
        raise TypeError(f"bitcast of {t.dtype.name} ({t.dtype.itemsize} bytes) to {d.name} ({d.itemsize} bytes)")

    def attrs(n):
        n.convert.dtype = _dtypes.to_proto(d)
        n.convert.bitcast = True

    return _b().node(ir_pb2.CONVERT, [t], t.shape, d, set_attrs=attrs)


def _broadcast(t, shape):
    shape = tuple(shape)
    if t.shape == shape:
        return t
    offset = len(shape) - len(t.shape)

    def attrs(n):
        n.broadcast_in_dim.dims.extend(shape)
        n.broadcast_in_dim.broadcast_dimensions.extend(range(offset, len(shape)))

    return _b().node(ir_pb2.BROADCAST_IN_DIM, [t], shape, t.dtype, set_attrs=attrs)


def _operand(x, d, shape):
    """`x` as a Tracer of dtype `d` broadcast to `shape`. Scalars are generated
    on the device at their full shape, never shipped."""
    if _is_pyscalar(x):
        return _b().fill(x, shape, d)
    return _broadcast(_convert(_tracer(x), d), shape)


def _shape(x):
    if isinstance(x, Tracer):
        return x.shape
    return _np.shape(x)


def _out_of_range(x, d):
    """Whether Python int `x` cannot be held by integer dtype `d` (NEP 50)."""
    if not (isinstance(x, int) and not isinstance(x, bool)) or _np.dtype(d).kind not in "iu":
        return False
    info = _np.iinfo(d)
    return not info.min <= x <= info.max


def _check_in_range(xs, d):
    for x in xs:
        if _out_of_range(x, d):
            raise OverflowError(f"Python integer {x} out of bounds for {_np.dtype(d).name}")


def _elementwise(op, xs, d=None, out_dtype=None, set_attrs=None):
    # The common case in a trace: strongly typed tracers of one dtype and
    # shape, nothing to convert, broadcast or range-check.
    first = xs[0]
    if type(first) is Tracer and not first.weak and (d is None or first.dtype == d):
        fd, fs = first.dtype, first.shape
        if builtins.all(type(x) is Tracer and not x.weak and x.dtype == fd and x.shape == fs for x in xs[1:]):
            return _b().node(op, xs, fs, out_dtype or fd, set_attrs=set_attrs)
    d = _np.dtype(d) if d is not None else _result_dtype(*xs)
    _check_in_range(xs, d)
    shapes = [_shape(x) for x in xs]
    shape = shapes[0] if builtins.all(s == shapes[0] for s in shapes) else _np.broadcast_shapes(*shapes)
    ops = [_operand(x, d, shape) for x in xs]
    return _b().node(op, ops, shape, out_dtype or d, set_attrs=set_attrs)


def _float_dtype(*xs):
    d = _result_dtype(*xs)
    return d if _dtypes.is_float(d) else _np.dtype(_np.float64)


def _is_device_array(i):
    return type(i).__name__ == "Array" and hasattr(i, "sharding")


def _is_traced(i):
    """A value known only on the device: a tracer, or a tessel.Array."""
    return isinstance(i, Tracer) or _is_device_array(i)


# ---------------------------------------------------------------- creation


@_op
def zeros(shape, dtype=None):
    return full(shape, 0, float64 if dtype is None else dtype)


@_op
def ones(shape, dtype=None):
    return full(shape, 1, float64 if dtype is None else dtype)


@_op
def full(shape, fill_value, dtype=None):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    d = _np.dtype(dtype) if dtype is not None else _result_dtype(fill_value)
    _check_in_range([fill_value], d)  # numpy 2: full(3, 300, uint8) is an OverflowError
    return _operand(fill_value, d, shape)


@_op
def zeros_like(a, dtype=None):
    t = _tracer(a)
    return full(t.shape, 0, dtype or t.dtype)


@_op
def ones_like(a, dtype=None):
    t = _tracer(a)
    return full(t.shape, 1, dtype or t.dtype)
