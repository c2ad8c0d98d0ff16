"""tessel.tree_util against jax.tree_util (jax from PyPI) on the same trees:
the same leaves in the same order, the same structures, containers rebuilt
as their own types; and those types kept through jit, grad and vmap."""

import collections
import dataclasses
import typing

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import tree_util as ttu

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)
jtu = jax.tree_util


class Params(typing.NamedTuple):
    w: object
    b: object


@dataclasses.dataclass
class State:
    step: object
    params: object
    name: str = dataclasses.field(default="s", metadata=dict(static=True))


class Pair:
    """A class registered by its own tree_flatten / tree_unflatten."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def tree_flatten(self):
        return (self.a, self.b), "pair"

    @classmethod
    def tree_unflatten(cls, aux, children):
        assert aux == "pair"
        return cls(*children)

    def __eq__(self, other):
        return type(other) is Pair and (self.a, self.b) == (other.a, other.b)


ttu.register_dataclass(State)
jtu.register_dataclass(State, data_fields=["step", "params"], meta_fields=["name"])
ttu.register_pytree_node_class(Pair)
jtu.register_pytree_node_class(Pair)

TREES = [
    1,
    None,
    (1, 2, [3, None, 4]),
    {"b": 1, "a": (2, 3), "c": {"y": 4, "x": 5}},
    collections.OrderedDict([("z", 1), ("a", 2)]),
    Params(w=[1, 2], b=3),
    State(step=1, params=Params(2, {"k": 3}), name="t"),
    [Pair(1, (2, 3)), Pair(None, 4)],
    ((), [], {}),
]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: type(t).__name__)
def test_leaves_and_structure_match_jax(tree):
    leaves, treedef = ttu.tree_flatten(tree)
    j_leaves, j_treedef = jtu.tree_flatten(tree)
    assert leaves == j_leaves
    assert treedef.num_leaves == j_treedef.num_leaves
    assert treedef.num_nodes == j_treedef.num_nodes
    rebuilt = ttu.tree_unflatten(treedef, [x * 10 for x in leaves])
    assert rebuilt == jtu.tree_unflatten(j_treedef, [x * 10 for x in j_leaves])
    assert type(rebuilt) is type(tree)
    assert ttu.tree_structure(rebuilt) == treedef
    assert hash(ttu.tree_structure(rebuilt)) == hash(treedef)


def test_structures_differ_where_jaxs_do():
    pairs = [
        ((1, 2), [1, 2]),
        (Params(1, 2), (1, 2)),
        ({"a": 1}, collections.OrderedDict(a=1)),
        (State(1, 2, name="x"), State(1, 2, name="y")),  # meta fields are structure
        ([1, None], [1, 2]),
    ]
    for a, b in pairs:
        assert (ttu.tree_structure(a) == ttu.tree_structure(b)) == (jtu.tree_structure(a) == jtu.tree_structure(b))
        assert ttu.tree_structure(a) != ttu.tree_structure(b)


def test_tree_map_with_several_trees_and_a_prefix():
    a = {"x": Params(1, 2), "y": [3, 4]}
    b = {"x": Params(10, 20), "y": [30, 40]}
    assert ttu.tree_map(lambda u, v: u + v, a, b) == jtu.tree_map(lambda u, v: u + v, a, b)
    # `a`'s leaves matched to whole subtrees of the second tree
    prefix = {"x": 1, "y": 2}
    full = {"x": (5, 6), "y": [7]}
    assert ttu.tree_map(lambda u, v: (u, v), prefix, full) == jtu.tree_map(lambda u, v: (u, v), prefix, full)
    assert ttu.tree_map(lambda x: x * 2, [1, (2,)], is_leaf=lambda x: isinstance(x, tuple)) == [2, (2, 2)]
    with pytest.raises(ValueError, match="expected a dict with keys"):
        ttu.tree_map(lambda u, v: u, {"x": 1}, {"z": 1})


def test_leaves_and_reductions():
    tree = {"b": [1, 2], "a": Params(3, None)}
    assert ttu.tree_leaves(tree) == jtu.tree_leaves(tree)
    assert ttu.tree_reduce(lambda s, x: s + x, tree, 0) == 6
    assert ttu.tree_all([True, (1, 2)]) and not ttu.tree_all([True, (0,)])
    with pytest.raises(ValueError, match="has 2 leaves; 3 given"):
        ttu.tree_structure((1, 2)).unflatten([1, 2, 3])


def test_jit_grad_and_vmap_keep_container_types(cluster):
    rng = np.random.default_rng(3)
    w, b, x = rng.normal(size=(3, 2)), rng.normal(size=2), rng.normal(size=(4, 3))

    def loss(np_, p, state, x):
        y = np_.tanh(x @ p.w + p.b) * state.params["scale"]
        return np_.sum(y * y)

    def ours(p, state, x):
        return loss(tnp, p, state, x)

    p = Params(w, b)
    state = State(step=np.int32(0), params={"scale": np.float64(1.5)}, name="run")
    out = tessel.jit(lambda p: Params(p.w * 2, p.b + 1))(p)
    assert type(out) is Params
    np.testing.assert_allclose(out.w.fetch(), w * 2)
    st = tessel.jit(lambda s: State(s.step + 1, s.params, s.name))(state)
    assert type(st) is State and st.name == "run" and int(st.step.fetch()) == 1

    g = tessel.jit(tessel.grad(ours))(p, state, x)
    jg = jax.grad(lambda p, s, x: loss(jax.numpy, p, s, x))(p, state, x)
    assert type(g) is Params
    np.testing.assert_allclose(g.w.fetch(), np.asarray(jg.w), rtol=1e-10)
    np.testing.assert_allclose(g.b.fetch(), np.asarray(jg.b), rtol=1e-10)

    batched = tessel.jit(tessel.vmap(lambda p: Params(p.w.sum(), p.b * 2)))(Params(w, w[:, 0]))
    assert type(batched) is Params
    np.testing.assert_allclose(batched.w.fetch(), w.sum(axis=1))
