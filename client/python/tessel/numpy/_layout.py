"""Layout ops: reshape, transpose, broadcast, concatenate and stack, squeeze
and axes, triangles and eye, padding, roll, tile, repeat and split.
"""

import builtins

import numpy as _np

from tessel import _dtypes
from tessel.v1 import ir_pb2
from tessel.numpy._core import (
    _b,
    _broadcast,
    _convert,
    float64,
    int64,
    _is_pyscalar,
    _op,
    _operand,
    _result_dtype,
    _tracer,
    zeros,
)
from tessel.numpy._elementwise import add, astype, equal, greater_equal, multiply, where


# ---------------------------------------------------------------- layout


@_op
def reshape(a, shape=None, order="C", *, newshape=None, copy=None):
    """numpy.reshape (row-major); `shape` is the Array API's name, and
    numpy's older `newshape` still works."""
    if order != "C":
        raise NotImplementedError(f"reshape: order={order!r}; only row-major ('C') is supported")
    newshape = shape if newshape is None else newshape
    if newshape is None:
        raise TypeError("reshape: missing the new shape")
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
    return _pad_general(t, constant_values, widths[:, 0], widths[:, 1], [0] * t.ndim)


def _pad_general(x, value, low, high, interior):
    """StableHLO's pad, the one place the IR's PAD is emitted: `interior`
    values between neighbours (a dilation), `low`/`high` at the ends; a
    negative one crops."""
    low, high, interior = [int(v) for v in low], [int(v) for v in high], [int(v) for v in interior]
    if not any(low) and not any(high) and not any(interior):
        return x
    grow = [builtins.max(v, 0) for v in low], [builtins.max(v, 0) for v in high]
    shape = tuple(
        (0 if n == 0 else n + (n - 1) * i) + lo + hi for n, lo, hi, i in zip(x.shape, grow[0], grow[1], interior)
    )

    def attrs(node):
        node.pad.low.extend(grow[0])
        node.pad.high.extend(grow[1])
        if any(interior):
            node.pad.interior.extend(interior)

    out = _b().node(ir_pb2.PAD, [x, _operand(value, x.dtype, ())], shape, x.dtype, set_attrs=attrs)
    if builtins.min(low + high) < 0:
        out = out[tuple(slice(-lo if lo < 0 else 0, n + hi if hi < 0 else n) for lo, hi, n in zip(low, high, shape))]
    return out


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
