"""Random array programs, as source, for the differential harness.

A program is straight-line Python over a namespace `xp`:

    def program(a, b):
        v0 = xp.sum(a, axis=1, keepdims=True)
        v1 = (v0 < b)
        v2 = xp.where(v1, a, 2.5)
        return v2, a

It is built step by step while the oracle runs it, so every step is valid
for numpy and the shapes, dtypes and values so far are known: each op is
drawn among those that apply (broadcasting operands, Python and numpy
scalars under NEP 50, reductions over axes that exist, concatenations of
fitting shapes, einsum letters that agree). Steps numpy rejects are drawn
again, except the errors Tessel must raise the same way (an out-of-range
Python int in arithmetic, a NaN padded into an int): those end the program
and every mode must raise them.
"""

import dataclasses
import math
import re

import numpy as np
from hypothesis import strategies as st

from differential import oracle
from differential.oracle import BF16, Oracle, is_float

INTS = [
    np.dtype(np.uint8),
    np.dtype(np.int32),
    np.dtype(np.int64),
    np.dtype(np.int8),
    np.dtype(np.int16),
    np.dtype(np.uint16),
    np.dtype(np.uint32),
    np.dtype(np.uint64),
]
FLOATS = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
BOOL = np.dtype(np.bool_)
DTYPES = [BOOL] + INTS + FLOATS
# How often each dtype leads a program: the common ones more.
DTYPE_WEIGHTS = {
    BOOL: 1,
    INTS[0]: 2,
    INTS[1]: 3,
    INTS[2]: 2,
    FLOATS[0]: 1,
    BF16: 1,
    FLOATS[2]: 4,
    FLOATS[3]: 3,
    **{d: 1 for d in INTS[3:]},
}

MAX_SIZE = 256  # elements of any value, so that a program stays cheap

# Programs the harness leaves out until the C++ side is fixed (each has an
# xfail regression test in test_regressions_cpp.py; flip it with the fix).
# A size-0 arange met by a broadcast 0-d value kills the worker (SIGFPE in
# IotaKernel: the fused loop runs over a length the size-0 output lacks).
SIZE0_ARANGE_CRASHES_WORKER = True
EXPECTED_ERRORS = (OverflowError,)


def dtype_name(d):
    return "bfloat16" if np.dtype(d) == BF16 else np.dtype(d).name if np.dtype(d) != BOOL else "bool_"


def render_scalar(x):
    """Source for a constant: Python scalars as literals, numpy scalars and
    0-d arrays as numpy calls."""
    if isinstance(x, np.ndarray):
        return f"np.array({render_scalar(x.item())}, dtype=np.{x.dtype.name})"
    if isinstance(x, np.generic):
        return f"np.{x.dtype.name}({render_scalar(x.item())})"
    if isinstance(x, float):
        if math.isnan(x):
            return "np.nan"
        if math.isinf(x):
            return "np.inf" if x > 0 else "-np.inf"
    return repr(x)


def render_array(a):
    d = a.dtype
    values = a.astype(np.float64).tolist() if d == BF16 else a.tolist()
    text = repr(values).replace("nan", "np.nan").replace("inf", "np.inf")
    dt = "ml_dtypes.bfloat16" if d == BF16 else f"np.{d.name}"
    return f"np.array({text}, dtype={dt})"


@dataclasses.dataclass
class Program:
    """Straight-line source over `xp`, its inputs, and what the oracle knows
    of each value: whether a float carries rounding error (`exact`)."""

    inputs: list  # (name, numpy array)
    steps: list  # (name, expression source)
    outputs: list  # names
    exact: dict  # name -> bool
    error: type = None  # an exception every mode must raise, or None

    @property
    def arg_names(self):
        return [n for n, _ in self.inputs]

    @property
    def arrays(self):
        return [a for _, a in self.inputs]

    def source(self, steps=None, outputs=None):
        steps = self.steps if steps is None else steps
        outputs = self.outputs if outputs is None else outputs
        lines = [f"def program({', '.join(self.arg_names)}):  # xp: numpy, tessel.numpy or the oracle"]
        lines += [f"    {n} = {e}" for n, e in steps]
        lines.append(f"    return ({', '.join(outputs)},)")
        return "\n".join(lines)

    def function(self, xp, steps=None, outputs=None, lax=None, vmap=None):
        """The program as a Python function over namespace `xp` (with the
        control flow and vmap that go with it: `lax` and `vmap` name them
        where xp is not ours, as for jax.numpy)."""
        env = {"np": np, "ml_dtypes": oracle.ml_dtypes, "xp": xp}
        env.update(lax=lax or lax_of(xp), vmap=vmap or vmap_of(xp))
        exec(self.source(steps, outputs), env)  # noqa: S102 - the program is ours
        return env["program"]

    def run(self, xp, args):
        """The outputs (a tuple) of the program with namespace `xp`."""
        return self.function(xp)(*args)

    def live(self):
        """The steps the outputs depend on (the program with its dead values
        dropped)."""
        need = set(self.outputs)
        kept = []
        for n, e in reversed(self.steps):
            if n in need:
                kept.append((n, e))
                need |= {m for m, _ in self.steps if _mentions(e, m)} | {a for a in self.arg_names if _mentions(e, a)}
        return list(reversed(kept))

    def __repr__(self):
        ins = "\n".join(f"{n} = {render_array(a)}" for n, a in self.inputs)
        tail = f"\n# every mode must raise {self.error.__name__}" if self.error else ""
        return f"\n{self.source()}\n{ins}{tail}\n"


def lax_of(xp):
    """The control flow that goes with namespace `xp`: an oracle's own
    loops, or tessel.lax for tessel.numpy."""
    if hasattr(xp, "lax"):
        return xp.lax
    from tessel import lax

    return lax


def vmap_of(xp):
    """vmap with namespace `xp`: an oracle's loop, or tessel.vmap."""
    if hasattr(xp, "lax"):
        return xp.lax.vmap
    from tessel import vmap

    return vmap


def _mentions(expr, name):
    return re.search(rf"\b{name}\b", expr) is not None


# ---------------------------------------------------------------- inputs


def edge_values(d):
    d = np.dtype(d)
    if d == BOOL:
        return [True, False]
    if d.kind in "iu":
        info = np.iinfo(d)
        signed = [] if d.kind == "u" else [-1]
        return [0, 1, info.max, info.min, info.max // 3, 7, info.max - 1, info.min + 1] + signed
    info = oracle.finfo(d)
    tiny = float(info.smallest_normal)
    return [
        0.0,
        -0.0,
        1.0,
        -1.5,
        0.1,
        np.nan,
        np.inf,
        -np.inf,
        tiny / 4,
        tiny,
        float(info.max),
        -float(info.max),
        -tiny / 4,
        3.25,
    ]


@st.composite
def arrays(draw, d, shape, edge_rates=(0.0, 0.1, 0.3)):
    d = np.dtype(d)
    n = int(np.prod(shape, dtype=np.int64))
    if d == BOOL:
        plain = st.booleans()
    elif d.kind in "iu":
        info = np.iinfo(d)
        plain = st.integers(max(info.min, -20), min(info.max, 20))
    else:
        # Tenths (inexact in binary: their quotients and remainders round),
        # eighths (exact) and arbitrary floats.
        plain = st.one_of(
            st.integers(-40, 40).map(lambda k: k / 10),
            st.integers(-64, 64).map(lambda k: k / 8),
            st.floats(-1e3, 1e3, width=16 if d == np.float16 else 32 if d == BF16 else 64),
        )
    edge_rate = draw(st.sampled_from(edge_rates))
    vals = []
    for _ in range(n):
        if edge_rate and draw(st.floats(0, 1)) < edge_rate:
            vals.append(draw(st.sampled_from(edge_values(d))))
        else:
            vals.append(draw(plain))
    with np.errstate(all="ignore"):
        return np.array(vals, dtype=np.float64 if d == BF16 else d).astype(d).reshape(shape)


@st.composite
def shapes(draw):
    rank = draw(st.sampled_from([0, 1, 1, 2, 2, 2, 3]))
    dims = [draw(st.sampled_from([1, 2, 2, 3, 4, 4, 8, 0])) for _ in range(rank)]
    while int(np.prod(dims, dtype=np.int64)) > 64:
        dims[dims.index(max(dims))] //= 2
    return tuple(dims)


def _broadcast_variant(draw, shape):
    """A shape that broadcasts against `shape`: a suffix, with some dims 1."""
    keep = draw(st.integers(0, len(shape)))
    out = list(shape[len(shape) - keep :])
    for i in range(len(out)):
        if draw(st.integers(0, 3)) == 0:
            out[i] = 1
    return tuple(out)


# ---------------------------------------------------------------- steps


@dataclasses.dataclass
class Val:
    name: str
    value: np.ndarray  # in the plain oracle
    alt: np.ndarray  # in the alternate oracle (another valid order of terms, the other zero of a tie)
    exact: bool = True

    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.value.dtype)
    ndim = property(lambda self: self.value.ndim)


class _Reject(Exception):
    """This draw does not make a valid step."""


def _inexact_float(v):
    return is_float(v.dtype) and not v.exact


class Builder:
    """Draws steps into a growing program while the oracle runs them."""

    def __init__(self, draw, inputs):
        self.draw = draw
        self.inputs = inputs
        self.pool = [Val(n, a, a) for n, a in inputs]
        self.steps = []
        self.error = None
        self.ns = Oracle()
        self.alt_ns = Oracle(alternate=True)

    # The value most steps read: recent ones more often, so chains get deep.
    def pick(self, pred=lambda v: True):
        cands = [v for v in self.pool if pred(v)]
        if not cands:
            raise _Reject
        recent = cands[-4:]
        return self.draw(st.one_of(st.sampled_from(recent), st.sampled_from(cands)))

    def pick_broadcastable(self, x, pred=lambda v: True):
        def fits(v):
            try:
                np.broadcast_shapes(v.shape, x.shape)
                return pred(v)
            except ValueError:
                return False

        return self.pick(fits)

    def scalar(self, v, past_rate=1):
        """A Python or numpy scalar (or 0-d array) to meet `v`: in range, or
        past its range or another's (NEP 50); `past_rate` weighs the latter."""
        ints = [0, 1, 2, -1, 3, 7, 100, 255, -7, 2**31 - 1]
        past = [256, 300, 2**31, 2**32, -(2**40), 2**62]  # past some dtype's range
        if v.dtype.kind in "iu":
            info = np.iinfo(v.dtype)
            past += [int(info.max) + 1, int(info.min) - 1, int(info.max) + 2**40, int(info.min) - 2**40]
        floats = [0.5, -2.0, 1e-3, 2.5, 1e30, -0.0, np.inf, np.nan, 3.0, 1e-40]
        kinds = ["int", "int", "float", "float", "bool", "numpy", "0d"] + ["past"] * past_rate
        kind = self.draw(st.sampled_from(kinds))
        if kind == "int":
            return self.draw(st.sampled_from(ints))
        if kind == "past":
            return self.draw(st.sampled_from(past))
        if kind == "float":
            return self.draw(st.sampled_from(floats))
        if kind == "bool":
            return self.draw(st.booleans())
        d = self.draw(
            st.sampled_from(
                [np.float32, np.float64, np.int32, np.int64, np.uint8, np.float16, np.int8, np.uint16, np.uint64]
            )
        )
        x = self.draw(st.sampled_from([0, 1, 2, 3, 0.5, -1.5] if np.dtype(d).kind == "f" else [0, 1, 2, 5]))
        return np.dtype(d).type(x) if kind == "numpy" else np.array(x, dtype=d)

    def operand(self, x, scalar_rate=0.35, pred=lambda v: True, past_rate=1):
        """Source for a second operand meeting `x`: a value or a constant."""
        if self.draw(st.floats(0, 1)) < scalar_rate:
            c = self.scalar(x, past_rate)
            return render_scalar(c), [], c
        v = self.pick_broadcastable(x, pred)
        return v.name, [v], None

    def add(self, expr, operands, inexact=False, discontinuous=False, raises=()):
        """Runs `expr` in the oracle; a valid step joins the program. An
        error in `raises` (or EXPECTED_ERRORS) ends the program: Tessel must
        raise it too."""
        if discontinuous and any(_inexact_float(v) for v in operands):
            raise _Reject

        def run(ns, alt):
            env = {v.name: oracle.Value(ns, v.alt if alt else v.value) for v in self.pool}
            env.update({"xp": ns, "np": np, "ml_dtypes": oracle.ml_dtypes, "lax": ns.lax, "vmap": ns.lax.vmap})
            with np.errstate(all="ignore"):
                return np.asarray(oracle._raw(eval(expr, env)))  # noqa: S307 - the program is ours

        try:
            r = run(self.ns, False)
        except EXPECTED_ERRORS + tuple(raises) as e:
            if isinstance(e, oracle.OrderDependent):
                raise _Reject
            self.error = type(e)
            self.steps.append((f"v{len(self.steps)}", expr))
            return None
        except (ValueError, TypeError, IndexError, ZeroDivisionError, np.exceptions.DTypePromotionError):
            raise _Reject
        if r.dtype not in oracle.SUPPORTED or r.size > MAX_SIZE:
            raise _Reject
        try:
            alt = run(self.alt_ns, True)
        except Exception:
            raise _Reject
        agree = (
            bool(np.all((r == alt) & (np.signbit(r) == np.signbit(alt)) | (r != r) & (alt != alt)))
            if is_float(r.dtype)
            else bool(np.array_equal(r, alt))
        )
        if not agree and not is_float(r.dtype):
            raise _Reject  # an integer or bool that depends on an order of terms
        exact = agree and not (inexact and is_float(r.dtype)) and not any(_inexact_float(v) for v in operands)
        v = Val(f"v{len(self.steps)}", r, alt, exact or not is_float(r.dtype))
        self.steps.append((v.name, expr))
        self.pool.append(v)
        return v


# Each op draws a step from the builder's pool. `inexact`: its float result
# may differ by rounding between correct implementations; `discontinuous`: a
# tiny change of an operand can change its result a lot.
UNARY = {
    # name: (inexact, discontinuous, operator form or None); hypothesis draws
    # the first entry of a list most often, so the first is a plain one.
    "negative": (False, False, "-{}"),
    "abs": (False, False, "abs({})"),
    "sign": (False, True, None),
    "exp": (True, False, None),
    "log": (True, False, None),
    "log1p": (True, False, None),
    "tanh": (True, False, None),
    "sqrt": (False, False, None),
    "rsqrt": (True, False, None),
    "sigmoid": (True, False, None),
    "floor": (False, True, None),
    "ceil": (False, True, None),
    "square": (False, False, None),
    "logical_not": (False, True, None),
    "invert": (False, True, "~{}"),
    "sin": (True, False, None),
    "cos": (True, False, None),
    "arctan": (True, False, None),
    "sinh": (True, False, None),
    "cosh": (True, False, None),
    "arcsinh": (True, False, None),
    "expm1": (True, False, None),
    "exp2": (True, False, None),
    "cbrt": (True, False, None),
    "trunc": (False, True, None),
    "rint": (False, True, None),
}
BINARY = {
    "add": (False, False, "+"),
    "subtract": (False, False, "-"),
    "multiply": (False, False, "*"),
    "divide": (False, False, "/"),
    "floor_divide": (False, True, "//"),
    "remainder": (False, True, "%"),
    "power": (True, False, "**"),
    "maximum": (False, False, None),
    "minimum": (False, False, None),
    "bitwise_and": (False, True, "&"),
    "bitwise_or": (False, True, "|"),
    "bitwise_xor": (False, True, "^"),
    "logical_and": (False, True, None),
    "logical_or": (False, True, None),
    "logical_xor": (False, True, None),
    "left_shift": (False, True, "<<"),
    "right_shift": (False, True, ">>"),
}
COMPARE = {"less": "<", "less_equal": "<=", "greater": ">", "greater_equal": ">=", "equal": "==", "not_equal": "!="}


def _names(table):
    """The op names of `table`, in its order (hypothesis shrinks toward the first)."""
    return list(table)


def op_unary(b, name=None):
    name = name or b.draw(st.sampled_from(_names(UNARY)))
    inexact, disc, operator = UNARY[name]
    x = b.pick()
    form = operator if operator and b.draw(st.booleans()) else f"xp.{name}({{}})"
    b.add(form.format(x.name), [x], inexact, disc)


def op_binary(b, name=None):
    name = name or b.draw(st.sampled_from(_names(BINARY)))
    inexact, disc, operator = BINARY[name]
    x = b.pick()
    other, vals, _ = b.operand(x)
    if b.draw(st.booleans()):
        x_src, y_src = x.name, other
    else:
        x_src, y_src = other, x.name  # the scalar on the left: reflected operators
    if operator and b.draw(st.integers(0, 2)):
        expr = f"({x_src} {operator} {y_src})"
    else:
        expr = f"xp.{name}({x_src}, {y_src})"
    b.add(expr, [x] + vals, inexact, disc)


def op_compare(b, name=None):
    name = name or b.draw(st.sampled_from(_names(COMPARE)))
    x = b.pick()
    other, vals, _ = b.operand(x, scalar_rate=0.5, past_rate=4)  # comparisons decide those exactly
    left = b.draw(st.booleans())
    a, c = (x.name, other) if left else (other, x.name)
    expr = f"({a} {COMPARE[name]} {c})" if b.draw(st.booleans()) else f"xp.{name}({a}, {c})"
    b.add(expr, [x] + vals, discontinuous=True)


def op_where(b):
    cond = b.pick(lambda v: v.dtype == BOOL)
    x = b.pick_broadcastable(cond)
    y_src, vals, _ = b.operand(x, scalar_rate=0.4)
    if b.draw(st.booleans()):
        expr = f"xp.where({cond.name}, {x.name}, {y_src})"
    else:
        expr = f"xp.where({cond.name}, {y_src}, {x.name})"
    b.add(expr, [cond, x] + vals)


def op_clip(b):
    if b.draw(st.integers(0, 4)) == 0:
        # bools clipped by bools stay bools (an or with the lower bound, an and with the upper)
        x = b.pick(lambda v: v.dtype == BOOL)
        lo, hi = b.draw(st.sampled_from([None, False, True])), b.draw(st.sampled_from([None, False, True]))
        if lo is None and hi is None:
            hi = True
        b.add(f"xp.clip({x.name}, {lo!r}, {hi!r})", [x])
        return
    x = b.pick(lambda v: v.dtype != BOOL)
    bounds = [-1, 0, 2, 5, 100, 300, -(2**40), 0.5, -np.inf, np.nan]
    lo = b.draw(st.sampled_from(bounds))
    hi = b.draw(st.sampled_from(bounds))
    vals = []
    if b.draw(st.integers(0, 3)) == 0:
        v = b.pick_broadcastable(x, lambda v: v.dtype != BOOL)
        lo_src, vals = v.name, [v]
    else:
        lo_src = render_scalar(lo)
    b.add(f"xp.clip({x.name}, {lo_src}, {render_scalar(hi)})", [x] + vals)


def op_astype(b):
    x = b.pick()
    d = b.draw(st.sampled_from(DTYPES))
    disc = not is_float(d)
    t = f"xp.{dtype_name(d)}"
    expr = f"{x.name}.astype({t})" if b.draw(st.booleans()) else f"xp.astype({x.name}, {t})"
    b.add(expr, [x], discontinuous=disc and is_float(x.dtype))


def _axis(b, ndim, allow_tuple=True):
    if ndim == 0:
        return None
    choices = [None] + list(range(ndim)) + [-1]
    if allow_tuple and ndim >= 2:
        choices.append(tuple(sorted(b.draw(st.permutations(list(range(ndim))))[:2])))
    return b.draw(st.sampled_from(choices))


def op_reduce(b):
    name = b.draw(st.sampled_from(["sum", "sum", "prod", "mean", "max", "min", "any", "all", "argmax", "argmin"]))
    x = b.pick(lambda v: v.ndim > 0 or name not in ("argmax", "argmin"))
    axis = _axis(b, x.ndim, allow_tuple=name not in ("argmax", "argmin"))
    kwargs = [] if axis is None and b.draw(st.booleans()) else [f"axis={axis!r}"]
    if name not in ("argmax", "argmin") and b.draw(st.booleans()):
        kwargs.append(f"keepdims={b.draw(st.booleans())}")
    method = name in ("sum", "prod", "mean", "max", "min", "argmax", "argmin") and b.draw(st.booleans())
    args = ", ".join(kwargs)
    expr = f"{x.name}.{name}({args})" if method else f"xp.{name}({x.name}{', ' if args else ''}{args})"
    b.add(
        expr,
        [x],
        inexact=name in ("sum", "prod", "mean"),
        discontinuous=name in ("any", "all", "argmax", "argmin"),
        raises=(ValueError,) if name in ("max", "min", "argmax", "argmin") else (),
    )  # over no elements


def _factor(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def op_reshape(b):
    x = b.pick()
    n = x.value.size
    kind = b.draw(st.sampled_from(["flat", "split", "merge", "minus1", "method"]))
    if kind == "flat":
        shape = (n,)
    elif kind == "split" and x.ndim:
        i = b.draw(st.integers(0, x.ndim - 1))
        f = b.draw(st.sampled_from(_factor(x.shape[i]) or [1]))
        shape = x.shape[:i] + (f, x.shape[i] // f if f else 0) + x.shape[i + 1 :]
    elif kind == "merge" and x.ndim >= 2:
        i = b.draw(st.integers(0, x.ndim - 2))
        shape = x.shape[:i] + (x.shape[i] * x.shape[i + 1],) + x.shape[i + 2 :]
    elif kind == "minus1" and n:
        shape = (b.draw(st.sampled_from(_factor(n))), -1)
    else:
        shape = tuple(reversed(x.shape)) if x.ndim else (1,)
    if kind == "method":
        b.add(f"{x.name}.reshape({', '.join(str(s) for s in shape)}{',' if len(shape) == 1 else ''})", [x])
    else:
        b.add(f"xp.reshape({x.name}, {shape!r})", [x])


def op_transpose(b):
    x = b.pick(lambda v: v.ndim >= 1)
    kind = b.draw(st.sampled_from(["T", "none", "perm"]))
    if kind == "T":
        b.add(f"{x.name}.T", [x])
    elif kind == "none":
        b.add(f"xp.transpose({x.name})", [x])
    else:
        perm = tuple(b.draw(st.permutations(list(range(x.ndim)))))
        b.add(f"xp.transpose({x.name}, {perm!r})", [x])


def op_broadcast(b):
    x = b.pick()
    kind = b.draw(st.sampled_from(["to", "expand"]))
    if kind == "expand":
        axis = b.draw(st.integers(-x.ndim - 1, x.ndim))
        b.add(f"xp.expand_dims({x.name}, {axis})", [x])
        return
    lead = tuple(b.draw(st.lists(st.sampled_from([1, 2, 3]), max_size=2)))
    shape = lead + tuple(b.draw(st.sampled_from([1, 2, 4])) if s == 1 else s for s in x.shape)
    b.add(f"xp.broadcast_to({x.name}, {shape!r})", [x])


def op_slice(b):
    x = b.pick(lambda v: v.ndim >= 1)
    parts = []
    for s in x.shape:
        kind = b.draw(st.sampled_from(["all", "range", "step", "int", "neg", "reverse"]))
        if kind == "int" and s:
            parts.append(str(b.draw(st.integers(-s, s - 1))))
        elif kind == "range":
            lo = b.draw(st.integers(0, s))
            hi = b.draw(st.integers(lo, s))
            parts.append(f"{lo}:{hi}")
        elif kind == "step":
            parts.append(f"::{b.draw(st.integers(1, 3))}")
        elif kind == "neg" and s:
            parts.append(f"-{b.draw(st.integers(1, s))}:")
        elif kind == "reverse":  # a negative step, from anywhere to anywhere
            hi = b.draw(st.sampled_from(["", str(b.draw(st.integers(-s - 1, s)))]))
            lo = b.draw(st.sampled_from(["", str(b.draw(st.integers(-s - 1, s)))]))
            parts.append(f"{hi}:{lo}:-{b.draw(st.integers(1, 3))}")
        else:
            parts.append(":")
    while parts and parts[-1] == ":" and b.draw(st.booleans()):
        parts.pop()
    if parts and b.draw(st.integers(0, 4)) == 0:
        parts = ["..."] + parts[1:]
    for _ in range(b.draw(st.sampled_from([0, 0, 0, 1, 2]))):  # np.newaxis
        parts.insert(b.draw(st.integers(0, len(parts))), "None")
    idx = ", ".join(parts) if parts else "..."
    b.add(f"{x.name}[{idx}]", [x])


def op_concatenate(b):
    x = b.pick(lambda v: v.ndim >= 1)
    axis = b.draw(st.integers(-x.ndim, x.ndim - 1))
    ax = axis % x.ndim

    def fits(v):
        return v.ndim == x.ndim and all(a == c for i, (a, c) in enumerate(zip(v.shape, x.shape)) if i != ax)

    others = [b.pick(fits) for _ in range(b.draw(st.integers(1, 2)))]
    names = ", ".join(v.name for v in [x] + others)
    b.add(f"xp.concatenate([{names}], axis={axis})", [x] + others)


def op_stack(b):
    x = b.pick()
    others = [b.pick(lambda v: v.shape == x.shape) for _ in range(b.draw(st.integers(1, 2)))]
    axis = b.draw(st.integers(-x.ndim - 1, x.ndim))
    names = ", ".join(v.name for v in [x] + others)
    b.add(f"xp.stack([{names}], axis={axis})", [x] + others)


def op_pad(b):
    x = b.pick(lambda v: v.ndim >= 1)
    widths = tuple((b.draw(st.integers(0, 2)), b.draw(st.integers(0, 2))) for _ in range(x.ndim))
    if b.draw(st.booleans()):
        b.add(f"xp.pad({x.name}, {widths!r})", [x])
    else:
        cv = b.draw(st.sampled_from([0, 1, -1, 0.5, 1e30, np.nan, -np.inf, True, 7, 300]))
        b.add(
            f"xp.pad({x.name}, {widths!r}, constant_values={render_scalar(cv)})",
            [x],
            raises=(ValueError, OverflowError),
        )  # NaN or inf into an int32


def op_matmul(b):
    x = b.pick(lambda v: v.ndim >= 1)
    k = x.shape[-1]

    def fits(v):
        if v.ndim == 0:
            return False
        if v.ndim == 1:
            return v.shape[0] == k
        if v.shape[-2] != k:
            return False
        try:
            np.broadcast_shapes(x.shape[:-2], v.shape[:-2])
            return True
        except ValueError:
            return False

    if not any(fits(v) for v in b.pool):
        if x.ndim == 2:
            kind = b.draw(st.sampled_from(["@", "xp.matmul", "xp.dot"]))
            expr = f"({x.name} @ {x.name}.T)" if kind == "@" else f"{kind}({x.name}, xp.transpose({x.name}))"
            b.add(expr, [x], inexact=True)
            return
        raise _Reject
    y = b.pick(fits)
    kind = b.draw(st.sampled_from(["@", "xp.matmul", "xp.dot"]))
    if kind == "xp.dot" and (x.ndim > 2 or y.ndim > 2):
        kind = "@"
    expr = f"({x.name} @ {y.name})" if kind == "@" else f"{kind}({x.name}, {y.name})"
    b.add(expr, [x, y], inexact=True)


def op_einsum(b):
    x = b.pick(lambda v: 1 <= v.ndim <= 3)
    letters = "ijklmnopq"
    xs = letters[: x.ndim]
    sizes = dict(zip(xs, x.shape))
    ops, specs = [x], [xs]
    fresh = iter(letters[x.ndim :])
    for _ in range(b.draw(st.sampled_from([0, 1, 1, 2]))):
        # More operands (three or more contract pairwise, in a greedy
        # order): each shares letters where its dims agree.
        y = b.pick(lambda v: 1 <= v.ndim <= 3)
        ys = ""
        for s in y.shape:
            shared = [c for c in sizes if sizes[c] == s and c not in ys]
            c = b.draw(st.sampled_from(shared)) if shared and b.draw(st.integers(0, 3)) else next(fresh, None)
            if c is None:
                raise _Reject
            ys += c
            sizes.setdefault(c, s)
        ops.append(y)
        specs.append(ys)
    used = sorted(set("".join(specs)))
    out = b.draw(st.permutations(used))[: b.draw(st.integers(0, len(used)))]
    spec = ",".join(specs) + "->" + "".join(out)
    b.add(f"xp.einsum({spec!r}, {', '.join(v.name for v in ops)})", ops, inexact=True)


def op_layout_more(b):
    """The layout and classification ops numpy composes: squeeze, ravel,
    swapaxes, moveaxis, tril/triu, outer, isnan/isinf/isfinite."""
    kind = b.draw(
        st.sampled_from(
            ["squeeze", "ravel", "swapaxes", "moveaxis", "tril", "triu", "outer", "isnan", "isinf", "isfinite"]
        )
    )
    if kind == "squeeze":
        x = b.pick(lambda v: 1 in v.shape)
        ones = [i for i, s in enumerate(x.shape) if s == 1]
        if b.draw(st.booleans()):
            b.add(f"xp.squeeze({x.name})", [x])
        else:
            b.add(f"xp.squeeze({x.name}, axis={b.draw(st.sampled_from(ones)) - x.ndim})", [x])
    elif kind == "ravel":
        x = b.pick()
        b.add(f"xp.ravel({x.name})", [x])
    elif kind == "swapaxes":
        x = b.pick(lambda v: v.ndim >= 2)
        i, j = b.draw(st.integers(-x.ndim, x.ndim - 1)), b.draw(st.integers(-x.ndim, x.ndim - 1))
        b.add(f"xp.swapaxes({x.name}, {i}, {j})", [x])
    elif kind == "moveaxis":
        x = b.pick(lambda v: v.ndim >= 2)
        b.add(f"xp.moveaxis({x.name}, {b.draw(st.integers(0, x.ndim - 1))}, {b.draw(st.integers(-x.ndim, -1))})", [x])
    elif kind in ("tril", "triu"):
        x = b.pick(lambda v: v.ndim >= 2)
        b.add(f"xp.{kind}({x.name}, {b.draw(st.integers(-2, 2))})", [x])
    elif kind == "outer":
        x = b.pick(lambda v: 0 < v.value.size <= 16)
        y = b.pick(lambda v: 0 < v.value.size <= 16)
        b.add(f"xp.outer({x.name}, {y.name})", [x, y])
    else:
        x = b.pick()
        b.add(f"xp.{kind}({x.name})", [x])


# Loop bodies over carry {c} (and {y}, a value of the program; {i}, the
# iteration): each keeps the carry's shape and dtype.
LOOP_BODIES = [
    "({c} * 0.5 + {y}).astype({c}.dtype)",
    "xp.tanh({c} + {y}).astype({c}.dtype)",
    "xp.where({c} > {y}, {c} - {y}, {c} * 2).astype({c}.dtype)",
    "({c} + {y} * {i}).astype({c}.dtype)",
    "(xp.maximum({c}, {y}) - xp.minimum({c}, {y}) * 2 + xp.abs({c})).astype({c}.dtype)",
]


def op_control(b):
    """tessel.lax on the device against the same loop run by the oracle:
    fori_loop (a scan of known length), while_loop, scan with stacked
    outputs, cond. Bodies read another value of the program (a closure)."""
    kind = b.draw(st.sampled_from(["fori", "while", "scan", "cond"]))
    if kind == "scan":
        x = b.pick(lambda v: v.dtype != BOOL and v.ndim >= 1 and 0 < v.shape[0] <= 6 and v.value.size > 0)
        which = b.draw(st.sampled_from([0, 1]))
        b.add(
            f"lax.scan(lambda k, r: ((k + r).astype(k.dtype), k * r), xp.zeros_like({x.name}[0]), {x.name})"
            f"[{which}]",
            [x],
            inexact=True,
        )
        return
    x = b.pick(lambda v: v.dtype != BOOL and 0 < v.value.size)
    if kind == "cond":
        b.add(
            f"lax.cond(xp.sum({x.name}) > 0, lambda u: (u + 1).astype(u.dtype), lambda u: u * 2, {x.name})",
            [x],
            discontinuous=True,
        )
        return
    y = b.pick(lambda v: v.dtype != BOOL and _fits(v.shape, x.shape))
    template = b.draw(st.sampled_from(LOOP_BODIES))
    if "tanh" in template and x.dtype.kind in "iu":
        # Truncating tanh to an integer jumps where tanh is within an ulp of
        # +-1 (numpy's tanh(19.0) is 1.0, the correctly rounded one and
        # Tessel's 1 - 2**-53): scaled and rounded, no integer argument
        # lands near a jump.
        template = "xp.rint(xp.tanh({c} + {y}) * 3).astype({c}.dtype)"
    trips = b.draw(st.integers(0, 4))
    discontinuous = "where" in template
    if kind == "fori":
        body = template.format(c="k", y=y.name, i="i")
        b.add(
            f"lax.fori_loop(0, {trips}, lambda i, k: {body}, {x.name})",
            [x, y],
            inexact=True,
            discontinuous=discontinuous,
        )
    else:
        body = template.format(c="s[1]", y=y.name, i="s[0]")
        b.add(
            f"lax.while_loop(lambda s: s[0] < {trips}, lambda s: (s[0] + 1, {body}), (np.int32(0), {x.name}))[1]",
            [x, y],
            inexact=True,
            discontinuous=discontinuous,
        )


def _fits(small, big):
    try:
        return np.broadcast_shapes(small, big) == tuple(big)
    except ValueError:
        return False


def op_create(b):
    x = b.pick()
    kind = b.draw(st.sampled_from(["zeros_like", "ones_like", "full", "zeros", "arange", "arange_shaped"]))
    if kind in ("zeros_like", "ones_like"):
        if b.draw(st.booleans()):
            d = b.draw(st.sampled_from(DTYPES))
            b.add(f"xp.{kind}({x.name}, dtype=xp.{dtype_name(d)})", [x])
        else:
            b.add(f"xp.{kind}({x.name})", [x])
    elif kind == "full":
        d = b.draw(st.sampled_from(DTYPES))
        v = b.draw(st.sampled_from([0, 1, -3, 0.5, 2.5, 1e30, np.nan, -np.inf, True, 255, -0.0]))
        b.add(f"xp.full({x.shape!r}, {render_scalar(v)}, dtype=xp.{dtype_name(d)})", [])
    elif kind == "zeros":
        d = b.draw(st.sampled_from(DTYPES))
        b.add(f"xp.zeros({x.shape!r}, dtype=xp.{dtype_name(d)})", [])
    elif kind == "arange_shaped":  # an iota reshaped: later layout ops are pushed into it (scheduler/generated.h)
        d = b.draw(st.sampled_from(["int32", "float32"]))
        b.add(f"xp.arange({x.value.size}, dtype=xp.{d}).reshape({x.shape!r})", [])
    elif b.draw(st.integers(0, 3)) == 0:  # numpy fills at most two bools: [start, start + step]
        b.add(f"xp.arange({b.draw(st.integers(1, 2))}, dtype=xp.bool_)", [])
    else:
        b.add(f"xp.arange({b.draw(st.integers(1 if SIZE0_ARANGE_CRASHES_WORKER else 0, 8))})", [])


def op_at(b):
    """jax's functional updates, x.at[basic index].set/add/multiply/min/max,
    with a small scalar or a value of x's dtype that fits the region."""
    x = b.pick(lambda v: v.ndim >= 1 and v.value.size > 0)
    parts = []
    for s in x.shape:
        kind = b.draw(st.sampled_from(["all", "int", "range", "step", "reverse"]))
        if kind == "int" and s:
            parts.append(str(b.draw(st.integers(-s, s - 1))))
        elif kind == "range":
            lo = b.draw(st.integers(0, s))
            parts.append(f"{lo}:{b.draw(st.integers(lo, s))}")
        elif kind == "step":
            parts.append(f"::{b.draw(st.integers(1, 3))}")
        elif kind == "reverse":
            parts.append(f"::-{b.draw(st.integers(1, 2))}")
        else:
            parts.append(":")
    region = x.value[eval(f"np.s_[{', '.join(parts)}]", {"np": np})].shape
    mode = b.draw(st.sampled_from(["set", "add", "max", "min", "multiply"]))
    fits = [v for v in b.pool if v.dtype == x.dtype and _fits(v.shape, region)]
    if fits and b.draw(st.booleans()):
        y = b.draw(st.sampled_from(fits))
        src, vals = y.name, [y]
    else:
        src, vals = str(b.draw(st.sampled_from([0, 1, 2]))), []
        if x.dtype == BOOL:
            src = "True"
    b.add(f"{x.name}.at[{', '.join(parts)}].{mode}({src})", [x] + vals, discontinuous=mode in ("max", "min"))


def op_index(b):
    """numpy's advanced indexing with the index values in the program
    (lists with repeats and negatives, boolean masks, integers and slices
    beside them), take, take_along_axis, and x.at[index lists] updates
    (set with distinct indices: which repeat wins is unspecified in JAX)."""
    x = b.pick(lambda v: v.ndim >= 1 and v.value.size > 0)
    kind = b.draw(st.sampled_from(["fancy", "fancy", "mask", "take", "take_along", "at"]))
    k = b.draw(st.integers(1, 4))

    def positions(s, count, distinct=False):
        if distinct:
            return b.draw(st.lists(st.integers(0, s - 1), min_size=min(count, s), max_size=min(count, s), unique=True))
        return [b.draw(st.integers(-s, s - 1)) for _ in range(count)]

    if kind in ("fancy", "at"):
        mode = b.draw(st.sampled_from(["set", "add", "max", "min", "multiply"])) if kind == "at" else None
        if mode == "set":
            k = min([k] + list(x.shape))
        parts, lists = [], 0
        for s in x.shape:
            choice = b.draw(st.sampled_from(["all", "list", "int", "range"] if kind == "fancy" else ["all", "list"]))
            if choice == "list" or (choice == "int" and kind == "fancy"):
                lists += 1
                parts.append(repr(positions(s, k, mode == "set")) if choice == "list" else str(positions(s, 1)[0]))
            elif choice == "range":
                lo = b.draw(st.integers(0, s))
                parts.append(f"{lo}:{b.draw(st.integers(lo, s))}")
            else:
                parts.append(":")
        if not any(p.startswith("[") for p in parts):
            parts[0] = repr(positions(x.shape[0], k, mode == "set"))
        if mode == "set" and sum(p.startswith("[") for p in parts) > 1:
            raise _Reject  # distinct per axis is not distinct per element
        if kind == "fancy":
            b.add(f"{x.name}[{', '.join(parts)}]", [x])
            return
        src = "True" if x.dtype == BOOL else str(b.draw(st.sampled_from([0, 1, 2])))
        b.add(f"{x.name}.at[{', '.join(parts)}].{mode}({src})", [x], discontinuous=mode in ("max", "min"))
    elif kind == "mask":
        lead = b.draw(st.integers(1, x.ndim))
        mask = np.array(
            b.draw(
                st.lists(st.booleans(), min_size=int(np.prod(x.shape[:lead])), max_size=int(np.prod(x.shape[:lead])))
            )
        ).reshape(x.shape[:lead])
        b.add(f"{x.name}[np.array({mask.tolist()!r})]", [x])
    elif kind == "take":
        axis = b.draw(st.integers(0, x.ndim - 1))
        b.add(f"xp.take({x.name}, {positions(x.shape[axis], k)!r}, axis={axis})", [x])
    else:
        axis = b.draw(st.integers(0, x.ndim - 1))
        shape = list(x.shape)
        shape[axis] = k
        idx = np.array([positions(x.shape[axis], 1)[0] for _ in range(int(np.prod(shape)))]).reshape(shape)
        b.add(f"xp.take_along_axis({x.name}, np.array({idx.tolist()!r}), axis={axis})", [x])


def op_linalg(b):
    """numpy.linalg on a well-conditioned matrix built from a float value x
    [..., r, c]: M = tanh(x xᵀ) + r I (NaN and infinities of x xᵀ as 0) is
    symmetric with eigenvalues in [1, 2r - 1], so its condition number is
    below 2r (the oracle's bound). Right-hand sides and norms take
    tanh(x), bounded too."""
    x = b.pick(
        lambda v: v.ndim >= 2 and v.dtype in (np.dtype(np.float32), np.dtype(np.float64)) and 1 <= v.shape[-2] <= 8
    )
    r, dt = x.shape[-2], dtype_name(x.dtype)
    gram = f"({x.name} @ xp.swapaxes({x.name}, -1, -2))"
    m = f"(xp.tanh(xp.where(xp.isfinite({gram}), {gram}, 0)) + {r} * xp.eye({r}, dtype=xp.{dt}))"
    bounded = f"xp.tanh(xp.where(xp.isfinite({x.name}), {x.name}, 0))"
    kind = b.draw(st.sampled_from(["det", "logdet", "sign", "inv", "solve", "cholesky", "eigvalsh", "norm"]))
    if kind == "det":
        expr = f"xp.linalg.det({m})"
    elif kind in ("logdet", "sign"):
        expr = f"xp.linalg.slogdet({m})[{1 if kind == 'logdet' else 0}]"
    elif kind == "solve":
        expr = f"xp.linalg.solve({m}, {bounded})"
    elif kind == "norm":
        ord_, axis = b.draw(
            st.sampled_from(
                [
                    (None, None),
                    ("'fro'", (-2, -1)),
                    (1, (-2, -1)),
                    ("xp.inf", (-2, -1)),
                    (2, (-2, -1)),
                    ("'nuc'", (-2, -1)),
                    (1, -1),
                    (2, -1),
                ]
            )
        )
        if ord_ == "xp.inf":
            ord_ = "np.inf"
        expr = f"xp.linalg.norm({bounded}, ord={ord_}, axis={axis})"
    else:
        expr = f"xp.linalg.{kind}({m})"
    b.add(expr, [x], inexact=True)


def op_window(b):
    """jax.lax.dynamic_slice and dynamic_update_slice: starts static
    (negative or past the end: clamped) or traced (an argmax), the update
    a value of the pool that fits, or a slice of the operand."""
    x = b.pick(lambda v: v.ndim >= 1)
    starts, deps = [], []
    for s in x.shape:
        if b.draw(st.integers(0, 3)) == 0:
            y = b.pick(lambda v: v.value.size > 0 and v.dtype != BOOL)
            starts.append(f"xp.argmax({y.name})")
            deps.append(y)
        else:
            starts.append(str(b.draw(st.integers(-s - 2, s + 2))))
    start_text = "(" + ", ".join(starts) + ("," if len(starts) == 1 else "") + ")"
    if b.draw(st.booleans()):
        sizes = tuple(b.draw(st.integers(0, s)) for s in x.shape)
        b.add(f"lax.dynamic_slice({x.name}, {start_text}, {sizes!r})", [x] + deps, discontinuous=bool(deps))
        return
    fits = [
        v for v in b.pool if v.dtype == x.dtype and v.ndim == x.ndim and all(a <= c for a, c in zip(v.shape, x.shape))
    ]
    if fits and b.draw(st.booleans()):
        u = b.draw(st.sampled_from(fits))
        b.add(f"lax.dynamic_update_slice({x.name}, {u.name}, {start_text})", [x, u] + deps, discontinuous=bool(deps))
    else:
        part = ", ".join(f":{b.draw(st.integers(0, s))}" for s in x.shape)
        b.add(
            f"lax.dynamic_update_slice({x.name}, {x.name}[{part}], {start_text})", [x] + deps, discontinuous=bool(deps)
        )


def op_sequence(b):
    """Ops along one axis: flip, roll, cumsum, sort and argsort."""
    kind = b.draw(st.sampled_from(["flip", "roll", "cumsum", "sort", "argsort"]))
    x = b.pick(lambda v: v.ndim >= 1)
    axis = b.draw(st.sampled_from([None] + list(range(-x.ndim, x.ndim))))
    if kind == "flip":
        b.add(f"xp.flip({x.name}, {axis!r})", [x])
    elif kind == "roll":
        b.add(f"xp.roll({x.name}, {b.draw(st.integers(-5, 5))}, {axis!r})", [x])
    elif kind == "cumsum":
        b.add(f"xp.cumsum({x.name}, {axis!r})", [x], inexact=True)
    else:  # a tiny change of a key can reorder
        b.add(f"xp.{kind}({x.name}, {axis!r})", [x], discontinuous=True)


SORTABLE = INTS + [np.dtype(np.float32), np.dtype(np.float64)]


def op_array_api(b):
    """The Array API standard's own names: diff, vecdot, hypot,
    count_nonzero, concat (flattening too), permute_dims,
    matrix_transpose and unstack; signbit, copysign and nextafter (bitcasts
    underneath) over values without NaN, whose sign bit depends on how each
    side made it (numpy's 0/0 is -nan)."""
    kind = b.draw(
        st.sampled_from(
            ["diff", "vecdot", "hypot", "count_nonzero", "concat", "permute_dims", "matrix_transpose", "unstack"]
            + ["signbit", "copysign", "nextafter"]
        )
    )
    if kind == "diff":
        x = b.pick(lambda v: v.ndim >= 1)
        n, axis = b.draw(st.integers(0, 2)), b.draw(st.integers(-x.ndim, x.ndim - 1))
        b.add(f"xp.diff({x.name}, n={n}, axis={axis})", [x])
    elif kind == "vecdot":
        x = b.pick(lambda v: v.ndim >= 1)
        y = b.pick_broadcastable(x, lambda v: v.ndim >= 1 and v.shape[-1] == x.shape[-1])
        b.add(f"xp.vecdot({x.name}, {y.name})", [x, y], inexact=True)
    elif kind == "hypot":
        x = b.pick()
        text, deps, _ = b.operand(x, past_rate=0)
        b.add(f"xp.hypot({x.name}, {text})", [x] + deps, inexact=True)
    elif kind in ("signbit", "copysign", "nextafter"):
        no_nan = lambda v: not (is_float(v.dtype) and np.isnan(v.value.astype(np.float64)).any())  # noqa: E731
        x = b.pick(no_nan)
        if kind == "signbit":
            b.add(f"xp.signbit({x.name})", [x], discontinuous=True)
        else:
            y = b.pick_broadcastable(x, no_nan)
            b.add(f"xp.{kind}({x.name}, {y.name})", [x, y], discontinuous=True)
    elif kind == "count_nonzero":
        x = b.pick(lambda v: v.ndim >= 1)
        axis = b.draw(st.sampled_from([None] + list(range(-x.ndim, x.ndim))))
        b.add(f"xp.count_nonzero({x.name}, axis={axis!r}, keepdims={b.draw(st.booleans())})", [x])
    elif kind == "concat":
        x = b.pick()
        y = b.pick(lambda v: v.dtype == x.dtype)
        b.add(f"xp.concat([{x.name}, {y.name}], axis=None)", [x, y])
    elif kind == "permute_dims":
        x = b.pick(lambda v: v.ndim >= 2)
        perm = b.draw(st.permutations(list(range(x.ndim))))
        b.add(f"xp.permute_dims({x.name}, {tuple(perm)!r})", [x])
    elif kind == "matrix_transpose":
        x = b.pick(lambda v: v.ndim >= 2)
        b.add(f"xp.matrix_transpose({x.name})", [x])
    else:
        x = b.pick(lambda v: v.ndim >= 1 and v.shape[0] >= 1)
        axis = b.draw(st.integers(-x.ndim, x.ndim - 1))
        k = b.draw(st.integers(0, x.shape[axis] - 1)) if x.shape[axis] else 0
        b.add(f"xp.unstack({x.name}, axis={axis})[{k}]", [x])


def op_bodies(b):
    """jax.lax.reduce with a body of its own (REDUCE_WITH_BODY): a sum and
    a max over a pair of integer operands (exact, so any order agrees), and
    jax.lax.sort by two keys (SORT_WITH_COMPARATOR), NaN, ties and -0.0
    included."""
    if b.draw(st.booleans()):
        x = b.pick(lambda v: v.dtype in INTS and v.ndim >= 1)
        axis = b.draw(st.sampled_from(list(range(x.ndim))))
        k = b.draw(st.sampled_from([0, 1]))
        lo = f"{x.name}.dtype.type(np.iinfo({x.name}.dtype).min)"
        b.add(
            f"lax.reduce(({x.name}, {x.name} // 2), ({x.name}.dtype.type(0), {lo}), "
            f"lambda p, q: (p[0] + q[0], xp.maximum(p[1], q[1])), ({axis},))[{k}]",
            [x],
        )
        return
    x = b.pick(lambda v: v.dtype in SORTABLE and v.ndim >= 1)
    y = b.pick(lambda v: v.dtype in SORTABLE and v.shape == x.shape)
    axis = b.draw(st.sampled_from(list(range(-x.ndim, x.ndim))))
    k = b.draw(st.sampled_from([0, 1]))
    b.add(f"lax.sort(({x.name}, {y.name}), dimension={axis}, num_keys=2)[{k}]", [x, y], discontinuous=True)


# Bodies of a mapped function of one element {u} and an unmapped value {w}.
VMAP_BODIES = [
    "{u} * 2 + {w}",
    "xp.tanh({u}) - {w}",
    "xp.sum({u} * {w}, axis=-1)",
    "xp.max({u}, axis=0) + {w}",
    "xp.sort({u}, axis=-1)",
    "xp.flip({u}, -1)[::2]",
    "xp.cumsum({u}, axis=-1)",
    "{u}.T @ {w}",
    "xp.concatenate([{u}, {u} * {w}], axis=0)",
    "xp.pad({u}, 1)",
    "xp.argmax({u}, axis=-1)",
    "xp.where({u} > {w}, {u}, {w})",
    "xp.take({u}, xp.argsort({u}, axis=-1), axis=-1)",
    "{u}.reshape(-1)[1:]",
    "xp.einsum('...i,...i->...', {u}, {u})",
]


def op_vmap(b):
    """tessel.vmap of a small function against the oracle's loop over the
    mapped axis: the element and another value of the program (unmapped,
    or mapped along its own axis), the results stacked along out_axes."""
    # Elements of rank >= 1: numpy takes axis=-1 of a 0-d array (sort,
    # cumsum), where jax and Tessel raise.
    x = b.pick(lambda v: v.ndim >= 2 and 0 < v.value.size)
    axis = b.draw(st.integers(-x.ndim, x.ndim - 1))
    body = b.draw(st.sampled_from(VMAP_BODIES))
    size = x.shape[axis]
    mapped = [v for v in b.pool if v.ndim >= 1 and v.shape[0] == size]
    y = b.draw(st.sampled_from(mapped)) if mapped and b.draw(st.booleans()) else b.pick()
    y_axis = 0 if y.ndim >= 1 and y.shape[0] == size and b.draw(st.booleans()) else None
    out_axes = b.draw(st.sampled_from([0, -1]))
    b.add(
        f"vmap(lambda u, w: {body.format(u='u', w='w')}, in_axes=({axis}, {y_axis}), out_axes={out_axes})"
        f"({x.name}, {y.name})",
        [x, y],
        inexact=True,
        discontinuous="sort" in body or "arg" in body or "where" in body,
    )


OPS = [
    (op_binary, 14),
    (op_unary, 10),
    (op_compare, 7),
    (op_where, 4),
    (op_clip, 3),
    (op_astype, 5),
    (op_reduce, 8),
    (op_reshape, 4),
    (op_transpose, 3),
    (op_broadcast, 3),
    (op_slice, 4),
    (op_concatenate, 2),
    (op_stack, 2),
    (op_pad, 2),
    (op_matmul, 3),
    (op_einsum, 3),
    (op_create, 2),
    (op_layout_more, 3),
    (op_control, 2),
    (op_sequence, 3),
    (op_at, 2),
    (op_index, 3),
    (op_window, 2),
    (op_linalg, 2),
    (op_vmap, 2),
    (op_bodies, 2),
    (op_array_api, 3),
]
_OP_TABLE = [f for f, w in OPS for _ in range(w)]


@st.composite
def programs(draw, min_ops=5, max_ops=30):
    """A random Program (see the module doc)."""
    lead = draw(st.sampled_from([d for d, w in DTYPE_WEIGHTS.items() for _ in range(w)]))
    base = draw(shapes())
    n_args = draw(st.integers(1, 3))
    inputs = []
    for i in range(n_args):
        shape = base if i == 0 or draw(st.booleans()) else _broadcast_variant(draw, base)
        d = lead if draw(st.integers(0, 3)) else draw(st.sampled_from(DTYPES))
        inputs.append(("abc"[i], draw(arrays(d, shape))))
    b = Builder(draw, inputs)
    n_ops = draw(st.integers(min_ops, max_ops))
    attempts = 0
    while len(b.steps) < n_ops and b.error is None and attempts < 4 * n_ops:
        attempts += 1
        op = draw(st.sampled_from(_OP_TABLE))
        try:
            op(b)
        except _Reject:
            continue
    names = [v.name for v in b.pool]
    if b.error is not None:
        outputs = [b.steps[-1][0]]
    else:
        outputs = [names[-1]]
        for _ in range(draw(st.integers(0, 2))):
            outputs.append(draw(st.sampled_from(names)))
    exact = {v.name: v.exact for v in b.pool}
    return Program(inputs, b.steps, outputs, exact, b.error)


ELEMENTWISE = {
    **{n: (op_unary, n) for n in UNARY},
    **{n: (op_binary, n) for n in BINARY},
    **{n: (op_compare, n) for n in COMPARE},
    "where": (op_where, None),
    "clip": (op_clip, None),
    "astype": (op_astype, None),
}


@st.composite
def elementwise_programs(draw, name):
    """Op `name` of ELEMENTWISE alone over two long vectors rich in edge
    values (or a vector and a scalar): the per-element corners a program
    rarely meets (1.0 // 0.1, -0.0 % 2.5, NaN against an int bound, ...)."""
    d1 = draw(st.sampled_from(DTYPES))
    d2 = d1 if draw(st.booleans()) else draw(st.sampled_from(DTYPES))
    if draw(st.booleans()):
        # Every pair of 16 values: the edge values and a few plain ones.
        def values(d):
            pool = list(dict.fromkeys(edge_values(d)))[:12]
            extra = draw(arrays(d, (16 - len(pool),), edge_rates=(0.0,)))
            with np.errstate(all="ignore"):
                return np.concatenate([np.array(pool, np.float64 if d == BF16 else d).astype(d), extra])

        va, vb = values(d1), values(d2)
        inputs = [("a", np.repeat(va, len(vb))), ("b", np.tile(vb, len(va)))]
    else:
        n = draw(st.integers(16, 64))
        inputs = [(v, draw(arrays(d, (n,), edge_rates=(0.3, 0.6)))) for v, d in (("a", d1), ("b", d2))]
    b = Builder(draw, inputs)
    if name == "where" or draw(st.booleans()):
        b.add("(a < b)", [b.pool[0], b.pool[1]], discontinuous=True)  # a condition for where
    op, arg = ELEMENTWISE[name]
    for _ in range(20):
        try:
            op(b, arg) if arg else op(b)
            break
        except _Reject:
            continue
    outputs = [b.steps[-1][0]] if b.steps else ["a"]
    return Program(inputs, b.steps, outputs, {v.name: v.exact for v in b.pool}, b.error)


# ---------------------------------------------------------------- shardings

MESHES = [{"a": 4}, {"a": 2, "b": 2}, {"a": 4, "b": 1}]


@st.composite
def specs(draw, mesh, shape):
    """A random valid PartitionSpec for `shape` on `mesh`: each mesh axis at
    most once, on a dimension its size divides (with the axes before it)."""
    from tessel import P

    dims = [[] for _ in shape]
    for axis in draw(st.permutations(list(mesh))):
        if not shape or draw(st.integers(0, 2)) == 0:
            continue
        d = draw(st.integers(0, len(shape) - 1))
        size = int(np.prod([mesh[x] for x in dims[d]] + [mesh[axis]]))
        if shape[d] % size == 0:
            dims[d].append(axis)
    return P(*[None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims])
