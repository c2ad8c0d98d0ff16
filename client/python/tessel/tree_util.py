"""tessel.tree_util: jax.tree_util's names over Tessel's pytrees.

Tuples, lists, dicts (keys sorted), OrderedDicts, NamedTuples and None are
containers, as are the types registered here; every container comes back as
its own type from tessel.jit, grad, vmap and the control flow of tessel.lax.
"""

import functools

from tessel._tree import (
    _NODES,
    children_of,
    describe,
    flatten,
    num_leaves,
    register_dataclass,
    register_pytree_node,
    register_pytree_node_class,
    unflatten,
)

__all__ = [
    "PyTreeDef",
    "register_dataclass",
    "register_pytree_node",
    "register_pytree_node_class",
    "tree_all",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_reduce",
    "tree_structure",
    "tree_unflatten",
]


class PyTreeDef:
    """A tree's structure without its leaves; equal structures compare and
    hash equal."""

    __slots__ = ("_key",)

    def __init__(self, key):
        self._key = key

    @property
    def num_leaves(self):
        return num_leaves(self._key)

    @property
    def num_nodes(self):
        def count(k):
            return 1 + sum(count(c) for c in children_of(k))

        return count(self._key)

    def children(self):
        return [PyTreeDef(c) for c in children_of(self._key)]

    def unflatten(self, leaves):
        leaves = list(leaves)
        if len(leaves) != self.num_leaves:
            raise ValueError(f"tree_unflatten: the structure has {self.num_leaves} leaves; {len(leaves)} given")
        return unflatten(self._key, leaves)

    def __eq__(self, other):
        return isinstance(other, PyTreeDef) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        return f"PyTreeDef({describe(self._key)})"


def tree_flatten(tree, is_leaf=None):
    leaves, _, key = flatten(tree, is_leaf=is_leaf)
    return leaves, PyTreeDef(key)


def tree_unflatten(treedef, leaves):
    return treedef.unflatten(leaves)


def tree_leaves(tree, is_leaf=None):
    return flatten(tree, is_leaf=is_leaf)[0]


def tree_structure(tree, is_leaf=None):
    return PyTreeDef(flatten(tree, is_leaf=is_leaf)[2])


def tree_map(f, tree, *rest, is_leaf=None):
    """f applied leaf by leaf; `rest` are trees with `tree`'s structure, or
    with it as a prefix: each of `tree`'s leaves is matched to a whole
    subtree of theirs."""
    leaves, treedef = tree_flatten(tree, is_leaf)
    others = [_subtrees_at_leaves(treedef._key, r) for r in rest]
    return treedef.unflatten(f(*xs) for xs in zip(leaves, *others))


def _subtrees_at_leaves(key, other, out=None):
    # Recursion through the module, not a closure over itself: a recursive
    # closure is a reference cycle, which would hold `out` (the user's
    # arrays) until the cyclic collector runs.
    out = [] if out is None else out
    kind = key[0]
    if kind == "leaf":
        out.append(other)
        return out
    if kind == "none":
        if other is not None:
            raise ValueError(f"tree_map: expected None, got {type(other).__name__}")
        return out
    expected = children_of(key)
    got = _child_values(other, key)
    if len(got) != len(expected):
        raise ValueError(
            f"tree_map: a {type(other).__name__} of {len(got)} children where the first tree has {len(expected)}"
        )
    for c, oc in zip(expected, got):
        _subtrees_at_leaves(c, oc, out)
    return out


def _child_values(x, key, what="tree_map", sequences=False):
    """The children of `x`, a container of `key`'s kind (with `sequences`,
    a list and a tuple stand for each other)."""
    kind = key[0]
    if kind in ("dict", "odict"):
        if not isinstance(x, dict) or sorted(x) != sorted(key[1]):
            raise ValueError(f"{what}: expected a dict with keys {list(key[1])}, got {_name(x)}")
        return [x[k] for k in key[1]]
    if kind in ("namedtuple", "node"):
        if type(x) is not key[1]:
            raise ValueError(f"{what}: expected a {key[1].__name__}, got {_name(x)}")
        return list(x) if kind == "namedtuple" else list(_NODES[type(x)][0](x)[0])
    if sequences and kind in ("tuple", "list") and type(x) in (tuple, list):
        return list(x)
    if type(x).__name__ != kind:
        raise ValueError(f"{what}: expected a {kind}, got {_name(x)}")
    return list(x)


def prefix_per_leaf(prefix, key, is_leaf, what, path=""):
    """One value of tree `prefix` per leaf of structure `key`: where
    `prefix` holds a leaf (is_leaf), it stands for every leaf of the
    subtree it matches, as JAX reads in_shardings against the arguments.
    A list and a tuple stand for each other. A structure that does not fit
    is a ValueError naming its path and both sides."""
    if is_leaf(prefix):
        return [prefix] * num_leaves(key)
    where = path or "the top"
    if key[0] == "leaf":
        raise ValueError(f"{what}: at {where} the tree has one leaf, but got a {_name(prefix)}")
    expected = children_of(key)
    values = _child_values(prefix, key, f"{what}: at {where}", sequences=True)
    if len(values) != len(expected):
        raise ValueError(
            f"{what}: at {where} a {_name(prefix)} of {len(values)} entries for {len(expected)} children "
            f"({describe(key)})"
        )
    if key[0] in ("dict", "odict"):
        names = [f"[{k!r}]" for k in key[1]]
    elif key[0] == "namedtuple":
        names = [f".{n}" for n in key[1]._fields]
    else:
        names = [f"[{i}]" for i in range(len(expected))]
    return [v for c, x, n in zip(expected, values, names) for v in prefix_per_leaf(x, c, is_leaf, what, path + n)]


def _name(x):
    return type(x).__name__ if not isinstance(x, dict) else f"dict with keys {sorted(x)}"


def tree_reduce(function, tree, initializer=None, is_leaf=None):
    leaves = tree_leaves(tree, is_leaf)
    if initializer is None:
        return functools.reduce(function, leaves)
    return functools.reduce(function, leaves, initializer)


def tree_all(tree, is_leaf=None):
    return all(tree_leaves(tree, is_leaf))
