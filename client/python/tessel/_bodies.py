"""Reductions with a body and sorts with a comparator: jax.lax.reduce and
jax.lax.sort, and the general sort tessel.jax reads from StableHLO.

The computation (or comparator) is traced once on scalars into a function
of the graph, which the op (REDUCE_WITH_BODY, SORT_WITH_COMPARATOR) applies
on the device. As in JAX, a reduction whose computation is lax.add, mul, max
or min with its identity as init value is the plain reduction, and a sort by
one key is the plain sort; a computation may close over constants, not over
traced values. Outside a trace each call runs as a one-off jitted function.
"""

import numpy as np

from tessel import _dtypes, _region
from tessel import numpy as tnp
from tessel._jit import jit
from tessel._trace import current_builder
from tessel._tree import flatten, unflatten
from tessel.numpy._sorting import _sort_node
from tessel.v1 import ir_pb2

# The monoids a plain REDUCE computes: the computation, its reduction, and
# whether an init value is its identity.
_MONOIDS = [
    (tnp.add, tnp.sum, lambda v, d: v == 0),
    (tnp.multiply, tnp.prod, lambda v, d: v == 1),
    (tnp.maximum, tnp.max, lambda v, d: v == (-np.inf if _dtypes.is_float(d) else _bounds(d)[0])),
    (tnp.minimum, tnp.min, lambda v, d: v == (np.inf if _dtypes.is_float(d) else _bounds(d)[1])),
]


def _bounds(d):
    if d == np.bool_:
        return False, True
    info = np.iinfo(d)
    return info.min, info.max


def _concrete(v):
    """The value of a host scalar, or None for a traced one."""
    if isinstance(v, (bool, int, float, np.generic)) or (isinstance(v, np.ndarray) and v.ndim == 0):
        return np.asarray(v).item()
    return None


def _axes(dims, rank, what):
    out = []
    for d in dims:
        d = int(d)
        if not -rank <= d < rank:
            raise ValueError(f"{what}: dimension {d} is out of range for an operand of rank {rank}")
        out.append(d % rank)
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: dimensions {list(dims)} repeat a dimension")
    return out


def _same_shape(xs, what):
    """`xs` as arrays, every one of the first's shape."""
    xs = [tnp.asarray(x) for x in xs]
    for k, x in enumerate(xs):
        if tuple(x.shape) != tuple(xs[0].shape):
            raise ValueError(
                f"{what}: operand {k} is {_region.describe(x.shape, x.dtype)}; expected the shape of operand 0, "
                f"{_region.describe(xs[0].shape, xs[0].dtype)}"
            )
    return xs


def _trace_body(parent, kind, fn, specs, build_args, what):
    """`fn` traced on scalars of `specs` into a function of `parent`'s
    graph; refuses a function that reads traced values from outside it."""
    paths = [f"[{i}]" for i in range(len(specs))]
    b, out, out_paths, structure = _region.trace(parent, kind, fn, specs, paths, build_args)
    if b.captures:
        names = ", ".join(_region.describe(o.shape, o.dtype) for o, _ in b.captures)
        raise TypeError(
            f"{what} reads traced values from outside it ({names}); as in JAX, it may close over "
            "constants only: pass such values as operands"
        )
    return b, out, out_paths, structure


def reduce(operands, init_values, computation, dimensions):
    """jax.lax.reduce: `computation(acc, x)` folds the `dimensions` of
    `operands` (a pytree of arrays of one shape) into `init_values` (a
    pytree of scalars of the same structure); results of that structure.
    As in JAX, the computation and init values must form a monoid (the
    order it is applied in is the implementation's: a pairwise tree)."""
    xs, structure = flatten(operands)[0::2]
    inits, init_structure = flatten(init_values)[0::2]
    if structure != init_structure or len(xs) != len(inits):
        raise ValueError(f"lax.reduce: operands and init_values differ in structure: {structure} vs {init_structure}")
    if not xs:
        raise TypeError("lax.reduce: needs at least one operand")
    if not _region.in_trace(xs + inits):
        n = len(xs)
        return jit(
            lambda *ls: reduce(unflatten(structure, ls[:n]), unflatten(structure, ls[n:]), computation, dimensions)
        )(*xs, *inits)
    xs = _same_shape(xs, "lax.reduce")
    shape = tuple(xs[0].shape)
    dims = _axes(dimensions, len(shape), "lax.reduce")
    cast = []
    for k, (x, v) in enumerate(zip(xs, inits)):
        if tuple(getattr(v, "shape", np.shape(v))) != ():
            raise ValueError(f"lax.reduce: init value {k} has shape {np.shape(v)}; init values are scalars")
        if _concrete(v) is None and np.dtype(v.dtype) != x.dtype and not v.weak:
            raise TypeError(
                f"lax.reduce: init value {k} is {_region.describe((), v.dtype)}; expected "
                f"{_region.describe((), x.dtype)}, operand {k}'s dtype"
            )
        cast.append(tnp.astype(tnp.asarray(v), x.dtype))
    # The plain reductions refuse an empty extent (numpy's max does); the
    # body's lowering gives the init values there, as JAX.
    if len(xs) == 1 and all(shape[d] > 0 for d in dims):
        value = _concrete(inits[0])
        for fn, reduction, identity in _MONOIDS:
            if computation is fn and value is not None and identity(value, xs[0].dtype):
                out = tnp.astype(reduction(xs[0], axis=tuple(dims)), xs[0].dtype)
                return unflatten(structure, [out])
    parent = current_builder()
    n = len(xs)
    specs = [((), x.dtype, False) for x in xs] * 2
    b, out, out_paths, out_structure = _trace_body(
        parent,
        "reduce_body",
        computation,
        specs,
        lambda ps: (unflatten(structure, ps[:n]), unflatten(structure, ps[n:])),
        "lax.reduce: the computation",
    )
    if out_structure != structure:
        raise TypeError(
            f"lax.reduce: the computation returned a result of structure {out_structure}; the operands are "
            f"{structure}"
        )
    for x, p, (_, dtype, _) in zip(out, out_paths, specs[:n]):
        if tuple(x.shape) != () or (x.dtype != dtype and not x.weak):
            raise TypeError(
                f"lax.reduce: the computation's result{p} is {_region.describe(x.shape, x.dtype)}; expected "
                f"{_region.describe((), dtype)}, a scalar of its operand's dtype"
            )
    out = _region.match(b, out, out_paths, specs[:n], "lax.reduce computation")
    _region.finish(b, out)

    def attrs(node):
        node.body.function = b.graph.name
        node.body.dims.extend(dims)

    kept = tuple(d for i, d in enumerate(shape) if i not in dims)
    results = _region.control_node(
        parent, ir_pb2.REDUCE_WITH_BODY, xs + cast, attrs, [(kept, x.dtype, False) for x in xs]
    )
    return unflatten(structure, results)


def sort_by(operands, dimension, less):
    """`operands` (arrays of one shape) each moved by one stable order of
    their elements along `dimension`, in which `less(a_1, b_1, ..., a_N,
    b_N)` (a strict weak order on scalars) says whether a sorts before b.
    StableHLO's sort with its comparator; a list of results."""
    if not _region.in_trace(list(operands)):
        return list(jit(lambda *xs: tuple(sort_by(xs, dimension, less)))(*operands))
    xs = _same_shape(operands, "sort")
    shape = tuple(xs[0].shape)
    if not shape:
        raise ValueError("sort: operands of rank 0 have no dimension to sort")
    (dim,) = _axes([dimension], len(shape), "sort")
    parent = current_builder()
    specs = [((), x.dtype, False) for x in xs for _ in (0, 1)]
    b, out, _, _ = _trace_body(parent, "sort_comparator", less, specs, lambda ps: ps, "sort: the comparator")
    if len(out) != 1 or tuple(out[0].shape) != () or out[0].dtype != np.bool_:
        got = ", ".join(_region.describe(o.shape, o.dtype) for o in out)
        raise TypeError(f"sort: the comparator must return a boolean scalar, got ({got})")
    _region.finish(b, out)

    def attrs(node):
        node.body.function = b.graph.name
        node.body.dimension = dim

    return _region.control_node(parent, ir_pb2.SORT_WITH_COMPARATOR, xs, attrs, [(shape, x.dtype, False) for x in xs])


def _float_less(a, b):
    """a before b in JAX's float order: NaN last, -0.0 equal to 0.0."""
    return tnp.logical_or(tnp.less(a, b), tnp.logical_and(tnp.isnan(b), tnp.logical_not(tnp.isnan(a))))


def _float_equal(a, b):
    return tnp.logical_or(tnp.equal(a, b), tnp.logical_and(tnp.isnan(a), tnp.isnan(b)))


def _key_less(num_keys, dtypes):
    """The lexicographic comparator over the first `num_keys` operands."""

    def less(*ab):
        p = None
        for k in reversed(range(num_keys)):
            a, b = ab[2 * k], ab[2 * k + 1]
            floats = _dtypes.is_float(dtypes[k])
            lt = _float_less(a, b) if floats else tnp.less(a, b)
            if p is None:
                p = lt
            else:
                eq = _float_equal(a, b) if floats else tnp.equal(a, b)
                p = tnp.logical_or(lt, tnp.logical_and(eq, p))
        return p

    return less


def sort(operand, dimension=-1, is_stable=True, num_keys=1):
    """jax.lax.sort: `operand` (an array, or a sequence of arrays of one
    shape) sorted along `dimension`, lexicographically by the first
    `num_keys` operands, the others moved by the same order. Stable (as
    is_stable=True allows either way); NaN sorts last and -0.0 equals 0.0,
    as in JAX."""
    del is_stable  # always stable
    single = not isinstance(operand, (list, tuple))
    ops = [operand] if single else list(operand)
    if not ops:
        raise TypeError("lax.sort: needs at least one operand")
    if single and num_keys != 1:
        raise ValueError(f"lax.sort: num_keys={num_keys} must equal 1 for a single operand")
    if not 1 <= num_keys <= len(ops):
        raise ValueError(f"lax.sort: num_keys={num_keys} must be between 1 and {len(ops)}")
    if not _region.in_trace(ops):
        out = jit(lambda *xs: tuple(sort(list(xs), dimension, True, num_keys)))(*ops)
        return out[0] if single else tuple(out)
    xs = _same_shape(ops, "lax.sort")
    if not xs[0].shape:
        raise ValueError("lax.sort: operands of rank 0 have no dimension to sort")
    (dim,) = _axes([dimension], len(xs[0].shape), "lax.sort")
    if num_keys == 1:
        out = [_sort_node(xs[0], None if k == 0 else x, dim, False) for k, x in enumerate(xs)]
    else:
        out = sort_by(xs, dim, _key_less(num_keys, [x.dtype for x in xs]))
    return out[0] if single else tuple(out)


def sort_key_val(keys, values, dimension=-1, is_stable=True):
    """jax.lax.sort_key_val: `values` moved by the sort of `keys`."""
    return sort([keys, values], dimension, is_stable, 1)


__all__ = ["reduce", "sort", "sort_by", "sort_key_val"]
