"""Indexing: take, gather and scatter, basic and advanced __getitem__,
dynamic slices, flips, and x.at[...] updates.
"""

import builtins

import numpy as _np

from tessel import _dtypes
from tessel._trace import Tracer
from tessel.v1 import ir_pb2
from tessel.numpy._core import _b, _convert, full, int64, _is_traced, _op, _operand, _tracer
from tessel.numpy._elementwise import (
    add,
    clip,
    greater_equal,
    less,
    logical_and,
    logical_or,
    maximum,
    minimum,
    multiply,
    remainder,
    where,
)
from tessel.numpy._layout import _axis_list, broadcast_to, ravel, reshape, _runs, _take_static, transpose


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


def _gather(t, idx, axis, batch_dims=0):
    """GATHER: t's slices along `axis` at the integer tracer `idx` (indices
    out of range clamp): dimensions t[:axis] + idx[batch_dims:] +
    t[axis+1:]. The first `batch_dims` dimensions of t and idx pair up:
    each batch element gathers from its own part of t."""

    def attrs(n):
        n.gather.axis = axis
        n.gather.batch_dims = batch_dims

    shape = t.shape[:axis] + idx.shape[batch_dims:] + t.shape[axis + 1 :]
    return _b().node(ir_pb2.GATHER, [t, idx], shape, t.dtype, set_attrs=attrs)


_COMBINE = {"set": None, "add": ir_pb2.SUM, "multiply": ir_pb2.PROD, "min": ir_pb2.REDUCE_MIN, "max": ir_pb2.REDUCE_MAX}


def _scatter(t, idx, updates, axis, mode, batch_dims=0):
    """SCATTER: t with `updates` put in at `idx` along `axis`, replacing
    (mode "set") or combined; updates at indices out of range are dropped.
    `batch_dims` as _gather's."""
    combine = _COMBINE[mode]
    if t.dtype == _np.bool_:  # add is or, multiply is and, as numpy's bool arithmetic
        combine = {ir_pb2.SUM: ir_pb2.REDUCE_MAX, ir_pb2.PROD: ir_pb2.REDUCE_MIN}.get(combine, combine)

    def attrs(n):
        n.scatter.axis = axis
        n.scatter.batch_dims = batch_dims
        if combine is not None:
            n.scatter.combine = combine

    return _b().node(ir_pb2.SCATTER, [t, idx, updates], t.shape, t.dtype, set_attrs=attrs)


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
    return _take_mode(t, parts, ax, mode, fill_value, "take_along_axis", lambda i: _take_along(t, i, ax))


def _take_along(t, i, ax):
    """t's elements at indices `i` along `ax`, the other dimensions paired
    with t's (broadcast together): one GATHER whose batch dims are those
    others, so an array split along them gathers where it lies."""
    n = t.shape[ax]
    if _is_traced(i):
        i = _wrap_negative(_tracer(i), n)
    else:
        i = _np.asarray(i)
        bad = (i >= n) | (i < -n) if i.dtype.kind != "u" else i >= n
        if bad.any():
            raise IndexError(f"index {int(i[bad].flat[0])} is out of bounds for axis {ax} with size {n}")
        i = _np.where(i < 0, i + n, i) if i.dtype.kind != "u" else i
    others = _np.broadcast_shapes(
        tuple(s for d, s in enumerate(t.shape) if d != ax), tuple(s for d, s in enumerate(i.shape) if d != ax)
    )
    last = list(range(ax)) + list(range(ax + 1, len(others) + 1)) + [ax]  # ax moved last
    tb = transpose(broadcast_to(t, others[:ax] + (n,) + others[ax:]), last)
    ishape = others[:ax] + (i.shape[ax],) + others[ax:]
    if isinstance(i, _np.ndarray):
        ib = _tracer(_np.ascontiguousarray(_np.transpose(_np.broadcast_to(i, ishape), last)))
    else:
        ib = transpose(broadcast_to(i, ishape), last)
    nb = len(others)
    back = list(range(ax)) + [nb] + list(range(ax, nb))
    return transpose(_gather(tb, ib, nb, nb), back)


def _fill_value_for(d, fill_value):
    if fill_value is not None:
        return fill_value
    if d.kind == "f" or d == _dtypes.BFLOAT16:
        return float("nan")
    if d == _np.bool_:
        return True
    return int(_np.iinfo(d).max if d.kind == "u" else _np.iinfo(d).min)


def _take_mode(t, parts, ax, mode, fill_value, what, getitem=None):
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
    # `getitem`: t indexed by parts with these indices at ax, when the caller has its own way
    index = getitem or (lambda i: _advanced_getitem(t, parts[:ax] + [i] + parts[ax + 1 :]))
    if mode != "fill":
        return index(i)
    i = _tracer(i)
    inside = logical_and(greater_equal(i, -n), less(i, n)) if i.dtype.kind != "u" else less(i, n)
    parts[ax] = where(inside, i, 0)
    got = index(parts[ax])
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
    if isinstance(start, _np.ndarray) and start.shape == () and start.dtype.kind in "iu":
        start = start[()]  # a 0-d integer array, as jax.lax takes it
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
