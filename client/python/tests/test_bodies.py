"""Reductions with a body and sorts with a comparator (REDUCE_WITH_BODY,
SORT_WITH_COMPARATOR) against JAX on CPU (jax from PyPI): lax.reduce over
tuples and several dimensions, argmax written as its comparator, lax.sort
by several keys with NaN and ties, odd and single extents, gradients, vmap,
a split over devices, the same programs through tessel.jax, and bad input."""

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import lax
from tessel._bodies import sort_by

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)
jnp, jlax = jax.numpy, jax.lax

RNG = np.random.default_rng(41)


def sum_and_max(np_mod):
    def body(acc, x):
        return (acc[0] + x[0], np_mod.maximum(acc[1], x[1]))

    return body


def argmax_body(np_mod):
    """(value, index) pairs: the larger value, the smaller index on a tie."""

    def body(a, b):
        take_a = (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
        return (np_mod.where(take_a, a[0], b[0]), np_mod.where(take_a, a[1], b[1]))

    return body


@pytest.mark.parametrize("shape,dims", [((6, 7), (1,)), ((5, 4, 3), (0, 2)), ((9,), (0,)), ((3, 1), (1,))])
def test_a_tuple_reduction_matches_jax(cluster, shape, dims):
    x = RNG.normal(size=shape)
    y = RNG.integers(-50, 50, size=shape).astype(np.int32)
    inits = (0.0, np.int32(np.iinfo(np.int32).min))
    got = tessel.jit(lambda x, y: lax.reduce((x, y), inits, sum_and_max(tnp), dims))(x, y)
    want = jlax.reduce((x, y), inits, sum_and_max(jnp), dims)
    np.testing.assert_allclose(got[0].fetch(), np.asarray(want[0]), rtol=1e-12)
    np.testing.assert_array_equal(got[1].fetch(), np.asarray(want[1]))
    assert got[1].fetch().dtype == np.int32


def test_argmax_written_as_its_comparator_matches_jax(cluster):
    x = RNG.integers(0, 4, size=(5, 13)).astype(np.float32)  # ties on purpose
    inits = (np.float32(-np.inf), np.int32(0))
    for axis in (0, 1):
        idx = np.broadcast_to(
            np.arange(x.shape[axis], dtype=np.int32).reshape((-1, 1) if axis == 0 else (1, -1)), x.shape
        )
        got = tessel.jit(lambda x, i: lax.reduce((x, i), inits, argmax_body(tnp), (axis,)))(x, idx)
        np.testing.assert_array_equal(got[1].fetch(), np.argmax(x, axis=axis))
        np.testing.assert_array_equal(got[0].fetch(), np.max(x, axis=axis))


def test_a_body_over_an_empty_extent_gives_the_init_values(cluster):
    x = np.zeros((3, 0), np.float64)
    got = tessel.jit(lambda x: lax.reduce(x, 7.0, lambda a, b: a * b + 0.0, (1,)))(x)
    np.testing.assert_array_equal(got.fetch(), np.full(3, 7.0))


def test_the_monoids_are_the_plain_reduction(cluster):
    """lax.add with 0 is REDUCE (sum), as JAX's monoid reducers."""
    x = RNG.normal(size=(4, 5))
    f = tessel.jit(lambda x: lax.reduce(x, 0.0, lax.add, (0,)))
    np.testing.assert_allclose(f(x).fetch(), x.sum(axis=0), rtol=1e-12)
    assert "reduce_with_body" not in f.lower(x).as_text()


@pytest.mark.parametrize("n", [1, 2, 7, 16, 33])
def test_a_sort_by_two_keys_matches_jax(cluster, n):
    k1 = RNG.integers(0, 3, size=(4, n)).astype(np.int32)
    k2 = RNG.normal(size=(4, n))
    k2[0, : n // 2] = np.nan
    k2[1, :] = k2[1, 0]  # ties in both keys: the order of positions is kept
    k2[2, ::2] = -0.0
    k2[2, 1::2] = 0.0
    v = np.arange(4 * n, dtype=np.float64).reshape(4, n)
    got = tessel.jit(lambda a, b, c: lax.sort((a, b, c), dimension=1, num_keys=2))(k1, k2, v)
    want = jlax.sort((k1, k2, v), dimension=1, num_keys=2)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.fetch(), np.asarray(w))


def test_a_sort_along_the_leading_dimension_and_sort_key_val(cluster):
    keys = RNG.integers(0, 5, size=(11, 3)).astype(np.int64)
    vals = RNG.normal(size=(11, 3)).astype(np.float32)
    got = tessel.jit(lambda k, v: lax.sort((k, v), dimension=0, num_keys=2))(keys, vals)
    want = jlax.sort((keys, vals), dimension=0, num_keys=2)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.fetch(), np.asarray(w))
    kv = tessel.jit(lambda k, v: lax.sort_key_val(k, v, dimension=0))(keys, vals)
    for g, w in zip(kv, jlax.sort_key_val(keys, vals, dimension=0)):
        np.testing.assert_array_equal(g.fetch(), np.asarray(w))


def test_gradients_move_through_the_sort_and_the_body(cluster):
    k1 = RNG.integers(0, 3, size=(3, 9)).astype(np.float64)
    x = RNG.normal(size=(3, 9))
    w = RNG.normal(size=(3, 9))

    def loss(np_mod, sort):
        return lambda k, x: np_mod.sum(np_mod.sin(sort((k, x), dimension=1, num_keys=2)[1]) * w)

    got = tessel.jit(tessel.grad(loss(tnp, lax.sort), (0, 1)))(k1, x)
    want = jax.grad(loss(jnp, jlax.sort), (0, 1))(k1, x)
    for g, ww in zip(got, want):
        np.testing.assert_allclose(g.fetch(), np.asarray(ww), rtol=1e-12, atol=1e-14)
    # The max of distinct values, through the (value, index) body: one-hot, as jnp.max's gradient.
    v = RNG.permutation(24).astype(np.float64).reshape(4, 6)
    idx = np.broadcast_to(np.arange(6, dtype=np.int32), v.shape)

    def top(x):
        return tnp.sum(lax.reduce((x, idx), (-np.inf, np.int32(0)), argmax_body(tnp), (1,))[0] ** 2)

    g = tessel.jit(tessel.grad(top))(v).fetch()
    np.testing.assert_allclose(g, np.asarray(jax.grad(lambda x: jnp.sum(jnp.max(x, axis=1) ** 2))(v)), rtol=1e-12)


def test_vmap_of_a_body_matches_jax(cluster):
    x = RNG.normal(size=(5, 4, 6))
    idx = np.broadcast_to(np.arange(6, dtype=np.int32), (4, 6))

    def f(np_mod, reduce):
        return lambda x: reduce((x, idx), (-np.inf, np.int32(0)), argmax_body(np_mod), (1,))[1]

    got = tessel.jit(tessel.vmap(f(tnp, lax.reduce)))(x).fetch()
    np.testing.assert_array_equal(got, np.argmax(x, axis=2))
    s = tessel.jit(tessel.vmap(lambda x: lax.sort((x, -x), dimension=0, num_keys=2)[1]))(x).fetch()
    np.testing.assert_array_equal(s, np.asarray(jax.vmap(lambda x: jlax.sort((x, -x), dimension=0, num_keys=2)[1])(x)))


def test_a_split_operand_reduces_and_sorts_where_it_lies(cluster):
    mesh = tessel.Mesh({"data": 2})
    x = RNG.normal(size=(8, 10))
    idx = np.broadcast_to(np.arange(10, dtype=np.int32), x.shape)
    sh = tessel.NamedSharding(mesh, tessel.P("data"))
    xa, ia = tessel.device_put(x, sh), tessel.device_put(idx, sh)
    f = tessel.jit(lambda x, i: lax.reduce((x, i), (-np.inf, np.int32(0)), argmax_body(tnp), (1,))[1])
    np.testing.assert_array_equal(f(xa, ia).fetch(), np.argmax(x, axis=1))
    assert f.lower(xa, ia).collectives == []
    g = tessel.jit(lambda x, i: lax.sort((i % 3, x), dimension=1, num_keys=2)[1])
    np.testing.assert_array_equal(g(xa, ia).fetch(), np.asarray(jlax.sort((idx % 3, x), dimension=1, num_keys=2)[1]))


def test_jax_programs_with_bodies_run_through_tessel_jax(cluster):
    tjax = pytest.importorskip("tessel.jax")
    x = RNG.normal(size=(6, 9)).astype(np.float32)
    k = RNG.integers(0, 3, size=(6, 9)).astype(np.int32)

    def fun(x, k):
        s, m = jlax.reduce((x, k), (np.float32(0), np.int32(-(2**31))), sum_and_max(jnp), (1,))
        a, b = jlax.sort((k, x), dimension=1, num_keys=2)
        return s, m, a, b, jnp.argmax(x, axis=0)

    ours = tjax.jit(fun)(x, k)
    theirs = jax.jit(fun)(x, k)
    np.testing.assert_allclose(ours[0].fetch(), np.asarray(theirs[0]), rtol=1e-5)
    for o, t in zip(ours[1:], theirs[1:]):
        np.testing.assert_array_equal(o.fetch(), np.asarray(t))


def test_bad_bodies_are_clear_errors_and_the_cluster_keeps_serving(cluster):
    x = RNG.normal(size=(3, 4))
    with pytest.raises(TypeError, match="structure"):
        tessel.jit(lambda x: lax.reduce((x, x), (0.0, 0.0), lambda a, b: a[0] + b[0], (0,)))(x)
    with pytest.raises(TypeError, match="closes over|outside it"):
        tessel.jit(lambda x, y: lax.reduce(x, 0.0, lambda a, b: a + b * y[0, 0], (0,)))(x, x)
    with pytest.raises(TypeError, match="boolean scalar"):
        tessel.jit(lambda x: sort_by([x], 0, lambda a, b: a - b)[0])(x)
    with pytest.raises(ValueError, match="operand 1"):
        tessel.jit(lambda x: lax.sort((x, x[:, :2]), num_keys=2))(x)
    with pytest.raises(ValueError, match="num_keys"):
        lax.sort(x, num_keys=2)
    with pytest.raises(ValueError, match="out of range"):
        tessel.jit(lambda x: lax.reduce(x, 0.0, lambda a, b: a * b, (2,)))(x)
    np.testing.assert_allclose(tessel.jit(lambda x: x * 2)(x).fetch(), x * 2)


def test_bodies_inside_a_loop_and_a_shard_map(cluster):
    """A node with a body inside a loop's function and inside a manual
    region's body is lowered there too."""
    x = RNG.integers(0, 4, size=(4, 6)).astype(np.int32)
    y = RNG.normal(size=(4, 6))

    def step(np_mod, lax_mod):
        def body(i, c):
            k, v = lax_mod.sort((c[0], c[1]), dimension=1, num_keys=2)
            return (k[:, ::-1], v[:, ::-1] + 1.0)

        return lambda k, v: lax_mod.fori_loop(0, 3, body, (k, v))

    got = tessel.jit(step(tnp, lax))(x, y)
    want = step(jnp, jlax)(x, y)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.fetch(), np.asarray(w))
    mesh = tessel.Mesh({"data": 2})
    idx = np.broadcast_to(np.arange(6, dtype=np.int32), x.shape)

    def per_block(v, i):
        return lax.reduce((v, i), (-np.inf, np.int32(0)), argmax_body(tnp), (1,))[1]

    f = tessel.jit(
        tessel.shard_map(
            per_block, mesh=mesh, in_specs=(tessel.P("data"), tessel.P("data")), out_specs=tessel.P("data")
        )
    )
    np.testing.assert_array_equal(f(y, idx).fetch(), np.argmax(y, axis=1))


def test_jax_argmax_is_the_ir_argmax_and_other_pair_bodies_run_as_written(cluster):
    """tessel.jax reads JAX's argmax combiner as the IR's argmax; a body of
    the same ops that breaks ties toward the larger index is applied as
    written (REDUCE_WITH_BODY), not taken for an argmax."""
    tjax = pytest.importorskip("tessel.jax")
    x = RNG.integers(0, 3, size=(5, 7)).astype(np.float32)
    f = tjax.jit(lambda x: jnp.argmax(x, axis=1))
    np.testing.assert_array_equal(f(x).fetch(), np.argmax(x, axis=1))
    assert "argmax" in f.lower(x).as_text()

    def last_min(x):
        i = jlax.broadcasted_iota(np.int32, x.shape, 1)

        def body(a, b):
            take = (a[0] < b[0]) | ((a[0] == b[0]) & (a[1] > b[1]))
            return jnp.where(take, a[0], b[0]), jnp.where(take, a[1], b[1])

        return jlax.reduce((x, i), (np.float32(np.inf), np.int32(0)), body, (1,))[1]

    np.testing.assert_array_equal(tjax.jit(last_min)(x).fetch(), np.asarray(jax.jit(last_min)(x)))


def test_empty_extents_and_bfloat16_keys(cluster):
    """lax.max with -inf over an empty extent gives the init value, as in
    JAX; bfloat16 keys sort NaN last."""
    empty = np.zeros((2, 0), np.float32)
    got = tessel.jit(lambda x: lax.reduce(x, -np.inf, lax.max, (1,)))(empty).fetch()
    np.testing.assert_array_equal(got, np.asarray(jlax.reduce(empty, -np.inf, jlax.max, (1,))))
    bf16 = jnp.bfloat16
    k = np.array([[2.0, np.nan, 1.0, 2.0, -1.0]], dtype=bf16)
    v = np.arange(5, dtype=np.int32).reshape(1, 5)
    got = tessel.jit(lambda k, v: lax.sort((k, v), dimension=1, num_keys=2))(k, v)
    want = jlax.sort((k, v), dimension=1, num_keys=2)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g.fetch(), np.float32), np.asarray(w, np.float32))
