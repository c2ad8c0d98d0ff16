"""Pytrees, as jax.tree_util has them: tuples, lists, dicts (their keys
sorted), OrderedDicts (in their order), NamedTuples, None (a tree with no
leaves), and any type registered with register_pytree_node or
register_dataclass; everything else is a leaf. A structure key is a
hashable description of a tree without its leaves: jit keys its cache on it,
and every transformation rebuilds its results with it, each container as
its own type."""

import collections
import dataclasses

from tessel._array import Array

LEAF, NONE = ("leaf",), ("none",)  # the structure of one array, of None

# type -> (flatten(x) -> (children, aux), unflatten(aux, children) -> x,
# names(x, aux) -> a path suffix per child, or None for "[i]")
_NODES = {}


def register_pytree_node(nodetype, flatten_func, unflatten_func):
    """As jax.tree_util.register_pytree_node: `flatten_func(x)` returns
    (children, aux_data), aux_data hashable; `unflatten_func(aux_data,
    children)` rebuilds the node."""
    _NODES[nodetype] = (flatten_func, unflatten_func, None)
    return nodetype


def register_pytree_node_class(cls):
    """As jax.tree_util.register_pytree_node_class: the class's
    `tree_flatten()` and classmethod `tree_unflatten(aux, children)`."""
    _NODES[cls] = (lambda x: x.tree_flatten(), cls.tree_unflatten, None)
    return cls


def register_dataclass(nodetype, data_fields=None, meta_fields=None, drop_fields=()):
    """As jax.tree_util.register_dataclass: `data_fields` are children,
    `meta_fields` part of the structure (hashable). For a dataclass both may
    be left out: fields marked `metadata=dict(static=True)` are meta, the
    rest data."""
    if data_fields is None or meta_fields is None:
        if not dataclasses.is_dataclass(nodetype):
            raise TypeError(
                f"register_dataclass: {nodetype.__name__} is not a dataclass; name data_fields and meta_fields"
            )
        fields = [f for f in dataclasses.fields(nodetype) if f.init and f.name not in drop_fields]
        meta = [f.name for f in fields if f.metadata.get("static", False)]
        data = [f.name for f in fields if not f.metadata.get("static", False)]
        data_fields = data if data_fields is None else list(data_fields)
        meta_fields = meta if meta_fields is None else list(meta_fields)
    data_fields, meta_fields = tuple(data_fields), tuple(meta_fields)

    def flatten_fn(x):
        return [getattr(x, n) for n in data_fields], tuple(getattr(x, n) for n in meta_fields)

    def unflatten_fn(aux, children):
        return nodetype(**dict(zip(data_fields, children)), **dict(zip(meta_fields, aux)))

    _NODES[nodetype] = (flatten_fn, unflatten_fn, lambda x, aux: [f".{n}" for n in data_fields])
    return nodetype


def _is_namedtuple(tree):
    return isinstance(tree, tuple) and hasattr(type(tree), "_fields")


def flatten(tree, path="", leaves=None, paths=None, is_leaf=None):
    """Leaves, their paths and a structure key of `tree`."""
    if leaves is None:
        leaves, paths = [], []
    return leaves, paths, structure_of(tree, leaves, paths, path, is_leaf)


def structure_of(tree, leaves, paths=None, path="", is_leaf=None):
    """The structure key of `tree`; its leaves are appended to `leaves`, and
    their paths to `paths` when given (the fast path of a call skips them)."""
    t = type(tree)
    if t is not Array and (is_leaf is None or not is_leaf(tree)):  # an array, the common leaf, is no container
        if t is tuple or t is list:
            return (t.__name__, _children(tree, leaves, paths, path, is_leaf, None))
        if t is dict:
            keys = sorted(tree)
            names = None if paths is None else [f"[{k!r}]" for k in keys]
            return ("dict", tuple(keys), _children([tree[k] for k in keys], leaves, paths, path, is_leaf, names))
        if tree is None:
            return NONE
        node = _NODES.get(t)
        if node is not None:
            children, aux = node[0](tree)
            names = None if paths is None or node[2] is None else node[2](tree, aux)
            return ("node", t, aux, _children(children, leaves, paths, path, is_leaf, names))
        if t is collections.OrderedDict:
            keys = tuple(tree)
            names = None if paths is None else [f"[{k!r}]" for k in keys]
            return ("odict", keys, _children([tree[k] for k in keys], leaves, paths, path, is_leaf, names))
        if _is_namedtuple(tree):
            names = None if paths is None else [f".{n}" for n in t._fields]
            return ("namedtuple", t, _children(tree, leaves, paths, path, is_leaf, names))
    leaves.append(tree)
    if paths is not None:
        paths.append(path)
    return LEAF


def _children(items, leaves, paths, path, is_leaf, names):
    if paths is None:
        return tuple(structure_of(x, leaves, None, "", is_leaf) for x in items)
    return tuple(
        structure_of(x, leaves, paths, path + (names[i] if names else f"[{i}]"), is_leaf) for i, x in enumerate(items)
    )


def unflatten(structure, leaves):
    return _build(structure, iter(leaves))


def _build(s, it):
    # A module-level function, not a closure over itself: a recursive
    # closure is a reference cycle holding `it`, which would keep every
    # leaf (a call's output arrays) alive until the cyclic collector runs.
    kind = s[0]
    if kind == "leaf":
        return next(it)
    if kind == "none":
        return None
    if kind == "dict":
        return {k: _build(c, it) for k, c in zip(s[1], s[2])}
    if kind == "odict":
        return collections.OrderedDict((k, _build(c, it)) for k, c in zip(s[1], s[2]))
    if kind == "namedtuple":
        return s[1](*[_build(c, it) for c in s[2]])
    if kind == "node":
        return _NODES[s[1]][1](s[2], [_build(c, it) for c in s[3]])
    items = [_build(c, it) for c in s[1]]
    return tuple(items) if kind == "tuple" else items


def num_leaves(structure):
    kind = structure[0]
    if kind == "leaf":
        return 1
    if kind == "none":
        return 0
    children = {"dict": 2, "odict": 2, "namedtuple": 2, "node": 3}.get(kind, 1)
    return sum(num_leaves(c) for c in structure[children])


def children_of(structure):
    """The structure keys of a structure's children (none for a leaf)."""
    kind = structure[0]
    if kind in ("leaf", "none"):
        return ()
    return structure[{"dict": 2, "odict": 2, "namedtuple": 2, "node": 3}.get(kind, 1)]


def describe(key):
    """A structure as text: * for a leaf, containers as Python writes them."""
    kind = key[0]
    if kind == "leaf":
        return "*"
    if kind == "none":
        return "None"
    parts = ", ".join(describe(c) for c in children_of(key))
    if kind == "tuple":
        return f"({parts}{',' if len(children_of(key)) == 1 else ''})"
    if kind == "list":
        return f"[{parts}]"
    if kind in ("dict", "odict"):
        body = ", ".join(f"{k!r}: {describe(c)}" for k, c in zip(key[1], key[2]))
        return "{" + body + "}" if kind == "dict" else f"OrderedDict({{{body}}})"
    return f"{key[1].__name__}({parts})"
