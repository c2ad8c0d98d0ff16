"""tessel.lax: control flow that runs on the device, with jax.lax's signatures.

`while_loop`, `fori_loop`, `scan`, `cond` and `switch` trace their functions
once into functions of the graph; the loop or branch runs on the workers,
with no round trip to the client per iteration. Arguments and results are
pytrees (tuples, lists, dicts, None) of arrays. Values a function reads from
the enclosing trace become explicit operands (jax's closure conversion).
Outside a trace each call runs as a one-off jitted function.

Semantics follow jax.lax: a loop body must return its carry with the same
structure, shapes and dtypes (a Python scalar result takes the carry's
dtype); `fori_loop` with Python int bounds is a `scan` of known length,
with traced bounds a `while_loop`; `switch` clamps its index into range, as
jax does (the IR's conditional runs the last branch for an index out of
range, as XLA does); `cond`'s predicate is a boolean scalar.
"""

import builtins

import numpy as np

from tessel import _lax_linalg as linalg  # tessel.lax.linalg
from tessel._bodies import reduce, sort, sort_key_val
from tessel import _region
from tessel import numpy as tnp
from tessel._convolution import (
    conv,
    conv_general_dilated,
    conv_with_general_padding,
    padtype_to_pads,
    reduce_window,
)
from tessel._jit import jit
from tessel._shard_map import (  # jax.lax's collectives, inside shard_map
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
)
from tessel._trace import Tracer, current_builder
from tessel._tree import flatten, unflatten
from tessel.numpy._core import _bitcast, _elementwise, _op, _tracer
from tessel.numpy._dot import dot_general
from tessel.numpy._elementwise import _unary
from tessel.v1 import ir_pb2

# jax.lax's element-wise names, so that programs read as they do in JAX
# (`reduce_window(x, -inf, lax.max, ...)`). They take tessel.numpy's type
# promotion; lax.div and lax.rem round toward zero, as C and XLA do, where
# numpy's floor_divide and remainder floor.
add, sub, mul, neg, max, min = tnp.add, tnp.subtract, tnp.multiply, tnp.negative, tnp.maximum, tnp.minimum
abs, sign, floor, ceil, square = tnp.abs, tnp.sign, tnp.floor, tnp.ceil, tnp.square
exp, exp2, expm1, log, log1p = tnp.exp, tnp.exp2, tnp.expm1, tnp.log, tnp.log1p
sqrt, rsqrt, cbrt, pow, integer_pow = tnp.sqrt, tnp.rsqrt, tnp.cbrt, tnp.power, tnp.power
sin, cos, tan, asin, acos, atan, atan2 = tnp.sin, tnp.cos, tnp.tan, tnp.arcsin, tnp.arccos, tnp.arctan, tnp.arctan2
sinh, cosh, tanh, asinh, acosh, atanh, logistic = (
    tnp.sinh,
    tnp.cosh,
    tnp.tanh,
    tnp.arcsinh,
    tnp.arccosh,
    tnp.arctanh,
    tnp.sigmoid,
)
is_finite, reciprocal = tnp.isfinite, tnp.reciprocal
eq, ne, lt, le, gt, ge = tnp.equal, tnp.not_equal, tnp.less, tnp.less_equal, tnp.greater, tnp.greater_equal
bitwise_and, bitwise_or, bitwise_xor, bitwise_not = tnp.bitwise_and, tnp.bitwise_or, tnp.bitwise_xor, tnp.invert
and_, or_, xor, not_ = tnp.bitwise_and, tnp.bitwise_or, tnp.bitwise_xor, tnp.invert
shift_left, shift_right_arithmetic = tnp.left_shift, tnp.right_shift
erf = tnp._erf  # the error function
dot = tnp.dot


def _unsigned(x, what):
    """x as the unsigned type of its width (the same bits), and that width."""
    x = tnp.asarray(x)
    d = np.dtype(x.dtype)
    if d.kind not in "iu":
        raise TypeError(f"{what}: expected an integer array, got {d}")
    return tnp.astype(x, np.dtype(f"u{d.itemsize}")), 8 * d.itemsize, d


def _popcount(u, bits):
    """Set bits of each unsigned element, SWAR: pairs, nibbles, bytes, then
    the bytes summed by one multiply."""
    t = np.dtype(u.dtype)

    def c(v):
        return np.array(v, t)

    def pattern(byte):
        return c(int(byte * (bits // 8), 16))

    u = tnp.subtract(u, tnp.bitwise_and(tnp.right_shift(u, c(1)), pattern("55")))
    u = tnp.add(tnp.bitwise_and(u, pattern("33")), tnp.bitwise_and(tnp.right_shift(u, c(2)), pattern("33")))
    u = tnp.bitwise_and(tnp.add(u, tnp.right_shift(u, c(4))), pattern("0f"))
    if bits > 8:
        u = tnp.right_shift(tnp.multiply(u, pattern("01")), c(bits - 8))
    return u


@_op
def bitcast_convert_type(operand, new_dtype):
    """jax.lax.bitcast_convert_type: the operand's bits read as `new_dtype`.
    As wide: the same shape. Narrower: a last dimension of width ratio
    (little-endian, as numpy's view on this machine and XLA's). Wider: the
    last dimension, of that ratio, is taken away."""
    t = _tracer(operand)
    src, d = np.dtype(t.dtype), np.dtype(new_dtype)
    if np.bool_ in (src, d):
        raise TypeError(f"bitcast_convert_type: {src.name} to {d.name}: bool has no bits to read as another dtype")
    if src == d:
        return t
    ws, wd = src.itemsize, d.itemsize
    if ws == wd:
        return _bitcast(t, d)
    us, ud = np.dtype(f"u{ws}"), np.dtype(f"u{wd}")
    u = _bitcast(t, us)
    if wd < ws:
        parts = [
            tnp.astype(tnp.bitwise_and(tnp.floor_divide(u, us.type(1 << (8 * wd * k))), us.type((1 << 8 * wd) - 1)), ud)
            for k in range(ws // wd)
        ]
        return _bitcast(tnp.stack(parts, axis=-1), d)
    ratio = wd // ws
    if not t.shape or t.shape[-1] != ratio:
        raise ValueError(
            f"bitcast_convert_type: {src.name}{list(t.shape)} to {d.name}: a wider dtype takes a last "
            f"dimension of {ratio} (its width over the operand's), got {list(t.shape)}"
        )
    acc = None
    for k in range(ratio):
        part = tnp.multiply(tnp.astype(u[..., k], ud), ud.type(1 << (8 * ws * k)))
        acc = part if acc is None else tnp.bitwise_or(acc, part)
    return _bitcast(acc, d)


# Exponent and mantissa bits of each float dtype.
_FLOAT_FORMAT = {"float16": (5, 10), "bfloat16": (8, 7), "float32": (8, 23), "float64": (11, 52)}


@_op
def reduce_precision(operand, exponent_bits, mantissa_bits):
    """jax.lax.reduce_precision: each float rounded to the nearest (ties to
    even) of `mantissa_bits` bits, then to ±inf past the largest exponent
    of `exponent_bits` bits and to ±0 at or below the smallest (no
    subnormals); NaN stays NaN. XLA's algorithm, on the bits."""
    t = _tracer(operand)
    d = np.dtype(t.dtype)
    if d.name not in _FLOAT_FORMAT:
        raise TypeError(f"reduce_precision: expected a floating-point operand, got {d.name}")
    src_e, src_m = _FLOAT_FORMAT[d.name]
    exponent_bits, mantissa_bits = int(exponent_bits), int(mantissa_bits)
    if exponent_bits < 1 or mantissa_bits < 0:
        raise ValueError(
            f"reduce_precision: exponent_bits {exponent_bits} (at least 1) and mantissa_bits {mantissa_bits} (at least 0)"
        )
    u = np.dtype(f"u{d.itemsize}")
    c = u.type
    x = _bitcast(t, u)
    if mantissa_bits < src_m:
        drop = src_m - mantissa_bits
        last = 1 << drop  # the lowest mantissa bit kept
        odd = tnp.bitwise_and(tnp.floor_divide(x, c(last)), c(1))  # ties go to the even one
        x = tnp.add(x, tnp.add(odd, c((last >> 1) - 1)))
        x = tnp.bitwise_and(x, c(((1 << 8 * d.itemsize) - 1) ^ (last - 1)))
    if exponent_bits < src_e:
        bias, reduced_bias = (1 << (src_e - 1)) - 1, (1 << (exponent_bits - 1)) - 1
        exp_mask = ((1 << src_e) - 1) << src_m
        exponent = tnp.bitwise_and(x, c(exp_mask))
        signed_zero = tnp.bitwise_and(x, c(1 << (8 * d.itemsize - 1)))
        signed_inf = tnp.bitwise_or(signed_zero, c(exp_mask))
        x = tnp.where(
            exponent > c((bias + reduced_bias) << src_m),
            signed_inf,
            tnp.where(exponent <= c((bias - reduced_bias) << src_m), signed_zero, x),
        )
    return tnp.where(tnp.isnan(t), t, _bitcast(x, d))


@_op
def shift_right_logical(x, y):
    """jax.lax.shift_right_logical: x's bits moved right with zeros in; 0
    for a count past the width (or below 0), as XLA's."""
    u, _, d = _unsigned(x, "shift_right_logical")
    return tnp.astype(tnp.right_shift(u, tnp.astype(y, u.dtype)), d)


@_op
def population_count(x):
    """jax.lax.population_count: the number of set bits of each element."""
    u, bits, d = _unsigned(x, "population_count")
    return tnp.astype(_popcount(u, bits), d)


@_op
def clz(x):
    """jax.lax.clz: the number of leading zero bits of each element."""
    u, bits, d = _unsigned(x, "clz")
    shift = 1
    while shift < bits:  # every bit below the highest set one set too
        u = tnp.bitwise_or(u, tnp.right_shift(u, np.array(shift, u.dtype)))
        shift *= 2
    return tnp.astype(tnp.subtract(np.array(bits, u.dtype), _popcount(u, bits)), d)


@_op
def div(x, y):
    """jax.lax.div: integer division rounds toward zero; x / 0 is -1 for
    integers, as in XLA."""
    return _elementwise(ir_pb2.DIV, [x, y])


@_op
def rem(x, y):
    """jax.lax.rem: the remainder of a division rounding toward zero (the
    sign of x), as C's % and fmod."""
    return _elementwise(ir_pb2.REM, [x, y])


_round_afz = _unary(ir_pb2.ROUND, identity_on_ints=True)


class RoundingMethod:
    AWAY_FROM_ZERO = 0
    TO_NEAREST_EVEN = 1


def round(x, rounding_method=RoundingMethod.AWAY_FROM_ZERO):
    """jax.lax.round: halves away from zero (the default) or to even."""
    if rounding_method == RoundingMethod.TO_NEAREST_EVEN:
        return tnp.rint(x)
    if rounding_method != RoundingMethod.AWAY_FROM_ZERO:
        raise ValueError(
            f"round: rounding_method must be AWAY_FROM_ZERO (0) or TO_NEAREST_EVEN (1), got {rounding_method!r}"
        )
    return _round_afz(x)


def select(pred, on_true, on_false):
    """jax.lax.select: on_true where pred, else on_false (same shapes)."""
    return tnp.where(pred, on_true, on_false)


def clamp(min, x, max):
    """jax.lax.clamp: x limited to [min, max]."""
    return tnp.clip(x, min, max)


def convert_element_type(operand, new_dtype):
    return tnp.astype(operand, new_dtype)


__all__ = [
    "abs",
    "acos",
    "acosh",
    "add",
    "all_gather",
    "all_to_all",
    "and_",
    "argmax",
    "argmin",
    "asin",
    "asinh",
    "atan",
    "atan2",
    "atanh",
    "axis_index",
    "axis_size",
    "bitcast_convert_type",
    "bitwise_and",
    "bitwise_not",
    "bitwise_or",
    "bitwise_xor",
    "cbrt",
    "ceil",
    "clamp",
    "clz",
    "cond",
    "conv",
    "conv_general_dilated",
    "conv_with_general_padding",
    "convert_element_type",
    "cos",
    "cosh",
    "div",
    "dot",
    "dot_general",
    "dynamic_index_in_dim",
    "dynamic_slice",
    "dynamic_slice_in_dim",
    "dynamic_update_index_in_dim",
    "dynamic_update_slice",
    "dynamic_update_slice_in_dim",
    "eq",
    "erf",
    "exp",
    "exp2",
    "expm1",
    "floor",
    "fori_loop",
    "ge",
    "gt",
    "integer_pow",
    "is_finite",
    "le",
    "linalg",
    "log",
    "log1p",
    "logistic",
    "lt",
    "max",
    "min",
    "mul",
    "ne",
    "neg",
    "not_",
    "or_",
    "padtype_to_pads",
    "pmax",
    "pmean",
    "pmin",
    "population_count",
    "pow",
    "ppermute",
    "psum",
    "psum_scatter",
    "reciprocal",
    "reduce",
    "reduce_precision",
    "reduce_window",
    "rem",
    "round",
    "RoundingMethod",
    "rsqrt",
    "scan",
    "select",
    "shift_left",
    "shift_right_arithmetic",
    "shift_right_logical",
    "sign",
    "sin",
    "sinh",
    "sort",
    "sort_key_val",
    "sqrt",
    "square",
    "sub",
    "switch",
    "tan",
    "tanh",
    "top_k",
    "while_loop",
    "xor",
]


def argmax(operand, axis, index_dtype):
    """jax.lax.argmax: the first position of the largest element along
    `axis` (a NaN counts as the largest), as `index_dtype`."""
    return tnp.astype(tnp.argmax(operand, axis=axis), index_dtype)


def argmin(operand, axis, index_dtype):
    """jax.lax.argmin: the first position of the smallest element along
    `axis` (a NaN counts as the smallest), as `index_dtype`."""
    return tnp.astype(tnp.argmin(operand, axis=axis), index_dtype)


def top_k(operand, k):
    """jax.lax.top_k: the k largest entries along the last axis, largest
    first, and their int32 indices; equal entries in index order, NaN
    above every number (as XLA)."""
    k = int(k)
    shape = np.shape(operand)
    if not shape:
        raise ValueError("top_k: the operand needs at least one dimension")
    if not 0 <= k <= shape[-1]:
        raise ValueError(f"top_k: k={k} is out of range for a last dimension of {shape[-1]}")
    order = tnp.argsort(operand, axis=-1, descending=True)[..., :k]
    values = tnp.sort(operand, axis=-1, descending=True)[..., :k]
    return values, tnp.astype(order, np.int32)


def dynamic_slice(operand, start_indices, slice_sizes):
    """jax.lax.dynamic_slice: the window of `slice_sizes` at `start_indices`
    (traced or static scalars), each start clamped so the window fits. A
    traced start gathers the window's positions along its dimension."""
    return tnp._dynamic_slice(operand, tuple(start_indices), tuple(slice_sizes))


def dynamic_update_slice(operand, update, start_indices):
    """jax.lax.dynamic_update_slice: `operand` with `update` written at
    `start_indices` (clamped so it fits): a scatter when a start is traced."""
    return tnp._dynamic_update_slice(operand, update, tuple(start_indices))


def dynamic_slice_in_dim(operand, start_index, slice_size, axis=0):
    shape = np.shape(operand)
    axis = axis % len(shape)
    starts = [0] * len(shape)
    starts[axis] = start_index
    sizes = list(shape)
    sizes[axis] = slice_size
    return dynamic_slice(operand, starts, sizes)


def dynamic_index_in_dim(operand, index, axis=0, keepdims=True):
    out = dynamic_slice_in_dim(operand, index, 1, axis)
    return out if keepdims else tnp.squeeze(out, axis=axis % len(np.shape(operand)))


def dynamic_update_slice_in_dim(operand, update, start_index, axis):
    axis = axis % len(np.shape(operand))
    starts = [0] * len(np.shape(operand))
    starts[axis] = start_index
    return dynamic_update_slice(operand, update, starts)


def dynamic_update_index_in_dim(operand, update, index, axis):
    axis = axis % len(np.shape(operand))
    if len(np.shape(update)) == len(np.shape(operand)) - 1:
        update = tnp.expand_dims(update, axis)
    return dynamic_update_slice_in_dim(operand, update, index, axis)


def _eager(fn, leaves):
    """Outside a trace: `fn(*leaves)` as a one-off jitted function."""
    return jit(fn)(*leaves)


def while_loop(cond_fun, body_fun, init_val):
    """Runs `body_fun` on the carry while `cond_fun(carry)` holds; returns the
    final carry (jax.lax.while_loop)."""
    leaves, paths, structure = flatten(init_val)
    if not _region.in_trace(leaves):
        return _eager(lambda *ls: while_loop(cond_fun, body_fun, unflatten(structure, ls)), leaves)
    parent = current_builder()
    init = _region.operands(leaves)
    specs = [_region.spec(x) for x in init]
    n = len(init)
    rebuild = lambda ps: (unflatten(structure, ps),)
    cb, pred, _, _ = _region.trace(parent, "while_cond", cond_fun, specs, paths, rebuild)
    if len(pred) != 1 or pred[0].shape != () or pred[0].dtype != np.bool_:
        got = ", ".join(_region.describe(p.shape, p.dtype) for p in pred)
        raise TypeError(f"while_loop: cond_fun must return a boolean scalar, got ({got})")
    bb, out, out_paths, out_structure = _region.trace(parent, "while_body", body_fun, specs, paths, rebuild)
    if out_structure != structure:
        raise TypeError(
            f"while_loop: body_fun returned a carry of structure {out_structure}; the carry is " f"{structure}"
        )
    out = _region.match(bb, out, out_paths, specs, "while_loop body_fun")
    captured, (cond_caps, body_caps) = _region.bind_captures([cb, bb], n)
    _region.finish(cb, pred)
    _region.finish(bb, out + body_caps)

    def attrs(node):
        node.control.cond = cb.graph.name
        node.control.body = bb.graph.name

    results = _region.control_node(
        parent, ir_pb2.WHILE, init + captured, attrs, specs + [_region.spec(c) for c in captured]
    )
    return unflatten(structure, results[:n])


def scan(f, init, xs=None, length=None, reverse=False):
    """jax.lax.scan: `f(carry, x) -> (carry, y)` over the leading dimension
    of `xs`; returns (final carry, the ys stacked)."""
    c_leaves, c_paths, c_structure = flatten(init)
    x_leaves, x_paths, x_structure = flatten(xs)
    if not _region.in_trace(c_leaves + x_leaves):
        nc = len(c_leaves)
        return _eager(
            lambda *ls: scan(f, unflatten(c_structure, ls[:nc]), unflatten(x_structure, ls[nc:]), length, reverse),
            c_leaves + x_leaves,
        )
    parent = current_builder()
    carry = _region.operands(c_leaves)
    xs_t = _region.operands(x_leaves)
    lengths = {int(x.shape[0]) for x in xs_t if x.shape}
    if any(not x.shape for x in xs_t):
        raise ValueError("scan: every leaf of xs needs a leading dimension to scan over")
    if length is not None:
        lengths.add(int(length))
    if len(lengths) != 1:
        raise ValueError(
            f"scan: the leading dimensions of xs and `length` disagree: {sorted(lengths)}"
            if lengths
            else "scan: without xs, give `length`"
        )
    length = lengths.pop()
    c_specs = [_region.spec(x) for x in carry]
    x_specs = [(tuple(x.shape[1:]), np.dtype(x.dtype), False) for x in xs_t]
    nc = len(carry)
    rebuild = lambda ps: (unflatten(c_structure, ps[:nc]), unflatten(x_structure, ps[nc:]))
    b, out, out_paths, out_structure = _region.trace(
        parent, "scan_body", f, c_specs + x_specs, c_paths + x_paths, rebuild
    )
    if out_structure[0] not in ("tuple", "list") or len(out_structure[1]) != 2:
        raise TypeError("scan: f must return a pair (carry, y)")
    if out_structure[1][0] != c_structure:
        raise TypeError(f"scan: f returned a carry of structure {out_structure[1][0]}; the carry is {c_structure}")
    new_carry = _region.match(b, out[:nc], out_paths[:nc], c_specs, "scan f")
    ys = out[nc:]
    captured, (caps,) = _region.bind_captures([b], nc)
    _renumber_xs(b, nc, len(captured), len(x_specs), caps)
    _region.finish(b, new_carry + caps + ys)
    nk = nc + len(captured)

    def attrs(node):
        node.control.body = b.graph.name
        node.control.length = length
        node.control.num_carry = nk
        node.control.reverse = bool(reverse)

    y_specs = [((length,) + tuple(y.shape), np.dtype(y.dtype), False) for y in ys]
    results = _region.control_node(
        parent, ir_pb2.SCAN, carry + captured + xs_t, attrs, c_specs + [_region.spec(c) for c in captured] + y_specs
    )
    ys_out = unflatten(out_structure[1][1], results[nk:])
    return unflatten(c_structure, results[:nc]), ys_out


def _renumber_xs(b, nc, ncaps, nx, caps):
    """Moves the x-slice parameters (declared nc .. nc+nx-1, before the
    captures were known) after the captures."""
    cap_names = {p._name for p in caps}
    for node in b.graph.nodes:
        if node.op != ir_pb2.PARAMETER or node.name in cap_names:
            continue
        if nc <= node.parameter.index < nc + nx:
            node.parameter.index += ncaps


def fori_loop(lower, upper, body_fun, init_val):
    """jax.lax.fori_loop: body_fun(i, val) for i in [lower, upper). Python
    int bounds make a scan of known length; traced bounds a while_loop."""
    static = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (lower, upper))
    if static:
        lower, upper = int(lower), int(upper)

        def step(carry, _):
            i, val = carry
            # As JAX's: an index from Python bounds is weakly typed, so
            # `x * i` keeps a float32 x float32.
            weak_i = Tracer(i._builder, i._name, i.shape, i.dtype, weak=True) if isinstance(i, Tracer) else i
            return (i + 1, body_fun(weak_i, val)), None

        (_, val), _ = scan(step, (np.int32(lower), init_val), None, length=builtins.max(0, upper - lower))
        return val

    def body(carry):
        i, hi, val = carry
        return i + 1, hi, body_fun(i, val)

    _, _, val = while_loop(lambda c: c[0] < c[1], body, (lower, upper, init_val))
    return val


def _branches(index, branches, operands, what):
    o_leaves, o_paths, o_structure = flatten(tuple(operands))
    parent = current_builder()
    ops = _region.operands(o_leaves)
    specs = [_region.spec(x) for x in ops]
    rebuild = lambda ps: unflatten(o_structure, ps)
    traced = [_region.trace(parent, f"branch{k}_", fn, specs, o_paths, rebuild) for k, fn in enumerate(branches)]
    structure = traced[0][3]
    for k, (_, _, _, s) in enumerate(traced):
        if s != structure:
            raise TypeError(f"{what}: branch {k} returns structure {s}; branch 0 returns {structure}")
    # Each result's type: the branches' common dtype (weak Python scalars yield).
    result_specs = []
    for j in range(len(traced[0][1])):
        xs = [t[1][j] for t in traced]
        strong = [x for x in xs if not x.weak]
        ref = strong[0] if strong else xs[0]
        result_specs.append((tuple(ref.shape), np.dtype(ref.dtype), not strong))
    outs = [
        _region.match(b, leaves, paths, result_specs, f"{what} branch {k}")
        for k, (b, leaves, paths, _) in enumerate(traced)
    ]
    captured, caps = _region.bind_captures([t[0] for t in traced], len(ops))
    for (b, _, _, _), out in zip(traced, outs):
        _region.finish(b, out)
    index = index if isinstance(index, Tracer) else tnp.asarray_in_trace(index)

    def attrs(node):
        node.control.branches.extend(t[0].graph.name for t in traced)

    results = _region.control_node(parent, ir_pb2.CONDITIONAL, [index] + ops + captured, attrs, result_specs)
    return unflatten(structure, results)


def cond(pred, true_fun, false_fun, *operands):
    """jax.lax.cond: true_fun(*operands) if pred else false_fun(*operands);
    both traced, one run on the device."""
    if isinstance(pred, (bool, np.bool_, int, np.integer)):
        return (true_fun if pred else false_fun)(*operands)
    leaves = flatten(tuple(operands))[0]
    if not _region.in_trace(leaves + [pred]):
        structure = flatten(tuple(operands))[2]
        return _eager(lambda p, *ls: cond(p, true_fun, false_fun, *unflatten(structure, ls)), [pred] + leaves)
    pred = pred if isinstance(pred, Tracer) else tnp.asarray_in_trace(pred)
    if pred.shape != ():
        raise TypeError(f"cond: the predicate must be a scalar, got {_region.describe(pred.shape, pred.dtype)}")
    if pred.dtype != np.bool_:
        pred = pred != 0
    return _branches(pred, [false_fun, true_fun], operands, "cond")


def switch(index, branches, *operands):
    """jax.lax.switch: branches[clamp(index, 0, len - 1)](*operands)."""
    branches = list(branches)
    if not branches:
        raise ValueError("switch: no branches")
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return branches[builtins.min(builtins.max(int(index), 0), len(branches) - 1)](*operands)
    leaves = flatten(tuple(operands))[0]
    if not _region.in_trace(leaves + [index]):
        structure = flatten(tuple(operands))[2]
        return _eager(lambda i, *ls: switch(i, branches, *unflatten(structure, ls)), [index] + leaves)
    index = index if isinstance(index, Tracer) else tnp.asarray_in_trace(index)
    if index.shape != ():
        raise TypeError(f"switch: the index must be a scalar, got {_region.describe(index.shape, index.dtype)}")
    index = tnp.clip(tnp.astype(index, np.int32), 0, len(branches) - 1)
    return _branches(index, branches, operands, "switch")
