"""tessel.numpy: the op namespace, after jax.numpy names and numpy semantics.

Inside @tessel.jit these functions trace into the graph. Called on
tessel.Arrays (or numpy arrays) outside a trace, they run at once on the
devices, compiled like a one-op jit.
"""

import builtins
import functools
import operator as _operator

import numpy as _np

from tessel import _dtypes
from tessel._trace import Tracer, current_builder, install_operators
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


# ---------------------------------------------------------------- elementwise

# numpy's loops on two bools: add and maximum are a logical or, multiply and
# minimum a logical and; subtract is an error; power, floor_divide and
# remainder have no bool loop and take int8's.
_ON_BOOLS = {ir_pb2.ADD: ir_pb2.OR, ir_pb2.MAX: ir_pb2.OR, ir_pb2.MUL: ir_pb2.AND, ir_pb2.MIN: ir_pb2.AND}


def _int8_for_bools(d):
    return _np.dtype(_np.int8) if d == _np.bool_ else d


def _binary(op):
    @_op
    def f(x1, x2):
        d = _result_dtype(x1, x2)
        if d == _np.bool_:
            if op == ir_pb2.SUB:
                raise TypeError(
                    "numpy boolean subtract, the `-` operator, is not supported; "
                    "use the bitwise_xor, the `^` operator, or the logical_xor function instead"
                )
            if op == ir_pb2.POW:
                return _elementwise(op, [x1, x2], _np.int8)
            return _elementwise(_ON_BOOLS.get(op, op), [x1, x2])
        return _elementwise(op, [x1, x2], d)

    return f


add = _binary(ir_pb2.ADD)
subtract = _binary(ir_pb2.SUB)
multiply = _binary(ir_pb2.MUL)
maximum = _binary(ir_pb2.MAX)
minimum = _binary(ir_pb2.MIN)
power = _binary(ir_pb2.POW)
bitwise_and = _binary(ir_pb2.AND)
bitwise_or = _binary(ir_pb2.OR)
bitwise_xor = _binary(ir_pb2.XOR)


def _truth(x):
    """x != 0 as bool (NaN is true, as in numpy)."""
    if _is_pyscalar(x):
        return bool(x)
    t = _tracer(x)
    return t if t.dtype == _np.bool_ else not_equal(t, 0)


def _logical(op):
    @_op
    def f(x1, x2):
        # numpy's logical loops take a Python int as a C long, whatever the
        # other operand's dtype: past int64 it is an OverflowError.
        if not (_is_pyscalar(x1) and _is_pyscalar(x2)):
            _check_in_range([x1, x2], _np.int64)
        return _elementwise(op, [_truth(x1), _truth(x2)], _np.bool_)

    return f


logical_and = _logical(ir_pb2.AND)
logical_or = _logical(ir_pb2.OR)
logical_xor = _logical(ir_pb2.XOR)


@_op
def divide(x1, x2):
    """True division: integers divide as float64 (numpy)."""
    return _elementwise(ir_pb2.DIV, [x1, x2], _float_dtype(x1, x2))


true_divide = divide


@_op
def floor_divide(x1, x2):
    d = _int8_for_bools(_result_dtype(x1, x2))
    if _dtypes.is_float(d):
        # numpy's divmod: floor((a - fmod(a, b)) / b), corrected, so that
        # 1.0 // 0.1 is 9 (floor(1.0 / 0.1) is 10) and inf // 0.5 is nan.
        shape = _np.broadcast_shapes(_shape(x1), _shape(x2))
        a, b = _operand(x1, d, shape), _operand(x2, d, shape)
        mod = _elementwise(ir_pb2.REM, [a, b], d)
        div = divide(subtract(a, mod), b)
        div = where(_remainder_off_sign(mod, b), subtract(div, 1), div)
        fl = floor(div)
        fl = where(greater(subtract(div, fl), 0.5), add(fl, 1), fl)
        q = divide(a, b)
        fl = where(equal(div, 0), multiply(q, 0), fl)  # a zero with the sign of a / b
        return where(equal(b, 0), q, fl)
    q = _elementwise(ir_pb2.DIV, [x1, x2], d)
    r = _elementwise(ir_pb2.REM, [x1, x2], d)
    # Truncation rounds toward zero; floor is one less where the signs differ.
    return where(_remainder_off_sign(r, _operand(x2, d, r.shape)), subtract(q, 1), q)


@_op
def remainder(x1, x2):
    """numpy's remainder: the result has the sign of the divisor."""
    d = _int8_for_bools(_result_dtype(x1, x2))
    r = _elementwise(ir_pb2.REM, [x1, x2], d)
    b = _operand(x2, d, r.shape)
    r = where(_remainder_off_sign(r, b), add(r, b), r)
    if _dtypes.is_float(d):
        # A zero remainder takes the divisor's sign too (fmod gives the dividend's).
        r = where(equal(r, 0), where(less(b, 0), _np.array(-0.0, d), _np.array(0.0, d)), r)
    return r


mod = remainder


def _remainder_off_sign(r, b):
    """Where the truncated remainder r is nonzero and its sign is not b's (b
    nonzero: integer x // 0 stays XLA's -1 for every x, as documented)."""
    return logical_and(logical_and(not_equal(r, 0), not_equal(b, 0)), not_equal(less(r, 0), less(b, 0)))


# For `array OP k` with k above (+1) or below (-1) every value of the array's
# integer type: the answer, whatever the array holds.
_DECIDED = {
    ir_pb2.EQ: (False, False),
    ir_pb2.NE: (True, True),
    ir_pb2.LT: (True, False),
    ir_pb2.LE: (True, False),
    ir_pb2.GT: (False, True),
    ir_pb2.GE: (False, True),
}
_SWAPPED = {
    ir_pb2.LT: ir_pb2.GT,
    ir_pb2.LE: ir_pb2.GE,
    ir_pb2.GT: ir_pb2.LT,
    ir_pb2.GE: ir_pb2.LE,
    ir_pb2.EQ: ir_pb2.EQ,
    ir_pb2.NE: ir_pb2.NE,
}


def _compare(direction):
    @_op
    def f(x1, x2):
        d = _result_dtype(x1, x2)
        shape = _np.broadcast_shapes(_shape(x1), _shape(x2))
        # NEP 50: a Python int the array's type cannot hold is compared exactly.
        for k, other, dirn in ((x2, x1, direction), (x1, x2, _SWAPPED[direction])):
            if _out_of_range(k, d):
                above = k > _np.iinfo(d).max
                return _b().fill(_DECIDED[dirn][0 if above else 1], shape, _np.bool_)

        def attrs(n):
            n.compare.direction = direction

        return _elementwise(ir_pb2.COMPARE, [x1, x2], d, out_dtype=_np.dtype(_np.bool_), set_attrs=attrs)

    return f


equal = _compare(ir_pb2.EQ)
not_equal = _compare(ir_pb2.NE)
less = _compare(ir_pb2.LT)
less_equal = _compare(ir_pb2.LE)
greater = _compare(ir_pb2.GT)
greater_equal = _compare(ir_pb2.GE)


def _unary(op, float_only=False, identity_on_ints=False):
    @_op
    def f(x):
        t = _tracer(x)
        if not _dtypes.is_float(t.dtype):
            if identity_on_ints:
                return t
            if float_only:
                # numpy's loops: the smallest float that holds the integer type
                # (bool and uint8 -> float16, int32 and int64 -> float64).
                t = _convert(t, _np.result_type(t.dtype, _np.float16))
        return _b().node(op, [t], t.shape, t.dtype)

    return f


_neg, _abs, _sign = _unary(ir_pb2.NEG), _unary(ir_pb2.ABS), _unary(ir_pb2.SIGN)


def _unsigned(x, what):
    t = _tracer(x)
    if t.dtype == _np.bool_ and what:
        raise TypeError(
            f"numpy boolean {what} is not supported (numpy's ufunc has no bool loop); " "use logical_not or ~ on bools"
        )
    return t.dtype.kind in "ub", t


@_op
def negative(x):
    u, t = _unsigned(x, "negative")
    return subtract(_np.zeros((), t.dtype), t) if u else _neg(t)  # numpy wraps: -uint8(1) is 255


@_op
def abs(x):
    u, t = _unsigned(x, None)
    return t if u else _abs(t)  # abs of a bool is the bool, as in numpy


absolute = abs


@_op
def sign(x):
    u, t = _unsigned(x, "sign")
    if u:
        return _convert(not_equal(t, 0), t.dtype)
    if _dtypes.is_float(t.dtype):
        # numpy's sign of -0.0 is +0.0 (XLA's keeps the zero's sign).
        return where(equal(t, 0), _np.array(0, t.dtype), _sign(t))
    return _sign(t)


exp = _unary(ir_pb2.EXP, True)
log = _unary(ir_pb2.LOG, True)
log1p = _unary(ir_pb2.LOG1P, True)
tanh = _unary(ir_pb2.TANH, True)
sqrt = _unary(ir_pb2.SQRT, True)
rsqrt = _unary(ir_pb2.RSQRT, True)
floor = _unary(ir_pb2.FLOOR, identity_on_ints=True)
ceil = _unary(ir_pb2.CEIL, identity_on_ints=True)
logistic = sigmoid = _unary(ir_pb2.LOGISTIC, True)
sin = _unary(ir_pb2.SIN, True)
cos = _unary(ir_pb2.COS, True)
tan = _unary(ir_pb2.TAN, True)
arcsin = asin = _unary(ir_pb2.ASIN, True)
arccos = acos = _unary(ir_pb2.ACOS, True)
arctan = atan = _unary(ir_pb2.ATAN, True)
sinh = _unary(ir_pb2.SINH, True)
cosh = _unary(ir_pb2.COSH, True)
arcsinh = asinh = _unary(ir_pb2.ASINH, True)
arccosh = acosh = _unary(ir_pb2.ACOSH, True)
arctanh = atanh = _unary(ir_pb2.ATANH, True)
expm1 = _unary(ir_pb2.EXPM1, True)
cbrt = _unary(ir_pb2.CBRT, True)
_erf = _unary(ir_pb2.ERF, True)  # tessel.lax.erf (jax.lax.erf); numpy has none


@_op
def arctan2(x1, x2):
    """numpy.arctan2(x1, x2): the angle of the point (x2, x1)."""
    d = _result_dtype(x1, x2)
    if not _dtypes.is_float(d):
        d = _np.result_type(d, _np.float16)
    return _elementwise(ir_pb2.ATAN2, [x1, x2], d)


atan2 = arctan2


@_op
def log2(x):
    t = log(x)  # as jax.numpy: log(x) / log(2)
    return divide(t, _np.array(_np.log(2), t.dtype))


@_op
def log10(x):
    t = log(x)
    return divide(t, _np.array(_np.log(10), t.dtype))


@_op
def invert(x):
    t = _tracer(x)
    return _b().node(ir_pb2.NOT, [t], t.shape, t.dtype)


bitwise_not = invert


@_op
def logical_not(x):
    t = _tracer(x)
    return invert(t) if t.dtype == _np.bool_ else equal(t, 0)


@_op
def square(x):
    t = _tracer(x)
    if t.dtype == _np.bool_:
        t = _convert(t, _np.int8)  # numpy's square has no bool loop: int8's
    return multiply(t, t)


@_op
def where(condition, x, y):
    d = _result_dtype(x, y)
    shape = _np.broadcast_shapes(_shape(condition), _shape(x), _shape(y))
    c = _operand(condition, _np.bool_, shape)
    return _b().node(ir_pb2.SELECT, [c, _operand(x, d, shape), _operand(y, d, shape)], shape, d)


@_op
def clip(a, a_min=None, a_max=None):
    t = _tracer(a)
    if t.dtype.kind in "iu":
        # As numpy: a Python int bound past the array's range on its own side
        # clips nothing; one past the other side is an OverflowError (NEP 50).
        info = _np.iinfo(t.dtype)
        if type(a_min) is int and a_min <= info.min:
            a_min = None
        if type(a_max) is int and a_max >= info.max:
            a_max = None
    d = _result_dtype(*[x for x in (t, a_min, a_max) if x is not None])
    _check_in_range([a_min, a_max], d)
    low, high = (_np.iinfo(d).min, _np.iinfo(d).max) if d.kind in "iu" else (-_np.inf, _np.inf)
    a_min = low if a_min is None else a_min
    a_max = high if a_max is None else a_max
    shape = _np.broadcast_shapes(t.shape, _shape(a_min), _shape(a_max))
    return _b().node(
        ir_pb2.CLAMP, [_operand(a_min, d, shape), _operand(t, d, shape), _operand(a_max, d, shape)], shape, d
    )


@_op
def astype(x, dtype):
    return _convert(_tracer(x), dtype)


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


# ---------------------------------------------------------------- layout


@_op
def reshape(a, newshape):
    t = _tracer(a)
    newshape = (newshape,) if isinstance(newshape, int) else tuple(int(s) for s in newshape)
    if newshape.count(-1) > 1:
        raise ValueError("reshape: only one dimension may be -1")
    if -1 in newshape:
        known = int(_np.prod([s for s in newshape if s != -1], dtype=_np.int64))
        if known == 0 or t.size % known:
            raise ValueError(f"cannot reshape {t!r} into {newshape}")
        newshape = tuple(t.size // known if s == -1 else s for s in newshape)
    if int(_np.prod(newshape, dtype=_np.int64)) != t.size:
        raise ValueError(f"cannot reshape {t!r} ({t.size} elements) into shape {newshape}")
    if newshape == t.shape:
        return t

    def attrs(n):
        n.reshape.dims.extend(newshape)

    return _b().node(ir_pb2.RESHAPE, [t], newshape, t.dtype, set_attrs=attrs)


@_op
def transpose(a, axes=None):
    t = _tracer(a)
    perm = tuple(reversed(range(t.ndim))) if axes is None else tuple(a % t.ndim for a in axes)
    if sorted(perm) != list(range(t.ndim)):
        raise ValueError(f"transpose: axes {axes} are not a permutation of {t.ndim} dimensions")
    if perm == tuple(range(t.ndim)):
        return t

    def attrs(n):
        n.transpose.permutation.extend(perm)

    return _b().node(ir_pb2.TRANSPOSE, [t], tuple(t.shape[p] for p in perm), t.dtype, set_attrs=attrs)


@_op
def broadcast_to(array, shape):
    t = _tracer(array)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if _np.broadcast_shapes(t.shape, shape) != shape:
        raise ValueError(f"cannot broadcast {t!r} to shape {shape}")
    return _broadcast(t, shape)


@_op
def expand_dims(a, axis):
    t = _tracer(a)
    shape = list(t.shape)
    shape.insert(axis % (t.ndim + 1), 1)
    return reshape(t, tuple(shape))


@_op
def concatenate(arrays, axis=0):
    if axis is None:  # numpy: the arrays flattened, end to end
        arrays, axis = [ravel(x) for x in arrays], 0
    d = _result_dtype(*arrays)
    ts = [_convert(_tracer(x), d) for x in arrays]
    axis = axis % ts[0].ndim
    shape = list(ts[0].shape)
    shape[axis] = builtins.sum(t.shape[axis] for t in ts)

    def attrs(n):
        n.concatenate.dimension = axis

    return _b().node(ir_pb2.CONCATENATE, ts, shape, d, set_attrs=attrs)


@_op
def stack(arrays, axis=0):
    return concatenate([expand_dims(a, axis) for a in arrays], axis)


def _runs(indices):
    """Static indices as runs (first, last, step, length) of step 1, -1 or 0."""
    runs, i, n = [], 0, len(indices)
    while i < n:
        j = i + 1
        step = indices[j] - indices[i] if j < n else 1
        if step not in (-1, 0, 1):
            step = 1
        while j < n and indices[j] - indices[j - 1] == step:
            j += 1
        runs.append((int(indices[i]), int(indices[j - 1]), step, j - i))
        i = j
    return runs


def _take_static(t, indices, axis):
    """t's slices at `indices` (static, in range) along `axis`, as runs of
    slices (ascending, descending or repeated) put end to end."""
    lead = (slice(None),) * axis
    pieces = []
    for lo, hi, step, count in _runs(indices):
        if step == 0:
            one = t[lead + (slice(lo, lo + 1),)]
            shape = list(one.shape)
            shape[axis] = count
            pieces.append(broadcast_to(one, tuple(shape)))
        elif step == 1:
            pieces.append(t[lead + (slice(lo, hi + 1),)])
        else:
            pieces.append(t[lead + (slice(lo, hi - 1 if hi > 0 else None, -1),)])
    if not pieces:
        return t[lead + (slice(0, 0),)]
    return pieces[0] if len(pieces) == 1 else concatenate(pieces, axis=axis)


@_op
def take(a, indices, axis=None, mode=None, fill_value=None):
    """numpy.take. Indices known when tracing (a list, a numpy array) follow
    numpy: out of range raises unless mode is "clip" or "wrap"; a few runs
    of consecutive indices become slices, more a gather. Traced indices
    follow jax.numpy.take: mode "fill" by default (out-of-range reads give
    `fill_value`: NaN, the lowest signed or highest unsigned integer, True)."""
    t = _tracer(a)
    if axis is None:
        t, axis = ravel(t), 0
    ax = _axis_list(axis, t.ndim, "take")[0]
    traced = _is_traced(indices)
    if not traced and mode in (None, "raise", "clip", "wrap") and fill_value is None:
        idx = _np.asarray(indices)
        idx = idx.astype(_np.int64) if idx.size == 0 else idx
        if idx.dtype.kind not in "iu":
            raise IndexError(f"take: indices must be integers, got {idx.dtype}")
        n = t.shape[ax]
        if mode == "wrap":
            idx = idx % n if n else idx
        elif mode == "clip":
            idx = _np.clip(idx, 0, builtins.max(n - 1, 0))
        else:
            bad = (idx < -n) | (idx >= n)
            if bad.any():
                raise IndexError(f"take: index {int(idx[bad].flat[0])} is out of bounds for axis {ax} with size {n}")
            idx = idx % n if n else idx
        flat = [int(i) for i in idx.ravel()]
        if len(_runs(flat)) <= 4:
            out = _take_static(t, flat, ax)
            return reshape(out, t.shape[:ax] + idx.shape + t.shape[ax + 1 :])
        indices = idx
    parts = [slice(None)] * t.ndim
    parts[ax] = indices
    return _take_mode(t, parts, ax, mode, fill_value, "take")


# ---------------------------------------------------------------- gather and scatter


def _gather(t, idx, axis):
    """GATHER: t's slices along `axis` at the integer tracer `idx` (indices
    out of range clamp): dimensions t[:axis] + idx + t[axis+1:]."""

    def attrs(n):
        n.gather.axis = axis

    return _b().node(
        ir_pb2.GATHER, [t, idx], t.shape[:axis] + idx.shape + t.shape[axis + 1 :], t.dtype, set_attrs=attrs
    )


_COMBINE = {"set": None, "add": ir_pb2.SUM, "multiply": ir_pb2.PROD, "min": ir_pb2.REDUCE_MIN, "max": ir_pb2.REDUCE_MAX}


def _scatter(t, idx, updates, axis, mode):
    """SCATTER: t with `updates` put in at `idx` along `axis`, replacing
    (mode "set") or combined; updates at indices out of range are dropped."""
    combine = _COMBINE[mode]
    if t.dtype == _np.bool_:  # add is or, multiply is and, as numpy's bool arithmetic
        combine = {ir_pb2.SUM: ir_pb2.REDUCE_MAX, ir_pb2.PROD: ir_pb2.REDUCE_MIN}.get(combine, combine)

    def attrs(n):
        n.scatter.axis = axis
        if combine is not None:
            n.scatter.combine = combine

    return _b().node(ir_pb2.SCATTER, [t, idx, updates], t.shape, t.dtype, set_attrs=attrs)


def _is_device_array(i):
    return type(i).__name__ == "Array" and hasattr(i, "sharding")


def _is_traced(i):
    """A value known only on the device: a tracer, or a tessel.Array."""
    return isinstance(i, Tracer) or _is_device_array(i)


def _is_array_index(i):
    return isinstance(i, (list, _np.ndarray)) or _is_traced(i)


def _wrap_negative(idx, n):
    """Traced indices: negative ones count from the end, as numpy's."""
    if idx.dtype.kind == "u":
        return idx
    return where(less(idx, 0), add(idx, n), idx)


class _MaskPart:
    """Positions of a boolean mask along one of the dimensions it covers."""

    def __init__(self, positions, size):
        self.positions, self.size = positions, size


def _expand_index(t, idx, what):
    """An index tuple (no None) as one entry per dimension: boolean numpy
    masks become the integer positions of their true elements (numpy's
    nonzero), the ellipsis full slices, and missing trailing entries too."""
    parts = []
    for i in idx:
        if isinstance(i, (list, _np.ndarray)) and _np.asarray(i).dtype == _np.bool_:
            m = _np.asarray(i)
            if m.ndim == 0:
                raise NotImplementedError(f"{what}: a scalar boolean index is not supported")
            parts.extend(_MaskPart(p, size) for p, size in zip(m.nonzero(), m.shape))
        elif _is_traced(i) and i.dtype == _np.bool_:
            raise IndexError(
                f"{what}: a boolean mask with traced or device values: the result's shape would depend "
                "on the values. Use tessel.numpy.where(mask, x, other), or pass the mask as a numpy array"
            )
        else:
            parts.append(i)
    ellipses = builtins.sum(1 for i in parts if i is Ellipsis)
    if ellipses > 1:
        raise IndexError("an index can only have a single ellipsis")
    used = len(parts) - ellipses
    if used > t.ndim:
        raise IndexError(f"too many indices for {t!r}: {used} given")
    if ellipses:
        k = next(j for j, i in enumerate(parts) if i is Ellipsis)
        parts = parts[:k] + [slice(None)] * (t.ndim - used) + parts[k + 1 :]
    parts += [slice(None)] * (t.ndim - len(parts))
    for d, i in enumerate(parts):
        if isinstance(i, _MaskPart):
            if i.size != t.shape[d]:
                raise IndexError(
                    f"{what}: boolean index did not match indexed array along axis {d}; size of axis is "
                    f"{t.shape[d]} but size of corresponding boolean axis is {i.size}"
                )
            parts[d] = i.positions
    return parts


def _advanced(t, parts, what, out_of_range):
    """The array indices of an expanded index (integers count as arrays
    beside them, as in numpy): their dimensions, and each as an integer
    tracer broadcast to one shape, negative indices counted from the end.
    Numpy index values out of range raise (out_of_range "raise") or are
    kept (JAX's .at drops them); traced ones are kept."""
    dims = [
        d
        for d, i in enumerate(parts)
        if _is_array_index(i) or (isinstance(i, (int, _np.integer)) and not isinstance(i, (bool, _np.bool_)))
    ]
    tracers = []
    for d in dims:
        i, n = parts[d], t.shape[d]
        if _is_traced(i):
            tr = _tracer(i)
            if tr.dtype.kind not in "iu":
                raise IndexError(f"{what}: index arrays must be integers or booleans, got {tr.dtype} for axis {d}")
            tracers.append(_wrap_negative(tr, n))
            continue
        a = _np.asarray(i)
        if a.size == 0:
            a = a.astype(_np.int64)
        if a.dtype.kind not in "iu":
            raise IndexError(f"{what}: index arrays must be integers or booleans, got {a.dtype} for axis {d}")
        a = a.astype(_np.int64)
        bad = (a < -n) | (a >= n)
        if out_of_range == "raise" and bad.any():
            raise IndexError(f"index {int(a[bad].flat[0])} is out of bounds for axis {d} with size {n}")
        tracers.append(_tracer(_np.where(a < 0, a + n, a)))
    shape = _np.broadcast_shapes(*[tr.shape for tr in tracers])
    return dims, [broadcast_to(tr, shape) for tr in tracers], tuple(shape)


def _linear_index(t, dims, tracers):
    """One int64 index into t's `dims` flattened (row-major), from one
    index per dimension; -1 where any of them is out of range."""
    lin, outside = None, None
    for d, tr in zip(dims, tracers):
        tr = _convert(tr, _np.dtype(int64))
        stride = int(_np.prod([t.shape[e] for e in dims if e > d], dtype=_np.int64))
        term = multiply(tr, stride) if stride != 1 else tr
        lin = term if lin is None else add(lin, term)
        bad = logical_or(less(tr, 0), greater_equal(tr, t.shape[d]))
        outside = bad if outside is None else logical_or(outside, bad)
    return where(outside, -1, lin)


def _to_front(t, dims):
    """t with `dims` moved to the front and merged into one dimension."""
    rest = [d for d in range(t.ndim) if d not in dims]
    u = transpose(t, dims + rest)
    size = int(_np.prod([t.shape[d] for d in dims], dtype=_np.int64))
    return reshape(u, (size,) + tuple(t.shape[d] for d in rest)), rest


def _indexed_shape(t, dims, shape):
    """numpy's result shape of advanced indexing: the broadcast index shape
    where the indexed dimensions stood when they are adjacent, else first."""
    rest = [t.shape[d] for d in range(t.ndim) if d not in dims]
    at = dims[0] if dims == list(range(dims[0], dims[-1] + 1)) else 0
    return tuple(rest[:at]) + shape + tuple(rest[at:]), at


def _advanced_getitem(t, parts):
    dims, tracers, shape = _advanced(t, parts, "indexing", "raise")
    u = _getitem(t, tuple(slice(None) if d in dims else i for d, i in enumerate(parts)))  # slices keep every dimension
    for d in dims:
        if u.shape[d] == 0 and int(_np.prod(shape)) > 0:
            raise IndexError(f"index is out of bounds for axis {d} with size 0")
    if len(dims) == 1:
        return _gather(u, tracers[0], dims[0])
    # Out-of-range traced indices clamp, each in its own dimension (as JAX).
    tracers = [clip(tr, 0, u.shape[d] - 1) for d, tr in zip(dims, tracers)]
    flat, _ = _to_front(u, dims)
    g = _gather(flat, _linear_index(u, dims, tracers), 0)
    _, at = _indexed_shape(u, dims, shape)
    if at == 0:
        return g
    nb = len(shape)
    return transpose(g, list(range(nb, nb + at)) + list(range(nb)) + list(range(nb + at, g.ndim)))


def _advanced_update(t, parts, values, mode):
    """x.at[idx] with array indices: a scatter. Updates at indices out of
    range are dropped, as JAX's; repeated indices all apply (set: the last
    in row-major order stays)."""
    for d, i in enumerate(parts):
        if isinstance(i, slice) and i != slice(None):
            raise NotImplementedError(
                f".at[...].{mode}: index arrays with a partial slice (axis {d}) are not "
                "supported; update the slice's whole axis, or index it with an array"
            )
    dims, tracers, shape = _advanced(t, parts, f".at[...].{mode}", "keep")
    want, at = _indexed_shape(t, dims, shape)
    v = _tracer(values)
    try:
        fits = tuple(_np.broadcast_shapes(v.shape, want)) == want
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f".at[...].{mode}: values of shape {v.shape} do not broadcast to the indexed shape {want}")
    v = broadcast_to(_convert(v, t.dtype), want)
    if len(dims) == 1:
        return _scatter(t, tracers[0], v, dims[0], mode)
    nb = len(shape)
    if at:  # the index dimensions first, as the flattened operand has them
        v = transpose(v, list(range(at, at + nb)) + list(range(at)) + list(range(at + nb, v.ndim)))
    flat, rest = _to_front(t, dims)
    out = _scatter(flat, _linear_index(t, dims, tracers), v, 0, mode)
    out = reshape(out, tuple(t.shape[d] for d in dims + rest))
    order = dims + rest
    return transpose(out, [order.index(d) for d in range(t.ndim)])


@_op
def take_along_axis(arr, indices, axis, mode=None, fill_value=None):
    """numpy.take_along_axis: arr's elements at `indices` along `axis`,
    the other dimensions broadcast together (as numpy 2)."""
    t = _tracer(arr)
    if axis is None:
        t, axis = ravel(t), 0
    ax = _axis_list(axis, t.ndim, "take_along_axis")[0]
    idx = _tracer(indices) if _is_traced(indices) else _np.asarray(indices)
    if len(idx.shape) != t.ndim:
        raise ValueError(
            f"take_along_axis: indices and arr must have the same number of dimensions, got "
            f"{len(idx.shape)} and {t.ndim}"
        )
    parts = []
    for d in range(t.ndim):
        if d == ax:
            parts.append(idx)
        else:
            shape = [1] * t.ndim
            shape[d] = t.shape[d]
            parts.append(_np.arange(t.shape[d]).reshape(shape))
    return _take_mode(t, parts, ax, mode, fill_value, "take_along_axis")


def _fill_value_for(d, fill_value):
    if fill_value is not None:
        return fill_value
    if d.kind == "f" or d == _dtypes.BFLOAT16:
        return float("nan")
    if d == _np.bool_:
        return True
    return int(_np.iinfo(d).max if d.kind == "u" else _np.iinfo(d).min)


def _take_mode(t, parts, ax, mode, fill_value, what):
    """Advanced indexing of t by `parts`, where parts[ax] holds the user's
    indices, with take's modes: "raise" (numpy's default for indices known
    when tracing), "fill" (JAX's default, and the default for traced
    indices: out-of-range reads give `fill_value`), "clip" (no negative
    indices: clamp) or "wrap"."""
    i, n = parts[ax], t.shape[ax]
    traced = _is_traced(i)
    if traced:
        i = _tracer(i)
    else:
        i = _np.asarray(i)
        i = i.astype(_np.int64) if i.size == 0 else i
    if i.dtype.kind not in "iu":
        raise IndexError(f"{what}: indices must be integers, got {i.dtype}")
    if mode == "wrap":
        i = remainder(i, n) if traced else i % n if n else i
    elif mode == "clip":
        i = clip(i, 0, builtins.max(n - 1, 0)) if traced else _np.clip(i, 0, builtins.max(n - 1, 0))
    elif mode is None:
        mode = "fill" if traced or fill_value is not None else "raise"
    elif mode not in ("fill", "raise", "promise_in_bounds"):
        raise ValueError(f"{what}: mode {mode!r}: expected 'raise', 'fill', 'clip' or 'wrap'")
    parts = list(parts)
    if mode != "fill":
        parts[ax] = i
        return _advanced_getitem(t, parts)
    i = _tracer(i)
    inside = logical_and(greater_equal(i, -n), less(i, n)) if i.dtype.kind != "u" else less(i, n)
    parts[ax] = where(inside, i, 0)
    got = _advanced_getitem(t, parts)
    dims = [d for d, p in enumerate(parts) if _is_array_index(p)]
    shape = tuple(
        _np.broadcast_shapes(
            *[tuple(p.shape) if isinstance(p, Tracer) else _np.shape(p) for p in parts if _is_array_index(p)]
        )
    )
    _, at = _indexed_shape(t, dims, shape)
    return where(
        _broadcast_into(broadcast_to(inside, shape), got.shape, at, len(shape)),
        got,
        _fill_value_for(t.dtype, fill_value),
    )


def _broadcast_into(mask, shape, at, nb):
    """A mask over the broadcast index shape, spread over an indexing
    result whose index dimensions are shape[at:at+nb]."""
    if tuple(mask.shape) == tuple(shape):
        return mask

    def attrs(n):
        n.broadcast_in_dim.dims.extend(shape)
        n.broadcast_in_dim.broadcast_dimensions.extend(range(at, at + nb))

    return _b().node(ir_pb2.BROADCAST_IN_DIM, [mask], tuple(shape), mask.dtype, set_attrs=attrs)


def _start_index(start, n, size, what, d):
    """A dynamic_slice start: negative counts from the end, then clamped so
    the window fits (as jax.lax)."""
    hi = builtins.max(n - size, 0)
    if _is_traced(start):
        st = _tracer(start)
        if st.shape != () or st.dtype.kind not in "iu":
            raise TypeError(f"{what}: start index {d} must be an integer scalar, got {st!r}")
        return clip(_wrap_negative(st, n), 0, hi)
    if not isinstance(start, (int, _np.integer)) or isinstance(start, (bool, _np.bool_)):
        raise TypeError(f"{what}: start index {d} must be an integer scalar, got {start!r}")
    start = int(start)
    return builtins.min(builtins.max(start + n if start < 0 else start, 0), hi)


def _check_window(t, starts, sizes, what):
    if len(starts) != t.ndim or len(sizes) != t.ndim:
        raise TypeError(f"{what}: {t!r} needs {t.ndim} start indices and sizes, got {len(starts)} and {len(sizes)}")
    for d, (n, k) in enumerate(zip(t.shape, sizes)):
        if not 0 <= k <= n:
            raise TypeError(f"{what}: size {k} of dimension {d} is outside [0, {n}]")


@_op
def _dynamic_slice(operand, start_indices, slice_sizes):
    t = _tracer(operand)
    sizes = [int(k) for k in slice_sizes]
    _check_window(t, list(start_indices), sizes, "dynamic_slice")
    out = t
    for d, (start, k) in enumerate(zip(start_indices, sizes)):
        st = _start_index(start, t.shape[d], k, "dynamic_slice", d)
        if isinstance(st, Tracer):  # a gather of the window's positions
            out = _gather(out, add(_convert(st, _np.dtype(int64)), _b().iota((k,), _np.dtype(int64), 0)), d)
        elif k != t.shape[d]:
            out = out[(slice(None),) * d + (slice(st, st + k),)]
    return out


@_op
def _dynamic_update_slice(operand, update, start_indices):
    t = _tracer(operand)
    u = _convert(_tracer(update), t.dtype)
    _check_window(t, list(start_indices), list(u.shape), "dynamic_update_slice")
    starts = [
        _start_index(s, n, k, "dynamic_update_slice", d)
        for d, (s, n, k) in enumerate(zip(start_indices, t.shape, u.shape))
    ]
    if not builtins.any(isinstance(s, Tracer) for s in starts):
        return _at_update(t, tuple(slice(s, s + k) for s, k in zip(starts, u.shape)), u, "set")
    # A scatter over the window's positions in every dimension it does not
    # cover whole.
    parts = []
    partial = [d for d in range(t.ndim) if u.shape[d] != t.shape[d] or isinstance(starts[d], Tracer)]
    for d in range(t.ndim):
        if d not in partial:
            parts.append(slice(None))
            continue
        shape = [1] * len(partial)
        shape[partial.index(d)] = u.shape[d]
        pos = _b().iota((u.shape[d],), _np.dtype(int64), 0)
        pos = add(pos, _convert(starts[d], _np.dtype(int64)) if isinstance(starts[d], Tracer) else starts[d])
        parts.append(reshape(pos, tuple(shape)))
    if partial != list(range(partial[0], partial[-1] + 1)):
        rest = [d for d in range(t.ndim) if d not in partial]
        u = transpose(u, partial + rest)  # the window's indexed dimensions first, as numpy puts them
    return _advanced_update(t, parts, u, "set")


_PAD_MODES = ("constant", "edge", "reflect", "symmetric", "wrap")


@_op
def pad(array, pad_width, mode="constant", constant_values=0, **kwargs):
    """numpy.pad: constant (one pad op), or edge, reflect, symmetric and
    wrap, whose source positions numpy itself computes for each axis (the
    pad of an index vector): runs of slices put end to end."""
    t = _tracer(array)
    if mode not in _PAD_MODES:
        raise NotImplementedError(f"pad: mode {mode!r} is not supported; supported: {', '.join(_PAD_MODES)}")
    if mode != "constant":
        widths = _np.broadcast_to(_np.asarray(pad_width, dtype=_np.int64), (t.ndim, 2))
        out = t
        for ax, (lo, hi) in enumerate(widths):
            if lo == 0 and hi == 0:
                continue
            if t.shape[ax] == 0:
                raise ValueError(f"pad: can't extend empty axis {ax} using modes other than 'constant' or 'empty'")
            source = _np.pad(_np.arange(t.shape[ax]), (int(lo), int(hi)), mode=mode, **kwargs)
            out = _take_static(out, [int(i) for i in source], ax)
        return out
    widths = _np.broadcast_to(_np.asarray(pad_width, dtype=_np.int64), (t.ndim, 2))
    if _is_pyscalar(constant_values) or isinstance(constant_values, _np.generic):
        # What numpy's pad stores: the value as a numpy scalar assigned into a
        # slice of the array's type (so NaN into an int32 raises, into a uint8
        # is 0; 300 into a uint8 wraps to 44).
        held = _np.zeros((1,), t.dtype)
        held[0:1] = _np.array(constant_values).ravel()[0]
        constant_values = held[0].item() if _dtypes.is_float(t.dtype) else int(held[0])
    value = _operand(constant_values, t.dtype, ())
    shape = tuple(int(s + lo + hi) for s, (lo, hi) in zip(t.shape, widths))

    def attrs(n):
        n.pad.low.extend(int(w) for w in widths[:, 0])
        n.pad.high.extend(int(w) for w in widths[:, 1])

    return _b().node(ir_pb2.PAD, [t, value], shape, t.dtype, set_attrs=attrs)


@_op
def _getitem(a, idx):
    t = _tracer(a)
    if not isinstance(idx, tuple):
        idx = (idx,)
    if builtins.sum(1 for i in idx if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis")
    if builtins.any(_is_array_index(i) for i in idx):
        if builtins.any(i is None for i in idx):
            raise NotImplementedError(
                "indexing: None (np.newaxis) beside index arrays is not supported; "
                "index first, then add the axis with expand_dims"
            )
        return _advanced_getitem(t, _expand_index(t, idx, "indexing"))
    if builtins.any(i is None for i in idx):
        # np.newaxis: index without them, then insert a dimension of 1 where
        # each stood among the result's dimensions (an integer drops one).
        inner = tuple(i for i in idx if i is not None)
        if Ellipsis in inner:
            n_full = t.ndim - len(inner) + 1
            expanded = []
            for i in idx:
                expanded += [slice(None)] * n_full if i is Ellipsis else [i]
            idx = tuple(expanded)
            inner = tuple(i for i in idx if i is not None)
        out = _getitem(t, inner)
        shape, dims = [], iter(out.shape)
        for i in idx + (slice(None),) * (t.ndim - len(inner)):
            if i is None:
                shape.append(1)
            elif not isinstance(i, (int, _np.integer)):
                shape.append(next(dims))
        return reshape(out, tuple(shape))
    reversed_dims, start, limit, strides, keep = _basic_index(t, idx)
    full = tuple(len(range(s, l, st)) for s, l, st in zip(start, limit, strides))
    out = _reverse(t, reversed_dims)
    if full != t.shape:

        def attrs(n):
            n.slice.start.extend(start)
            n.slice.limit.extend(limit)
            n.slice.strides.extend(strides)

        out = _b().node(ir_pb2.SLICE, [out], full, t.dtype, set_attrs=attrs)
    return reshape(out, tuple(keep)) if tuple(keep) != full else out


def _basic_index(t, idx):
    """Integers, slices and one ellipsis (no None) as the region they
    select: the dimensions read reversed (negative steps), then per
    dimension start, limit and stride in the reversed array, and the
    result's shape (integers drop their dimension)."""
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (slice(None),) * (t.ndim - len(idx) + 1) + idx[k + 1 :]
    if len(idx) > t.ndim:
        raise IndexError(f"too many indices for {t!r}")
    idx = idx + (slice(None),) * (t.ndim - len(idx))
    start, limit, strides, keep, reversed_dims = [], [], [], [], []
    for d, (i, size) in enumerate(zip(idx, t.shape)):
        if isinstance(i, slice):
            lo, hi, step = i.indices(size)
            count = len(range(lo, hi, step))
            if step < 0:
                # A negative step reads the reversed dimension forwards:
                # element lo is element size-1-lo of the reversal.
                reversed_dims.append(d)
                lo, step = size - 1 - lo, -step
            lo = lo if count else 0
            start.append(lo), limit.append(lo + (count - 1) * step + 1 if count else lo), strides.append(step)
            keep.append(count)
        elif isinstance(i, (int, _np.integer)) and not isinstance(i, (bool, _np.bool_)):
            i = int(i)
            if not -size <= i < size:
                raise IndexError(f"index {i} is out of bounds for axis {d} with size {size}")
            i %= size
            start.append(i), limit.append(i + 1), strides.append(1)
        else:
            raise IndexError(f"only integers, slices, None and ... index traced values (got {type(i).__name__})")
    return reversed_dims, start, limit, strides, keep


def _reverse(t, dims):
    if not dims:
        return t
    return _b().node(ir_pb2.REVERSE, [t], t.shape, t.dtype, set_attrs=lambda n: n.reverse.dimensions.extend(dims))


@_op
def flip(m, axis=None):
    t = _tracer(m)
    return _reverse(t, list(range(t.ndim)) if axis is None else _axis_list(axis, t.ndim, "flip"))


@_op
def fliplr(m):
    return flip(m, 1)


@_op
def flipud(m):
    return flip(m, 0)


# ---------------------------------------------------------------- dot


def _dot_general(lhs, rhs, lb, rb, lc, rc):
    d = _result_dtype(lhs, rhs)
    if d == _np.bool_:
        # numpy: a logical or of ands; the IR's dot multiplies numbers.
        return not_equal(
            _dot_general(_convert(_tracer(lhs), _np.int32), _convert(_tracer(rhs), _np.int32), lb, rb, lc, rc), 0
        )
    l, r = _convert(_tracer(lhs), d), _convert(_tracer(rhs), d)
    for a, b in zip(lc, rc):
        if l.shape[a] != r.shape[b]:
            raise ValueError(f"dot: contracting dimensions differ: {l!r} dim {a} vs {r!r} dim {b}")
    shape = (
        [l.shape[i] for i in lb]
        + [s for i, s in enumerate(l.shape) if i not in lb and i not in lc]
        + [s for i, s in enumerate(r.shape) if i not in rb and i not in rc]
    )

    def attrs(n):
        g = n.dot_general
        g.lhs_batch.extend(lb), g.rhs_batch.extend(rb)
        g.lhs_contracting.extend(lc), g.rhs_contracting.extend(rc)

    return _b().node(ir_pb2.DOT_GENERAL, [l, r], shape, d, set_attrs=attrs)


@_op
def matmul(x1, x2):
    a, b = _tracer(x1), _tracer(x2)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("matmul: operands must have at least one dimension")
    if a.ndim == 1 or b.ndim == 1 or (a.ndim == 2 and b.ndim == 2):
        return _dot_general(a, b, [], [], [a.ndim - 1], [0 if b.ndim == 1 else b.ndim - 2])
    if b.ndim == 2:
        return _dot_general(a, b, [], [], [a.ndim - 1], [0])
    batch = _np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = _broadcast(a, batch + a.shape[-2:])
    b = _broadcast(b, batch + b.shape[-2:])
    nb = len(batch)
    return _dot_general(a, b, list(range(nb)), list(range(nb)), [nb + 1], [nb])


@_op
def dot(a, b):
    ta, tb = _tracer(a), _tracer(b)
    if ta.ndim == 0 or tb.ndim == 0:
        return multiply(ta, tb)
    if ta.ndim > 2 or tb.ndim > 2:
        raise NotImplementedError("dot of arrays above 2-D: use matmul or einsum")
    return matmul(ta, tb)


def _einsum_parse(subscripts, ts):
    """Subscripts with each ellipsis spelled out as letters of its own
    (numpy's right-aligned, broadcast dimensions), and the output's."""
    spec = subscripts.replace(" ", "")
    ins, out = spec.split("->") if "->" in spec else (spec, None)
    ins = ins.split(",")
    if len(ins) != len(ts):
        raise ValueError(f"einsum '{subscripts}': {len(ins)} operand subscripts for {len(ts)} operands")
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in spec]
    n_ell = 0
    for s_, t in zip(ins, ts):
        if "..." in s_:
            n_ell = builtins.max(n_ell, t.ndim - (len(s_) - 3))
    ell = "".join(spare[:n_ell])
    expanded = []
    for s_, t in zip(ins, ts):
        if "..." in s_:
            k = t.ndim - (len(s_) - 3)
            if k < 0:
                raise ValueError(f"einsum '{subscripts}': '{s_}' has more letters than {t!r} has dimensions")
            s_ = s_.replace("...", ell[n_ell - k :])
        if "." in s_ or len(s_) != t.ndim:
            raise ValueError(f"einsum '{subscripts}': '{s_}' does not fit {t!r}")
        expanded.append(s_)
    if out is None:
        letters = "".join(expanded)
        out = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell))
    else:
        out = out.replace("...", ell)
        for c in out:
            if c not in "".join(expanded):
                raise ValueError(f"einsum '{subscripts}': output letter '{c}' is in no operand")
    return expanded, out


def _einsum_diagonals(subscripts, s_, t):
    """An operand whose letter repeats (`ii`, `iji`) as its diagonal over
    each repeat, the diagonal's letter last (numpy.diagonal's order)."""
    while len(set(s_)) != len(s_):
        c = next(c for c in s_ if s_.count(c) > 1)
        i = s_.index(c)
        j = s_.index(c, i + 1)
        if t.shape[i] != t.shape[j]:
            raise ValueError(
                f"einsum '{subscripts}': letter '{c}' repeated in one operand over dimensions of "
                f"sizes {t.shape[i]} and {t.shape[j]}: expected equal sizes"
            )
        t = diagonal(t, 0, i, j)
        s_ = "".join(x for k, x in enumerate(s_) if k not in (i, j)) + c
    return s_, t


def _einsum_pair(ls, rs, keep, l, r):
    """Contracts two operands, keeping the letters in `keep` (in the order
    batch, left's, right's); returns the result and its letters."""
    batch = [c for c in ls if c in rs and c in keep]
    contract = [c for c in ls if c in rs and c not in keep]
    # Letters in one operand only and kept nowhere are summed first.
    lonly = [i for i, c in enumerate(ls) if c not in rs and c not in keep]
    ronly = [i for i, c in enumerate(rs) if c not in ls and c not in keep]
    if lonly:
        l, ls = sum(l, tuple(lonly)), "".join(c for i, c in enumerate(ls) if i not in lonly)
    if ronly:
        r, rs = sum(r, tuple(ronly)), "".join(c for i, c in enumerate(rs) if i not in ronly)
    res = _dot_general(
        l,
        r,
        [ls.index(c) for c in batch],
        [rs.index(c) for c in batch],
        [ls.index(c) for c in contract],
        [rs.index(c) for c in contract],
    )
    order = (
        batch
        + [c for c in ls if c not in batch and c not in contract]
        + [c for c in rs if c not in batch and c not in contract]
    )
    return res, "".join(order)


@_op
def einsum(subscripts, *operands, optimize=None):
    """numpy.einsum: any number of operands, ellipses (broadcast as numpy
    does), implicit or explicit output. Three or more operands contract
    pairwise, greedily: at each step the pair whose result is smallest. A
    letter repeated within one operand takes that operand's diagonal
    (`ii->i`, `ii` the trace, `bii->bi`)."""
    ts = [_tracer(o) for o in operands]
    if not ts:
        raise ValueError("einsum: at least one operand is needed")
    ins, out = _einsum_parse(subscripts, ts)
    ins, ts = map(list, zip(*[_einsum_diagonals(subscripts, s_, t) for s_, t in zip(ins, ts)]))
    # numpy's einsum keeps the operands' type (integer sums wrap in it; bool
    # sums are a logical or), where sum() would widen: accumulate wide, then
    # convert, which gives the same bits.
    d = _result_dtype(*ts)
    # Every operand in the result's type before anything is summed: an
    # int64 operand of a float64 einsum must not sum (and wrap) as int64.
    ts = [t if t.dtype == d else _convert(t, d) for t in ts]
    sizes = {}
    for s_, t in zip(ins, ts):
        for c, n in zip(s_, t.shape):
            if c not in sizes or sizes[c] == 1:
                sizes[c] = n
            elif n not in (1, sizes[c]):
                raise ValueError(f"einsum '{subscripts}': letter '{c}' has sizes {sizes[c]} and {n}")
    # Dimensions of size 1 that meet a larger size broadcast to it.
    ts = [
        t if tuple(sizes[c] for c in s_) == t.shape else broadcast_to(t, tuple(sizes[c] for c in s_))
        for s_, t in zip(ins, ts)
    ]
    work = list(zip(ins, ts))
    while len(work) > 1:
        best = None
        for i in range(len(work)):
            for j in range(i + 1, len(work)):
                others = "".join(s_ for k, (s_, _) in enumerate(work) if k not in (i, j)) + out
                kept = set(work[i][0] + work[j][0]) & set(others)
                size = int(_np.prod([sizes[c] for c in kept], dtype=_np.int64))
                if best is None or size < best[0]:
                    best = (size, i, j, kept)
        _, i, j, kept = best
        (ls, l), (rs, r) = work[i], work[j]
        res, letters = _einsum_pair(ls, rs, kept, l, r)
        work = [w for k, w in enumerate(work) if k not in (i, j)] + [(letters, res)]
    ((s_, t),) = work
    summed = [i for i, c in enumerate(s_) if c not in out]
    r = sum(t, tuple(summed)) if summed else t
    rest = [c for c in s_ if c in out]
    return _convert(transpose(r, [rest.index(c) for c in out]), d)


@_op
def diagonal(a, offset=0, axis1=0, axis2=1):
    """numpy.diagonal: the diagonal over axes (axis1, axis2), offset above
    (> 0) or below (< 0) the main one, as the last dimension. A strided
    slice of the two axes flattened: no gather."""
    t = _tracer(a)
    a1, a2 = _axis_list(axis1, t.ndim, "diagonal")[0], _axis_list(axis2, t.ndim, "diagonal")[0]
    if a1 == a2:
        raise ValueError(f"diagonal: axis1 and axis2 cannot be the same (both {a1})")
    t = moveaxis(t, (a1, a2), (-2, -1))
    n, m = t.shape[-2:]
    offset = _operator.index(offset)
    k = builtins.max(0, builtins.min(n, m - offset) if offset >= 0 else builtins.min(n + offset, m))
    flat = reshape(t, t.shape[:-2] + (n * m,))
    if k == 0:
        return flat[..., 0:0]
    start = offset if offset >= 0 else -offset * m
    return flat[..., start : start + (k - 1) * (m + 1) + 1 : m + 1]


@_op
def trace(a, offset=0, axis1=0, axis2=1, dtype=None):
    """numpy.trace: the sum of diagonal(a, offset, axis1, axis2), in sum's dtype."""
    return sum(diagonal(a, offset, axis1, axis2), axis=-1, dtype=dtype)


# ---------------------------------------------------------------- creation


@_op
def zeros(shape, dtype=float64):
    return full(shape, 0, dtype)


@_op
def ones(shape, dtype=float64):
    return full(shape, 1, dtype)


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


# ---------------------------------------------------------------- more layout, as numpy composes it


def _axis_list(axis, ndim, what):
    axes = (axis,) if isinstance(axis, (int, _np.integer)) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise _np.exceptions.AxisError(f"{what}: axis {a} is out of bounds for an array of dimension {ndim}")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: repeated axis in {axis}")
    return out


@_op
def squeeze(a, axis=None):
    t = _tracer(a)
    if axis is None:
        drop = [i for i, s in enumerate(t.shape) if s == 1]
    else:
        drop = _axis_list(axis, t.ndim, "squeeze")
        for i in drop:
            if t.shape[i] != 1:
                raise ValueError(
                    f"cannot select an axis to squeeze out which has size not equal to one " f"(axis {i} of {t!r})"
                )
    return reshape(t, tuple(s for i, s in enumerate(t.shape) if i not in drop))


@_op
def ravel(a):
    return reshape(a, (-1,))


@_op
def swapaxes(a, axis1, axis2):
    t = _tracer(a)
    i, j = _axis_list(axis1, t.ndim, "swapaxes") + _axis_list(axis2, t.ndim, "swapaxes")
    perm = list(range(t.ndim))
    perm[i], perm[j] = perm[j], perm[i]
    return transpose(t, perm)


@_op
def moveaxis(a, source, destination):
    t = _tracer(a)
    src = _axis_list(source, t.ndim, "moveaxis")
    dst = _axis_list(destination, t.ndim, "moveaxis")
    if len(src) != len(dst):
        raise ValueError("moveaxis: `source` and `destination` arguments must have the same number of elements")
    order = [i for i in range(t.ndim) if i not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return transpose(t, order)


@_op
def outer(a, b):
    return multiply(reshape(a, (-1, 1)), reshape(b, (1, -1)))


@_op
def tensordot(a, b, axes=2):
    ta, tb = _tracer(a), _tracer(b)
    if isinstance(axes, (int, _np.integer)):
        if not 0 <= axes <= builtins.min(ta.ndim, tb.ndim):
            raise ValueError(f"tensordot: axes={axes} does not fit {ta!r} and {tb!r}")
        axes_a, axes_b = list(range(ta.ndim - axes, ta.ndim)), list(range(axes))
    else:
        axes_a, axes_b = axes
        axes_a = _axis_list(axes_a, ta.ndim, "tensordot")
        axes_b = _axis_list(axes_b, tb.ndim, "tensordot")
    if len(axes_a) != len(axes_b) or builtins.any(ta.shape[i] != tb.shape[j] for i, j in zip(axes_a, axes_b)):
        raise ValueError(f"tensordot: shape-mismatch for sum over axes {axes_a} of {ta!r} and {axes_b} of {tb!r}")
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    sa = [next(letters) for _ in range(ta.ndim)]
    sb = [next(letters) for _ in range(tb.ndim)]
    for i, j in zip(axes_a, axes_b):
        sb[j] = sa[i]
    out = [c for i, c in enumerate(sa) if i not in axes_a] + [c for j, c in enumerate(sb) if j not in axes_b]
    return einsum(f"{''.join(sa)},{''.join(sb)}->{''.join(out)}", ta, tb)


@_op
def tri(N, M=None, k=0, dtype=float64):
    M = N if M is None else M
    rows = _b().iota((int(N), int(M)), _np.dtype(int64), 0)
    cols = _b().iota((int(N), int(M)), _np.dtype(int64), 1)
    return astype(greater_equal(add(rows, int(k)), cols), dtype)


@_op
def tril(m, k=0):
    t = _tracer(m)
    mask = tri(*t.shape[-2:], k=k, dtype=bool)
    return where(mask, t, zeros((), t.dtype))


@_op
def triu(m, k=0):
    t = _tracer(m)
    mask = tri(*t.shape[-2:], k=k - 1, dtype=bool)
    return where(mask, zeros((), t.dtype), t)


@_op
def eye(N, M=None, k=0, dtype=float64):
    M = N if M is None else M
    rows = _b().iota((int(N), int(M)), _np.dtype(int64), 0)
    cols = _b().iota((int(N), int(M)), _np.dtype(int64), 1)
    return astype(equal(add(rows, int(k)), cols), dtype)


# ---------------------------------------------------------------- float classification


@_op
def isnan(x):
    t = _tracer(x)
    if not _dtypes.is_float(t.dtype):
        return full(t.shape, False, bool)
    return not_equal(t, t)


@_op
def isinf(x):
    t = _tracer(x)
    if not _dtypes.is_float(t.dtype):
        return full(t.shape, False, bool)
    return equal(abs(t), _np.inf)


@_op
def isfinite(x):
    t = _tracer(x)
    if not _dtypes.is_float(t.dtype):
        return full(t.shape, True, bool)
    return logical_not(logical_or(isnan(t), isinf(t)))


# ---------------------------------------------------------------- statistics


@_op
def var(a, axis=None, dtype=None, ddof=0, keepdims=False):
    """numpy's var: the mean of squared deviations from the mean (in float64
    for integer input), divided by N - ddof."""
    t = _tracer(a)
    d = _np.dtype(dtype) if dtype is not None else (t.dtype if _dtypes.is_float(t.dtype) else _np.dtype(float64))
    x = astype(t, d)
    axes = tuple(range(t.ndim)) if axis is None else tuple(_axis_list(axis, t.ndim, "var"))
    n = int(_np.prod([t.shape[i] for i in axes], dtype=_np.int64))
    dev = subtract(x, divide(sum(x, axes, keepdims=True), d.type(n)))
    return divide(sum(multiply(dev, dev), axes, keepdims=keepdims), d.type(builtins.max(n - ddof, 0)))


@_op
def std(a, axis=None, dtype=None, ddof=0, keepdims=False):
    return sqrt(var(a, axis=axis, dtype=dtype, ddof=ddof, keepdims=keepdims))


# ---------------------------------------------------------------- rounding, as numpy defines it


def _round_half_even(t):
    """numpy.rint: ties to the even neighbour. x - floor(x) is exact in
    floating point, so the tie test is exact too."""
    f = floor(t)
    diff = subtract(t, f)
    up = add(f, t.dtype.type(1))
    f_even = equal(remainder(f, t.dtype.type(2)), t.dtype.type(0))
    r = where(greater(diff, t.dtype.type(0.5)), up, where(less(diff, t.dtype.type(0.5)), f, where(f_even, f, up)))
    # A result of zero keeps the argument's sign, as rint's does (-0.4 -> -0.0).
    return where(equal(r, t.dtype.type(0)), multiply(t, t.dtype.type(0)), r)


@_op
def round(a, decimals=0):
    """numpy.round: to `decimals` places, ties to even; numpy's scaling by
    10**decimals (so round(2.675, 2) is 2.67, as in numpy)."""
    t = _tracer(a)
    decimals = int(decimals)
    if t.dtype == _np.bool_:
        return _convert(t, _np.float16)  # numpy's loop for bool is float16's
    if not _dtypes.is_float(t.dtype):
        if decimals >= 0:
            return t
        f = 10**-decimals
        q = floor_divide(t, f)
        r2 = multiply(subtract(t, multiply(q, f)), 2)
        q_odd = not_equal(remainder(q, 2), 0)
        up = logical_or(greater(r2, f), logical_and(equal(r2, f), q_odd))
        return multiply(where(up, add(q, 1), q), f)
    if decimals == 0:
        return _round_half_even(t)
    if decimals > 0:
        f = t.dtype.type(10.0**decimals)
        return divide(_round_half_even(multiply(t, f)), f)
    f = t.dtype.type(10.0**-decimals)
    return multiply(_round_half_even(divide(t, f)), f)


around = round


@_op
def rint(x):
    t = _tracer(x)
    if not _dtypes.is_float(t.dtype):
        t = _convert(t, _np.result_type(t.dtype, _np.float16))
    return _round_half_even(t)


@_op
def trunc(x):
    t = _tracer(x)
    if not _dtypes.is_float(t.dtype):
        return t
    return where(less(t, t.dtype.type(0)), ceil(t), floor(t))


fix = trunc


@_op
def reciprocal(x):
    t = _tracer(x)
    if _dtypes.is_float(t.dtype):
        return divide(t.dtype.type(1), t)
    if t.dtype == _np.bool_:
        t = _convert(t, _np.int8)  # numpy's reciprocal has no bool loop: int8's
    # numpy's integer loop is C's 1 / x: 1 and -1 are their own reciprocals,
    # every other nonzero value truncates to 0 (and 1 / 0 is undefined).
    return where(equal(abs(t), 1), t, zeros((), t.dtype))


@_op
def nan_to_num(x, copy=True, nan=0.0, posinf=None, neginf=None):
    t = _tracer(x)
    if not _dtypes.is_float(t.dtype):
        return t
    info = _np.finfo(t.dtype)
    big = info.max if posinf is None else posinf
    small = info.min if neginf is None else neginf
    out = where(isnan(t), t.dtype.type(nan), t)
    out = where(equal(t, t.dtype.type(_np.inf)), t.dtype.type(big), out)
    return where(equal(t, t.dtype.type(-_np.inf)), t.dtype.type(small), out)


@_op
def logaddexp(x1, x2):
    """numpy.logaddexp: log(exp(x1) + exp(x2)) without overflow, as numpy's
    loop computes it: equal arguments give x + log 2 (so inf stays inf)."""
    d = _result_dtype(x1, x2)
    if not _dtypes.is_float(d):
        d = _np.result_type(d, _np.float16)
    shape = _np.broadcast_shapes(_shape(x1), _shape(x2))
    a, b = _operand(x1, d, shape), _operand(x2, d, shape)
    diff = subtract(a, b)
    r = add(maximum(a, b), log1p(exp(negative(abs(diff)))))
    r = where(isnan(diff), add(a, b), r)
    return where(equal(a, b), add(a, d.type(_np.log(2))), r)


# ---------------------------------------------------------------- shifts


def _shift_operands(x1, x2, name):
    d = _result_dtype(x1, x2)
    if d == _np.bool_:
        d = _np.dtype(_np.int8)  # numpy's shift loops for bools are int8's
    if d.kind not in "iu":
        raise TypeError(f"ufunc '{name}' not supported for the input types ({d}): integers or bools only")
    _check_in_range([x1, x2], d)
    shape = _np.broadcast_shapes(_shape(x1), _shape(x2))
    return d, _operand(x1, d, shape), _operand(x2, d, shape)


@_op
def left_shift(x1, x2):
    """numpy.left_shift: x1 * 2**x2, wrapping; 0 for a count below 0 or
    past the width (numpy's npy_lshift)."""
    d, a, n = _shift_operands(x1, x2, "left_shift")
    bits = 8 * d.itemsize
    valid = logical_and(greater_equal(n, 0), less(n, bits))
    scale = power(_np.array(2, d), clip(n, 0, bits - 1))  # 2**(bits-1) wraps to the sign bit, as it should
    return where(valid, multiply(a, scale), _np.array(0, d))


@_op
def right_shift(x1, x2):
    """numpy.right_shift: arithmetic for signed integers (floor division by
    2**x2); past the width (or below 0), -1 for a negative x1, else 0."""
    d, a, n = _shift_operands(x1, x2, "right_shift")
    bits = 8 * d.itemsize
    top = bits - 1 if d.kind == "u" else bits - 2  # the largest power of two d holds
    fill = where(less(a, 0), _np.array(-1, d), _np.array(0, d)) if d.kind == "i" else _np.array(0, d)
    shifted = floor_divide(a, power(_np.array(2, d), clip(n, 0, top)))
    return where(logical_and(greater_equal(n, 0), less_equal(n, top)), shifted, fill)


bitwise_left_shift, bitwise_right_shift = left_shift, right_shift


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


cumulative_sum, cumulative_prod = cumsum, cumprod


# ---------------------------------------------------------------- layout by composition


@_op
def roll(a, shift, axis=None):
    t = _tracer(a)
    if axis is None:
        return reshape(roll(ravel(t), shift, 0), t.shape)
    shifts = (shift,) if isinstance(shift, (int, _np.integer)) else tuple(shift)
    axes = (axis,) if isinstance(axis, (int, _np.integer)) else tuple(axis)
    if len(shifts) == 1 and len(axes) > 1:
        shifts = shifts * len(axes)
    if len(axes) == 1 and len(shifts) > 1:
        axes = axes * len(shifts)
    if len(shifts) != len(axes):
        raise ValueError("roll: 'shift' and 'axis' should be scalars or 1D sequences of the same length")
    out = t
    for s_, ax in zip(shifts, axes):
        ax = _axis_list(ax, t.ndim, "roll")[0]
        n = t.shape[ax]
        if n == 0 or int(s_) % n == 0:
            continue
        k = int(s_) % n
        lead = (slice(None),) * ax
        out = concatenate([out[lead + (slice(n - k, n),)], out[lead + (slice(0, n - k),)]], axis=ax)
    return out


@_op
def tile(A, reps):
    t = _tracer(A)
    reps = (int(reps),) if isinstance(reps, (int, _np.integer)) else tuple(int(r) for r in reps)
    if builtins.any(r < 0 for r in reps):
        raise ValueError(f"tile: negative repetitions in {reps}")
    ndim = builtins.max(t.ndim, len(reps))
    reps = (1,) * (ndim - len(reps)) + reps
    t = reshape(t, (1,) * (ndim - t.ndim) + t.shape)
    spread = []
    for r, s_ in zip(reps, t.shape):
        spread += [r, s_]
    pairs = reshape(t, tuple(x for s_ in t.shape for x in (1, s_)))
    return reshape(broadcast_to(pairs, tuple(spread)), tuple(r * s_ for r, s_ in zip(reps, t.shape)))


@_op
def repeat(a, repeats, axis=None):
    t = _tracer(a)
    if axis is None:
        t, axis = ravel(t), 0
    ax = _axis_list(axis, t.ndim, "repeat")[0]
    n = t.shape[ax]
    counts = _np.asarray(repeats)
    if counts.dtype.kind not in "iu":
        raise TypeError(f"repeat: repeats must be integers, got {counts.dtype}")
    if counts.ndim == 0 or counts.size == 1:
        r = int(counts.reshape(-1)[0])
        if r < 0:
            raise ValueError(f"repeat: negative repetitions ({r})")
        spread = t.shape[: ax + 1] + (r,) + t.shape[ax + 1 :]
        column = reshape(t, t.shape[: ax + 1] + (1,) + t.shape[ax + 1 :])
        return reshape(broadcast_to(column, spread), t.shape[:ax] + (n * r,) + t.shape[ax + 1 :])
    if counts.shape != (n,):
        raise ValueError(f"repeat: {counts.size} repeat counts for axis {ax} of size {n}")
    if (counts < 0).any():
        raise ValueError("repeat: negative repetitions")
    lead = (slice(None),) * ax
    pieces = [repeat(t[lead + (slice(i, i + 1),)], int(c), ax) for i, c in enumerate(counts) if c > 0]
    if not pieces:
        return t[lead + (slice(0, 0),)]
    return pieces[0] if len(pieces) == 1 else concatenate(pieces, axis=ax)


def _split_points(n, indices_or_sections, even, name):
    if isinstance(indices_or_sections, (int, _np.integer)):
        k = int(indices_or_sections)
        if k <= 0:
            raise ValueError(f"{name}: number sections must be larger than 0")
        if even and n % k:
            raise ValueError("array split does not result in an equal division")
        base, extra = divmod(n, k)
        sizes = [base + 1] * extra + [base] * (k - extra)
        return list(_np.cumsum([0] + sizes))
    points = [int(i) for i in indices_or_sections]
    return [0] + points + [n]


def _split(ary, indices_or_sections, axis, even, name):
    t = _tracer(ary)
    ax = _axis_list(axis, t.ndim, name)[0]
    n = t.shape[ax]
    bounds = _split_points(n, indices_or_sections, even, name)
    lead = (slice(None),) * ax
    # numpy slices ary[lo:hi] for each pair: indexing already clamps and
    # wraps the bounds as Python slices do.
    return [t[lead + (slice(lo, hi),)] for lo, hi in zip(bounds[:-1], bounds[1:])]


@_op
def split(ary, indices_or_sections, axis=0):
    return _split(ary, indices_or_sections, axis, True, "split")


@_op
def array_split(ary, indices_or_sections, axis=0):
    return _split(ary, indices_or_sections, axis, False, "array_split")


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
def asarray(a, dtype=None):
    t = _tracer(a)
    return t if dtype is None or _np.dtype(dtype) == t.dtype else astype(t, dtype)


array = asarray


# ---------------------------------------------------------------- sorting


def _sort_node(keys, moved, axis, descending):
    """SORT: `moved` (or the keys themselves) reordered along `axis` by a
    stable sort of the keys, NaN last (descending: first)."""
    ops = [keys] if moved is None else [keys, moved]

    def attrs(n):
        n.sort.dimension = axis
        n.sort.descending = bool(descending)
        n.sort.result_operand = len(ops) - 1

    return _b().node(ir_pb2.SORT, ops, ops[-1].shape, ops[-1].dtype, set_attrs=attrs)


def _sort_axis(t, axis, name):
    if axis is None:
        return ravel(t), 0
    if t.ndim == 0:
        raise _np.exceptions.AxisError(f"{name}: axis {axis} is out of bounds for array of dimension 0")
    return t, _axis_list(axis, t.ndim, name)[0]


@_op
def sort(a, axis=-1, kind=None, order=None, *, stable=True, descending=False):
    """numpy.sort, always stable: NaN sorts last, -0.0 and 0.0 are equal
    (they keep their order, as numpy's stable sort). `descending` (as
    jax.numpy) orders the largest first, NaN first, equal keys still in
    their order."""
    if order is not None:
        raise NotImplementedError("sort: `order` (structured arrays) is not supported")
    t, ax = _sort_axis(_tracer(a), axis, "sort")
    return _sort_node(t, None, ax, descending)


@_op
def argsort(a, axis=-1, kind=None, order=None, *, stable=True, descending=False):
    """numpy.argsort (as kind='stable'): int64 indices."""
    if order is not None:
        raise NotImplementedError("argsort: `order` (structured arrays) is not supported")
    t, ax = _sort_axis(_tracer(a), axis, "argsort")
    return _sort_node(t, _b().iota(t.shape, _np.dtype(int64), ax), ax, descending)


@_op
def searchsorted(a, v, side="left", sorter=None, method=None):
    """numpy.searchsorted into a sorted 1-D `a` (NaN sorts last, as
    numpy's): per value of v, how many elements of a go before it (left:
    those less than it; right: those not greater). Every pair is compared
    (a broadcast compare and a sum): memory grows as len(a) * v.size."""
    t = _tracer(a)
    if t.ndim != 1:
        raise ValueError(f"searchsorted: a must be 1-dimensional, got {t!r}")
    if side not in ("left", "right"):
        raise ValueError(f"searchsorted: side must be 'left' or 'right', got {side!r}")
    if sorter is not None:
        t = take(t, sorter)
    x = _tracer(v)
    d = _result_dtype(t, x)
    sa = reshape(_convert(t, d), (1,) * x.ndim + t.shape)
    sv = expand_dims(_convert(x, d), -1)
    before = less(sa, sv) if side == "left" else less_equal(sa, sv)
    if d.kind == "f" or d == _dtypes.BFLOAT16:  # NaN is the largest: every number goes before it
        nan_v = not_equal(sv, sv)
        before = logical_or(before, logical_and(nan_v, equal(sa, sa)) if side == "left" else nan_v)
    return sum(before, axis=-1, dtype=int64)


# ---------------------------------------------------------------- x.at[...]: functional updates


@_op
def _at_update(x, idx, values, mode):
    """x with the region idx selects (integers, slices of either step, one
    ellipsis) combined with `values` (broadcast to the region, cast to x's
    dtype, as jax does): set, add, multiply, min or max. The region goes in
    with a pad (interior padding for strides) and a select: no copy of x
    beyond the result."""
    t = _tracer(x)
    if not isinstance(idx, tuple):
        idx = (idx,)
    if builtins.any(i is None for i in idx):
        raise IndexError(f".at[{idx!r}]: None (np.newaxis) does not name a region to update")
    if builtins.any(_is_array_index(i) for i in idx):
        return _advanced_update(t, _expand_index(t, idx, f".at[...].{mode}"), values, mode)
    rev, start, limit, strides, keep = _basic_index(t, idx)
    region = tuple(len(range(a, b, c)) for a, b, c in zip(start, limit, strides))
    if 0 in region:
        return t
    v = _tracer(values)
    try:
        fits = tuple(_np.broadcast_shapes(v.shape, tuple(keep))) == tuple(keep)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f".at[...].{mode}: values of shape {v.shape} do not broadcast to the indexed shape " f"{tuple(keep)}"
        )
    v = reshape(broadcast_to(_convert(v, t.dtype), tuple(keep)), region)
    u = _reverse(t, rev)
    low = start
    high = [size - (lim if n else lo) for size, lo, lim, n in zip(t.shape, start, limit, region)]
    interior = [st - 1 for st in strides]
    # -0.0 is the additive identity of floats: x + -0.0 is x, -0.0 included.
    neutral = {"set": 0, "add": -0.0 if _dtypes.is_float(t.dtype) else 0, "multiply": 1, "min": 0, "max": 0}[mode]

    def spread(val, fill):
        def attrs(n):
            n.pad.low.extend(low)
            n.pad.high.extend(high)
            n.pad.interior.extend(interior)

        return _b().node(ir_pb2.PAD, [val, _operand(fill, val.dtype, ())], t.shape, val.dtype, set_attrs=attrs)

    placed = spread(v, neutral)
    if mode == "add":
        out = add(u, placed) if t.dtype != _np.bool_ else logical_or(u, placed)
    elif mode == "multiply":
        out = multiply(u, placed) if t.dtype != _np.bool_ else logical_and(u, placed)
    else:
        mask = spread(full(region, True, _np.bool_), False)
        new = placed if mode == "set" else minimum(u, placed) if mode == "min" else maximum(u, placed)
        out = where(mask, new, u)
    return _reverse(out, rev)


class _IndexUpdateRef:
    """x.at[idx]: jax's functional update of one region."""

    def __init__(self, x, idx):
        self._x, self._idx = x, idx

    def get(self):
        return self._x[self._idx]

    def set(self, values):
        return _at_update(self._x, self._idx, values, "set")

    def add(self, values):
        return _at_update(self._x, self._idx, values, "add")

    def multiply(self, values):
        return _at_update(self._x, self._idx, values, "multiply")

    mul = multiply

    def min(self, values):
        return _at_update(self._x, self._idx, values, "min")

    def max(self, values):
        return _at_update(self._x, self._idx, values, "max")


class _IndexUpdateHelper:
    def __init__(self, x):
        self._x = x

    def __getitem__(self, idx):
        return _IndexUpdateRef(self._x, idx)


# Index arguments: numpy arrays in them are indices known when tracing (and
# boolean masks), also for an eager call, which keeps them static.
for _f in (_getitem, _at_update, take, take_along_axis):
    _f.__wrapped__._static_arrays = (1,)

install_operators(Tracer, __import__(__name__, fromlist=["_"]))
