"""Products: dot_general, matmul, dot, einsum, tensordot and outer,
diagonal and trace.
"""

import builtins
import operator as _operator

import numpy as _np

from tessel import _context, _dtypes
from tessel.v1 import ir_pb2
from tessel.numpy._core import _b, _broadcast, _convert, _op, _result_dtype, _tracer
from tessel.numpy._elementwise import multiply, not_equal
from tessel.numpy._layout import _axis_list, broadcast_to, moveaxis, reshape, transpose
from tessel.numpy._reductions import sum


# ---------------------------------------------------------------- dot


def _dot_general(lhs, rhs, lb, rb, lc, rc):
    d = _result_dtype(lhs, rhs)
    if d == _np.bool_:
        # numpy: a logical or of ands; the IR's dot multiplies numbers.
        return not_equal(
            _dot_general(_convert(_tracer(lhs), _np.int32), _convert(_tracer(rhs), _np.int32), lb, rb, lc, rc), 0
        )
    l, r = _convert(_tracer(lhs), d), _convert(_tracer(rhs), d)
    for a, b in zip(lc, rc):
        if l.shape[a] != r.shape[b]:
            raise ValueError(f"dot: contracting dimensions differ: {l!r} dim {a} vs {r!r} dim {b}")
    shape = (
        [l.shape[i] for i in lb]
        + [s for i, s in enumerate(l.shape) if i not in lb and i not in lc]
        + [s for i, s in enumerate(r.shape) if i not in rb and i not in rc]
    )

    def attrs(n):
        g = n.dot_general
        g.lhs_batch.extend(lb), g.rhs_batch.extend(rb)
        g.lhs_contracting.extend(lc), g.rhs_contracting.extend(rc)

    out = _b().node(ir_pb2.DOT_GENERAL, [l, r], shape, d, set_attrs=attrs)
    hook = _context.remat_hook()  # a checkpointed function saving or replaying its dots
    if hook is None:
        return out
    return hook("dot", out, batch=bool(lb), operands=(l, r), dims=(lb, rb, lc, rc))


def _preferred(operands, preferred_element_type):
    """The operands in the type a product with `preferred_element_type`
    accumulates in, and a function giving its result that type. As XLA: the
    product is computed in the wider of the operands' common type and the
    preferred one (bf16 operands accumulate in float32 when float32 is
    preferred), then takes the preferred type."""
    ts = [_tracer(o) for o in operands]
    if preferred_element_type is None:
        return ts, lambda r: r
    want = _np.dtype(preferred_element_type)
    common = _result_dtype(*ts)
    if _dtypes.is_float(want) != _dtypes.is_float(common) and common != _np.bool_:
        raise TypeError(
            f"preferred_element_type {want.name} for operands of {common.name}: a float product must "
            "prefer a float type, an integer one an integer type"
        )
    acc = want if common == _np.bool_ else _np.promote_types(common, want)
    return [t if t.dtype == acc else _convert(t, acc) for t in ts], lambda r: r if r.dtype == want else _convert(
        r, want
    )


@_op
def matmul(x1, x2, *, precision=None, preferred_element_type=None):
    """numpy.matmul; `precision` is accepted for JAX's signature (products
    here are computed at the operands' full precision)."""
    (a, b), finish = _preferred((x1, x2), preferred_element_type)
    return finish(_matmul(a, b))


def _matmul(a, b):
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("matmul: operands must have at least one dimension")
    if a.ndim == 1 or b.ndim == 1 or (a.ndim == 2 and b.ndim == 2):
        return _dot_general(a, b, [], [], [a.ndim - 1], [0 if b.ndim == 1 else b.ndim - 2])
    if b.ndim == 2:
        return _dot_general(a, b, [], [], [a.ndim - 1], [0])
    batch = _np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = _broadcast(a, batch + a.shape[-2:])
    b = _broadcast(b, batch + b.shape[-2:])
    nb = len(batch)
    return _dot_general(a, b, list(range(nb)), list(range(nb)), [nb + 1], [nb])


@_op
def dot(a, b, *, precision=None, preferred_element_type=None):
    (ta, tb), finish = _preferred((a, b), preferred_element_type)
    if ta.ndim == 0 or tb.ndim == 0:
        return finish(multiply(ta, tb))
    if ta.ndim > 2 or tb.ndim > 2:
        raise NotImplementedError("dot of arrays above 2-D: use matmul or einsum")
    return finish(_matmul(ta, tb))


@_op
def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """jax.lax.dot_general: dimension_numbers is ((lhs_contracting,
    rhs_contracting), (lhs_batch, rhs_batch)); the result's dimensions are
    the batch ones, then lhs's free ones, then rhs's."""
    ((lc, rc), (lb, rb)) = dimension_numbers
    (l, r), finish = _preferred((lhs, rhs), preferred_element_type)
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(
            f"dot_general: dimension_numbers {dimension_numbers}: contracting ({len(lc)} vs {len(rc)}) and "
            f"batch ({len(lb)} vs {len(rb)}) dimensions must pair up"
        )
    for what, dims, t in (("lhs", list(lc) + list(lb), l), ("rhs", list(rc) + list(rb), r)):
        for i in dims:
            if not 0 <= i < t.ndim:
                raise ValueError(f"dot_general: {what} dimension {i} is out of range for {t.ndim} dimensions")
    for a, b in zip(lb, rb):
        if l.shape[a] != r.shape[b]:
            raise ValueError(
                f"dot_general: batch dimensions differ: lhs dim {a} is {l.shape[a]}, rhs dim {b} is {r.shape[b]}"
            )
    return finish(_dot_general(l, r, list(lb), list(rb), list(lc), list(rc)))


def _einsum_parse(subscripts, ts):
    """Subscripts with each ellipsis spelled out as letters of its own
    (numpy's right-aligned, broadcast dimensions), and the output's."""
    spec = subscripts.replace(" ", "")
    ins, out = spec.split("->") if "->" in spec else (spec, None)
    ins = ins.split(",")
    if len(ins) != len(ts):
        raise ValueError(f"einsum '{subscripts}': {len(ins)} operand subscripts for {len(ts)} operands")
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in spec]
    n_ell = 0
    for s_, t in zip(ins, ts):
        if "..." in s_:
            n_ell = builtins.max(n_ell, t.ndim - (len(s_) - 3))
    ell = "".join(spare[:n_ell])
    expanded = []
    for s_, t in zip(ins, ts):
        if "..." in s_:
            k = t.ndim - (len(s_) - 3)
            if k < 0:
                raise ValueError(f"einsum '{subscripts}': '{s_}' has more letters than {t!r} has dimensions")
            s_ = s_.replace("...", ell[n_ell - k :])
        if "." in s_ or len(s_) != t.ndim:
            raise ValueError(f"einsum '{subscripts}': '{s_}' does not fit {t!r}")
        expanded.append(s_)
    if out is None:
        letters = "".join(expanded)
        out = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell))
    else:
        out = out.replace("...", ell)
        for c in out:
            if c not in "".join(expanded):
                raise ValueError(f"einsum '{subscripts}': output letter '{c}' is in no operand")
    return expanded, out


def _einsum_diagonals(subscripts, s_, t):
    """An operand whose letter repeats (`ii`, `iji`) as its diagonal over
    each repeat, the diagonal's letter last (numpy.diagonal's order)."""
    while len(set(s_)) != len(s_):
        c = next(c for c in s_ if s_.count(c) > 1)
        i = s_.index(c)
        j = s_.index(c, i + 1)
        if t.shape[i] != t.shape[j]:
            raise ValueError(
                f"einsum '{subscripts}': letter '{c}' repeated in one operand over dimensions of "
                f"sizes {t.shape[i]} and {t.shape[j]}: expected equal sizes"
            )
        t = diagonal(t, 0, i, j)
        s_ = "".join(x for k, x in enumerate(s_) if k not in (i, j)) + c
    return s_, t


def _einsum_pair(ls, rs, keep, l, r):
    """Contracts two operands, keeping the letters in `keep` (in the order
    batch, left's, right's); returns the result and its letters."""
    batch = [c for c in ls if c in rs and c in keep]
    contract = [c for c in ls if c in rs and c not in keep]
    # Letters in one operand only and kept nowhere are summed first.
    lonly = [i for i, c in enumerate(ls) if c not in rs and c not in keep]
    ronly = [i for i, c in enumerate(rs) if c not in ls and c not in keep]
    if lonly:
        l, ls = sum(l, tuple(lonly)), "".join(c for i, c in enumerate(ls) if i not in lonly)
    if ronly:
        r, rs = sum(r, tuple(ronly)), "".join(c for i, c in enumerate(rs) if i not in ronly)
    res = _dot_general(
        l,
        r,
        [ls.index(c) for c in batch],
        [rs.index(c) for c in batch],
        [ls.index(c) for c in contract],
        [rs.index(c) for c in contract],
    )
    order = (
        batch
        + [c for c in ls if c not in batch and c not in contract]
        + [c for c in rs if c not in batch and c not in contract]
    )
    return res, "".join(order)


@_op
def einsum(subscripts, *operands, optimize=None, precision=None, preferred_element_type=None):
    """numpy.einsum: any number of operands, ellipses (broadcast as numpy
    does), implicit or explicit output. Three or more operands contract
    pairwise, greedily: at each step the pair whose result is smallest. A
    letter repeated within one operand takes that operand's diagonal
    (`ii->i`, `ii` the trace, `bii->bi`)."""
    if not operands:
        raise ValueError("einsum: at least one operand is needed")
    ts, finish = _preferred(operands, preferred_element_type)
    ins, out = _einsum_parse(subscripts, ts)
    ins, ts = map(list, zip(*[_einsum_diagonals(subscripts, s_, t) for s_, t in zip(ins, ts)]))
    # numpy's einsum keeps the operands' type (integer sums wrap in it; bool
    # sums are a logical or), where sum() would widen: accumulate wide, then
    # convert, which gives the same bits.
    d = _result_dtype(*ts)
    # Every operand in the result's type before anything is summed: an
    # int64 operand of a float64 einsum must not sum (and wrap) as int64.
    ts = [t if t.dtype == d else _convert(t, d) for t in ts]
    sizes = {}
    for s_, t in zip(ins, ts):
        for c, n in zip(s_, t.shape):
            if c not in sizes or sizes[c] == 1:
                sizes[c] = n
            elif n not in (1, sizes[c]):
                raise ValueError(f"einsum '{subscripts}': letter '{c}' has sizes {sizes[c]} and {n}")
    # Dimensions of size 1 that meet a larger size broadcast to it.
    ts = [
        t if tuple(sizes[c] for c in s_) == t.shape else broadcast_to(t, tuple(sizes[c] for c in s_))
        for s_, t in zip(ins, ts)
    ]
    work = list(zip(ins, ts))
    while len(work) > 1:
        best = None
        for i in range(len(work)):
            for j in range(i + 1, len(work)):
                others = "".join(s_ for k, (s_, _) in enumerate(work) if k not in (i, j)) + out
                kept = set(work[i][0] + work[j][0]) & set(others)
                size = int(_np.prod([sizes[c] for c in kept], dtype=_np.int64))
                if best is None or size < best[0]:
                    best = (size, i, j, kept)
        _, i, j, kept = best
        (ls, l), (rs, r) = work[i], work[j]
        res, letters = _einsum_pair(ls, rs, kept, l, r)
        work = [w for k, w in enumerate(work) if k not in (i, j)] + [(letters, res)]
    ((s_, t),) = work
    summed = [i for i, c in enumerate(s_) if c not in out]
    r = sum(t, tuple(summed)) if summed else t
    rest = [c for c in s_ if c in out]
    return finish(_convert(transpose(r, [rest.index(c) for c in out]), d))


@_op
def diagonal(a, offset=0, axis1=0, axis2=1):
    """numpy.diagonal: the diagonal over axes (axis1, axis2), offset above
    (> 0) or below (< 0) the main one, as the last dimension. A strided
    slice of the two axes flattened: no gather."""
    t = _tracer(a)
    a1, a2 = _axis_list(axis1, t.ndim, "diagonal")[0], _axis_list(axis2, t.ndim, "diagonal")[0]
    if a1 == a2:
        raise ValueError(f"diagonal: axis1 and axis2 cannot be the same (both {a1})")
    t = moveaxis(t, (a1, a2), (-2, -1))
    n, m = t.shape[-2:]
    offset = _operator.index(offset)
    k = builtins.max(0, builtins.min(n, m - offset) if offset >= 0 else builtins.min(n + offset, m))
    flat = reshape(t, t.shape[:-2] + (n * m,))
    if k == 0:
        return flat[..., 0:0]
    start = offset if offset >= 0 else -offset * m
    return flat[..., start : start + (k - 1) * (m + 1) + 1 : m + 1]


@_op
def trace(a, offset=0, axis1=0, axis2=1, dtype=None):
    """numpy.trace: the sum of diagonal(a, offset, axis1, axis2), in sum's dtype."""
    return sum(diagonal(a, offset, axis1, axis2), axis=-1, dtype=dtype)


@_op
def tensordot(a, b, axes=2):
    ta, tb = _tracer(a), _tracer(b)
    if isinstance(axes, (int, _np.integer)):
        if not 0 <= axes <= builtins.min(ta.ndim, tb.ndim):
            raise ValueError(f"tensordot: axes={axes} does not fit {ta!r} and {tb!r}")
        axes_a, axes_b = list(range(ta.ndim - axes, ta.ndim)), list(range(axes))
    else:
        axes_a, axes_b = axes
        axes_a = _axis_list(axes_a, ta.ndim, "tensordot")
        axes_b = _axis_list(axes_b, tb.ndim, "tensordot")
    if len(axes_a) != len(axes_b) or builtins.any(ta.shape[i] != tb.shape[j] for i, j in zip(axes_a, axes_b)):
        raise ValueError(f"tensordot: shape-mismatch for sum over axes {axes_a} of {ta!r} and {axes_b} of {tb!r}")
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    sa = [next(letters) for _ in range(ta.ndim)]
    sb = [next(letters) for _ in range(tb.ndim)]
    for i, j in zip(axes_a, axes_b):
        sb[j] = sa[i]
    out = [c for i, c in enumerate(sa) if i not in axes_a] + [c for j, c in enumerate(sb) if j not in axes_b]
    return einsum(f"{''.join(sa)},{''.join(sb)}->{''.join(out)}", ta, tb)
