"""Sorting: sort, argsort and searchsorted."""

import numpy as _np

from tessel import _dtypes
from tessel.v1 import ir_pb2
from tessel.numpy._core import _b, _convert, int64, _op, _result_dtype, _tracer
from tessel.numpy._elementwise import equal, less, less_equal, logical_and, logical_or, not_equal
from tessel.numpy._layout import _axis_list, expand_dims, ravel, reshape
from tessel.numpy._reductions import sum
from tessel.numpy._indexing import take


# ---------------------------------------------------------------- sorting


def _sort_node(keys, moved, axis, descending):
    """SORT: `moved` (or the keys themselves) reordered along `axis` by a
    stable sort of the keys, NaN last (descending: first)."""
    ops = [keys] if moved is None else [keys, moved]

    def attrs(n):
        n.sort.dimension = axis
        n.sort.descending = bool(descending)
        n.sort.result_operand = len(ops) - 1

    return _b().node(ir_pb2.SORT, ops, ops[-1].shape, ops[-1].dtype, set_attrs=attrs)


def _sort_axis(t, axis, name):
    if axis is None:
        return ravel(t), 0
    if t.ndim == 0:
        raise _np.exceptions.AxisError(f"{name}: axis {axis} is out of bounds for array of dimension 0")
    return t, _axis_list(axis, t.ndim, name)[0]


@_op
def sort(a, axis=-1, kind=None, order=None, *, stable=True, descending=False):
    """numpy.sort, always stable: NaN sorts last, -0.0 and 0.0 are equal
    (they keep their order, as numpy's stable sort). `descending` (as
    jax.numpy) orders the largest first, NaN first, equal keys still in
    their order."""
    if order is not None:
        raise NotImplementedError("sort: `order` (structured arrays) is not supported")
    t, ax = _sort_axis(_tracer(a), axis, "sort")
    return _sort_node(t, None, ax, descending)


@_op
def argsort(a, axis=-1, kind=None, order=None, *, stable=True, descending=False):
    """numpy.argsort (as kind='stable'): int64 indices."""
    if order is not None:
        raise NotImplementedError("argsort: `order` (structured arrays) is not supported")
    t, ax = _sort_axis(_tracer(a), axis, "argsort")
    return _sort_node(t, _b().iota(t.shape, _np.dtype(int64), ax), ax, descending)


@_op
def searchsorted(a, v, side="left", sorter=None, method=None):
    """numpy.searchsorted into a sorted 1-D `a` (NaN sorts last, as
    numpy's): per value of v, how many elements of a go before it (left:
    those less than it; right: those not greater). Every pair is compared
    (a broadcast compare and a sum): memory grows as len(a) * v.size."""
    t = _tracer(a)
    if t.ndim != 1:
        raise ValueError(f"searchsorted: a must be 1-dimensional, got {t!r}")
    if side not in ("left", "right"):
        raise ValueError(f"searchsorted: side must be 'left' or 'right', got {side!r}")
    if sorter is not None:
        t = take(t, sorter)
    x = _tracer(v)
    d = _result_dtype(t, x)
    sa = reshape(_convert(t, d), (1,) * x.ndim + t.shape)
    sv = expand_dims(_convert(x, d), -1)
    before = less(sa, sv) if side == "left" else less_equal(sa, sv)
    if d.kind == "f" or d == _dtypes.BFLOAT16:  # NaN is the largest: every number goes before it
        nan_v = not_equal(sv, sv)
        before = logical_or(before, logical_and(nan_v, equal(sa, sa)) if side == "left" else nan_v)
    return sum(before, axis=-1, dtype=int64)
