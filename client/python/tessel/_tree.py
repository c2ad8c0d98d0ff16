"""Pytrees: tuples, lists, dicts and None, with arrays (or anything else)
as leaves. A structure key is a hashable description of a tree without its
leaves: jit keys its cache on it, and every transformation rebuilds its
results with it."""

from tessel._array import Array


def flatten(tree, path="", leaves=None, paths=None):
    """Leaves and a structure key of tuples, lists, dicts and None."""
    if leaves is None:
        leaves, paths = [], []
    return leaves, paths, structure_of(tree, leaves, paths, path)


def structure_of(tree, leaves, paths=None, path=""):
    """The structure key of `tree`; its leaves are appended to `leaves`, and
    their paths to `paths` when given (the fast path of a call skips them)."""
    if type(tree) is not Array:  # an array, the common leaf, is no container
        if isinstance(tree, (tuple, list)):
            if paths is None:
                return (type(tree).__name__, tuple(structure_of(x, leaves) for x in tree))
            return (
                type(tree).__name__,
                tuple(structure_of(x, leaves, paths, f"{path}[{i}]") for i, x in enumerate(tree)),
            )
        if isinstance(tree, dict):
            keys = sorted(tree)
            if paths is None:
                return ("dict", tuple(keys), tuple(structure_of(tree[k], leaves) for k in keys))
            return ("dict", tuple(keys), tuple(structure_of(tree[k], leaves, paths, f"{path}[{k!r}]") for k in keys))
        if tree is None:
            return NONE
    leaves.append(tree)
    if paths is not None:
        paths.append(path)
    return LEAF


LEAF, NONE = ("leaf",), ("none",)  # the structure of one array, of None


def unflatten(structure, leaves):
    it = iter(leaves)

    def build(s):
        kind = s[0]
        if kind == "leaf":
            return next(it)
        if kind == "none":
            return None
        if kind == "dict":
            return {k: build(c) for k, c in zip(s[1], s[2])}
        items = [build(c) for c in s[1]]
        return tuple(items) if kind == "tuple" else items

    return build(structure)
