"""StableHLO's gather and scatter with their full dimension numbers, as
tessel.numpy's point gathers (take) and scatters (.at[]) over an operand
flattened along the dims the indices choose.

Every dim of the operand is one of:
- a batching dim (operand_batching_dims): paired with a batch dim of the
  indices, position by position;
- an indexed dim (start_index_map): its window starts where the index
  vector says;
- an unindexed dim whose window starts at 0: kept whole where the window
  covers it, else a point dim whose start is 0.
The point dims are flattened into one leading dim; each element of each
window is then one linear position in it, and the dims kept whole ride
along. Gather clamps each start so that its window fits; scatter drops a
window that does not fit, whole (XLA's choice where StableHLO leaves it to
the implementation)."""

import numpy as np

from tessel import numpy as tnp
from tessel.numpy import _indexing


def _broadcast_in_dim(x, dims, shape):
    full = [1] * len(shape)
    for i, d in enumerate(dims):
        full[d] = x.shape[i]
    return tnp.broadcast_to(tnp.reshape(x, tuple(full)), tuple(shape))


def _positions(x, indices, index_vector_dim, index_map, batching, index_batching, starts_at_0, window, clamp):
    """Linear positions of every window's elements in `x` flattened over its
    point dims (`batching`, `index_map`, then `starts_at_0`).

    `window` maps each point dim whose window is an axis of the result to
    its size; the other point dims take one position. Returns xs (positions,
    kept dims...), lin and valid (of shape batch + the window sizes, in
    operand order), the number of positions, the dims kept whole and the
    indices' batch shape."""
    idx = tnp.asarray(indices)
    if index_vector_dim == idx.ndim:
        idx = tnp.expand_dims(idx, -1)
    idx = tnp.moveaxis(idx, index_vector_dim, -1)  # batch..., vector
    batch_shape = tuple(idx.shape[:-1])
    nb = len(batch_shape)
    point_dims = list(batching) + list(index_map) + list(starts_at_0)
    kept = [d for d in range(x.ndim) if d not in point_dims]
    sizes = [x.shape[d] for d in point_dims]
    total = int(np.prod(sizes, dtype=np.int64))
    xs = tnp.reshape(tnp.transpose(x, point_dims + kept), (total,) + tuple(x.shape[d] for d in kept))
    wdims = sorted(window)
    full = batch_shape + tuple(window[d] for d in wdims)

    def spread(c, dim):
        """A start per index (batch_shape), then each offset of dim's window along its axis."""
        c = tnp.reshape(c, batch_shape + (1,) * len(wdims))
        if dim in window:
            shape = [1] * len(full)
            shape[nb + wdims.index(dim)] = window[dim]
            c = c + tnp.reshape(tnp.arange(window[dim], dtype=np.int64), tuple(shape))
        return c

    coords, valid = [], None
    for bd in index_batching:
        pos = bd if bd < index_vector_dim else bd - 1  # among idx's batch dims, which lost the vector dim
        coords.append(spread(_broadcast_in_dim(tnp.arange(batch_shape[pos], dtype=np.int64), [pos], batch_shape), None))
    for k, dim in enumerate(index_map):
        n, s = x.shape[dim], window.get(dim, 1)
        c = tnp.astype(idx[..., k], np.int64)
        if clamp:
            c = tnp.clip(c, 0, max(n - s, 0))
        else:
            fits = (c >= 0) & (c <= n - s)
            valid = fits if valid is None else valid & fits
        coords.append(spread(c, dim))
    for dim in starts_at_0:
        coords.append(spread(tnp.zeros(batch_shape, np.int64), dim))
    lin, stride = None, 1
    for c, n in reversed(list(zip(coords, sizes))):
        term = c * stride if stride != 1 else c
        lin = term if lin is None else lin + term
        stride *= n
    lin = tnp.zeros(full, np.int64) if lin is None else tnp.broadcast_to(lin, full)
    if valid is None:
        valid = tnp.full(full, True)
    else:
        valid = tnp.broadcast_to(tnp.reshape(valid, batch_shape + (1,) * len(wdims)), full)
    return xs, lin, valid, total, kept, batch_shape


def _batched_form(x, indices, index_vector_dim, index_map, batching, index_batching, one_point):
    """Whether a gather or scatter is one GATHER/SCATTER with batch dims:
    the batching dims lead the operand and the indices alike, one dim is
    indexed by one index per point, and `one_point` holds for that dim.
    Returns (axis, number of batch dims, the indices without their vector
    dim), or None."""
    nb = len(batching)
    if not nb or list(batching) != list(range(nb)) or list(index_batching) != list(range(nb)):
        return None
    if len(index_map) != 1 or index_map[0] < nb or not one_point(index_map[0]):
        return None
    idx = tnp.asarray(indices)
    if index_vector_dim == idx.ndim - 1 and idx.shape[-1] == 1:
        idx = tnp.reshape(idx, tuple(idx.shape[:-1]))
    elif index_vector_dim != idx.ndim:
        return None
    if idx.ndim < nb:
        return None
    return index_map[0], nb, idx


def _reorder(dims, want):
    """The permutation that takes dims labelled `dims` to the order `want`."""
    return [dims.index(w) for w in want]


def gather(dimension_numbers, slice_sizes, x, indices):
    """stablehlo.gather: `dimension_numbers` is a GatherDimensionNumbers."""
    d, sizes = dimension_numbers, list(slice_sizes)
    x = tnp.asarray(x)
    form = _batched_form(
        x,
        indices,
        d.index_vector_dim,
        list(d.start_index_map),
        list(d.operand_batching_dims),
        list(d.start_indices_batching_dims),
        lambda dim: sizes[dim] == 1 and dim in set(d.collapsed_slice_dims),
    )
    whole = form is not None and all(sizes[k] == x.shape[k] for k in range(x.ndim) if k >= form[1] and k != form[0])
    if whole:  # one GATHER with batch dims: a batch split stays split
        axis, nb, idx = form
        out = _indexing._gather(x, idx, axis, nb)  # any integer indices, as the op takes them
        # ours: batch, operand[nb:axis], idx[nb:], operand[axis+1:]; StableHLO's:
        # the indices' dims (batch first) where no offset dim is, the operand's others at offset_dims
        ours = [("i", k) for k in range(nb)] + [("o", k) for k in range(nb, axis)]
        ours += [("i", k) for k in range(nb, idx.ndim)] + [("o", k) for k in range(axis + 1, x.ndim)]
        offsets = iter([("o", k) for k in range(nb, x.ndim) if k != axis])
        points = iter([("i", k) for k in range(idx.ndim)])
        want = [next(offsets) if p in set(d.offset_dims) else next(points) for p in range(out.ndim)]
        return tnp.transpose(out, _reorder(ours, want))
    index_map, batching = list(d.start_index_map), list(d.operand_batching_dims)
    collapsed = set(d.collapsed_slice_dims)
    # dims neither indexed nor batched start at 0 (a start of 0 clamps
    # there): a static crop keeps them whole
    crop = tuple(slice(None) if dim in index_map or dim in batching else slice(0, sizes[dim]) for dim in range(x.ndim))
    x = x[crop]
    window = {dim: sizes[dim] for dim in index_map if dim not in collapsed}
    xs, lin, _, _, kept, batch_shape = _positions(
        x, indices, d.index_vector_dim, index_map, batching, list(d.start_indices_batching_dims), [], window, True
    )
    out = tnp.take(xs, lin, axis=0, mode="clip")  # batch..., window dims..., kept dims...
    nb, wdims = len(batch_shape), sorted(window)
    if any(dim in collapsed for dim in kept):  # a collapsed dim nothing indexes: size 1, no axis
        out = tnp.reshape(
            out, tuple(out.shape[: nb + len(wdims)]) + tuple(x.shape[k] for k in kept if k not in collapsed)
        )
        kept = [k for k in kept if k not in collapsed]
    at = {dim: nb + i for i, dim in enumerate(wdims)}
    at.update({dim: nb + len(wdims) + i for i, dim in enumerate(kept)})
    offsets = sorted(at)  # the operand's dims with an axis in the result, in order
    order = [None] * (nb + len(offsets))
    for od, dim in zip(d.offset_dims, offsets):
        order[od] = at[dim]
    it = iter(range(nb))
    return tnp.transpose(out, [next(it) if o is None else o for o in order])


def scatter(dimension_numbers, x, indices, updates, mode):
    """stablehlo.scatter with an update computation tessel.numpy's .at[]
    has (`mode`: set, add, multiply, min, max); `dimension_numbers` is a
    ScatterDimensionNumbers."""
    d = dimension_numbers
    x, u = tnp.asarray(x), tnp.asarray(updates)
    index_map, batching = list(d.scattered_dims_to_operand_dims), list(d.input_batching_dims)
    inserted, window_dims = set(d.inserted_window_dims), list(d.update_window_dims)
    form = _batched_form(
        x,
        indices,
        d.index_vector_dim,
        index_map,
        batching,
        list(d.scatter_indices_batching_dims),
        inserted.__contains__,
    )
    if form is not None:
        axis, nb, idx = form
        # the updates' window dims: the operand's others, whole
        others = [k for k in range(nb, x.ndim) if k != axis]
        if len(window_dims) == len(others) and all(u.shape[w] == x.shape[k] for w, k in zip(window_dims, others)):
            points = [k for k in range(u.ndim) if k not in window_dims]  # the indices' dims, batch first
            at = dict(zip(others, window_dims))
            # SCATTER's updates: batch, operand[nb:axis], idx[nb:], operand[axis+1:]
            order = points[:nb] + [at[k] for k in range(nb, axis)] + points[nb:]
            order += [at[k] for k in range(axis + 1, x.ndim)]
            return _indexing._scatter(x, idx, tnp.transpose(u, order), axis, mode, nb)
    # the operand's dims with a window axis in the updates, in order
    windowed = [dim for dim in range(x.ndim) if dim not in batching and dim not in inserted]
    size = {dim: u.shape[window_dims[j]] for j, dim in enumerate(windowed)}
    starts_at_0 = [
        dim
        for dim in range(x.ndim)
        if dim not in index_map and dim not in batching and (dim in inserted or size[dim] != x.shape[dim])
    ]
    window = {dim: size[dim] for dim in windowed if dim in index_map or dim in starts_at_0}
    xs, lin, valid, total, kept, _ = _positions(
        x,
        indices,
        d.index_vector_dim,
        index_map,
        batching,
        list(d.scatter_indices_batching_dims),
        starts_at_0,
        window,
        False,
    )
    # updates: the indices' batch dims (in order), the window axes, the kept dims
    axis = {dim: window_dims[j] for j, dim in enumerate(windowed)}
    scatter_dims = [k for k in range(u.ndim) if k not in window_dims]
    u = tnp.transpose(u, scatter_dims + [axis[dim] for dim in sorted(window)] + [axis[dim] for dim in kept])
    lin = tnp.where(valid, lin, total)  # a window that does not fit: dropped, as XLA
    out = getattr(xs.at[lin], mode)(u)
    point_dims = batching + index_map + starts_at_0
    out = tnp.reshape(out, tuple(x.shape[dim] for dim in point_dims + kept))
    perm = point_dims + kept
    return tnp.transpose(out, [perm.index(dim) for dim in range(x.ndim)])
