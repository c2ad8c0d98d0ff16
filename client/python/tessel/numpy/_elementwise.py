"""Element-wise ops: arithmetic, comparisons, logic, unary math, float
checks, rounding and shifts.
"""

import builtins

import numpy as _np

from tessel import _dtypes
from tessel.v1 import ir_pb2
from tessel.numpy._core import (
    _b,
    _check_in_range,
    _convert,
    _elementwise,
    _float_dtype,
    full,
    _is_pyscalar,
    _op,
    _operand,
    _out_of_range,
    _result_dtype,
    _shape,
    _tracer,
    zeros,
)


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


@_op
def exp2(x):
    """numpy.exp2: 2 ** x, in the smallest float type holding x's."""
    t = _tracer(x)
    if not _dtypes.is_float(t.dtype):
        t = _convert(t, _np.result_type(t.dtype, _np.float16))
    return power(2.0, t)


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
def clip(a, a_min=None, a_max=None, *, min=None, max=None):
    """numpy.clip; `min` and `max` are the Array API's (and numpy 2.1's)
    names for the bounds."""
    if min is not None:
        a_min = min
    if max is not None:
        a_max = max
    t = _tracer(a)
    if t.dtype == _np.bool_ and builtins.all(x is None or _np.result_type(x) == _np.bool_ for x in (a_min, a_max)):
        # bools stay bools, as numpy's: at least a_min (an or), at most a_max (an and)
        out = t if a_min is None else logical_or(t, a_min)
        return out if a_max is None else logical_and(out, a_max)
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
def astype(x, dtype, copy=True):
    """x converted to `dtype`. `copy` (the Array API's) changes nothing:
    arrays are values, so no caller can tell a copy from the original."""
    return _convert(_tracer(x), dtype)


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
