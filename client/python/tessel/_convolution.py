"""Convolutions and pooling windows, with jax.lax's signatures.

conv_general_dilated and reduce_window are composed of ops the IR already
has, so their gradients, vmap and partitioning are those ops' rules:

- a convolution pads its input (lhs dilation is the pad's interior), then
  adds up, over the kernel's positions, one dot_general per position: a
  strided slice of the input against that position's kernel slice,
  contracting the input features (grouped as feature_group_count and
  batch_group_count say);
- a window reduction pads with the reduction's identity (base dilation is
  the pad's interior), then reduces the window's strided slices pairwise.

Both hold only the result and one slice at a time, never an im2col copy.
"""

import builtins
import itertools
import math

import numpy as np

from tessel import numpy as tnp
from tessel.numpy._core import _operand, _tracer
from tessel.numpy._dot import _dot_general, _preferred
from tessel.numpy._layout import _pad_general

__all__ = ["conv", "conv_general_dilated", "conv_with_general_padding", "padtype_to_pads", "reduce_window"]


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
    x = tnp.transpose(x, lhs_spec)  # N, C, spatial...
    k = tnp.transpose(k, rhs_spec)  # O, I, spatial...
    strides = tuple(int(s) for s in window_strides)
    lhs_dil = tuple(int(d) for d in (lhs_dilation or (1,) * ns))
    rhs_dil = tuple(int(d) for d in (rhs_dilation or (1,) * ns))
    for name, v in (("window_strides", strides), ("lhs_dilation", lhs_dil), ("rhs_dilation", rhs_dil)):
        if len(v) != ns or builtins.min(v, default=1) < 1:
            raise ValueError(f"conv_general_dilated: {name} needs {ns} positive entries, got {v}")
    n, c = x.shape[:2]
    o, i = k.shape[:2]
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
    window = k.shape[2:]
    dilated_in = [0 if m == 0 else (m - 1) * d + 1 for m, d in zip(x.shape[2:], lhs_dil)]
    dilated_window = [(w - 1) * d + 1 for w, d in zip(window, rhs_dil)]
    if isinstance(padding, str):
        pads = padtype_to_pads(dilated_in, dilated_window, strides, padding)
    else:
        pads = _pairs(padding, ns, "conv_general_dilated")
    (x, k), finish = _preferred((x, k), preferred_element_type)
    zero = 0.0 if np.dtype(x.dtype).kind in "fV" else 0
    x = _pad_general(
        x, zero, [0, 0] + [p[0] for p in pads], [0, 0] + [p[1] for p in pads], [0, 0] + [d - 1 for d in lhs_dil]
    )
    out_sp = _out_shape(x.shape[2:], window, strides, rhs_dil)
    # Grouped: lhs (groups, N', C') and rhs (groups, O', I) with the groups a
    # batch dimension of each dot; out features ordered group-major.
    if g > 1:
        x = tnp.reshape(x, (n, g, c // g) + x.shape[2:])
        x = tnp.moveaxis(x, 1, 0)  # G, N, Cg, spatial
        k = tnp.reshape(k, (g, o // g, i) + tuple(window))
    elif b > 1:
        x = tnp.reshape(x, (b, n // b, c) + x.shape[2:])  # B, N', C, spatial
        k = tnp.reshape(k, (b, o // b, i) + tuple(window))
    else:
        x = tnp.expand_dims(x, 0)
        k = tnp.expand_dims(k, 0)
    acc = None
    for pos in itertools.product(*[range(w) for w in window]):
        patch = _window_slice(x, 3, [p * d for p, d in zip(pos, rhs_dil)], strides, out_sp)  # G, N, C, out...
        kern = k[(slice(None), slice(None), slice(None)) + pos]  # G, O, I
        # batch G; contract C with I -> G, N, out..., O
        term = _dot_general(patch, kern, [0], [0], [2], [2])
        acc = term if acc is None else tnp.add(acc, term)
    if acc is None:  # an empty window: a zero-sized kernel
        raise ValueError(f"conv_general_dilated: the kernel's spatial dimensions {tuple(window)} hold nothing")
    # acc: G, N', out..., O'  ->  N, out..., O
    perm = [1] + list(range(2, 2 + ns)) + [0, 2 + ns]
    acc = tnp.transpose(acc, perm)  # N', out..., G, O'
    acc = tnp.reshape(acc, (acc.shape[0],) + tuple(out_sp) + (o,))
    # N, out..., C  ->  the out layout
    nc_first = tnp.moveaxis(acc, -1, 1)  # N, C, out...
    inverse = [0] * nd
    for pos, dim in enumerate(out_spec):
        inverse[dim] = pos
    return finish(tnp.transpose(nc_first, inverse))


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


def _identity(kind, dtype):
    d = np.dtype(dtype)
    if kind in ("add", "mul"):
        return 0 if kind == "add" else 1
    if d.kind in "iu":
        return np.iinfo(d).min if kind == "max" else np.iinfo(d).max
    if d == np.bool_:
        return False if kind == "max" else True
    return -np.inf if kind == "max" else np.inf
