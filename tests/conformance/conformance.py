#!/usr/bin/env python3
"""Tessel op conformance suite: every op on every dtype it admits, one graph
per case, run through `tessel run` on a real local cluster (2 workers x 2 CPU
devices) and checked against an independent numpy reference.

Usage:
  conformance.py --bin BUILD/bin [--device-kind cpu|cuda] [--filter SUBSTR] [--keep DIR] [--verbose]

  --bin DIR       folder holding tessel, tessel-coordinator and tessel-worker
  --device-kind K the devices the workers serve (default: $TESSEL_DEVICE_KIND,
                  else cpu). With cuda each worker serves every GPU it sees;
                  the cases go round robin over however many devices there are
  --filter SUBSTR run only the cases whose name contains SUBSTR (the negative
                  cases run when their name, "NEGATIVE/...", matches)
  --keep DIR      write graphs, inputs and outputs under DIR and keep them
                  (default: a temporary folder, removed at the end)
  --verbose       also print passing cases and the negative cases' errors

Each case is one graph: PARAMETER nodes p0, p1, ... (bound with --input), the
op under test, and one output named "out" (fetched with --fetch). Cases go to
the devices round robin (0..3 on CPU) so both worker processes serve them.

Numerics of the reference:
  * f32/f64 results are computed in float64 from the exact inputs and rounded
    once to the result type.
  * f16 and bf16 are computed in float32 (the CPU backend's compute type) and
    rounded to f16/bf16 with round-to-nearest-even, like numpy does for f16.
    bf16 has no numpy dtype: it travels in .npy files as two-byte void
    ('<V2', as ml_dtypes' bfloat16 saves it) bit patterns; in memory this script keeps bf16 values as float32/float64
    numbers that are exactly representable in bf16.
  * Conversions to a floating type are rounded exactly (one rounding of the
    exact source value, computed with integer / power-of-two arithmetic).
  * Integer results wrap modulo 2^bits; integer division truncates.
Inputs avoid implementation-defined corners: no integer division by zero or
INT_MIN / -1, no log/sqrt of negatives, float->int converts stay in range.

Negative cases feed invalid graphs to `tessel compile` / `tessel run` and
require a nonzero exit and an INVALID_ARGUMENT error that names the node and
its op; afterwards one valid case runs again on every device.

Prints one line per failing case and a summary "N cases, M failed"; exits 1 if
any case failed.
"""

import argparse
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

FLOATS = ["f32", "f64", "f16", "bf16"]
INTS = ["s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64"]
UNSIGNED = ["u8", "u16", "u32", "u64"]
ALL = FLOATS + INTS + ["pred"]
NUMERIC = FLOATS + INTS  # everything but pred
SIGNED = FLOATS + ["s8", "s16", "s32", "s64"]
INT_OR_PRED = INTS + ["pred"]

# In-memory numpy dtype of each Tessel dtype (bf16 values live in float32).
NP = {
    "f32": np.float32,
    "f64": np.float64,
    "f16": np.float16,
    "bf16": np.float32,
    "s32": np.int32,
    "s64": np.int64,
    "u8": np.uint8,
    "pred": np.bool_,
    "s8": np.int8,
    "s16": np.int16,
    "u16": np.uint16,
    "u32": np.uint32,
    "u64": np.uint64,
}
# .npy descr the CLI reads and writes for each dtype.
NPY_DESCR = {
    "f32": "<f4",
    "f64": "<f8",
    "f16": "<f2",
    "bf16": "<V2",
    "s32": "<i4",
    "s64": "<i8",
    "u8": "|u1",
    "pred": "|b1",
    "s8": "|i1",
    "s16": "<i2",
    "u16": "<u2",
    "u32": "<u4",
    "u64": "<u8",
}
PROTO = {d: d.upper() for d in ALL}
INT_RANGE = {
    "s8": (-(2**7), 2**7 - 1),
    "s16": (-(2**15), 2**15 - 1),
    "s32": (-(2**31), 2**31 - 1),
    "s64": (-(2**63), 2**63 - 1),
    "u8": (0, 2**8 - 1),
    "u16": (0, 2**16 - 1),
    "u32": (0, 2**32 - 1),
    "u64": (0, 2**64 - 1),
}

# Floating formats: (precision in bits incl. the implicit one, exponent of the
# smallest normal, largest finite value).
FMT = {
    "f32": (24, -126, float(np.finfo(np.float32).max)),
    "f16": (11, -14, 65504.0),
    "bf16": (8, -126, float.fromhex("0x1.fep127")),
    "f64": (53, -1022, float(np.finfo(np.float64).max)),
}

# ----------------------------------------------------------------------------
# bf16 and exact rounding helpers.


def f32_to_bf16_bits(x):
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = np.array(x, dtype=np.float32, order="C").view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    r = np.where(nan, (u >> 16) | 0x40, r)
    return r.astype(np.uint16)


def bf16_bits_to_f32(b):
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_float(x, dt):
    """Rounds float64 values once, to nearest even, to the precision and range
    of `dt`; returns float64 values exactly representable in `dt`."""
    x = np.array(x, dtype=np.float64, copy=True)
    if dt == "f64":
        return x
    p, emin, maxv = FMT[dt]
    fin = np.isfinite(x) & (x != 0)
    v = x[fin]
    _, e = np.frexp(v)  # |v| in [2^(e-1), 2^e): ulp 2^(e-p), subnormals 2^(emin-p+1)
    q = np.ldexp(1.0, np.maximum(e - p, emin - p + 1))
    r = np.rint(v / q) * q
    r = np.where(np.abs(r) > maxv, np.copysign(np.inf, r), r)
    x[fin] = r
    return x


def int_to_float_exact(v, dt):
    """Python int -> nearest (ties to even) value of float type dt, as a float."""
    p, _, maxv = FMT[dt]
    if v == 0:
        return 0.0
    s, a = (-1.0 if v < 0 else 1.0), abs(int(v))
    n = a.bit_length()
    if n > p:
        shift = n - p
        q, r = divmod(a, 1 << shift)
        half = 1 << (shift - 1)
        if r > half or (r == half and q & 1):
            q += 1
        a = q << shift
    f = float(a)  # exact: at most p <= 53 significant bits
    return s * (np.inf if f > maxv else f)


def to_mem(dt, x):
    """Values -> in-memory array of dt (floats rounded once, to nearest even)."""
    x = np.asarray(x)
    if dt in FLOATS:
        return round_float(x.astype(np.float64), dt).astype(NP[dt])
    if dt in INTS:
        if x.dtype.kind == "f":
            x = x.astype(np.int64)
        return x.astype(NP[dt])
    return x.astype(np.bool_)


def rf(dt, x):
    """Reference rounding of float64 results to a float dtype (in-memory)."""
    return round_float(np.asarray(x, np.float64), dt).astype(NP[dt])


def via_f32(dt, x):
    """A float64 result as the CPU backend produces it for dt: f16/bf16 are
    computed in float32 then stored; f32/f64 are rounded once."""
    if dt in ("f16", "bf16"):
        return rf(dt, rf("f32", x))
    return rf(dt, x)


def wrap(dt, x):
    """Integer values (any int dtype, possibly out of range) modulo 2^bits."""
    return np.asarray(x).astype(np.int64).astype(NP[dt])


def store(dt, x):
    """In-memory array -> what goes into the .npy file."""
    x = np.asarray(x)
    if dt == "bf16":
        return f32_to_bf16_bits(x.astype(np.float32)).view("V2")
    return np.array(x, dtype=NP[dt], order="C")  # keeps shape () for scalars


def load(dt, x):
    if dt == "bf16":
        return bf16_bits_to_f32(x.view(np.uint16))
    return x


def f64(x):
    return np.asarray(x).astype(np.float64)


def i64(x):
    return np.asarray(x).astype(np.int64)


def iw(dt, x):
    """Integers widened for a reference that wraps: uint64 stays uint64 (its
    order, division and maximum are unsigned), the rest go to int64."""
    return np.asarray(x).astype(np.uint64 if dt == "u64" else np.int64)


# ----------------------------------------------------------------------------
# Random inputs.


def rand_float(rng, dt, shape, lo=-3.0, hi=3.0):
    return to_mem(dt, rng.uniform(lo, hi, shape))


def rand_nonzero_float(rng, dt, shape, lo=0.5, hi=4.0):
    mag = rng.uniform(lo, hi, shape)
    return to_mem(dt, np.where(rng.integers(0, 2, shape) == 1, mag, -mag))


def rand_int(rng, dt, shape, lo=None, hi=None):
    a, b = INT_RANGE[dt]
    lo = a if lo is None else max(lo, a)
    hi = b if hi is None else min(hi, b)
    return rng.integers(lo, hi, shape, endpoint=True, dtype=np.uint64 if dt in UNSIGNED else np.int64).astype(NP[dt])


def rand_pred(rng, shape):
    return rng.integers(0, 2, shape).astype(np.bool_)


def rand_any(rng, dt, shape):
    if dt == "pred":
        return rand_pred(rng, shape)
    if dt in INTS:
        return rand_int(rng, dt, shape)
    return rand_float(rng, dt, shape)


def rand_small(rng, dt, shape, lo=-3, hi=3):
    """Small values: ints in [lo, hi] (>= 0 when unsigned), floats in [lo, hi)."""
    if dt == "pred":
        return rand_pred(rng, shape)
    if dt in INTS:
        return rand_int(rng, dt, shape, lo if dt not in UNSIGNED else 0, hi if dt not in UNSIGNED else hi - lo)
    return rand_float(rng, dt, shape, lo, hi)


# ----------------------------------------------------------------------------
# Cases.


def type_text(dt, shape):
    return "type { dtype: %s%s }" % (PROTO[dt], "".join(" dims: %d" % d for d in shape))


def ints_text(field, values):
    return "%s: [%s]" % (field, ", ".join(str(int(v)) for v in values))


class Case:
    """One graph: parameters p0.., nodes, one output "out"."""

    def __init__(self, name, op, dtype):
        self.name, self.op, self.dtype = name, op, dtype
        self.nodes = []
        self.inputs = {}  # name -> (dtype, in-memory array)
        self.expected = None  # (dtype, array)
        self.rtol, self.atol = 0.0, 0.0
        # Exact float results must also get the sign of zero right (except
        # where +0 and -0 tie: max, min, clamp).
        self.signed_zero = op not in ("MAX", "MIN", "CLAMP", "REDUCE")

    def param(self, dt, x):
        i = len(self.inputs)
        name = "p%d" % i
        x = np.asarray(x)
        self.nodes.append(
            'nodes { name: "%s" op: PARAMETER parameter { index: %d } %s }' % (name, i, type_text(dt, x.shape))
        )
        self.inputs[name] = (dt, x)
        return name

    def node(self, name, op, operands=(), attrs=""):
        ops = ""
        if operands:
            ops = " operands: [%s]" % ", ".join('"%s"' % o for o in operands)
        self.nodes.append('nodes { name: "%s" op: %s%s%s }' % (name, op, ops, (" " + attrs) if attrs else ""))
        return name

    def out(self, op, operands=(), attrs="", dt=None, want=None, rtol=0.0, atol=0.0):
        self.node("out", op, operands, attrs)
        self.expect(dt, want, rtol, atol)

    def expect(self, dt, want, rtol=0.0, atol=0.0):
        self.expected = (dt, np.asarray(want))
        self.rtol, self.atol = rtol, atol

    def graph(self):
        return 'name: "%s"\n%s\noutputs: "out"\n' % (
            self.name.replace("/", "_").replace('"', ""),
            "\n".join(self.nodes),
        )


# Tolerances (rtol, atol) by class of computation.
# f16 and bf16 results may differ from the reference by one unit in the last
# place (2^-10 and 2^-7 relative), hence rtol 1e-3 and 1e-2.
TOL_ARITH = {"f32": (1e-5, 1e-7), "f64": (1e-12, 1e-14), "f16": (1e-3, 1e-6), "bf16": (1e-2, 1e-6)}
TOL_TRANS = {"f32": (1e-5, 1e-6), "f64": (1e-12, 1e-14), "f16": (1e-3, 1e-6), "bf16": (1e-2, 1e-6)}
# Reductions and dots: atol is multiplied by the sum of |terms| of each output
# (f16 and bf16 accumulate in float32, then round once).
TOL_ACCUM = {"f32": (1e-5, 1e-5), "f64": (1e-12, 1e-12), "f16": (2e-3, 1e-5), "bf16": (1e-2, 1e-5)}


def tol(table, dt):
    return table.get(dt, (0.0, 0.0))


# --- unary ------------------------------------------------------------------


def round_afz(x):
    """Round half away from zero, exactly."""
    a = np.abs(x)
    r = np.floor(a)
    r = r + ((a - r) >= 0.5)
    return np.copysign(r, x)


def _pos(lo, hi):
    return lambda rng, dt, shape: rand_float(rng, dt, shape, lo, hi)


def _signed_zeros(x):
    if x.dtype.kind == "f":
        x.flat[0], x.flat[1] = -0.0, 0.0
    return x


def _with_halves(rng, dt, shape):
    x = rng.uniform(-4, 4, shape)
    halves = np.floor(x) + 0.5  # k + 0.5: ties, representable in every float type
    x = np.where(rng.integers(0, 3, shape) == 0, halves, x)
    x.flat[2] = -0.25  # rounds to -0
    x = _signed_zeros(to_mem(dt, x))
    # The largest value below 0.5 rounds to 0 (floor(x + 0.5) would give 1).
    below_half = 0.5 - 2.0 ** -(FMT[dt][0] + 1)
    x.flat[3], x.flat[4] = below_half, -below_half
    return x


def _with_zeros(rng, dt, shape):
    x = rand_any(rng, dt, shape)
    return _signed_zeros(np.where(rng.integers(0, 4, shape) == 0, np.zeros_like(x), x))


def sign_ref(x):
    return np.where(x == 0, x, np.sign(x))  # sign(-0) = -0, sign(NaN) = NaN (StableHLO)


def _signed_int_no_min(rng, dt, shape):
    if dt in INTS:
        lo, hi = INT_RANGE[dt]
        return rand_int(rng, dt, shape, lo + 1 if dt not in UNSIGNED else 0, hi)
    return _signed_zeros(rand_float(rng, dt, shape))


UNARY = {  # op: (admitted dtypes, input generator, float64 reference, exact?)
    "NEG": (NUMERIC, _signed_int_no_min, lambda x: -x, True),
    "ABS": (SIGNED, _signed_int_no_min, np.abs, True),
    "EXP": (FLOATS, _pos(-5, 5), np.exp, False),
    "LOG": (FLOATS, _pos(0.01, 20), np.log, False),
    "LOG1P": (FLOATS, _pos(0.0, 5), np.log1p, False),
    "TANH": (FLOATS, _pos(-3, 3), np.tanh, False),
    "LOGISTIC": (FLOATS, _pos(-6, 6), lambda x: 1.0 / (1.0 + np.exp(-x)), False),
    "SQRT": (FLOATS, _pos(0.01, 100), np.sqrt, False),
    "RSQRT": (FLOATS, _pos(0.01, 100), lambda x: 1.0 / np.sqrt(x), False),
    "FLOOR": (FLOATS, _with_halves, np.floor, True),
    "CEIL": (FLOATS, _with_halves, np.ceil, True),
    "ROUND": (FLOATS, _with_halves, round_afz, True),
    "SIGN": (SIGNED, _with_zeros, sign_ref, True),
    "NOT": (
        INT_OR_PRED,
        lambda rng, dt, shape: rand_any(rng, dt, shape),
        lambda x: np.logical_not(x) if x.dtype == np.bool_ else np.invert(x),
        True,
    ),
    "SIN": (FLOATS, _pos(-3, 3), np.sin, False),
    "COS": (FLOATS, _pos(-3, 3), np.cos, False),
    "TAN": (FLOATS, _pos(-1.2, 1.2), np.tan, False),
    "ASIN": (FLOATS, _pos(-0.99, 0.99), np.arcsin, False),
    "ACOS": (FLOATS, _pos(-0.99, 0.99), np.arccos, False),
    "ATAN": (FLOATS, _pos(-10, 10), np.arctan, False),
    "SINH": (FLOATS, _pos(-3, 3), np.sinh, False),
    "COSH": (FLOATS, _pos(-3, 3), np.cosh, False),
    "ASINH": (FLOATS, _pos(-10, 10), np.arcsinh, False),
    "ACOSH": (FLOATS, _pos(1.01, 10), np.arccosh, False),
    "ATANH": (FLOATS, _pos(-0.95, 0.95), np.arctanh, False),
    "EXPM1": (FLOATS, _pos(-3, 3), np.expm1, False),
    "ERF": (FLOATS, _pos(-3, 3), np.vectorize(math.erf, otypes=[np.float64]), False),
    "CBRT": (FLOATS, _pos(-3, 3), np.cbrt, False),
}


def unary_cases(rng):
    for op, (dts, gen, fn, exact) in UNARY.items():
        for dt in dts:
            c = Case("%s/%s" % (op, dt), op, dt)
            shape = (3, 4) if len(dt) % 2 else (2, 3, 4)
            x = gen(rng, dt, shape)
            p = c.param(dt, x)
            rt = at = 0.0
            if dt in FLOATS:
                want = via_f32(dt, fn(f64(x)))
                if not exact:
                    rt, at = tol(TOL_TRANS, dt)
            elif dt == "pred" or op == "NOT":
                want = fn(x)
            else:
                want = wrap(dt, fn(iw(dt, x)))
            c.out(op, [p], dt=dt, want=want, rtol=rt, atol=at)
            yield c


# --- binary -----------------------------------------------------------------


def trunc_div(a, b):  # a, b widened (iw)
    return (a - np.fmod(a, b)) // b  # exact: a - fmod(a, b) is a multiple of b


def binary_inputs(rng, op, dt, shape):
    if dt == "pred":
        return rand_pred(rng, shape), rand_pred(rng, shape)
    if dt in INTS:
        if op in ("DIV", "REM"):
            lo, hi = INT_RANGE[dt]
            a = rand_int(rng, dt, shape, lo + 1 if dt not in UNSIGNED else 0, hi)
            if dt in UNSIGNED:
                b = rand_int(rng, dt, shape, 1, hi)
                b = np.where(rng.integers(0, 2, shape) == 1, b, b % 13 + 1).astype(NP[dt])
            else:
                mag = np.where(
                    rng.integers(0, 2, shape) == 1,
                    rng.integers(1, 50, shape),
                    rng.integers(1, hi, shape, dtype=np.int64),
                )
                b = (mag * np.where(rng.integers(0, 2, shape) == 1, 1, -1)).astype(NP[dt])
            return a, b
        if op == "POW":
            if dt in UNSIGNED:
                return rand_int(rng, dt, shape, 0, 20), rand_int(rng, dt, shape, 0, 6)
            return rand_int(rng, dt, shape, -40, 40), rand_int(rng, dt, shape, 0, 9)
        return rand_int(rng, dt, shape), rand_int(rng, dt, shape)
    if op in ("DIV", "REM"):
        return rand_float(rng, dt, shape, -10, 10), rand_nonzero_float(rng, dt, shape)
    if op == "POW":
        return rand_float(rng, dt, shape, 0.1, 4), rand_float(rng, dt, shape, -3, 3)
    a, b = rand_float(rng, dt, shape, -10, 10), rand_float(rng, dt, shape, -10, 10)
    if op in ("MAX", "MIN"):  # some ties
        b = np.where(rng.integers(0, 4, shape) == 0, a, b).astype(a.dtype)
    return a, b


def int_pow(a, b, dt):
    # Modular exponentiation by squaring in uint64 (exponents are >= 0 here).
    base = i64(a).astype(np.uint64)
    e = i64(b).astype(np.uint64)
    res = np.ones_like(base)
    for _ in range(64):
        res = np.where(e & np.uint64(1), res * base, res)
        base = base * base
        e = e >> np.uint64(1)
    return res.astype(NP[dt])


BINARY = {  # op: (dtypes, float64 reference, int reference (wraps), exact?)
    "ADD": (NUMERIC, np.add, np.add, False),
    "SUB": (NUMERIC, np.subtract, np.subtract, False),
    "MUL": (NUMERIC, np.multiply, np.multiply, False),
    "DIV": (NUMERIC, np.divide, trunc_div, False),
    "REM": (NUMERIC, np.fmod, np.fmod, False),
    "POW": (NUMERIC, np.power, None, False),
    "MAX": (NUMERIC, np.maximum, np.maximum, True),
    "MIN": (NUMERIC, np.minimum, np.minimum, True),
    "AND": (INT_OR_PRED, None, np.bitwise_and, True),
    "OR": (INT_OR_PRED, None, np.bitwise_or, True),
    "XOR": (INT_OR_PRED, None, np.bitwise_xor, True),
    "ATAN2": (FLOATS, np.arctan2, None, False),
}


def binary_cases(rng):
    for op, (dts, ffn, ifn, exact) in BINARY.items():
        for dt in dts:
            c = Case("%s/%s" % (op, dt), op, dt)
            shape = (3, 4) if len(dt) % 2 else (2, 3, 4)
            a, b = binary_inputs(rng, op, dt, shape)
            pa, pb = c.param(dt, a), c.param(dt, b)
            rt = at = 0.0
            if dt in FLOATS:
                want = via_f32(dt, ffn(f64(a), f64(b)))
                if not exact:
                    rt, at = tol(TOL_TRANS if op == "POW" else TOL_ARITH, dt)
            elif dt == "pred":
                want = ifn(a, b)
            elif op == "POW":
                want = int_pow(a, b, dt)
            else:
                want = wrap(dt, ifn(iw(dt, a), iw(dt, b)))
            c.out(op, [pa, pb], dt=dt, want=want, rtol=rt, atol=at)
            yield c
    # NaN propagation of MAX and MIN (StableHLO semantics).
    for op, fn in (("MAX", np.maximum), ("MIN", np.minimum)):
        for dt in FLOATS:
            c = Case("%s.nan/%s" % (op, dt), op, dt)
            a, b = rand_float(rng, dt, (3, 4)), rand_float(rng, dt, (3, 4))
            a[0, :2] = np.nan
            b[1, 1:3] = np.nan
            b[0, 0] = np.nan
            pa, pb = c.param(dt, a), c.param(dt, b)
            c.out(op, [pa, pb], dt=dt, want=fn(a, b))
            yield c


# --- compare, select, clamp -------------------------------------------------

COMPARE = {
    "EQ": np.equal,
    "NE": np.not_equal,
    "LT": np.less,
    "LE": np.less_equal,
    "GT": np.greater,
    "GE": np.greater_equal,
}


def compare_cases(rng):
    for d, fn in COMPARE.items():
        for dt in ALL:
            c = Case("COMPARE.%s/%s" % (d, dt), "COMPARE", dt)
            shape = (3, 4)
            a = rand_any(rng, dt, shape)
            b = np.where(rng.integers(0, 3, shape) == 0, a, rand_any(rng, dt, shape)).astype(a.dtype)
            if dt in FLOATS:
                a[2, 3] = np.nan
                b[1, 0] = -0.0
                a[1, 0] = 0.0
            pa, pb = c.param(dt, a), c.param(dt, b)
            c.out("COMPARE", [pa, pb], "compare { direction: %s }" % d, dt="pred", want=fn(a, b))
            yield c


def select_clamp_cases(rng):
    for dt in ALL:
        for scalar in (False, True):
            c = Case("SELECT%s/%s" % (".scalar_pred" if scalar else "", dt), "SELECT", dt)
            shape = (2, 3, 4)
            p = rand_pred(rng, () if scalar else shape)
            a, b = rand_any(rng, dt, shape), rand_any(rng, dt, shape)
            pp, pa, pb = c.param("pred", p), c.param(dt, a), c.param(dt, b)
            c.out("SELECT", [pp, pa, pb], dt=dt, want=np.where(p, a, b))
            yield c
    for dt in NUMERIC:
        for scalar in (False, True):
            c = Case("CLAMP%s/%s" % (".scalar_bounds" if scalar else "", dt), "CLAMP", dt)
            shape = (3, 4)
            bshape = () if scalar else shape
            u, v = rand_any(rng, dt, bshape), rand_any(rng, dt, bshape)
            lo, hi = np.minimum(u, v), np.maximum(u, v)
            if scalar and dt in INTS:
                lo, hi = rand_int(rng, dt, (), 0, 60), rand_int(rng, dt, (), 120, 200)
            elif scalar:
                lo, hi = to_mem(dt, -1.25), to_mem(dt, 1.5)
            x = rand_any(rng, dt, shape)
            pl, px, ph = c.param(dt, lo), c.param(dt, x), c.param(dt, hi)
            c.out("CLAMP", [pl, px, ph], dt=dt, want=np.minimum(np.maximum(x, lo), hi).astype(x.dtype))
            yield c


# --- convert ----------------------------------------------------------------


def convert_source(rng, src, dst, shape):
    if src == "pred":
        return rand_pred(rng, shape)
    if src in INTS:
        x = rand_int(rng, src, shape)
        if src not in UNSIGNED:  # mix in small values
            small = rand_int(rng, src, shape, -300, 300)
            x = np.where(rng.integers(0, 2, shape) == 1, x, small).astype(NP[src])
        x.flat[0] = 0
        return x
    # Float source: stay inside the destination's range when it is an integer.
    if dst in UNSIGNED:
        x = rng.uniform(0, 250, shape)
    elif dst in INTS:  # inside the destination's range (past it saturates: see the saturation cases)
        x = rng.uniform(max(-1000, INT_RANGE[dst][0]), min(1000, INT_RANGE[dst][1]), shape)
    elif dst == "pred":
        x = rng.uniform(-2, 2, shape) * (rng.integers(0, 3, shape) != 0)
    else:
        x = rng.uniform(-1000, 1000, shape) * 10.0 ** rng.integers(-6, 1, shape)
    x = to_mem(src, x)
    if dst in INTS or dst == "pred":
        x.flat[1] = -0.0
    return x


def convert_ref(x, src, dst):
    if dst == "pred":
        return x != 0
    if src == "pred":
        x = x.astype(np.int64)
        src = "s64"
    if src in INTS:
        if dst in INTS:
            return wrap(dst, x)
        return to_mem(dst, np.array([int_to_float_exact(int(v), dst) for v in x.flat]).reshape(x.shape))
    if dst in INTS:
        return wrap(dst, np.trunc(f64(x)))
    return rf(dst, f64(x))


def bitcast_cases(rng):
    """CONVERT with bitcast: the bits read as another dtype of the width,
    against numpy's view; every bit pattern (integers of the full range,
    so floats with NaN payloads, infinities and subnormals), and back."""
    width = {d: np.dtype(NP[d]).itemsize for d in ALL if d not in ("pred", "bf16")}
    for src in width:
        for dst in width:
            if src == dst or width[src] != width[dst]:
                continue
            c = Case("CONVERT.bitcast/%s->%s" % (src, dst), "CONVERT", src)
            bits = rand_int(rng, "u%d" % (8 * width[src]), (3, 4)).view(NP[src])
            p = c.param(src, bits)
            want = bits.view(NP[dst])
            if dst in FLOATS:  # the checker reads floats by value: NaN for NaN whatever its bits
                want = want.copy()
            c.out("CONVERT", [p], "convert { dtype: %s bitcast: true }" % PROTO[dst], dt=dst, want=want)
            yield c


def convert_cases(rng):
    for src in ALL:
        for dst in ALL:
            c = Case("CONVERT/%s->%s" % (src, dst), "CONVERT", src)
            x = convert_source(rng, src, dst, (3, 4))
            p = c.param(src, x)
            c.out("CONVERT", [p], "convert { dtype: %s }" % PROTO[dst], dt=dst, want=convert_ref(x, src, dst))
            yield c
    # Rounding corners: one rounding from the source value, ties to even,
    # subnormals, overflow to infinity, NaN and infinities kept.
    m11, m8 = 2.0**-11, 2.0**-8  # half an ulp at 1.0 in f16 and bf16
    edge = {
        ("f64", "f16"): [
            1 + m11 + 2.0**-40,
            1 + m11,
            1 + 3 * m11,
            -(1 + m11 + 2.0**-40),
            65519.99,
            65520.0,
            2.0**-24 * 0.5000001,
            2.0**-25,
            3 * 2.0**-25,
            1e-30,
            np.inf,
            np.nan,
        ],
        ("f64", "bf16"): [
            1 + m8 + 2.0**-40,
            1 + m8,
            1 + 3 * m8,
            -(1 + m8 + 2.0**-40),
            3.0e38,
            3.4e38,
            2.0**-133 * 0.75,
            2.0**-134,
            1e-45,
            0.1,
            -np.inf,
            np.nan,
        ],
        ("f64", "f32"): [
            1 + 2.0**-24 + 2.0**-50,
            1 + 2.0**-24,
            1 + 3 * 2.0**-24,
            3.5e38,
            2.0**-149 * 0.75,
            2.0**-150,
            1e-46,
            0.1,
            -0.1,
            1e300,
            np.inf,
            np.nan,
        ],
        ("f32", "f16"): [
            1 + m11,
            1 + 3 * m11,
            1 + m11 + 2.0**-20,
            65504.0,
            65519.0,
            65520.0,
            2.0**-25,
            3 * 2.0**-25,
            2.0**-24 * 1.5,
            6.1e-5,
            -np.inf,
            np.nan,
        ],
        ("f32", "bf16"): [
            1 + m8,
            1 + 3 * m8,
            1 + m8 + 2.0**-20,
            3.3895e38,
            3.4e38,
            1e-39,
            2.0**-133,
            2.0**-134 * 3,
            0.1,
            -1e-3,
            np.inf,
            np.nan,
        ],
        ("f16", "bf16"): [
            1 + 2.0**-10 + 2.0**-9,
            1 + 2.0**-8,
            1 + 3 * 2.0**-9,
            65504.0,
            2.0**-24,
            6.0e-5,
            -0.1,
            1000.5,
            3.0,
            -(2.0**-14),
            np.inf,
            np.nan,
        ],
        ("bf16", "f16"): [
            1e5,
            65536.0,
            2.0**-26,
            2.0**-25 * 3,
            0.1,
            1.0 + 2.0**-7,
            300.0,
            -7e-8,
            1e-8,
            65280.0,
            -np.inf,
            np.nan,
        ],
    }
    for (src, dst), vals in edge.items():
        c = Case("CONVERT.rounding/%s->%s" % (src, dst), "CONVERT", src)
        x = to_mem(src, np.array(vals, np.float64).reshape(3, 4))
        p = c.param(src, x)
        c.out("CONVERT", [p], "convert { dtype: %s }" % PROTO[dst], dt=dst, want=rf(dst, f64(x)))
        yield c
    big = [
        2**30 + 2**22 + 1,
        2**30 + 2**22,
        2**30 + 3 * 2**22,
        -(2**30 + 2**22 + 1),
        2**24 + 1,
        2**24 + 3,
        2**31 - 1,
        -(2**31),
        65519,
        65520,
        257,
        -(2**24 + 1),
    ]
    huge = big + [2**62 + 2**54 + 1]
    for src, dst, vals in (
        ("s32", "bf16", big),
        ("s32", "f16", big),
        ("s32", "f32", big),
        ("s64", "bf16", huge[:12]),
        ("s64", "f32", [2**62 + 2**38 + 1, 2**53 + 1, 2**60 + 2**36, 2**60 + 3 * 2**36] + big[:8]),
        ("s64", "f64", [2**53 + 1, 2**53 + 3, 2**62 + 2**9 + 1, -(2**53 + 1), 2**63 - 1, -(2**63)] + big[:6]),
    ):
        c = Case("CONVERT.rounding/%s->%s" % (src, dst), "CONVERT", src)
        x = np.array(vals[:12], dtype=np.int64).astype(NP[src]).reshape(3, 4)
        p = c.param(src, x)
        c.out("CONVERT", [p], "convert { dtype: %s }" % PROTO[dst], dt=dst, want=convert_ref(x, src, dst))
        yield c
    # uint64 past 2^63 rounds once to a float: 2^63 + 2^55 is a bf16 tie (to even), one more rounds up.
    top = 2**63
    wide = [
        top + 2**55,
        top + 2**55 + 1,
        2**64 - 1,
        top,
        top + 2**40 + 1,
        2**53 + 1,
        2**24 + 1,
        65520,
        65519,
        0,
        1,
        top + 2**39 + 2**11,
    ]
    for src, dst, vals in (
        ("u64", "bf16", wide),
        ("u64", "f16", wide),
        ("u64", "f32", wide),
        ("u64", "f64", wide),
        (
            "u32",
            "f16",
            [2**32 - 1, 65520, 65519, 2049, 2051, 2**31 + 2**20, 7, 0, 1, 2**24 + 1, 2**31 - 1, 3 * 2**20 + 1],
        ),
    ):
        c = Case("CONVERT.rounding/%s->%s" % (src, dst), "CONVERT", src)
        x = np.array(vals, dtype=np.uint64).astype(NP[src]).reshape(3, 4)
        p = c.param(src, x)
        c.out("CONVERT", [p], "convert { dtype: %s }" % PROTO[dst], dt=dst, want=convert_ref(x, src, dst))
        yield c
    # A float past an integer type's range saturates; NaN is 0 (XLA's conversion).
    for dst in ("s8", "s16", "u16", "u32", "u64"):
        lo, hi = INT_RANGE[dst]
        vals = [
            1e30,
            -1e30,
            np.inf,
            -np.inf,
            np.nan,
            -0.75,
            0.75,
            float(lo) - 1.5,
            float(hi) + 1.5,
            float(hi) * 2,
            -3.5,
            2.0**63 + 2.0**40,
        ]
        want = [0 if v != v else max(lo, min(hi, int(v) if abs(v) < 1e300 else (hi if v > 0 else lo))) for v in vals]
        c = Case("CONVERT.saturation/f64->%s" % dst, "CONVERT", "f64")
        p = c.param("f64", np.array(vals, np.float64).reshape(3, 4))
        c.out(
            "CONVERT",
            [p],
            "convert { dtype: %s }" % PROTO[dst],
            dt=dst,
            want=np.array(want, dtype=object).astype(NP[dst]).reshape(3, 4),
        )
        yield c


# --- layout ops -------------------------------------------------------------


def pad_ref(x, pv, low, high, interior):
    # Interior padding, then edge padding (negative = crop).
    core = [d + (d - 1) * i if d > 0 else 0 for d, i in zip(x.shape, interior)]
    y = np.full(core, pv, dtype=x.dtype)
    y[tuple(slice(None, None, i + 1) for i in interior)] = x
    for ax, (lo, hi) in enumerate(zip(low, high)):

        def block(n):
            s = list(y.shape)
            s[ax] = n
            return np.full(s, pv, dtype=x.dtype)

        if lo > 0:
            y = np.concatenate([block(lo), y], axis=ax)
        elif lo < 0:
            y = np.take(y, range(-lo, y.shape[ax]), axis=ax)
        if hi > 0:
            y = np.concatenate([y, block(hi)], axis=ax)
        elif hi < 0:
            y = np.take(y, range(0, y.shape[ax] + hi), axis=ax)
    return y


def layout_cases(rng):
    for dt in ALL:
        # BROADCAST_IN_DIM: operand dims -> result dims, with size-1 expansion and a scalar.
        for tag, shape, dims, bd in (
            ("rank2to3", (3, 4), (2, 3, 4), (1, 2)),
            ("middle", (2, 4), (2, 3, 4), (0, 2)),
            ("size1", (3, 1), (3, 4), (0, 1)),
            ("transposing", (4, 3), (3, 2, 4), (2, 0)),
            ("one_elem", (1, 1), (3, 4), (0, 1)),
            ("rank1_one", (1,), (2, 3), (1,)),
            ("scalar", (), (2, 3), ()),
        ):
            c = Case("BROADCAST_IN_DIM.%s/%s" % (tag, dt), "BROADCAST_IN_DIM", dt)
            x = rand_any(rng, dt, shape)
            p = c.param(dt, x)
            # numpy: move operand dims to their result positions, then broadcast.
            order = np.argsort(bd)
            xv = np.transpose(x, order) if len(bd) else x
            sorted_bd = [bd[i] for i in order]
            view_shape = [1] * len(dims)
            for k, d in enumerate(sorted_bd):
                view_shape[d] = xv.shape[k]
            want = np.broadcast_to(xv.reshape(view_shape), dims)
            c.out(
                "BROADCAST_IN_DIM",
                [p],
                "broadcast_in_dim { %s %s }" % (ints_text("dims", dims), ints_text("broadcast_dimensions", bd)),
                dt=dt,
                want=want,
            )
            yield c
        for tag, shape, dims in (
            ("3to2", (2, 3, 4), (4, 6)),
            ("flatten", (3, 4), (12,)),
            ("to_scalar", (1, 1), ()),
            ("split", (12,), (2, 1, 6)),
        ):
            c = Case("RESHAPE.%s/%s" % (tag, dt), "RESHAPE", dt)
            x = rand_any(rng, dt, shape)
            p = c.param(dt, x)
            c.out("RESHAPE", [p], "reshape { %s }" % ints_text("dims", dims), dt=dt, want=x.reshape(dims))
            yield c
        for tag, shape, perm in (("2d", (3, 5), (1, 0)), ("3d", (2, 3, 4), (2, 0, 1)), ("3d_b", (2, 3, 4), (1, 2, 0))):
            c = Case("TRANSPOSE.%s/%s" % (tag, dt), "TRANSPOSE", dt)
            x = rand_any(rng, dt, shape)
            p = c.param(dt, x)
            c.out(
                "TRANSPOSE", [p], "transpose { %s }" % ints_text("permutation", perm), dt=dt, want=np.transpose(x, perm)
            )
            yield c
        for tag, shape, start, limit, strides in (
            ("strided", (2, 3, 4), (0, 1, 0), (2, 3, 4), (1, 1, 3)),
            ("2d", (5, 7), (1, 2), (5, 7), (2, 3)),
            ("nostride", (4, 6), (1, 0), (3, 5), None),
        ):
            c = Case("SLICE.%s/%s" % (tag, dt), "SLICE", dt)
            x = rand_any(rng, dt, shape)
            p = c.param(dt, x)
            attrs = "%s %s" % (ints_text("start", start), ints_text("limit", limit))
            if strides:
                attrs += " " + ints_text("strides", strides)
            idx = tuple(slice(s, l, (strides or [1] * len(shape))[i]) for i, (s, l) in enumerate(zip(start, limit)))
            c.out("SLICE", [p], "slice { %s }" % attrs, dt=dt, want=x[idx])
            yield c
        for tag, shape, dims in (
            ("one", (5, 3), (0,)),
            ("both", (4, 6), (1, 0)),
            ("3d_outer", (2, 3, 4), (0, 2)),
            ("none", (3, 2), ()),
            ("unit", (1, 4), (0,)),
        ):
            c = Case("REVERSE.%s/%s" % (tag, dt), "REVERSE", dt)
            x = rand_any(rng, dt, shape)
            c.out(
                "REVERSE",
                [c.param(dt, x)],
                "reverse { %s }" % ints_text("dimensions", dims),
                dt=dt,
                want=np.flip(x, dims) if dims else x,
            )
            yield c
        for tag, shape, dim, desc in (
            ("rows", (4, 7), 1, False),
            ("cols_desc", (6, 3), 0, True),
            ("3d_mid", (2, 5, 3), 1, False),
        ):
            c = Case("SORT.%s/%s" % (tag, dt), "SORT", dt)
            x = rand_any(rng, dt, shape)
            if x.dtype.kind == "f" and x.size > 3:
                x.flat[1], x.flat[2] = np.nan, -np.inf
            idx = np.argsort(x, axis=dim, kind="stable")
            if desc:  # largest first, NaN first, equal keys in their order: NaN-ness, then -x (stable)
                wide = x.astype(np.float64)
                nan = np.isnan(wide)
                rank = np.argsort(np.argsort(-np.where(nan, 0, wide), axis=dim, kind="stable"), axis=dim, kind="stable")
                idx = np.argsort(np.where(nan, -1, rank), axis=dim, kind="stable")
            pk = c.param(dt, x)
            attrs = "sort { dimension: %d descending: %s result_operand: %%d }" % (dim, "true" if desc else "false")
            pos = np.broadcast_to(
                np.arange(shape[dim]).reshape([-1 if d == dim else 1 for d in range(len(shape))]), shape
            ).astype(np.int32)
            c.out("SORT", [pk], attrs % 0, dt=dt, want=np.take_along_axis(x, idx, axis=dim))
            yield c
            c = Case("SORT.%s.indices/%s" % (tag, dt), "SORT", dt)
            c.out(
                "SORT",
                [c.param(dt, x), c.param("s32", pos)],
                attrs % 1,
                dt="s32",
                want=np.take_along_axis(pos, idx, axis=dim),
            )
            yield c
        for tag, shape, axis, idx in (
            ("rows", (5, 3), 0, [[4, 0], [2, 2], [-1, 9]]),
            ("mid", (2, 6, 3), 1, [5, 0, 3, 3, 1]),
            ("last", (3, 4), 1, []),
        ):
            idx = np.asarray(idx, dtype=np.int64).reshape(-1, 2) if tag == "rows" else np.asarray(idx, dtype=np.int64)
            x = rand_any(rng, dt, shape)
            n = shape[axis]
            # Out of range clamps, as XLA's gather; -1 as u64 is 2^64 - 1, past the end.
            for it in ("s32", "s64", "s8", "u64"):
                ix = idx.astype(NP[it])
                c = Case("GATHER.%s.%s/%s" % (tag, it, dt), "GATHER", dt)
                c.out(
                    "GATHER",
                    [c.param(dt, x), c.param(it, ix)],
                    "gather { axis: %d }" % axis,
                    dt=dt,
                    want=np.take(x, np.clip(ix, 0, n - 1), axis=axis),
                )
                yield c
            upd_shape = shape[:axis] + idx.shape + shape[axis + 1 :]
            upd = rand_any(rng, dt, upd_shape)
            kinds = [("replace", ""), ("max", "REDUCE_MAX"), ("min", "REDUCE_MIN")]
            if dt not in ("pred", "bf16"):  # bf16 rounds after each combine: numpy's add.at does not
                kinds += [("sum", "SUM"), ("prod", "PROD")]
            for kind, combine in kinds:
                # A naive loop over the indices in row-major order: repeated
                # indices all apply (replace: the last stays), out of range dropped.
                want = x.copy()
                moved = np.moveaxis(want, axis, 0)
                u = np.moveaxis(upd.reshape(shape[:axis] + (idx.size,) + shape[axis + 1 :]), axis, 0)
                for j, i in enumerate(idx.ravel()):
                    if not 0 <= i < n:
                        continue
                    if kind == "replace":
                        moved[i] = u[j]
                    elif kind == "sum":
                        moved[i] = moved[i] + u[j]
                    elif kind == "prod":
                        moved[i] = moved[i] * u[j]
                    else:
                        moved[i] = (np.maximum if kind == "max" else np.minimum)(moved[i], u[j])
                c = Case("SCATTER.%s.%s/%s" % (tag, kind, dt), "SCATTER", dt)
                attrs = "scatter { axis: %d %s }" % (axis, "combine: %s" % combine if combine else "")
                c.out(
                    "SCATTER",
                    [c.param(dt, x), c.param("s32", idx.astype(np.int32)), c.param(dt, upd)],
                    attrs,
                    dt=dt,
                    want=want,
                )
                yield c
        for tag, shapes, dim in (
            ("2ops_dim0", [(2, 3), (3, 3)], 0),
            ("3ops_dim1", [(2, 3, 4), (2, 1, 4), (2, 2, 4)], 1),
            ("3ops_last", [(3, 2), (3, 1), (3, 4)], 1),
        ):
            c = Case("CONCATENATE.%s/%s" % (tag, dt), "CONCATENATE", dt)
            xs = [rand_any(rng, dt, s) for s in shapes]
            ps = [c.param(dt, x) for x in xs]
            c.out("CONCATENATE", ps, "concatenate { dimension: %d }" % dim, dt=dt, want=np.concatenate(xs, axis=dim))
            yield c
        for tag, shape, low, high, interior in (
            ("lo_hi_interior", (3, 4), (1, -1), (0, 2), (1, 0)),
            ("neg_high", (3, 4), (0, 2), (-1, 1), (0, 2)),
            ("3d", (2, 3, 2), (1, 0, -1), (1, -2, 0), (0, 1, 1)),
        ):
            c = Case("PAD.%s/%s" % (tag, dt), "PAD", dt)
            x = rand_any(rng, dt, shape)
            pv = rand_any(rng, dt, ())
            px, ppv = c.param(dt, x), c.param(dt, pv)
            c.out(
                "PAD",
                [px, ppv],
                "pad { %s %s %s }" % (ints_text("low", low), ints_text("high", high), ints_text("interior", interior)),
                dt=dt,
                want=pad_ref(x, pv, low, high, interior),
            )
            yield c


# --- dot_general ------------------------------------------------------------

DOTS = [  # tag, lhs shape, rhs shape, attrs, einsum
    ("matmul", (3, 4), (4, 5), dict(lc=[1], rc=[0]), "mk,kn->mn"),
    ("batch", (2, 3, 4), (2, 4, 5), dict(lb=[0], rb=[0], lc=[2], rc=[1]), "bmk,bkn->bmn"),
    ("lhs_km", (4, 3), (4, 5), dict(lc=[0], rc=[0]), "km,kn->mn"),
    ("rhs_nk", (3, 4), (5, 4), dict(lc=[1], rc=[1]), "mk,nk->mn"),
    ("batch_mid", (4, 2, 3), (2, 5, 4), dict(lb=[1], rb=[0], lc=[0], rc=[2]), "kbm,bnk->bmn"),
    ("two_contracting", (3, 2, 4), (2, 4, 5), dict(lc=[1, 2], rc=[0, 1]), "mij,ijn->mn"),
    ("vector", (6,), (6,), dict(lc=[0], rc=[0]), "k,k->"),
    ("two_batch", (2, 3, 4, 5), (2, 3, 5, 2), dict(lb=[0, 1], rb=[0, 1], lc=[3], rc=[2]), "abmk,abkn->abmn"),
    ("batch_perm", (2, 3, 4, 5), (3, 2, 5, 2), dict(lb=[0, 1], rb=[1, 0], lc=[3], rc=[2]), "abmk,bakn->abmn"),
    ("multi_free", (2, 3, 4), (4, 5, 2), dict(lc=[2], rc=[0]), "xyk,kuv->xyuv"),
    ("contracting_perm", (3, 2, 4), (4, 2, 5), dict(lc=[1, 2], rc=[1, 0]), "mij,jin->mn"),
    ("batch_trans", (2, 4, 3), (2, 5, 4), dict(lb=[0], rb=[0], lc=[1], rc=[2]), "bkm,bnk->bmn"),
]


def dot_attrs(d):
    parts = []
    for key, field in (("lb", "lhs_batch"), ("rb", "rhs_batch"), ("lc", "lhs_contracting"), ("rc", "rhs_contracting")):
        for v in d.get(key, []):
            parts.append("%s: %d" % (field, v))
    return "dot_general { %s }" % " ".join(parts)


def dot_cases(rng):
    for tag, ls, rs, attrs, spec in DOTS:
        for dt in NUMERIC:
            c = Case("DOT_GENERAL.%s/%s" % (tag, dt), "DOT_GENERAL", dt)
            if dt in INTS:
                lo, hi = (0, 40) if dt in UNSIGNED else (-100, 100) if dt == "s8" else (-1000, 1000)
                a, b = rand_int(rng, dt, ls, lo, hi), rand_int(rng, dt, rs, lo, hi)
                want = wrap(dt, np.einsum(spec, i64(a), i64(b)))
                rt = at = 0.0
            else:
                a, b = rand_float(rng, dt, ls, -2, 2), rand_float(rng, dt, rs, -2, 2)
                want = rf(dt, np.einsum(spec, f64(a), f64(b)))
                rt, at = tol(TOL_ACCUM, dt)
                at = at * np.einsum(spec, np.abs(f64(a)), np.abs(f64(b)))
            pa, pb = c.param(dt, a), c.param(dt, b)
            c.out("DOT_GENERAL", [pa, pb], dot_attrs(attrs), dt=dt, want=want, rtol=rt, atol=at)
            yield c


# --- convolution ----------------------------------------------------------

CONVS = [  # tag, lhs shape, rhs shape, (lhs, rhs, out) specs, window, groups (feature, batch)
    ("nchw", (2, 3, 5, 4), (4, 3, 3, 2), ((0, 1, 2, 3),) * 3, dict(), (1, 1)),
    (
        "nhwc_strided_padded",
        (2, 6, 5, 3),
        (3, 2, 3, 4),
        ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)),
        dict(window_strides=[2, 1], padding_low=[1, 0], padding_high=[1, 1]),
        (1, 1),
    ),
    (
        "dilated_negative_pad",
        (1, 2, 6, 6),
        (2, 2, 2, 2),
        ((0, 1, 2, 3),) * 3,
        dict(padding_low=[-1, 2], padding_high=[0, 1], lhs_dilation=[2, 1], rhs_dilation=[1, 2]),
        (1, 1),
    ),
    ("grouped", (2, 4, 4, 4), (6, 2, 2, 2), ((0, 1, 2, 3),) * 3, dict(), (2, 1)),
    ("batch_grouped", (4, 3, 4, 4), (6, 3, 2, 2), ((0, 1, 2, 3), (0, 1, 2, 3), (1, 0, 3, 2)), dict(), (1, 2)),
    ("1d", (3, 9, 2), (3, 2, 4), ((0, 2, 1), (2, 1, 0), (0, 2, 1)), dict(window_strides=[2]), (1, 1)),
]


def conv_reference(a, b, specs, window, groups):
    """StableHLO's convolution in numpy: lhs dilated and padded, then one
    einsum per window position, per group; exact in int64 and float64."""
    (ls, rs, os_), (g, bg) = specs, groups
    x, k = np.transpose(a, ls), np.transpose(b, rs)  # N C S..., O I S...
    ns = x.ndim - 2
    st = window.get("window_strides", [1] * ns)
    lo, hi = window.get("padding_low", [0] * ns), window.get("padding_high", [0] * ns)
    ld, rd = window.get("lhs_dilation", [1] * ns), window.get("rhs_dilation", [1] * ns)
    dil = np.zeros(x.shape[:2] + tuple((m - 1) * d + 1 for m, d in zip(x.shape[2:], ld)), x.dtype)
    dil[(slice(None),) * 2 + tuple(slice(None, None, d) for d in ld)] = x
    pad = np.zeros(
        dil.shape[:2] + tuple(m + max(l_, 0) + max(h, 0) for m, l_, h in zip(dil.shape[2:], lo, hi)), x.dtype
    )
    pad[(slice(None),) * 2 + tuple(slice(max(l_, 0), max(l_, 0) + m) for l_, m in zip(lo, dil.shape[2:]))] = dil
    pad = pad[(slice(None),) * 2 + tuple(slice(max(-l_, 0), m - max(-h, 0)) for l_, h, m in zip(lo, hi, pad.shape[2:]))]
    win = k.shape[2:]
    out_sp = [(m - ((w - 1) * d + 1)) // s + 1 for m, w, d, s in zip(pad.shape[2:], win, rd, st)]
    n, o = x.shape[0] // bg, k.shape[0]
    out = np.zeros((n, o) + tuple(out_sp), x.dtype)
    for pos in np.ndindex(*win):
        sl = tuple(slice(p * d, p * d + (m - 1) * s + 1, s) for p, d, s, m in zip(pos, rd, st, out_sp))
        patch = pad[(slice(None),) * 2 + sl]
        kern = k[(slice(None),) * 2 + pos]  # O I
        for j in range(g * bg):
            ob = slice(j * o // (g * bg), (j + 1) * o // (g * bg))
            nb = slice(j * n, (j + 1) * n) if bg > 1 else slice(None)
            cb = slice(j * k.shape[1], (j + 1) * k.shape[1]) if g > 1 else slice(None)
            out[:, ob] += np.einsum("nc...,oc->no...", patch[nb, cb], kern[ob])
    return np.transpose(out, np.argsort(os_))


def conv_attrs(specs, window, groups):
    (ls, rs, os_), (g, bg) = specs, groups
    parts = [
        "input_batch_dimension: %d input_feature_dimension: %d" % ls[:2],
        "kernel_output_feature_dimension: %d kernel_input_feature_dimension: %d" % rs[:2],
        "output_batch_dimension: %d output_feature_dimension: %d" % os_[:2],
    ]
    for field, spec in (("input", ls), ("kernel", rs), ("output", os_)):
        parts += ["%s_spatial_dimensions: %d" % (field, d) for d in spec[2:]]
    for field, vals in window.items():
        parts += ["%s: %d" % (field, v) for v in vals]
    parts.append("feature_group_count: %d batch_group_count: %d" % (g, bg))
    return "convolution { %s }" % " ".join(parts)


def conv_cases(rng):
    for tag, ls, rs, specs, window, groups in CONVS:
        for dt in NUMERIC:
            c = Case("CONVOLUTION.%s/%s" % (tag, dt), "CONVOLUTION", dt)
            if dt in INTS:
                lo, hi = (0, 20) if dt in UNSIGNED else (-30, 30)
                a, b = rand_int(rng, dt, ls, lo, hi), rand_int(rng, dt, rs, lo, hi)
                want = wrap(dt, conv_reference(i64(a), i64(b), specs, window, groups))
                rt = at = 0.0
            else:
                a, b = rand_float(rng, dt, ls, -2, 2), rand_float(rng, dt, rs, -2, 2)
                want = rf(dt, conv_reference(f64(a), f64(b), specs, window, groups))
                rt, at = tol(TOL_ACCUM, dt)
                at = at * conv_reference(np.abs(f64(a)), np.abs(f64(b)), specs, window, groups)
            c.out(
                "CONVOLUTION",
                [c.param(dt, a), c.param(dt, b)],
                conv_attrs(specs, window, groups),
                dt=dt,
                want=want,
                rtol=rt,
                atol=at,
            )
            yield c


# --- reduce, argmax, argmin -------------------------------------------------

REDUCE_DIMS = [(0,), (1,), (2,), (0, 2), (2, 0), (0, 1, 2)]
REDUCE_KINDS = {"SUM": np.sum, "PROD": np.prod, "REDUCE_MAX": np.max, "REDUCE_MIN": np.min}


def reduce_input(rng, kind, dt, shape):
    if kind == "PROD":
        if dt in INTS:
            vals = np.array([1, 2, 3] if dt in UNSIGNED else [-2, -1, 1, 2, 3])
            return vals[rng.integers(0, len(vals), shape)].astype(NP[dt])
        return to_mem(dt, rng.uniform(0.8, 1.25, shape) * np.where(rng.integers(0, 5, shape) == 0, -1, 1))
    if dt in INTS:
        return rand_int(rng, dt, shape)  # full range: sums wrap
    return rand_float(rng, dt, shape, -4, 4)


def reduce_cases(rng):
    shape = (2, 3, 4)
    for kind, fn in REDUCE_KINDS.items():
        for dims in REDUCE_DIMS:
            for dt in NUMERIC:
                c = Case("REDUCE.%s.d%s/%s" % (kind, "".join(map(str, dims)), dt), "REDUCE", dt)
                x = reduce_input(rng, kind, dt, shape)
                p = c.param(dt, x)
                rt = at = 0.0
                if dt in INTS:
                    want = wrap(dt, fn(iw(dt, x), axis=dims))
                elif kind in ("REDUCE_MAX", "REDUCE_MIN"):
                    want = fn(x, axis=dims)
                else:
                    want = rf(dt, fn(f64(x), axis=dims))
                    rt, at = tol(TOL_ACCUM, dt)
                    if kind == "SUM":
                        at = at * np.sum(np.abs(f64(x)), axis=dims)
                    else:
                        at = at * np.abs(f64(want))
                c.out(
                    "REDUCE",
                    [p],
                    "reduce { kind: %s %s }" % (kind, " ".join("dims: %d" % d for d in dims)),
                    dt=dt,
                    want=want,
                    rtol=rt,
                    atol=at,
                )
                yield c
    for kind, fn in (("REDUCE_MAX", np.max), ("REDUCE_MIN", np.min)):
        for dt in FLOATS:
            c = Case("REDUCE.%s.nan/%s" % (kind, dt), "REDUCE", dt)
            x = rand_float(rng, dt, (3, 4))
            x[1, 2] = np.nan
            x[2, 0] = np.nan
            p = c.param(dt, x)
            c.out("REDUCE", [p], "reduce { kind: %s dims: 1 }" % kind, dt=dt, want=fn(x, axis=1))
            yield c


def arg_cases(rng):
    shape = (3, 4, 5)
    for op, fn in (("ARGMAX", np.argmax), ("ARGMIN", np.argmin)):
        for dim, idt in ((0, "S32"), (1, "S64"), (2, None), (2, "S64")):
            for dt in NUMERIC:
                name = "%s.d%d.%s/%s" % (op, dim, (idt or "default").lower(), dt)
                c = Case(name, op, dt)
                # Few distinct values: ties, where the first index must win.
                x = rand_small(rng, dt, shape, -3, 3)
                if dt in FLOATS:
                    x = to_mem(dt, np.round(f64(x) * 2) / 2)
                p = c.param(dt, x)
                attrs = "arg_reduce { dimension: %d%s }" % (dim, (" index_dtype: %s" % idt) if idt else "")
                odt = (idt or "S32").lower()
                c.out(op, [p], attrs, dt=odt, want=fn(x, axis=dim).astype(NP[odt]))
                yield c
        for dt in FLOATS:
            c = Case("%s.nan/%s" % (op, dt), op, dt)
            x = rand_float(rng, dt, (3, 5))
            x[0, 3] = np.nan
            x[1, 0] = np.nan
            x[1, 4] = np.nan
            p = c.param(dt, x)
            c.out(
                op, [p], "arg_reduce { dimension: 1 index_dtype: S64 }", dt="s64", want=fn(x, axis=1).astype(np.int64)
            )  # numpy: the first NaN wins, as in Tessel
            yield c


# --- constants --------------------------------------------------------------


def fmt_double(v):
    return repr(float(v))  # shortest text that parses back to the same double


def constant_cases(rng):
    for dt in ALL:
        shape = (2, 3)
        if dt in FLOATS:
            vals = to_mem(dt, rng.uniform(-100, 100, shape))
            body = "literal { f: [%s] }" % ", ".join(fmt_double(v) for v in f64(vals).flat)
            want = vals
        elif dt in INTS:
            vals = rand_int(rng, dt, shape)
            bits = vals.view(np.int64) if dt == "u64" else vals  # i is int64: a u64 travels as its bits
            body = "literal { i: [%s] }" % ", ".join(str(int(v)) for v in bits.flat)
            want = vals
        else:
            vals = rand_pred(rng, shape)
            body = "literal { i: [%s] }" % ", ".join(str(int(v)) for v in vals.flat)
            want = vals
        c = Case("CONSTANT.literal/%s" % dt, "CONSTANT", dt)
        c.out("CONSTANT", (), "constant { %s } %s" % (body, type_text(dt, shape)), dt=dt, want=want)
        yield c
        # Literal of a scalar.
        c = Case("CONSTANT.literal_scalar/%s" % dt, "CONSTANT", dt)
        if dt in FLOATS:
            c.out(
                "CONSTANT", (), "constant { literal { f: -2.5 } } %s" % type_text(dt, ()), dt=dt, want=to_mem(dt, -2.5)
            )
        else:
            v = 1 if dt == "pred" else 7
            c.out(
                "CONSTANT",
                (),
                "constant { literal { i: %d } } %s" % (v, type_text(dt, ())),
                dt=dt,
                want=to_mem(dt, np.array(v)),
            )
        yield c
        # Fill with f and with i.
        for kind in ("f", "i"):
            c = Case("CONSTANT.fill_%s/%s" % (kind, dt), "CONSTANT", dt)
            if kind == "f":
                v = {
                    "pred": 1.0,
                    "u8": 200.0,
                    "s32": -123456.0,
                    "s64": -(2.0**40),
                    "s8": -100.0,
                    "s16": -30000.0,
                    "u16": 60000.0,
                    "u32": 4.0e9,
                    "u64": 2.0**63 + 2.0**40,
                }.get(dt, -3.375)
                text = "fill { f: %s }" % fmt_double(v)
                want = np.full((3, 4), v) if dt in FLOATS else np.full((3, 4), v).astype(iw(dt, 0).dtype)
            else:
                v = {
                    "pred": 1,
                    "u8": 17,
                    "s32": -7,
                    "s64": 2**40 + 1,
                    "s8": -7,
                    "s16": -300,
                    "u16": 65000,
                    "u32": 4000000000,
                    "u64": -1,
                }.get(dt, 1000)  # u64: the bits of 2^64 - 1
                text = "fill { i: %d }" % v
                want = np.full((3, 4), v)
            if dt == "pred":
                want = np.full((3, 4), True)
            c.out("CONSTANT", (), "constant { %s } %s" % (text, type_text(dt, (3, 4))), dt=dt, want=to_mem(dt, want))
            yield c
        if dt != "pred":  # iota admits numeric dtypes
            for dim, ishape in ((1, (2, 4)), (0, (3, 2, 2))):
                c = Case("CONSTANT.iota_d%d/%s" % (dim, dt), "CONSTANT", dt)
                idx = np.indices(ishape)[dim]
                c.out(
                    "CONSTANT",
                    (),
                    "constant { iota { dimension: %d } } %s" % (dim, type_text(dt, ishape)),
                    dt=dt,
                    want=to_mem(dt, idx),
                )
                yield c
    # Literal values given as f (double) round once to f16 / bf16.
    for dt, vals in (
        ("f16", [1 + 2.0**-11 + 2.0**-40, 1 + 2.0**-11, 0.1, 65519.99]),
        ("bf16", [1 + 2.0**-8 + 2.0**-40, 1 + 2.0**-8, 0.1, 3.0e38]),
    ):
        c = Case("CONSTANT.literal_rounding/%s" % dt, "CONSTANT", dt)
        c.out(
            "CONSTANT",
            (),
            "constant { literal { f: [%s] } } %s" % (", ".join(fmt_double(v) for v in vals), type_text(dt, (4,))),
            dt=dt,
            want=rf(dt, np.array(vals)),
        )
        yield c
        c = Case("CONSTANT.fill_rounding/%s" % dt, "CONSTANT", dt)
        c.out(
            "CONSTANT",
            (),
            "constant { fill { f: %s } } %s" % (fmt_double(vals[0]), type_text(dt, (2,))),
            dt=dt,
            want=rf(dt, np.full((2,), vals[0])),
        )
        yield c


# --- fusion -----------------------------------------------------------------


def fused_cases(rng):
    # max(tanh(a*b + c), 0) * 2: mul, add, tanh, a scalar constant broadcast,
    # max and a scalar fill, over several 2048-element blocks.
    n = 5000
    for dt in FLOATS:
        c = Case("FUSED.tanh_chain/%s" % dt, "FUSED", dt)
        a, b, d = (rand_float(rng, dt, (n,), -2, 2) for _ in range(3))
        pa, pb, pd = c.param(dt, a), c.param(dt, b), c.param(dt, d)
        c.node("m", "MUL", [pa, pb])
        c.node("s", "ADD", ["m", pd])
        c.node("t", "TANH", ["s"])
        c.node("zero", "CONSTANT", (), "constant { fill { f: 0 } } %s" % type_text(dt, ()))
        c.node("zeros", "BROADCAST_IN_DIM", ["zero"], "broadcast_in_dim { dims: [%d] }" % n)
        c.node("r", "MAX", ["t", "zeros"])
        c.node("two", "CONSTANT", (), "constant { fill { f: 2 } } %s" % type_text(dt, (n,)))
        c.out("MUL", ["r", "two"])
        step = lambda v: via_f32(dt, v)  # noqa: E731  (each op rounds to dt)
        m = step(f64(a) * f64(b))
        s = step(f64(m) + f64(d))
        t = step(np.tanh(f64(s)))
        r = np.maximum(t, 0)
        c.expect(dt, step(f64(r) * 2), *tol(TOL_TRANS, dt))
        yield c
    # compare/select/convert/iota/clamp with scalar-literal bounds in one fusion.
    for dt in ("f32", "bf16"):
        c = Case("FUSED.select_clamp_iota/%s" % dt, "FUSED", dt)
        shape = (40, 64)
        x = rand_float(rng, dt, shape, -80, 80)
        px = c.param(dt, x)
        c.node("xi", "CONVERT", [px], "convert { dtype: S32 }")
        c.node("io", "CONSTANT", (), "constant { iota { dimension: 1 } } %s" % type_text("s32", shape))
        c.node("io2", "SUB", ["io", "io"])
        c.node("io3", "ADD", ["io", "io2"])
        c.node("gt", "COMPARE", ["xi", "io3"], "compare { direction: GT }")
        c.node("nx", "NEG", [px])
        c.node("sel", "SELECT", ["gt", px, "nx"])
        c.node("lo", "CONSTANT", (), "constant { literal { f: -20.5 } } %s" % type_text(dt, ()))
        c.node("hi", "CONSTANT", (), "constant { fill { f: 30.25 } } %s" % type_text(dt, ()))
        c.out("CLAMP", ["lo", "sel", "hi"])
        io = np.indices(shape)[1]
        sel = np.where(np.trunc(f64(x)) > io, f64(x), -f64(x))
        c.expect(dt, to_mem(dt, np.clip(sel, -20.5, 30.25)))
        yield c
    # An intermediate read by a non-elementwise node, then broadcast back in.
    for dt in ("f32", "f64"):
        c = Case("FUSED.reduce_broadcast/%s" % dt, "FUSED", dt)
        shape = (6, 300)
        x = rand_float(rng, dt, shape, -1, 1)
        px = c.param(dt, x)
        c.node("e", "EXP", [px])
        c.node("s", "REDUCE", ["e"], "reduce { kind: SUM dims: 0 dims: 1 }")
        c.node("sb", "BROADCAST_IN_DIM", ["s"], "broadcast_in_dim { dims: [6, 300] }")
        c.node("q", "DIV", ["e", "sb"])
        c.out("SUB", ["q", "e"])
        e = rf(dt, np.exp(f64(x)))
        s = np.sum(f64(e))
        c.expect(dt, rf(dt, f64(e) / s - f64(e)), 1e-5 if dt == "f32" else 1e-12, 1e-6 if dt == "f32" else 1e-14)
        yield c
    # Integer chain with wraparound: ((a * b) ^ c) >> via div, min with a fill.
    for dt in INTS:
        c = Case("FUSED.int_chain/%s" % dt, "FUSED", dt)
        shape = (3000,)
        a, b, d = rand_int(rng, dt, shape), rand_int(rng, dt, shape), rand_int(rng, dt, shape)
        pa, pb, pd = c.param(dt, a), c.param(dt, b), c.param(dt, d)
        c.node("m", "MUL", [pa, pb])
        c.node("x", "XOR", ["m", pd])
        c.node("k", "CONSTANT", (), "constant { fill { i: 7 } } %s" % type_text(dt, shape))
        c.node("q", "DIV", ["x", "k"])
        c.node("cap", "CONSTANT", (), "constant { fill { i: 100 } } %s" % type_text(dt, ()))
        c.node("capb", "BROADCAST_IN_DIM", ["cap"], "broadcast_in_dim { dims: [%d] }" % shape[0])
        c.out("MIN", ["q", "capb"])
        m = wrap(dt, i64(a) * i64(b))
        xx = wrap(dt, i64(m) ^ i64(d))
        q = wrap(dt, trunc_div(xx, np.full(shape, 7)))
        c.expect(dt, np.minimum(q, NP[dt](100)))
        yield c


# --- shapes at the edges: scalars, empty arrays, arrays streamed in chunks ---


def edge_cases(rng):
    # Rank-0 operands everywhere.
    for dt in ("f32", "f16", "s64", "u8"):
        c = Case("SCALAR.ADD/%s" % dt, "ADD", dt)
        a, b = rand_small(rng, dt, (), -9, 9), rand_small(rng, dt, (), -9, 9)
        pa, pb = c.param(dt, a), c.param(dt, b)
        want = via_f32(dt, f64(a) + f64(b)) if dt in FLOATS else wrap(dt, i64(a) + i64(b))
        c.out("ADD", [pa, pb], dt=dt, want=want)
        yield c
        c = Case("SCALAR.chain/%s" % dt, "FUSED", dt)
        x = rand_small(rng, dt, (), 1, 9)
        px = c.param(dt, x)
        c.node("n", "NEG", [px])
        c.node("k", "CONSTANT", (), "constant { fill { i: 3 } } %s" % type_text(dt, ()))
        c.node("m", "MUL", ["n", "k"])
        c.node("lt", "COMPARE", ["m", px], "compare { direction: LT }")
        c.out("SELECT", ["lt", "m", px])
        m = wrap(dt, -i64(x) * 3) if dt in INTS else via_f32(dt, -f64(x) * 3)
        c.expect(dt, np.where(m < x, m, x).astype(NP[dt]))
        yield c
    c = Case("SCALAR.REDUCE/f64", "REDUCE", "f64")
    x = rand_float(rng, "f64", ())
    c.out("REDUCE", [c.param("f64", x)], "reduce { kind: SUM }", dt="f64", want=x)
    yield c
    # Zero-element arrays.
    for dt in ("f32", "s32", "bf16"):
        c = Case("EMPTY.MUL/%s" % dt, "MUL", dt)
        a, b = rand_any(rng, dt, (0, 3)), rand_any(rng, dt, (0, 3))
        c.out("MUL", [c.param(dt, a), c.param(dt, b)], dt=dt, want=a * b if dt != "s32" else wrap(dt, i64(a) * i64(b)))
        yield c
        for kind, ident in (("SUM", 0), ("PROD", 1), ("REDUCE_MAX", None), ("REDUCE_MIN", None)):
            c = Case("EMPTY.REDUCE.%s/%s" % (kind, dt), "REDUCE", dt)
            x = rand_any(rng, dt, (0, 3))
            if ident is None:
                big = np.inf if dt in FLOATS else INT_RANGE[dt][1]
                small = -np.inf if dt in FLOATS else INT_RANGE[dt][0]
                ident = small if kind == "REDUCE_MAX" else big
            c.out(
                "REDUCE",
                [c.param(dt, x)],
                "reduce { kind: %s dims: 0 }" % kind,
                dt=dt,
                want=to_mem(dt, np.full((3,), ident, dtype=np.float64 if dt in FLOATS else np.int64)),
            )
            yield c
        c = Case("EMPTY.DOT_GENERAL.k0/%s" % dt, "DOT_GENERAL", dt)
        a, b = rand_any(rng, dt, (3, 0)), rand_any(rng, dt, (0, 4))
        c.out(
            "DOT_GENERAL",
            [c.param(dt, a), c.param(dt, b)],
            dot_attrs(dict(lc=[1], rc=[0])),
            dt=dt,
            want=to_mem(dt, np.zeros((3, 4))),
        )
        yield c
        c = Case("EMPTY.CONCATENATE/%s" % dt, "CONCATENATE", dt)
        xs = [rand_any(rng, dt, (2, 0)), rand_any(rng, dt, (2, 3)), rand_any(rng, dt, (2, 0))]
        c.out(
            "CONCATENATE",
            [c.param(dt, x) for x in xs],
            "concatenate { dimension: 1 }",
            dt=dt,
            want=np.concatenate(xs, axis=1),
        )
        yield c
        c = Case("EMPTY.PAD/%s" % dt, "PAD", dt)
        x, pv = rand_any(rng, dt, (0, 2)), rand_any(rng, dt, ())
        c.out(
            "PAD",
            [c.param(dt, x), c.param(dt, pv)],
            "pad { low: [1, 0] high: [2, 1] interior: [3, 1] }",
            dt=dt,
            want=pad_ref(x, pv, (1, 0), (2, 1), (3, 1)),
        )
        yield c
        c = Case("EMPTY.SLICE/%s" % dt, "SLICE", dt)
        x = rand_any(rng, dt, (3, 4))
        c.out("SLICE", [c.param(dt, x)], "slice { start: [1, 2] limit: [3, 2] }", dt=dt, want=x[1:3, 2:2])
        yield c
        c = Case("EMPTY.REVERSE/%s" % dt, "REVERSE", dt)
        x = rand_any(rng, dt, (3, 0))
        c.out("REVERSE", [c.param(dt, x)], "reverse { dimensions: [0, 1] }", dt=dt, want=x)
        yield c
    # Arrays larger than one 1 MiB transfer chunk and many fusion blocks.
    n = 700001
    c = Case("LARGE.NEG/f32", "NEG", "f32")
    x = rand_float(rng, "f32", (n,))
    c.out("NEG", [c.param("f32", x)], dt="f32", want=-x)
    yield c
    c = Case("LARGE.CONVERT/f32->bf16", "CONVERT", "f32")
    x = rng.standard_normal((n,)).astype(np.float32)
    c.out("CONVERT", [c.param("f32", x)], "convert { dtype: BF16 }", dt="bf16", want=rf("bf16", f64(x)))
    yield c
    c = Case("LARGE.REDUCE.SUM/f64", "REDUCE", "f64")
    x = rand_float(rng, "f64", (1001, 300))
    c.out(
        "REDUCE",
        [c.param("f64", x)],
        "reduce { kind: SUM dims: 0 }",
        dt="f64",
        want=np.sum(x, axis=0),
        rtol=1e-12,
        atol=1e-12 * np.sum(np.abs(x), axis=0),
    )
    yield c
    c = Case("LARGE.TRANSPOSE/u8", "TRANSPOSE", "u8")
    x = rand_int(rng, "u8", (1200, 1100))
    c.out("TRANSPOSE", [c.param("u8", x)], "transpose { permutation: [1, 0] }", dt="u8", want=x.T)
    yield c
    c = Case("LARGE.DOT_GENERAL/f32", "DOT_GENERAL", "f32")
    a, b = rand_float(rng, "f32", (300, 200), -1, 1), rand_float(rng, "f32", (300, 250), -1, 1)
    c.out(
        "DOT_GENERAL",
        [c.param("f32", a), c.param("f32", b)],
        dot_attrs(dict(lc=[0], rc=[0])),
        dt="f32",
        want=rf("f32", f64(a).T @ f64(b)),
        rtol=1e-5,
        atol=1e-5 * (np.abs(f64(a)).T @ np.abs(f64(b))),
    )
    yield c


def all_cases(rng):
    for gen in (
        unary_cases,
        binary_cases,
        compare_cases,
        select_clamp_cases,
        convert_cases,
        bitcast_cases,
        layout_cases,
        dot_cases,
        conv_cases,
        reduce_cases,
        arg_cases,
        constant_cases,
        fused_cases,
        edge_cases,
    ):
        yield from gen(rng)


# ----------------------------------------------------------------------------
# Negative cases: invalid graphs that compile and run must reject, naming the
# node (and its op).

P0 = 'nodes { name: "p0" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 2 } }\n'
P1S = 'nodes { name: "p1" op: PARAMETER parameter { index: 1 } type { dtype: S32 dims: 2 } }\n'
NEGATIVE = [  # name, graph text, command, strings the error must contain
    (
        "wrong_arity",
        P0 + 'nodes { name: "bad_add" op: ADD operands: ["p0"] }\noutputs: "bad_add"\n',
        "compile",
        ["'bad_add'", "add", "expected 2 operands"],
    ),
    (
        "dtype_mismatch",
        P0 + P1S + 'nodes { name: "bad_mix" op: ADD operands: ["p0", "p1"] }\noutputs: "bad_mix"\n',
        "run",
        ["'bad_mix'", "add", "f32[2]", "s32[2]"],
    ),
    (
        "dangling_operand",
        P0 + 'nodes { name: "bad_ref" op: NEG operands: ["ghost"] }\noutputs: "bad_ref"\n',
        "compile",
        ["'bad_ref'", "neg", "ghost"],
    ),
    (
        "later_node_cycle",
        P0 + 'nodes { name: "early" op: NEG operands: ["late"] }\n'
        'nodes { name: "late" op: NEG operands: ["early"] }\noutputs: "late"\n',
        "run",
        ["'early'", "neg", "late"],
    ),
    (
        "self_reference",
        P0 + 'nodes { name: "selfish" op: ABS operands: ["selfish"] }\noutputs: "selfish"\n',
        "compile",
        ["'selfish'", "abs"],
    ),
    (
        "negative_dimension",
        'nodes { name: "neg_dim" op: PARAMETER parameter { index: 0 } '
        'type { dtype: F32 dims: 3 dims: -2 } }\noutputs: "neg_dim"\n',
        "compile",
        ["'neg_dim'", "parameter", "-2"],
    ),
    (
        "reshape_count",
        'nodes { name: "p0" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 6 } }\n'
        'nodes { name: "bad_reshape" op: RESHAPE operands: ["p0"] reshape { dims: [4, 2] } }\noutputs: "bad_reshape"\n',
        "run",
        ["'bad_reshape'", "reshape", "6", "8"],
    ),
    (
        "unknown_op",
        P0 + 'nodes { name: "mystery" op: 7 operands: ["p0"] }\noutputs: "mystery"\n',
        "compile",
        ["'mystery'", "7"],
    ),
    (
        "unary_dtype",
        'nodes { name: "p0" op: PARAMETER parameter { index: 0 } type { dtype: S32 dims: 2 } }\n'
        'nodes { name: "bad_exp" op: EXP operands: ["p0"] }\noutputs: "bad_exp"\n',
        "compile",
        ["'bad_exp'", "exp", "s32"],
    ),
    (
        "compare_no_direction",
        P0 + 'nodes { name: "bad_cmp" op: COMPARE operands: ["p0", "p0"] }\n' 'outputs: "bad_cmp"\n',
        "compile",
        ["'bad_cmp'", "compare"],
    ),
    (
        "duplicate_name",
        P0 + 'nodes { name: "twin" op: NEG operands: ["p0"] }\n'
        'nodes { name: "twin" op: ABS operands: ["p0"] }\noutputs: "twin"\n',
        "compile",
        ["'twin'"],
    ),
    (
        "slice_out_of_range",
        P0 + 'nodes { name: "bad_slice" op: SLICE operands: ["p0"] slice { start: [1] limit: [3] } }\n'
        'outputs: "bad_slice"\n',
        "compile",
        ["'bad_slice'", "slice"],
    ),
]

# ----------------------------------------------------------------------------
# Running.


class Runner:
    def __init__(self, tessel, env, workdir):
        self.tessel, self.env, self.workdir = tessel, env, workdir

    def run_case(self, case, index, device):
        d = os.path.join(self.workdir, "%04d_%s" % (index, case.name.replace("/", "_").replace(">", "")))
        os.makedirs(d, exist_ok=True)
        g = os.path.join(d, "graph.textproto")
        with open(g, "w") as f:
            f.write(case.graph())
        args = [self.tessel, "run", g, "--device", str(device)]
        for name, (dt, x) in case.inputs.items():
            path = os.path.join(d, name + ".npy")
            np.save(path, store(dt, x))
            args += ["--input", "%s=%s" % (name, path)]
        out_path = os.path.join(d, "out.npy")
        args += ["--fetch", "out=" + out_path]
        try:
            r = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            return "tessel run timed out after 60 s (device %d)" % device
        if r.returncode != 0:
            return "tessel run failed (rc %d, device %d): %s" % (r.returncode, device, r.stderr.strip()[-400:])
        return check_output(case, out_path)


def fmt_vals(v):
    return "[" + ", ".join(repr(x.item()) if hasattr(x, "item") else repr(x) for x in v) + "]"


def check_output(case, out_path):
    dt, want = case.expected
    try:
        raw = np.load(out_path)
    except Exception as e:  # noqa: BLE001
        return "cannot read output: %s" % e
    no_order = dt in ("u8", "s8", "pred", "bf16") and raw.dtype.str[1:] == NPY_DESCR[dt][1:]  # "|" or "<"
    if raw.dtype.str != NPY_DESCR[dt] and not no_order:
        return "output dtype %s, expected %s (%s)" % (raw.dtype.str, NPY_DESCR[dt], dt)
    got = load(dt, raw)
    want = np.asarray(want)
    if got.shape != want.shape:
        return "output shape %s, expected %s" % (got.shape, want.shape)
    if dt in FLOATS:
        g, w = f64(got), f64(want)
        nan_ok = np.isnan(g) & np.isnan(w)
        err = np.where(nan_ok, 0.0, np.abs(g - w))
        err = np.where(np.isinf(w) & (g == w), 0.0, err)
        allowed = case.rtol * np.abs(np.where(np.isfinite(w), w, 0)) + np.broadcast_to(case.atol, w.shape)
        bad = ~(err <= allowed)  # NaN error (one side NaN) is bad
        if case.signed_zero and case.rtol == 0 and np.all(case.atol == 0):
            bad |= (g == 0) & (w == 0) & (np.signbit(g) != np.signbit(w))
    else:
        g, w = i64(got), i64(want)
        err = np.abs(g.astype(np.float64) - w.astype(np.float64))
        bad = g != w
    if not bad.any():
        return None
    idx = np.argwhere(bad) if bad.ndim else [()]
    idx = [tuple(int(k) for k in i) for i in idx[:4]]
    maxerr = np.nanmax(np.where(bad, err, 0)) if np.isfinite(np.where(bad, err, 0)).all() else float("inf")
    if np.isnan(np.where(bad, err, 0)).any():
        maxerr = float("nan")
    msg = "%d/%d wrong, max error %.4g (rtol %g); first at %s: got %s, expected %s" % (
        int(bad.sum()),
        bad.size,
        maxerr,
        case.rtol,
        [list(i) for i in idx],
        fmt_vals([got[i] for i in idx]),
        fmt_vals([want[i] for i in idx]),
    )
    ins = []
    for name, (idt, x) in case.inputs.items():
        if x.shape == want.shape:
            ins.append("%s=%s" % (name, fmt_vals([x[i] for i in idx])))
        elif x.ndim == 0:
            ins.append("%s=%r" % (name, x.item()))
    if ins:
        msg += "; inputs there: " + ", ".join(ins)
    return msg


def run_negative(tessel, env, workdir, name, text, command, needles, verbose=False):
    g = os.path.join(workdir, "neg_%s.textproto" % name)
    with open(g, "w") as f:
        f.write(text)
    args = [tessel, command, g]
    if command == "run":
        args += ["--device", "1"]
        # Bind every parameter that the text declares, so only the graph is wrong.
        for i in range(2):
            pname = "p%d" % i
            if ('name: "%s"' % pname) in text:
                path = os.path.join(workdir, "neg_%s_%s.npy" % (name, pname))
                np.save(path, np.zeros(2, np.int32 if pname == "p1" else np.float32))
                args += ["--input", "%s=%s" % (pname, path)]
    try:
        r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "tessel %s timed out" % command
    err = r.stderr.strip()
    if r.returncode == 0:
        return "tessel %s accepted an invalid graph (rc 0): %s" % (command, (r.stdout + err).strip()[-300:])
    missing = [s for s in needles + ["INVALID_ARGUMENT"] if s not in err]
    if missing:
        return "error does not mention %s: %s" % (missing, err[-400:])
    if verbose:
        print("ok   NEGATIVE/%s (tessel %s, rc %d): %s" % (name, command, r.returncode, err), flush=True)
    return None


def start_cluster(tessel, workdir, device_kind):
    log = open(os.path.join(workdir, "tessel-local.log"), "w")
    p = subprocess.Popen(
        [tessel, "local", "--workers", "2", "--devices-per-worker", "2", "--device-kind", device_kind],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    ready, _, _ = select.select([p.stdout], [], [], 60)
    addr = p.stdout.readline().strip() if ready else ""
    return p, log, addr


def count_devices(tessel, env):
    """The cluster's devices, from `tessel status` (one row per worker; the
    last column lists its global device ids)."""
    r = subprocess.run([tessel, "status"], env=env, capture_output=True, text=True, timeout=30)
    rows = [line.split() for line in r.stdout.splitlines()]
    return sum(len(row[-1].split(",")) for row in rows if len(row) >= 5 and row[2] == "alive")


def stop_cluster(p, log):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    log.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="folder with tessel, tessel-coordinator, tessel-worker")
    ap.add_argument(
        "--device-kind",
        default=os.environ.get("TESSEL_DEVICE_KIND", "cpu"),
        choices=["cpu", "cuda"],
        help="the devices the workers serve (default: $TESSEL_DEVICE_KIND, else cpu)",
    )
    ap.add_argument("--filter", default="", help="run only cases whose name contains this")
    ap.add_argument("--keep", default=None, help="keep graphs, inputs and outputs in this folder")
    ap.add_argument("--verbose", "-v", action="store_true", help="print passing cases too")
    args = ap.parse_args()
    tessel = os.path.abspath(os.path.join(args.bin, "tessel"))
    for b in ("tessel", "tessel-coordinator", "tessel-worker"):
        if not os.access(os.path.join(args.bin, b), os.X_OK):
            print("conformance: %s not found or not executable in %s" % (b, args.bin))
            return 2
    if args.keep:
        workdir = os.path.abspath(args.keep)
        os.makedirs(workdir, exist_ok=True)
    else:
        workdir = tempfile.mkdtemp(prefix="tessel-conformance-")
    t0 = time.time()
    np.seterr(all="ignore")
    cluster, log, addr = None, None, ""
    n = failed = 0
    try:
        cluster, log, addr = start_cluster(tessel, workdir, args.device_kind)
        if not addr:
            print("conformance: could not start a local cluster (see %s)" % os.path.join(workdir, "tessel-local.log"))
            return 2
        env = dict(os.environ, TESSEL_COORDINATOR=addr, TESSEL_BIN_DIR=os.path.abspath(args.bin))
        runner = Runner(tessel, env, workdir)
        devices = count_devices(tessel, env)
        if devices == 0:
            print(
                "conformance: the local cluster has no live devices (see %s)"
                % os.path.join(workdir, "tessel-local.log")
            )
            return 2
        rng = np.random.default_rng(20240611)
        first_ok = None
        for case in all_cases(rng):  # generate all, so the seed sequence is filter-independent
            if args.filter not in case.name:
                continue
            device = n % devices
            err = runner.run_case(case, n, device)
            n += 1
            if err:
                failed += 1
                print(
                    "FAIL %-40s op=%s dtype=%s device=%d: %s" % (case.name, case.op, case.dtype, device, err),
                    flush=True,
                )
            else:
                if args.verbose:
                    print("ok   %s (device %d)" % (case.name, device), flush=True)
                if first_ok is None:
                    first_ok = case
        ran_negative = False
        for name, text, command, needles in NEGATIVE:
            cname = "NEGATIVE/%s" % name
            if args.filter not in cname:
                continue
            ran_negative = True
            err = run_negative(tessel, env, workdir, name, text, command, needles, args.verbose)
            n += 1
            if err:
                failed += 1
                print("FAIL %-40s: %s" % (cname, err), flush=True)
        if ran_negative:
            # The daemons keep serving after rejected graphs.
            if first_ok is None:
                first_ok = next(c for c in all_cases(np.random.default_rng(1)) if c.name == "ADD/f32")
            for device in range(devices):
                err = runner.run_case(first_ok, n, device)
                n += 1
                if err:
                    failed += 1
                    print(
                        "FAIL %-40s: after the negative cases, on device %d: %s"
                        % ("AFTER_ERRORS/" + first_ok.name, device, err),
                        flush=True,
                    )
            if cluster.poll() is not None:
                failed += 1
                print("FAIL the local cluster exited (rc %s)" % cluster.returncode)
    finally:
        if cluster is not None:
            stop_cluster(cluster, log)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print("%d cases, %d failed (%.1f s)" % (n, failed, time.time() - t0))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
