"""tessel.vmap: a function mapped over a batch dimension (jax.vmap).

The function is traced once, at the shapes of one element of the batch, into
a function of the graph, and a VMAP node runs it over the batch; the
coordinator expands that node with batching rules (scheduler/batching.cc),
so every SDK maps functions the same way. Values that do not depend on the
batch are computed once. Outside a trace each call runs as a one-off jitted
program.
"""

import numpy as np

from tessel import _region
from tessel._jit import jit
from tessel._trace import Tracer, current_builder
from tessel._tree import children_of, describe, flatten, num_leaves, unflatten
from tessel.v1 import ir_pb2

__all__ = ["vmap"]


def _prefix(axes, s, what):
    """Per leaf of structure `s`, its axis (an int, or None): `axes` is an
    int or None for everything below, or a tuple, list or dict matching the
    structure down to where it gives an int or None (a pytree prefix, as
    jax.vmap's in_axes and out_axes)."""
    if axes is None or isinstance(axes, (int, np.integer)):
        return [None if axes is None else int(axes)] * num_leaves(s)
    kind, children = s[0], children_of(s)
    sub = None
    if kind in ("tuple", "list", "namedtuple") and isinstance(axes, (tuple, list)) and len(axes) == len(children):
        sub = list(axes)
    elif kind in ("dict", "odict") and isinstance(axes, dict) and sorted(axes) == sorted(s[1]):
        sub = [axes[k] for k in s[1]]
    elif kind == "node" and type(axes) is s[1]:
        sub = flatten(axes, is_leaf=lambda x: x is not axes)[0]
    if sub is not None:
        return [a for ax, c in zip(sub, children) for a in _prefix(ax, c, what)]
    raise ValueError(
        f"vmap {what}={axes!r} does not match the structure it maps ({describe(s)}): expected an "
        "int, None, or a tuple, list or dict of those with the same structure"
    )


def vmap(fun, in_axes=0, out_axes=0, axis_size=None):
    """jax.vmap: `fun` mapped over axis `in_axes` of its arguments (None: an
    argument the same for every element), its results stacked along
    `out_axes` (None: a result that must not depend on the batch). Composes
    with jit, grad and itself."""
    name = getattr(fun, "__name__", "f")

    def wrapped(*args):
        leaves, paths, structure = flatten(args)
        if current_builder() is None and not any(isinstance(x, Tracer) for x in leaves):
            return jit(wrapped)(*args)
        axes = _prefix(tuple(in_axes) if isinstance(in_axes, list) else in_axes, structure, "in_axes")
        ops = _region.operands(leaves)
        in_norm, sizes = [], []
        for x, a, p in zip(ops, axes, paths):
            if a is None:
                in_norm.append(-1)
                continue
            if not -x.ndim <= a < x.ndim:
                raise ValueError(
                    f"vmap of {name}: in_axes {a} for argument{p} of rank {x.ndim} "
                    f"({_region.describe(x.shape, x.dtype)}): expected an axis in [{-x.ndim}, {x.ndim})"
                )
            a %= x.ndim
            in_norm.append(a)
            sizes.append((p, x.shape[a]))
        distinct = {n for _, n in sizes}
        if axis_size is not None:
            distinct.add(int(axis_size))
        if len(distinct) > 1:
            listed = ", ".join(f"argument{p} has {n}" for p, n in sizes)
            raise ValueError(
                f"vmap of {name}: inconsistent sizes for the mapped axes: {listed}"
                + (f", axis_size={axis_size}" if axis_size is not None else "")
            )
        if not distinct:
            raise ValueError(f"vmap of {name}: no argument is mapped (every in_axes is None): give axis_size")
        size = distinct.pop()
        specs = []
        for x, a in zip(ops, in_norm):
            shape = tuple(x.shape) if a < 0 else tuple(d for i, d in enumerate(x.shape) if i != a)
            specs.append((shape, np.dtype(x.dtype), bool(x.weak)))
        parent = current_builder()
        b, out, out_paths, out_structure = _region.trace(
            parent, "vmap_fn", fun, specs, paths, lambda ps: unflatten(structure, ps)
        )
        captured, _ = _region.bind_captures([b], len(ops))
        _region.finish(b, out)
        out_norm, result_specs = [], []
        for x, a, p in zip(out, _prefix(out_axes, out_structure, "out_axes"), out_paths):
            if a is None:
                out_norm.append(-1)
                result_specs.append(_region.spec(x))
                continue
            rank = len(x.shape) + 1
            if not -rank <= a < rank:
                raise ValueError(
                    f"vmap of {name}: out_axes {a} for result{p} of rank {rank - 1}: expected an axis "
                    f"in [{-rank}, {rank})"
                )
            a %= rank
            out_norm.append(a)
            shape = list(x.shape)
            shape.insert(a, size)
            result_specs.append((tuple(shape), np.dtype(x.dtype), bool(x.weak)))

        def attrs(node):
            node.batch.function = b.graph.name
            node.batch.in_axes.extend(in_norm + [-1] * len(captured))
            node.batch.out_axes.extend(out_norm)
            node.batch.size = size

        results = _region.control_node(parent, ir_pb2.VMAP, ops + captured, attrs, result_specs)
        return unflatten(out_structure, results)

    wrapped.__name__ = f"vmap({name})"
    wrapped.__doc__ = fun.__doc__
    return wrapped
