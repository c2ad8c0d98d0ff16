"""Convolutions and pooling windows, with jax.lax's signatures.

conv_general_dilated is the IR's CONVOLUTION (StableHLO's convolution):
oneDNN runs it on the CPU, and its gradients are convolutions too.
reduce_window is composed of ops the IR already has, so its gradients,
vmap and partitioning are those ops' rules: it pads with the reduction's
identity (base dilation is the pad's interior), then reduces the window's
strided slices pairwise, holding only the result and one slice at a time.
"""

import builtins
import itertools
import math

import numpy as np

from tessel import numpy as tnp
from tessel.numpy._core import _b, _convert, _operand, _result_dtype, _tracer
from tessel.numpy._dot import _preferred
from tessel.v1 import ir_pb2
from tessel.numpy._layout import _pad_general

__all__ = [
    "conv",
    "conv_general_dilated",
    "conv_with_general_padding",
    "padtype_to_pads",
    "reduce_window",
    "select_and_scatter_add",
]


def padtype_to_pads(in_shape, window_shape, window_strides, padding):
    """jax.lax.padtype_to_pads: "SAME" or "VALID" as (low, high) per spatial
    dimension (SAME puts the odd one at the end, as XLA)."""
    kind = padding.upper() if isinstance(padding, str) else padding
    if kind == "VALID":
        return [(0, 0)] * len(in_shape)
    if kind in ("SAME", "SAME_LOWER"):
        pads = []
        for n, w, s in zip(in_shape, window_shape, window_strides):
            out = -(-n // s)
            total = builtins.max((out - 1) * s + w - n, 0)
            lo = total // 2 if kind == "SAME" else total - total // 2
            pads.append((lo, total - lo))
        return pads
    raise ValueError(f"padding: expected 'SAME', 'SAME_LOWER', 'VALID' or (low, high) pairs, got {padding!r}")


def _pairs(padding, n, what):
    pads = [tuple(int(v) for v in p) for p in padding]
    if len(pads) != n or any(len(p) != 2 for p in pads):
        raise ValueError(f"{what}: padding needs {n} (low, high) pairs, got {padding!r}")
    return pads


def _window_slice(x, lead, offsets, strides, out_shape):
    """x[..., o : o + (out - 1) * s + 1 : s] over the spatial dimensions
    after the `lead` leading ones."""
    idx = [slice(None)] * lead
    idx += [slice(o, o + (m - 1) * s + 1, s) for o, s, m in zip(offsets, strides, out_shape)]
    return x[tuple(idx)]


def _out_shape(padded, window, strides, dilation):
    out = []
    for n, w, s, d in zip(padded, window, strides, dilation):
        span = (w - 1) * d + 1
        out.append(0 if n < span else (n - span) // s + 1)
    return out


# ---------------------------------------------------------------- convolution


def _conv_specs(dimension_numbers, nd):
    """(lhs_spec, rhs_spec, out_spec) as dimension indices: (batch, feature,
    spatial...) for lhs and out, (out feature, in feature, spatial...) for
    rhs, from None (NCHW, OIHW, NCHW), three layout strings, or three
    index tuples (jax.lax.ConvDimensionNumbers)."""
    if dimension_numbers is None:
        default = tuple(range(nd))
        return default, default, default
    lhs, rhs, out = dimension_numbers
    if isinstance(lhs, str):
        if not (len(lhs) == len(rhs) == len(out) == nd):
            raise ValueError(
                f"conv_general_dilated: dimension_numbers {dimension_numbers!r}: each layout needs {nd} letters"
            )
        spatial = [c for c in rhs if c not in "OI"]

        def spec(layout, first, second):
            return (layout.index(first), layout.index(second)) + tuple(layout.index(c) for c in spatial)

        try:
            return spec(lhs, "N", "C"), spec(rhs, "O", "I"), spec(out, "N", "C")
        except ValueError:
            raise ValueError(
                f"conv_general_dilated: dimension_numbers {dimension_numbers!r}: lhs and out need N, C and rhs's "
                "spatial letters; rhs needs O and I"
            ) from None
    return tuple(lhs), tuple(rhs), tuple(out)


def conv_general_dilated(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    batch_group_count=1,
    precision=None,
    preferred_element_type=None,
):
    """jax.lax.conv_general_dilated over 1 to 3 (or more) spatial dimensions."""
    x, k = _tracer(lhs), _tracer(rhs)
    if x.ndim != k.ndim or x.ndim < 3:
        raise ValueError(
            f"conv_general_dilated: lhs and rhs need the same rank, at least 3; got {x.ndim} ({x.shape}) "
            f"and {k.ndim} ({k.shape})"
        )
    nd = x.ndim
    ns = nd - 2
    lhs_spec, rhs_spec, out_spec = _conv_specs(dimension_numbers, nd)
    strides = tuple(int(s) for s in window_strides)
    lhs_dil = tuple(int(d) for d in (lhs_dilation or (1,) * ns))
    rhs_dil = tuple(int(d) for d in (rhs_dilation or (1,) * ns))
    for name, v in (("window_strides", strides), ("lhs_dilation", lhs_dil), ("rhs_dilation", rhs_dil)):
        if len(v) != ns or builtins.min(v, default=1) < 1:
            raise ValueError(f"conv_general_dilated: {name} needs {ns} positive entries, got {v}")
    n, c = x.shape[lhs_spec[0]], x.shape[lhs_spec[1]]
    o, i = k.shape[rhs_spec[0]], k.shape[rhs_spec[1]]
    g, b = int(feature_group_count), int(batch_group_count)
    if g < 1 or b < 1 or (g > 1 and b > 1):
        raise ValueError(
            f"conv_general_dilated: feature_group_count {g} and batch_group_count {b}: each >= 1, and not both > 1"
        )
    if c != i * g:
        raise ValueError(
            f"conv_general_dilated: lhs has {c} input features; rhs's {i} input features times "
            f"feature_group_count {g} is {i * g}"
        )
    if o % (g * b) or n % b:
        raise ValueError(
            f"conv_general_dilated: rhs's {o} output features must divide by feature_group_count {g} and "
            f"batch_group_count {b}, and lhs's batch {n} by batch_group_count {b}"
        )
    window = [k.shape[d] for d in rhs_spec[2:]]
    dilated_in = [0 if m == 0 else (m - 1) * d + 1 for m, d in zip((x.shape[d] for d in lhs_spec[2:]), lhs_dil)]
    dilated_window = [(w - 1) * d + 1 for w, d in zip(window, rhs_dil)]
    if isinstance(padding, str):
        pads = padtype_to_pads(dilated_in, dilated_window, strides, padding)
    else:
        pads = _pairs(padding, ns, "conv_general_dilated")
    if x.dtype != k.dtype and preferred_element_type is None:
        common = _result_dtype(x, k)
        x, k = _convert(x, common), _convert(k, common)
    (x, k), finish = _preferred((x, k), preferred_element_type)
    padded = [m + lo + hi for m, (lo, hi) in zip(dilated_in, pads)]
    out_shape = [0] * nd
    out_shape[out_spec[0]] = n // b
    out_shape[out_spec[1]] = o
    for d, m in zip(out_spec[2:], _out_shape(padded, window, strides, rhs_dil)):
        out_shape[d] = m

    def attrs(node):
        a = node.convolution
        a.input_batch_dimension, a.input_feature_dimension = lhs_spec[:2]
        a.kernel_output_feature_dimension, a.kernel_input_feature_dimension = rhs_spec[:2]
        a.output_batch_dimension, a.output_feature_dimension = out_spec[:2]
        a.input_spatial_dimensions.extend(lhs_spec[2:])
        a.kernel_spatial_dimensions.extend(rhs_spec[2:])
        a.output_spatial_dimensions.extend(out_spec[2:])
        a.window_strides.extend(strides)
        a.padding_low.extend(p[0] for p in pads)
        a.padding_high.extend(p[1] for p in pads)
        a.lhs_dilation.extend(lhs_dil)
        a.rhs_dilation.extend(rhs_dil)
        a.feature_group_count = g
        a.batch_group_count = b

    return finish(_b().node(ir_pb2.CONVOLUTION, [x, k], out_shape, x.dtype, set_attrs=attrs))


def conv(lhs, rhs, window_strides, padding, precision=None, preferred_element_type=None):
    """jax.lax.conv: NCHW input, OIHW kernel."""
    return conv_general_dilated(
        lhs, rhs, window_strides, padding, precision=precision, preferred_element_type=preferred_element_type
    )


def conv_with_general_padding(
    lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, precision=None, preferred_element_type=None
):
    return conv_general_dilated(
        lhs,
        rhs,
        window_strides,
        padding,
        lhs_dilation,
        rhs_dilation,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )


# ---------------------------------------------------------------- windows

# The reductions a window takes: the tessel.numpy op, and the names a
# foreign callable (jax.lax.max, operator.add) goes by.
COMBINE = {"max": tnp.maximum, "min": tnp.minimum, "add": tnp.add, "mul": tnp.multiply}
_NAMES = {"max": ("max", "maximum", "gt"), "min": ("min", "minimum", "lt"), "add": ("add",), "mul": ("mul", "multiply")}


def _reducer(computation):
    name = getattr(computation, "__name__", "")
    for kind, fn in COMBINE.items():
        if computation is fn or name in _NAMES[kind]:
            return kind
    raise NotImplementedError(
        f"reduce_window: computation {computation!r}: supported are lax.max, lax.min, lax.add and lax.mul "
        "(and tessel.numpy's maximum, minimum, add, multiply)"
    )


def reduce_window(
    operand,
    init_value,
    computation,
    window_dimensions,
    window_strides,
    padding,
    base_dilation=None,
    window_dilation=None,
):
    """jax.lax.reduce_window for max, min, add and mul: `init_value` fills
    the padding and starts each window, as in XLA."""
    x = _tracer(operand)
    nd = x.ndim
    kind = _reducer(computation)
    window = tuple(int(w) for w in window_dimensions)
    strides = tuple(int(s) for s in window_strides)
    base = tuple(int(d) for d in (base_dilation or (1,) * nd))
    wdil = tuple(int(d) for d in (window_dilation or (1,) * nd))
    for name, v in (("window_dimensions", window), ("window_strides", strides), ("base_dilation", base),
                    ("window_dilation", wdil)):  # fmt: skip
        if len(v) != nd or builtins.min(v, default=1) < 1:
            raise ValueError(f"reduce_window: {name} needs {nd} positive entries (one per dimension), got {v}")
    dilated = [0 if n == 0 else (n - 1) * d + 1 for n, d in zip(x.shape, base)]
    if isinstance(padding, str):
        pads = padtype_to_pads(dilated, [(w - 1) * d + 1 for w, d in zip(window, wdil)], strides, padding)
    else:
        pads = _pairs(padding, nd, "reduce_window")
    init = np.asarray(init_value).item() if not hasattr(init_value, "shape") or init_value.shape == () else None
    if init is None:
        raise ValueError("reduce_window: init_value must be a scalar")
    x = _pad_general(x, init, [p[0] for p in pads], [p[1] for p in pads], [d - 1 for d in base])
    out_shape = _out_shape(x.shape, window, strides, wdil)
    combine = COMBINE[kind]
    acc = None
    for pos in itertools.product(*[range(w) for w in window]):
        s = _window_slice(x, 0, [p * d for p, d in zip(pos, wdil)], strides, out_shape)
        acc = s if acc is None else combine(acc, s)
    if acc is None or math.prod(window) == 0:
        return tnp.full(tuple(out_shape), init, x.dtype)
    if init != _identity(kind, x.dtype):  # XLA starts each window at init_value
        acc = combine(acc, _operand(init, x.dtype, ()))
    return acc


def select_and_scatter_add(source, operand, select, window_dimensions, window_strides, padding):
    """XLA's select_and_scatter with an add (the gradient of a max or min
    pool): in each window of `operand` (padded with the lowest value for
    select "ge"/"gt", the highest for "le"/"lt") the element `select` keeps
    against every later one (the first maximum for "ge") takes the window's
    `source` value; the result, operand-shaped, sums what each element
    took. Composed like reduce_window: per window position a strided slice
    and a running choice, then each position's share padded back into
    place."""
    x, src = _tracer(operand), _tracer(source)
    compare = {"ge": tnp.greater_equal, "gt": tnp.greater, "le": tnp.less_equal, "lt": tnp.less}[select]
    nd = x.ndim
    window = tuple(int(w) for w in window_dimensions)
    strides = tuple(int(v) for v in window_strides)
    pads = _pairs(padding, nd, "select_and_scatter_add")
    fill = _identity("max" if select in ("ge", "gt") else "min", x.dtype)
    padded = _pad_general(x, fill, [p[0] for p in pads], [p[1] for p in pads], [0] * nd)
    out_shape = _out_shape(padded.shape, window, strides, (1,) * nd)
    if tuple(out_shape) != tuple(src.shape):
        raise ValueError(f"select_and_scatter_add: source has shape {src.shape}, the windows {tuple(out_shape)}")
    positions = list(itertools.product(*[range(w) for w in window]))
    best = choice = None
    for k, pos in enumerate(positions):
        s = _window_slice(padded, 0, pos, strides, out_shape)
        if best is None:
            best, choice = s, tnp.zeros(tuple(out_shape), np.int32)
            continue
        keep = compare(best, s)
        best, choice = tnp.where(keep, best, s), tnp.where(keep, choice, k)
    out = tnp.zeros(padded.shape, src.dtype)
    for k, pos in enumerate(positions):
        share = tnp.where(choice == k, src, tnp.zeros((), src.dtype))
        high = [n - o - (m - 1) * st - 1 for n, o, m, st in zip(padded.shape, pos, out_shape, strides)]
        out = out + _pad_general(share, 0, list(pos), high, [st - 1 for st in strides])
    crop = tuple(slice(lo, n - hi) for (lo, hi), n in zip(pads, padded.shape))
    return out[crop]


def _identity(kind, dtype):
    d = np.dtype(dtype)
    if kind in ("add", "mul"):
        return 0 if kind == "add" else 1
    if d.kind in "iu":
        return np.iinfo(d).min if kind == "max" else np.iinfo(d).max
    if d == np.bool_:
        return False if kind == "max" else True
    return -np.inf if kind == "max" else np.inf
