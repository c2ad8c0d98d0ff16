"""The reference a differential program is checked against.

`Oracle` is a namespace with tessel.numpy's names (add, sum, einsum, astype,
float32, ...) computed by numpy, over `Value`s, which carry numpy arrays and
have the operators and methods of a tessel.Array. A program written once
against `xp` runs with xp=tessel.numpy on tessel.Arrays and with xp=Oracle()
on Values.

Where Tessel documents a difference from numpy, the oracle computes Tessel's
documented answer instead; each such place is an entry of DOCUMENTED, and
where XLA's semantics are the documented answer, JAX on CPU computes it.
Everything else must match numpy.

Rounding. Ops whose result may differ by a few ulps between correct
implementations (transcendentals, sums, products and dot products, whose
order is free) are *inexact*. A perturbed oracle adds to each inexact result
a random fraction of that op's error bound, and a program runs once plain and
a few times perturbed; an inexact output of Tessel must lie within the range
those runs span (plus a few ulps). Every other float is compared bit for bit,
signs of zeros included, and so are integers and booleans. The program
generator never feeds an inexact float into a discontinuous op (a
comparison, floor, a cast to int, argmax, ...), where a one-ulp difference
could flip the answer.
"""

import functools
import os

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
SUPPORTED = tuple(
    np.dtype(d)
    for d in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        BF16,
        np.float32,
        np.float64,
    )
)

# Tessel's documented differences from numpy, each implemented below where it
# applies (search for its key). test_differential.py prints this table with
# --differential-table, and docs/python.md carries it.
DOCUMENTED = {
    "int-div-zero": (
        "x // 0 and x % 0 on integers are 0 (with a warning)",
        "-1 and x, whatever the sign of x",
        "XLA's integer division (JAX adjusts floor_divide to -2 for x != 0 and gives x % 0 = 0)",
    ),
    "float-to-int": (
        "a float cast to an integer type out of its range, or NaN, is undefined (INT_MIN on x86)",
        "saturates at the type's bounds; NaN is 0",
        "XLA's conversion, as JAX on CPU",
    ),
    "clip-zero": (
        "the sign of a zero from clip when it ties a zero bound depends on numpy's code path "
        "(clip(-0.0, -inf, 0.0) is -0.0 with scalar bounds, 0.0 with array bounds)",
        "either sign",
        "implementation-defined in numpy itself",
    ),
    "reduce-zero": (
        "the sign of a zero from max or min over +0.0 and -0.0 depends on the order of comparisons",
        "either sign",
        "implementation-defined in numpy itself",
    ),
    "max-zero": (
        "maximum and minimum of +0.0 and -0.0 give the first operand (np.maximum(-0.0, 0.0) is -0.0), "
        "also in x.at[i].max and .min",
        "either sign",
        "StableHLO leaves it open; XLA on CPU gives +0.0 from that maximum, as JAX",
    ),
    "pow-neg-inf": (
        "(-inf) ** y for a positive non-integer y is NaN (numpy's SIMD power, float32 and float64)",
        "+inf",
        "C99's pow, XLA's and JAX's",
    ),
    "bf16-sign-zero": (
        "sign(-0.0) is -0.0 for bfloat16 (ml_dtypes), +0.0 for numpy's floats",
        "+0.0 for every float",
        "numpy's rule for its own floats",
    ),
    "bf16-contraction": (
        "matmul of bfloat16 is float32; einsum of bfloat16 is an error",
        "bfloat16 (accumulated in float32)",
        "as JAX",
    ),
    "bf16-promotion": (
        "bfloat16 (ml_dtypes) has no promotion with int32/int64/float16, and a Python float " "makes it float32",
        "bfloat16 promotes as float16 does in numpy (with int32/int64: float64); with float16: "
        "float32; a Python float keeps it bfloat16",
        "numpy has no rule; JAX keeps bfloat16 with any integer",
    ),
}


def _jnp():
    """jax.numpy on CPU with 64-bit types (the oracle for XLA's semantics)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    return jnp


def is_float(dtype):
    d = np.dtype(dtype)
    return d.kind == "f" or d == BF16


def finfo(dtype):
    return ml_dtypes.finfo(dtype) if np.dtype(dtype) == BF16 else np.finfo(dtype)


def _is_pyscalar(x):
    return isinstance(x, (bool, int, float)) and not isinstance(x, np.generic)


class Value:
    """A numpy array in an oracle run, with a tessel.Array's operators."""

    __array_priority__ = 2000

    def __init__(self, ns, a):
        self.ns = ns
        self.a = np.asarray(a)

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    ndim = property(lambda self: self.a.ndim)
    size = property(lambda self: self.a.size)
    T = property(lambda self: self.ns.transpose(self))

    def __repr__(self):
        return f"Value({self.a!r})"

    def astype(self, dtype):
        return self.ns.astype(self, dtype)

    def reshape(self, *shape):
        return self.ns.reshape(self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)

    def transpose(self, *axes):
        return self.ns.transpose(self, axes if axes else None)

    def sum(self, axis=None, keepdims=False, dtype=None):
        return self.ns.sum(self, axis, dtype=dtype, keepdims=keepdims)

    def mean(self, axis=None, keepdims=False):
        return self.ns.mean(self, axis, keepdims=keepdims)

    def max(self, axis=None, keepdims=False):
        return self.ns.max(self, axis, keepdims=keepdims)

    def min(self, axis=None, keepdims=False):
        return self.ns.min(self, axis, keepdims=keepdims)

    def prod(self, axis=None, keepdims=False):
        return self.ns.prod(self, axis, keepdims=keepdims)

    def argmax(self, axis=None):
        return self.ns.argmax(self, axis)

    def argmin(self, axis=None):
        return self.ns.argmin(self, axis)

    def __getitem__(self, idx):
        return self.ns._getitem(self, idx)

    @property
    def at(self):
        value = self

        class Ref:
            def __init__(self, idx):
                self.idx = idx

            def __getattr__(self, mode):
                return lambda values: value.ns._at(value, self.idx, values, mode)

        class Helper:
            def __getitem__(self, idx):
                return Ref(idx)

        return Helper()

    def __neg__(self):
        return self.ns.negative(self)

    def __pos__(self):
        return self

    def __abs__(self):
        return self.ns.abs(self)

    def __invert__(self):
        return self.ns.invert(self)

    def __bool__(self):
        raise TypeError("bool() of a program value: programs are traced, their values are not known")

    __hash__ = object.__hash__


# The operators a tessel.Array has, written out here (not borrowed from the
# SDK, so that a wrong mapping there shows).
_BINARY_OPERATORS = {
    "add": "add",
    "sub": "subtract",
    "mul": "multiply",
    "truediv": "divide",
    "floordiv": "floor_divide",
    "mod": "remainder",
    "pow": "power",
    "matmul": "matmul",
    "and": "bitwise_and",
    "or": "bitwise_or",
    "xor": "bitwise_xor",
    "lshift": "left_shift",
    "rshift": "right_shift",
}
for _op, _fn in _BINARY_OPERATORS.items():
    setattr(Value, f"__{_op}__", lambda a, b, fn=_fn: getattr(a.ns, fn)(a, b))
    setattr(Value, f"__r{_op}__", lambda a, b, fn=_fn: getattr(a.ns, fn)(b, a))
for _op, _fn in {
    "lt": "less",
    "le": "less_equal",
    "gt": "greater",
    "ge": "greater_equal",
    "eq": "equal",
    "ne": "not_equal",
}.items():
    setattr(Value, f"__{_op}__", lambda a, b, fn=_fn: getattr(a.ns, fn)(a, b))


def _raw(x):
    if isinstance(x, Value):
        return x.a
    if isinstance(x, (list, tuple)):
        return type(x)(_raw(v) for v in x)
    return x


def _finite_abs(x):
    """|x| in float64 with NaN and infinities as 0: the scale of a rounding
    error (an infinite or NaN result carries none)."""
    a = np.abs(np.asarray(x).astype(np.float64))
    return np.where(np.isfinite(a), a, 0.0)


# Error bounds, in ulps of the result's type, per inexact op.
ULPS_ELEMENTWISE = 4  # a transcendental function: a few ulps of its result
ULPS_REDUCTION = 8  # a sum or dot product in any order: ulps of the sum of |terms|


class OrderDependent(ValueError):
    """A sum or product whose answer depends on the order of its terms (a
    partial result can overflow): not a program the oracle can judge."""


def _elementwise_op(fn):
    """An op over arrays and scalars: bf16 promotion as Tessel documents it,
    numpy's warnings off."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with np.errstate(all="ignore"):
            return self._wrap(fn(self, *args, **kwargs))

    return wrapper


class Oracle:
    """tessel.numpy's names over numpy (see the module doc). `perturb`, when
    given, maps a shape to factors in [-1, 1]: each inexact result moves by
    that fraction of its error bound. `alternate`: where an op's terms may be
    associated in another valid order, use it."""

    float16, float32, float64, bfloat16 = np.float16, np.float32, np.float64, BF16.type
    int8, int16, int32, int64, bool_ = np.int8, np.int16, np.int32, np.int64, np.bool_
    uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64

    def __init__(self, perturb=None, alternate=False):
        self.perturb = perturb
        self.alternate = alternate

    def wrap_inputs(self, arrays):
        return [Value(self, a) for a in arrays]

    @property
    def lax(self):
        return OracleLax(self)

    def _wrap(self, r):
        if isinstance(r, (list, tuple)):
            return type(r)(self._wrap(x) for x in r)
        return Value(self, r)

    def _check_order_free(self, bound, dtype):
        """Raises OrderDependent where the sum of |terms| (finite ones) could
        overflow `dtype` in some order (checked on the plain run, the one
        the generator draws with)."""
        if self.perturb is None and not self.alternate and np.any(np.asarray(bound) > float(finfo(dtype).max) / 4):
            raise OrderDependent("a partial sum could overflow")

    def _inexact(self, r, bound):
        """`r`, moved by the perturbation within `bound` (absolute, per element)."""
        r = np.asarray(r)
        if self.perturb is None or not is_float(r.dtype):
            return r
        with np.errstate(all="ignore"):
            moved = r.astype(np.float64) + self.perturb(r.shape) * np.nan_to_num(bound, posinf=finfo(r.dtype).max)
            return np.where(np.isfinite(r), moved, r.astype(np.float64)).astype(r.dtype)

    # ------------------------------------------------------------ promotion

    @staticmethod
    def result_type(*xs):
        """numpy's result type, and DOCUMENTED["bf16-promotion"] where a
        bfloat16 meets what numpy cannot promote it with."""
        strong = [np.asarray(x).dtype for x in xs if not _is_pyscalar(x)]
        weak = [x for x in xs if _is_pyscalar(x)]
        if BF16 not in strong:
            return np.result_type(*strong, *weak)
        has_f16 = np.dtype(np.float16) in strong
        d = np.result_type(*[np.dtype(np.float16) if s == BF16 else s for s in strong], *weak)
        if d == np.float16:
            return np.dtype(np.float32) if has_f16 else BF16
        return d

    def _cast_all(self, xs):
        xs = _raw(xs)
        if not any(not _is_pyscalar(x) and np.asarray(x).dtype == BF16 for x in xs):
            return xs
        d = self.result_type(*xs)
        return [np.asarray(x).astype(d) for x in xs]

    # ------------------------------------------------------------ elementwise

    def _binary(ufunc):
        @_elementwise_op
        def f(self, x1, x2):
            a, b = self._cast_all([x1, x2])
            return ufunc(a, b)

        f.__name__ = ufunc.__name__
        return f

    add = _binary(np.add)
    subtract = _binary(np.subtract)
    multiply = _binary(np.multiply)

    def _extremum2(ufunc):
        @_elementwise_op
        def f(self, x1, x2):
            a, b = self._cast_all([x1, x2])
            return self._tied_zeros(ufunc(a, b), a, b)

        f.__name__ = ufunc.__name__
        return f

    def _tied_zeros(self, r, a, b):
        """DOCUMENTED["max-zero"]: where +0.0 meets -0.0 in a maximum or a
        minimum, the alternate runs take the other zero."""
        r = np.asarray(r)
        if not self.alternate or not is_float(r.dtype):
            return r
        a, b = np.asarray(a), np.asarray(b)
        tie = (a == 0) & (b == 0) & (np.signbit(a) != np.signbit(b))
        return np.where(np.broadcast_to(tie, r.shape), -r, r).astype(r.dtype)

    maximum = _extremum2(np.maximum)
    minimum = _extremum2(np.minimum)
    bitwise_and = _binary(np.bitwise_and)
    bitwise_or = _binary(np.bitwise_or)
    bitwise_xor = _binary(np.bitwise_xor)
    left_shift = _binary(np.left_shift)
    right_shift = _binary(np.right_shift)
    logical_and = _binary(np.logical_and)
    logical_or = _binary(np.logical_or)
    logical_xor = _binary(np.logical_xor)
    equal = _binary(np.equal)
    not_equal = _binary(np.not_equal)
    less = _binary(np.less)
    less_equal = _binary(np.less_equal)
    greater = _binary(np.greater)
    greater_equal = _binary(np.greater_equal)
    divide = true_divide = _binary(np.divide)

    @_elementwise_op
    def power(self, x1, x2):
        a, b = self._cast_all([x1, x2])
        r = np.asarray(np.power(a, b))
        if not is_float(r.dtype):
            return r
        at_neg_inf = np.broadcast_to(np.asarray(a) == -np.inf, r.shape)
        if at_neg_inf.any():
            # DOCUMENTED["pow-neg-inf"]: C99's and XLA's special cases.
            r = np.where(at_neg_inf, np.asarray(_jnp().power(np.asarray(a), np.asarray(b))), r).astype(r.dtype)
        # pow's error grows with |y log x| in the usual exp(y * log(x)) form.
        with np.errstate(all="ignore"):
            k = 1 + np.minimum(_finite_abs(np.asarray(b, np.float64) * np.log(_finite_abs(a))), 1e3)
        return self._inexact(r, ULPS_ELEMENTWISE * finfo(np.asarray(r).dtype).eps * _finite_abs(r) * k)

    copysign = _binary(np.copysign)
    nextafter = _binary(np.nextafter)

    @_elementwise_op
    def hypot(self, x1, x2):
        a, b = self._cast_all([x1, x2])
        r = np.asarray(np.hypot(a, b))
        return self._inexact(r, ULPS_ELEMENTWISE * finfo(r.dtype).eps * _finite_abs(r))

    def _integer_division(ufunc, by_zero):
        @_elementwise_op
        def f(self, x1, x2):
            a, b = self._cast_all([x1, x2])
            r = np.asarray(ufunc(a, b))
            if r.dtype.kind in "iu":
                # DOCUMENTED["int-div-zero"]: x // 0 is -1, x % 0 is x.
                r = np.where(np.broadcast_to(np.asarray(b) == 0, r.shape), by_zero(np.asarray(a), r), r).astype(r.dtype)
            return r

        f.__name__ = ufunc.__name__
        return f

    floor_divide = _integer_division(np.floor_divide, lambda a, r: np.full(r.shape, -1).astype(r.dtype))
    remainder = mod = _integer_division(np.remainder, lambda a, r: np.broadcast_to(a, r.shape).astype(r.dtype))

    def _unary(ufunc, inexact=False):
        @_elementwise_op
        def f(self, x):
            r = np.asarray(ufunc(_raw(x)))
            if inexact and is_float(r.dtype):
                r = self._inexact(r, ULPS_ELEMENTWISE * finfo(r.dtype).eps * _finite_abs(r))
            return r

        f.__name__ = ufunc.__name__
        return f

    negative = _unary(np.negative)
    abs = absolute = _unary(np.abs)

    @_elementwise_op
    def sign(self, x):
        x = np.asarray(_raw(x))
        r = np.sign(x)
        if x.dtype == BF16:
            # DOCUMENTED["bf16-sign-zero"]: +0.0, as numpy's floats.
            r = np.where(x == 0, np.zeros((), BF16), r).astype(BF16)
        return r

    floor = _unary(np.floor)
    ceil = _unary(np.ceil)
    sqrt = _unary(np.sqrt)
    square = _unary(np.square)
    invert = bitwise_not = _unary(np.invert)
    logical_not = _unary(np.logical_not)
    exp = _unary(np.exp, inexact=True)
    log = _unary(np.log, inexact=True)
    log1p = _unary(np.log1p, inexact=True)
    tanh = _unary(np.tanh, inexact=True)
    sin = _unary(np.sin, inexact=True)
    cos = _unary(np.cos, inexact=True)
    arctan = _unary(np.arctan, inexact=True)
    sinh = _unary(np.sinh, inexact=True)
    cosh = _unary(np.cosh, inexact=True)
    arcsinh = _unary(np.arcsinh, inexact=True)
    expm1 = _unary(np.expm1, inexact=True)
    exp2 = _unary(np.exp2, inexact=True)
    cbrt = _unary(np.cbrt, inexact=True)
    trunc = _unary(np.trunc)
    rint = _unary(np.rint)
    signbit = _unary(np.signbit)

    def _float_unary(formula):
        """Functions numpy lacks, computed in float64 and rounded once; ints
        go to the smallest float that holds them, as numpy's loops do."""

        @_elementwise_op
        def f(self, x):
            x = np.asarray(_raw(x))
            d = x.dtype if is_float(x.dtype) else np.result_type(x.dtype, np.float16)
            r = np.asarray(formula(x.astype(np.float64))).astype(d)
            return self._inexact(r, ULPS_ELEMENTWISE * finfo(d).eps * _finite_abs(r))

        return f

    sigmoid = logistic = _float_unary(lambda x: 1 / (1 + np.exp(-x)))
    rsqrt = _float_unary(lambda x: 1 / np.sqrt(x))

    @_elementwise_op
    def where(self, condition, x, y):
        a, b = self._cast_all([x, y])
        return np.where(_raw(condition), a, b)

    @_elementwise_op
    def clip(self, a, a_min, a_max):
        x, lo, hi = self._cast_all([a, a_min, a_max])
        # ml_dtypes has no clip loop for bfloat16: numpy computes it in float32.
        r = np.asarray(np.clip(x, lo, hi))
        if self.alternate and is_float(r.dtype):
            # DOCUMENTED["clip-zero"]: a zero tying a zero bound comes out
            # with either sign; the alternate runs flip it.
            tie = (r == 0) & np.broadcast_to((np.asarray(lo) == 0) | (np.asarray(hi) == 0), r.shape)
            r = np.where(tie, -r, r).astype(r.dtype)
        return r.astype(BF16) if np.asarray(x).dtype == BF16 else r

    @_elementwise_op
    def astype(self, x, dtype):
        x, d = np.asarray(_raw(x)), np.dtype(dtype)
        if is_float(x.dtype) and d.kind in "iu":
            # DOCUMENTED["float-to-int"]: XLA's saturating conversion.
            return np.asarray(_jnp().asarray(x).astype(d))
        return x.astype(d)

    # ------------------------------------------------------------ reductions

    @_elementwise_op
    def sum(self, a, axis=None, dtype=None, keepdims=False):
        x = np.asarray(_raw(a))
        r = np.asarray(np.sum(x, axis=axis, dtype=dtype, keepdims=keepdims))
        if is_float(r.dtype):
            bound = np.sum(_finite_abs(x), axis=axis, keepdims=keepdims)
            self._check_order_free(bound, r.dtype)
            r = self._inexact(r, ULPS_REDUCTION * finfo(r.dtype).eps * bound)
        return r

    @_elementwise_op
    def prod(self, a, axis=None, dtype=None, keepdims=False):
        x = np.asarray(_raw(a))
        r = np.asarray(np.prod(x, axis=axis, dtype=dtype, keepdims=keepdims))
        if is_float(r.dtype):
            n = max(1, x.size // max(1, r.size))
            # Every partial product stays inside the normal range.
            logs = np.abs(np.log2(np.where(_finite_abs(x) == 0, 1.0, _finite_abs(x))))
            judged = self.perturb is None and not self.alternate
            if judged and x.size and np.max(logs) * n > np.log2(float(finfo(r.dtype).max)) - 2:
                raise OrderDependent("a partial product could overflow or underflow")
            r = self._inexact(r, ULPS_REDUCTION * n * finfo(r.dtype).eps * _finite_abs(r))
        return r

    @_elementwise_op
    def mean(self, a, axis=None, keepdims=False):
        x = np.asarray(_raw(a))
        r = np.asarray(np.mean(x, axis=axis, keepdims=keepdims))
        n = max(1, x.size // max(1, r.size))
        bound = np.sum(_finite_abs(x), axis=axis, keepdims=keepdims)
        self._check_order_free(bound, r.dtype)
        bound = bound / n
        return self._inexact(r, ULPS_REDUCTION * finfo(r.dtype).eps * bound)

    @_elementwise_op
    def cumsum(self, a, axis=None, dtype=None):
        x = np.asarray(_raw(a))
        r = np.asarray(np.cumsum(x, axis=axis, dtype=dtype))
        if is_float(r.dtype):
            # Each prefix is a sum in some order: bounded by its |terms|.
            bound = np.cumsum(_finite_abs(x), axis=axis)
            self._check_order_free(bound, r.dtype)
            r = self._inexact(r, ULPS_REDUCTION * finfo(r.dtype).eps * bound)
        return r

    def _plain(npfn):
        @_elementwise_op
        def f(self, a, *args, **kwargs):
            return npfn(_raw(a), *_raw(args), **kwargs)

        f.__name__ = npfn.__name__
        return f

    def _extremum(npfn):
        @_elementwise_op
        def f(self, a, axis=None, keepdims=False):
            x = np.asarray(_raw(a))
            r = np.asarray(npfn(x, axis=axis, keepdims=keepdims))
            if self.alternate and is_float(r.dtype):
                # DOCUMENTED["reduce-zero"]: which zero a max or min of
                # +0.0 and -0.0 gives depends on the order of comparisons;
                # the alternate runs take the other one.
                both = np.any((x == 0) & ~np.signbit(x), axis=axis, keepdims=keepdims) & np.any(
                    (x == 0) & np.signbit(x), axis=axis, keepdims=keepdims
                )
                r = np.where((r == 0) & both, -r, r).astype(r.dtype)
            return r

        f.__name__ = npfn.__name__
        return f

    max = amax = _extremum(np.max)
    min = amin = _extremum(np.min)
    any = _plain(np.any)
    all = _plain(np.all)
    argmax = _plain(np.argmax)
    argmin = _plain(np.argmin)

    # ------------------------------------------------------------ layout

    reshape = _plain(np.reshape)
    transpose = _plain(np.transpose)
    broadcast_to = _plain(np.broadcast_to)
    expand_dims = _plain(np.expand_dims)

    @staticmethod
    def _sort_keys(x):
        """bfloat16 keys as float32 (exact): ml_dtypes' comparison leaves a
        NaN where it is, where numpy sorts a float NaN last."""
        return x.astype(np.float32) if x.dtype == ml_dtypes.bfloat16 else x

    @_elementwise_op
    def sort(self, a, axis=-1):
        x = np.asarray(_raw(a))
        order = np.argsort(self._sort_keys(x), axis=axis, kind="stable")
        return np.take_along_axis(x.ravel() if axis is None else x, order, axis=-1 if axis is None else axis)

    @_elementwise_op
    def argsort(self, a, axis=-1):
        return np.argsort(self._sort_keys(np.asarray(_raw(a))), axis=axis, kind="stable")

    @_elementwise_op
    def _at(self, a, idx, values, mode):
        """jax's x.at[idx].<mode>(values): the update made on a copy."""
        x = np.array(_raw(a), copy=True)
        v = np.asarray(_raw(values)).astype(x.dtype)
        old = x[idx]
        parts = idx if isinstance(idx, tuple) else (idx,)
        if mode != "set" and any(isinstance(i, (list, np.ndarray)) for i in parts):
            # Index arrays may repeat an index: every update applies (ufunc.at).
            ufunc = {
                "add": np.logical_or if x.dtype == np.bool_ else np.add,
                "multiply": np.logical_and if x.dtype == np.bool_ else np.multiply,
                "min": np.minimum,
                "max": np.maximum,
            }[mode]
            updates = np.broadcast_to(v, old.shape)
            if mode in ("min", "max") and self.alternate and is_float(x.dtype):
                # DOCUMENTED["max-zero"]: a slot that meets both zeros may end with either.
                pos, neg = (x == 0) & ~np.signbit(x), (x == 0) & np.signbit(x)
                np.logical_or.at(pos, idx, (updates == 0) & ~np.signbit(updates))
                np.logical_or.at(neg, idx, (updates == 0) & np.signbit(updates))
                ufunc.at(x, idx, updates)
                return np.where(pos & neg & (x == 0), -x, x).astype(x.dtype)
            ufunc.at(x, idx, updates)
            return x
        if mode == "set":
            x[idx] = v
        elif mode == "add":
            x[idx] = np.logical_or(old, v) if x.dtype == np.bool_ else old + v
        elif mode == "multiply":
            x[idx] = np.logical_and(old, v) if x.dtype == np.bool_ else old * v
        else:
            x[idx] = self._tied_zeros(np.minimum(old, v) if mode == "min" else np.maximum(old, v), old, v)
        return x

    take = _plain(np.take)
    take_along_axis = _plain(np.take_along_axis)
    flip = _plain(np.flip)
    roll = _plain(np.roll)
    squeeze = _plain(np.squeeze)
    ravel = _plain(np.ravel)
    swapaxes = _plain(np.swapaxes)
    moveaxis = _plain(np.moveaxis)
    isnan = _plain(np.isnan)
    isinf = _plain(np.isinf)
    isfinite = _plain(np.isfinite)

    def outer(self, a, b):
        return self.multiply(self.reshape(a, (-1, 1)), self.reshape(b, (1, -1)))

    def eye(self, n, dtype=np.float64):
        return Value(self, np.eye(n, dtype=dtype))

    @property
    def linalg(self):
        return OracleLinalg(self)

    def tril(self, m, k=0):
        raw = np.asarray(_raw(m))
        return self.where(np.tri(*raw.shape[-2:], k=k, dtype=bool), m, self.zeros((), raw.dtype))

    def triu(self, m, k=0):
        raw = np.asarray(_raw(m))
        return self.where(np.tri(*raw.shape[-2:], k=k - 1, dtype=bool), self.zeros((), raw.dtype), m)

    @_elementwise_op
    def _getitem(self, a, idx):
        return np.asarray(_raw(a))[idx]

    @_elementwise_op
    def concatenate(self, arrays, axis=0):
        return np.concatenate(self._cast_all(list(arrays)), axis)

    @_elementwise_op
    def stack(self, arrays, axis=0):
        return np.stack(self._cast_all(list(arrays)), axis)

    @_elementwise_op
    def pad(self, array, pad_width, constant_values=0):
        return np.pad(_raw(array), pad_width, constant_values=constant_values)

    @_elementwise_op
    def diff(self, a, n=1, axis=-1):
        return np.diff(_raw(a), n=n, axis=axis)

    @_elementwise_op
    def permute_dims(self, a, axes):
        return np.permute_dims(_raw(a), axes)

    @_elementwise_op
    def matrix_transpose(self, a):
        return np.matrix_transpose(_raw(a))

    def unstack(self, a, axis=0):
        return tuple(self._wrap(p) for p in np.unstack(np.asarray(_raw(a)), axis=axis))

    @_elementwise_op
    def count_nonzero(self, a, axis=None, keepdims=False):
        return np.asarray(np.count_nonzero(_raw(a), axis=axis, keepdims=keepdims))

    @_elementwise_op
    def concat(self, arrays, axis=0):
        return np.concat(self._cast_all(list(arrays)), axis=axis)

    @_elementwise_op
    def vecdot(self, x1, x2, axis=-1):
        a, b = self._cast_all([x1, x2])
        r = np.asarray(np.vecdot(a, b, axis=axis))
        if is_float(r.dtype):
            bound = np.asarray(np.vecdot(_finite_abs(a), _finite_abs(b), axis=axis))
            self._check_order_free(bound, r.dtype)
            r = self._inexact(r, ULPS_REDUCTION * finfo(r.dtype).eps * bound)
        return r

    # ------------------------------------------------------------ dot

    def _contraction(npfn):
        @_elementwise_op
        def f(self, *args):
            head = [a for a in args if isinstance(a, str)]
            ops = self._cast_all([a for a in args if not isinstance(a, str)])
            d = self.result_type(*ops)
            if d == BF16:
                # DOCUMENTED["bf16-contraction"]: bfloat16 in, bfloat16 out
                # (numpy's matmul gives float32, its einsum refuses).
                r = np.asarray(npfn(*head, *[o.astype(np.float32) for o in ops])).astype(BF16)
                ops = [o.astype(np.float32) for o in ops]
            else:
                r = np.asarray(npfn(*head, *ops))
            if is_float(r.dtype):
                bound = np.asarray(npfn(*head, *[_finite_abs(o) for o in ops]))
                self._check_order_free(bound, r.dtype)  # with FMA, inf - inf can be -inf
                r = self._inexact(r, ULPS_REDUCTION * finfo(r.dtype).eps * bound)
            return r

        f.__name__ = npfn.__name__
        return f

    matmul = _contraction(np.matmul)
    dot = _contraction(np.dot)
    _einsum = _contraction(np.einsum)

    def einsum(self, subscripts, *operands):
        """numpy's einsum; in the alternate runs, another valid order, the one
        a contraction path takes (JAX's, and Tessel's dot_generals): letters
        only one operand has are summed out first, then the operands are
        contracted pairwise from the left, each letter summed out as soon as
        nothing later needs it. With infinities the orders can differ, inf
        against NaN: 0 * 0 * inf summed at once is NaN, (0 * 0 + 1 * 1) * inf
        is inf."""
        spec = subscripts.replace(" ", "")
        if not self.alternate or "->" not in spec or len(operands) < 2:
            return self._einsum(subscripts, *operands)
        ins, out = spec.split("->")
        specs = ins.split(",")
        pre = []
        for k, (s, o) in enumerate(zip(specs, operands)):
            others = "".join(specs[:k] + specs[k + 1 :]) + out
            alone = "".join(c for c in s if c not in others)
            if alone:
                kept = "".join(c for c in s if c not in alone)
                o = self._einsum(f"{s}->{kept}", o)
                s = kept
            pre.append((s, o))
        s0, o0 = pre[0]
        for k in range(1, len(pre)):
            s1, o1 = pre[k]
            later = "".join(s for s, _ in pre[k + 1 :]) + out
            keep = "".join(dict.fromkeys(c for c in s0 + s1 if c in later))
            o0, s0 = self._einsum(f"{s0},{s1}->{keep}", o0, o1), keep
        return self._einsum(f"{s0}->{out}", o0)

    # ------------------------------------------------------------ creation

    @_elementwise_op
    def full(self, shape, fill_value, dtype=None):
        return np.full(shape, fill_value, dtype)

    def zeros(self, shape, dtype=np.float64):
        return self.full(shape, 0, dtype)

    def ones(self, shape, dtype=np.float64):
        return self.full(shape, 1, dtype)

    def zeros_like(self, a, dtype=None):
        return self.full(np.shape(_raw(a)), 0, dtype or _raw(a).dtype)

    def ones_like(self, a, dtype=None):
        return self.full(np.shape(_raw(a)), 1, dtype or _raw(a).dtype)

    @_elementwise_op
    def arange(self, n, dtype=np.int64):
        return np.arange(n, dtype=dtype)

    del _binary, _integer_division, _unary, _float_unary, _plain, _extremum, _contraction


class OracleLinalg:
    """numpy.linalg over an oracle's values, for matrices whose condition
    number is at most KAPPA (the generator builds them so). A backward
    stable factorization's result moves by about n * cond * eps of its
    scale: each result is perturbed by ULPS_REDUCTION times that."""

    def __init__(self, ns):
        self.ns = ns

    def _out(self, r, bound):
        return Value(self.ns, self.ns._inexact(np.asarray(r), bound))

    @staticmethod
    def _scale(r):
        """Per matrix: the largest finite |element|."""
        return np.max(_finite_abs(r), axis=(-2, -1), keepdims=True) if r.size else _finite_abs(r)

    def _bound(self, m, scale):
        m = np.asarray(_raw(m))
        n = m.shape[-1]
        return ULPS_REDUCTION * n * (2 * n) * float(finfo(m.dtype).eps) * scale

    def det(self, m):
        with np.errstate(all="ignore"):
            r = np.linalg.det(_raw(m))
        return self._out(r, self._bound(m, _finite_abs(r)))

    def slogdet(self, m):
        with np.errstate(all="ignore"):
            sign, logabs = np.linalg.slogdet(_raw(m))
        return Value(self.ns, sign), self._out(logabs, self._bound(m, 1.0 + _finite_abs(logabs)))

    def inv(self, m):
        with np.errstate(all="ignore"):
            r = np.linalg.inv(_raw(m))
        return self._out(r, self._bound(m, self._scale(r)))

    def solve(self, m, b):
        with np.errstate(all="ignore"):
            r = np.linalg.solve(_raw(m), _raw(b))
        return self._out(r, self._bound(m, self._scale(r)))

    def cholesky(self, m):
        with np.errstate(all="ignore"):
            r = np.linalg.cholesky(_raw(m))
        return self._out(r, self._bound(m, self._scale(r)))

    def eigvalsh(self, m):
        with np.errstate(all="ignore"):
            r = np.linalg.eigvalsh(_raw(m))
        return self._out(r, self._bound(m, np.max(_finite_abs(r), axis=-1, keepdims=True)))

    def norm(self, x, ord=None, axis=None):
        raw = np.asarray(_raw(x))
        with np.errstate(all="ignore"):
            r = np.asarray(np.linalg.norm(raw, ord=ord, axis=axis)).astype(raw.dtype)
        n = raw.size if axis is None else int(np.prod([raw.shape[a] for a in np.atleast_1d(axis)]))
        return self._out(r, ULPS_REDUCTION * (n + 2) * float(finfo(raw.dtype).eps) * _finite_abs(r))


class OracleLax:
    """jax.lax's control flow as plain Python loops over an oracle's values:
    the reference a device-side loop is checked against. Every iteration's
    ops run through the oracle, so their error bounds add up as Tessel's."""

    def __init__(self, ns):
        self.ns = ns

    def _leaf(self, x):
        return x if isinstance(x, Value) else Value(self.ns, np.asarray(x))

    def fori_loop(self, lower, upper, body, init):
        """The index is a Python int, weakly typed as JAX's (and Tessel's)
        int32 index is: `x * i` keeps x's dtype (a numpy int32 would make a
        uint64 carry float64)."""
        val = init
        for i in range(lower, upper):
            val = body(i, val)
        return val

    def while_loop(self, cond, body, init):
        val = init
        while bool(np.asarray(_raw(cond(val)))):
            val = body(val)
        return val

    def scan(self, f, init, xs):
        carry, ys = init, []
        for i in range(xs.shape[0]):
            carry, y = f(carry, xs[i])
            ys.append(y)
        return carry, self.ns.stack(ys)

    def cond(self, pred, true_fun, false_fun, *operands):
        return (true_fun if bool(np.asarray(_raw(pred))) else false_fun)(*operands)

    def reduce(self, operands, init_values, computation, dimensions):
        """jax.lax.reduce as a left fold over the reduced positions, each
        step through the oracle (the programs' bodies are exact)."""
        single = not isinstance(operands, (tuple, list))
        raws = [np.asarray(_raw(self._leaf(o))) for o in ([operands] if single else operands)]
        inits = [np.asarray(_raw(v)) for v in ([init_values] if single else init_values)]
        dims = [d % raws[0].ndim for d in dimensions]
        last = list(range(raws[0].ndim - len(dims), raws[0].ndim))
        moved = [np.moveaxis(r, dims, last) for r in raws]
        kept = moved[0].shape[: raws[0].ndim - len(dims)]
        flat = [m.reshape(kept + (-1,)) for m in moved]
        acc = [Value(self.ns, np.full(kept, v, dtype=r.dtype)) for v, r in zip(inits, raws)]
        for i in range(flat[0].shape[-1]):
            xs = [Value(self.ns, f[..., i].copy()) for f in flat]
            out = computation(acc[0], xs[0]) if single else computation(tuple(acc), tuple(xs))
            acc = [out] if single else list(out)
        return acc[0] if single else tuple(acc)

    def sort(self, operand, dimension=-1, is_stable=True, num_keys=1):
        """jax.lax.sort by numpy's stable lexsort: the first key primary,
        NaN last, -0.0 equal to 0.0."""
        raws = [np.asarray(_raw(self._leaf(o))) for o in operand]
        keys = [np.moveaxis(r, dimension, -1) for r in raws[:num_keys]]
        order = np.lexsort(keys[::-1], axis=-1)
        out = [np.moveaxis(np.take_along_axis(np.moveaxis(r, dimension, -1), order, -1), -1, dimension) for r in raws]
        return tuple(Value(self.ns, o) for o in out)

    def vmap(self, f, in_axes=0, out_axes=0):
        """jax.vmap as a loop: f on each element of the mapped arguments (an
        int or None per argument), the results stacked along out_axes."""

        def mapped(*args):
            axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
            size = next(self._leaf(x).shape[a] for x, a in zip(args, axes) if a is not None)
            ys = []
            for i in range(size):
                picked = [
                    x if a is None else self._leaf(x)[(slice(None),) * (a % self._leaf(x).ndim) + (i,)]
                    for x, a in zip(args, axes)
                ]
                ys.append(f(*picked))
            return self.ns.stack(ys, axis=out_axes)

        return mapped

    @staticmethod
    def _window(x, starts, sizes):
        """jax.lax's window: negative starts count from the end, then each
        is clamped so the window fits."""
        out = []
        for s, n, k in zip(starts, x.shape, sizes):
            s = int(np.asarray(_raw(s)))
            s = s + n if s < 0 else s
            out.append(slice(min(max(s, 0), n - k), min(max(s, 0), n - k) + k))
        return tuple(out)

    def dynamic_slice(self, x, starts, sizes):
        raw = np.asarray(_raw(x))
        return Value(self.ns, raw[self._window(raw, starts, sizes)].copy())

    def dynamic_update_slice(self, x, update, starts):
        raw = np.array(_raw(x), copy=True)
        u = np.asarray(_raw(update)).astype(raw.dtype)
        raw[self._window(raw, starts, u.shape)] = u
        return Value(self.ns, raw)


# ---------------------------------------------------------------- runs


def perturbations(n_random=3, seed=0):
    """The perturbed runs: every inexact op at +1 and at -1 of its bound, then
    `n_random` runs with independent factors per element."""
    out = [lambda shape: np.ones(shape), lambda shape: -np.ones(shape)]
    for k in range(n_random):
        rng = np.random.default_rng(seed + k)
        out.append(lambda shape, rng=rng: rng.uniform(-1.0, 1.0, shape))
    return out


def reference_runs(program, inputs):
    """The plain oracle's outputs, then each perturbed run's (numpy arrays)."""
    runs = []
    for k, perturb in enumerate([None] + perturbations()):
        ns = Oracle(perturb, alternate=k % 2 == 1)
        runs.append([np.asarray(_raw(o)) for o in program.run(ns, ns.wrap_inputs(inputs))])
    return runs


def mismatch(got, runs, exact):
    """None when `got` (numpy) agrees with the oracle runs of one output (see
    the module doc), else what differs."""
    want = runs[0]
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if not is_float(want.dtype):
        bad = got != want
        if bad.any():
            return _describe(bad, got, want)
        return None
    g = got.astype(np.float64)
    stack = np.stack([r.astype(np.float64) for r in runs])
    w = stack[0]
    if exact:
        same = (g == w) | (np.isnan(g) & np.isnan(w))
        bad = ~same | (same & (g == 0) & (np.signbit(g) != np.signbit(w)))
        if bad.any():
            return _describe(bad, got, want, "bit for bit, signs of zeros included")
        return None
    nan_all, nan_any = np.isnan(stack).all(0), np.isnan(stack).any(0)
    with np.errstate(all="ignore"):
        lo = np.where(nan_any, 0.0, np.nanmin(np.where(np.isnan(stack), np.inf, stack), axis=0))
        hi = np.where(nan_any, 0.0, np.nanmax(np.where(np.isnan(stack), -np.inf, stack), axis=0))
        info = finfo(want.dtype)
        slack = ULPS_ELEMENTWISE * float(info.eps) * np.maximum(
            _finite_abs(lo), _finite_abs(hi)
        ) + ULPS_ELEMENTWISE * float(info.smallest_normal)
        inside = (g >= lo - slack) & (g <= hi + slack)
        inf_pinned = (lo == hi) & np.isinf(lo)
        ok = np.where(
            nan_all, np.isnan(g), np.where(nan_any, True, np.where(inf_pinned, g == lo, inside & ~np.isnan(g)))
        )
    if not ok.all():
        return _describe(
            ~ok, got, want, "within the range of the perturbed runs", lo.astype(want.dtype), hi.astype(want.dtype)
        )
    return None


def _describe(bad, got, want, how="exactly", lo=None, hi=None):
    idx = [tuple(int(i) for i in ix) for ix in np.argwhere(bad)][:6]
    parts = []
    for ix in idx:
        s = f"  at {ix}: got {got[ix]!r}, expected {want[ix]!r}"
        if lo is not None:
            s += f" (runs span {lo[ix]!r} .. {hi[ix]!r})"
        parts.append(s)
    return (
        f"{int(bad.sum())} of {bad.size} elements differ ({how}):\n"
        + "\n".join(parts)
        + f"\n  got      {np.array2string(got, threshold=64)}\n  expected {np.array2string(want, threshold=64)}"
    )
