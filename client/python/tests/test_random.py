"""tessel.random against jax.random on CPU (the oracle: the same
Threefry-2x32 keys and counters must give the same bits), generated under
jit, eagerly, and sharded over a mesh."""

import numpy as np
import pytest

import tessel
import tessel.random as trandom
from tessel import Mesh, NamedSharding, P

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)  # float64 draws; every dtype below is explicit
jnp = jax.numpy

SEEDS = [0, 42, 2**32 + 7, -1]


@pytest.mark.parametrize("seed", SEEDS)
def test_keys_split_fold_in_and_bits_equal_jax(session, seed):
    k, jk = trandom.key(seed), jax.random.PRNGKey(seed)
    np.testing.assert_array_equal(k, np.asarray(jk))
    np.testing.assert_array_equal(trandom.split(k, 5).fetch(), np.asarray(jax.random.split(jk, 5)))
    np.testing.assert_array_equal(trandom.fold_in(k, 123456789).fetch(), np.asarray(jax.random.fold_in(jk, 123456789)))
    for shape in [(), (7,), (3, 0), (33, 17)]:
        got = tessel.jit(lambda k: trandom.bits(k, shape))(k).fetch()
        np.testing.assert_array_equal(got, np.asarray(jax.random.bits(jk, shape, dtype=jnp.uint32)))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_uniform_equals_jax_bit_for_bit(session, dtype):
    d = tessel.numpy.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    jd = jnp.bfloat16 if dtype == "bfloat16" else dtype
    for seed in SEEDS:
        k, jk = trandom.key(seed), jax.random.PRNGKey(seed)
        for shape, lo, hi in [((1000,), 0.0, 1.0), ((4, 5, 6), -2.0, 3.0), ((0,), 0.0, 1.0)]:
            got = tessel.jit(lambda k: trandom.uniform(k, shape, d, lo, hi))(k).fetch()
            want = np.asarray(jax.random.uniform(jk, shape, jd, lo, hi))
            assert got.dtype == want.dtype
            if (lo, hi) == (0.0, 1.0):
                np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}, shape {shape}")
            else:
                # u * (hi - lo) + lo: XLA contracts it into one fused
                # multiply-add, Tessel rounds twice; within an ulp of the
                # range.
                eps = float(np.finfo(np.float32 if dtype == "bfloat16" else dtype).eps)
                if dtype == "bfloat16":
                    eps = 2.0**-7
                np.testing.assert_allclose(
                    got.astype(np.float64),
                    want.astype(np.float64),
                    rtol=0,
                    atol=eps * (hi - lo),
                    err_msg=f"seed {seed}, shape {shape}",
                )


def test_normal_and_bernoulli_match_jax(session):
    for seed in SEEDS:
        k, jk = trandom.key(seed), jax.random.PRNGKey(seed)
        got = tessel.jit(lambda k: trandom.normal(k, (4000,), np.float32))(k).fetch()
        want = np.asarray(jax.random.normal(jk, (4000,), jnp.float32))
        np.testing.assert_allclose(got, want, rtol=4e-6, atol=4e-6)
        got = tessel.jit(lambda k: trandom.normal(k, (4000,), np.float64))(k).fetch()
        want = np.asarray(jax.random.normal(jk, (4000,), jnp.float64))
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
        p = np.float32(0.3)
        got = tessel.jit(lambda k: trandom.bernoulli(k, p, (50, 40)))(k).fetch()
        np.testing.assert_array_equal(got, np.asarray(jax.random.bernoulli(jk, p, (50, 40))))
        probs = np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)
        got = tessel.jit(lambda k, q: trandom.bernoulli(k, q))(k, probs).fetch()
        np.testing.assert_array_equal(got, np.asarray(jax.random.bernoulli(jk, probs)))


def test_a_sharded_draw_moves_no_host_bytes_and_equals_the_single_device_draw(session):
    """Each device generates its own block from the key and the elements'
    global indices: no collective, no host bytes beyond the key, and the
    same values as one device draws, whatever the layout."""
    mesh = Mesh({"data": 2, "model": 2})
    single = tessel.jit(lambda k: trandom.uniform(k, (64, 48)))(trandom.key(7)).fetch()
    k = tessel.device_put(trandom.key(7), NamedSharding(mesh, P()))  # the key's 16 bytes, on every device
    np.testing.assert_array_equal(single, np.asarray(jax.random.uniform(jax.random.PRNGKey(7), (64, 48), jnp.float32)))
    for spec in [P("data", "model"), P(None, ("data", "model")), P("model")]:
        f = tessel.jit(lambda k: trandom.uniform(k, (64, 48)), out_shardings=NamedSharding(mesh, spec))
        plan = f.lower(k)
        assert plan.collectives == [], plan.as_text()
        before = tessel.stats()
        out = f(k)
        after = tessel.stats()
        assert after["bytes_host_to_device"] == before["bytes_host_to_device"], (before, after)
        assert after["bytes_device_to_device"] == before["bytes_device_to_device"], (before, after)
        assert out.sharding.spec == spec
        np.testing.assert_array_equal(out.fetch(), single)
    g = tessel.jit(lambda k: trandom.normal(k, (8, 6), np.float64), out_shardings=NamedSharding(mesh, P("data")))
    np.testing.assert_array_equal(
        g(k).fetch(), tessel.jit(lambda k: trandom.normal(k, (8, 6), np.float64))(trandom.key(7)).fetch()
    )


def test_eager_draws_and_keys_from_jax(session):
    jk = jax.random.PRNGKey(3)
    keys = trandom.split(np.asarray(jk), 2)  # a uint32 key from JAX, taken as it is
    np.testing.assert_array_equal(keys.fetch(), np.asarray(jax.random.split(jk)))
    sub = keys.fetch()[1]
    got = trandom.uniform(sub, (10,))
    assert isinstance(got, tessel.Array)
    np.testing.assert_array_equal(
        got.fetch(), np.asarray(jax.random.uniform(jax.random.split(jk)[1], (10,), jnp.float32))
    )


def test_bad_keys_and_dtypes_are_clear_errors(session):
    with pytest.raises(ValueError, match="last dimension of 2"):
        trandom.uniform(np.zeros(3, np.int64), (2,))
    with pytest.raises(ValueError, match="single key of shape \\(2,\\)"):
        tessel.jit(lambda k: trandom.uniform(k, (2,)))(np.zeros((2, 2), np.int64))
    with pytest.raises(TypeError, match="floating-point dtype"):
        tessel.jit(lambda k: trandom.uniform(k, (2,), np.int32))(trandom.key(0))
    with pytest.raises(TypeError, match="32-bit words"):
        trandom.bits(np.array([-1, 2]), (2,))


def test_randint_equals_jax(session):
    for seed in SEEDS:
        k, jk = trandom.key(seed), jax.random.PRNGKey(seed)
        for lo, hi in [(0, 10), (-5, 5), (-(2**31), 2**31 - 1), (3, 3), (7, 2), (0, 2**40), (-(2**40), 100)]:
            got = tessel.jit(lambda k: trandom.randint(k, (200,), lo, hi))(k).fetch()
            want = np.asarray(jax.random.randint(jk, (200,), lo, hi, dtype=jnp.int32))
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}, [{lo}, {hi})")
    with pytest.raises(NotImplementedError, match="int32 is"):
        trandom.randint(trandom.key(0), (2,), 0, 5, np.int64)


def test_permutation_equals_jax(session):
    for seed in SEEDS:
        k, jk = trandom.key(seed), jax.random.PRNGKey(seed)
        for n in [1, 10, 5000]:  # 5000 elements take two rounds of sorting
            got = tessel.jit(lambda k: trandom.permutation(k, n))(k).fetch()
            np.testing.assert_array_equal(got, np.asarray(jax.random.permutation(jk, n)))
        x = np.arange(24.0).reshape(4, 6)
        got = tessel.jit(lambda k, v: trandom.permutation(k, v, axis=1, independent=True))(k, x).fetch()
        np.testing.assert_array_equal(got, np.asarray(jax.random.permutation(jk, x, axis=1, independent=True)))
        v = np.linspace(0, 1, 9)
        np.testing.assert_array_equal(
            trandom.permutation(k, tessel.device_put(v)).fetch(), np.asarray(jax.random.permutation(jk, v))
        )
        for axis in (0, 1, -1):  # whole rows or columns moved by one shuffled index vector (a gather)
            got = tessel.jit(lambda k, v: trandom.permutation(k, v, axis=axis))(k, x).fetch()
            np.testing.assert_array_equal(got, np.asarray(jax.random.permutation(jk, x, axis=axis)))


def test_choice_equals_jax(session):
    """choice by JAX's construction: randint indices (JAX's with 64-bit
    types off: Tessel's randint is int32), a permutation's head, the
    inverse cumulative sum of p (p exact in binary, so any summation order
    gives JAX's cumulative sums) and the Gumbel top-k."""
    x = np.arange(30.0).reshape(6, 5)
    p = np.array([0.25, 0.0, 0.125, 0.5, 0.0625, 0.0625])
    for seed in SEEDS:
        k, jk = trandom.key(seed), jax.random.PRNGKey(seed)
        with jax.enable_x64(False):
            np.testing.assert_array_equal(
                trandom.choice(k, 10, (3, 4)).fetch(), np.asarray(jax.random.choice(jk, 10, (3, 4)))
            )
            np.testing.assert_array_equal(
                tessel.jit(lambda k, v: trandom.choice(k, v, (7,), axis=1))(k, x).fetch(),
                np.asarray(jax.random.choice(jk, x.astype(np.float32), (7,), axis=1)),
            )
        np.testing.assert_array_equal(
            tessel.jit(lambda k: trandom.choice(k, 50, (4, 5), replace=False))(k).fetch(),
            np.asarray(jax.random.choice(jk, 50, (4, 5), replace=False)),
        )
        np.testing.assert_array_equal(
            tessel.jit(lambda k, v: trandom.choice(k, v, (2,), replace=False))(k, x).fetch(),
            np.asarray(jax.random.choice(jk, x, (2,), replace=False)),
        )
        np.testing.assert_array_equal(
            tessel.jit(lambda k: trandom.choice(k, 6, (200,), p=p))(k).fetch(),
            np.asarray(jax.random.choice(jk, 6, (200,), p=p)),
        )
        np.testing.assert_array_equal(
            tessel.jit(lambda k: trandom.choice(k, 6, (3,), replace=False, p=p))(k).fetch(),
            np.asarray(jax.random.choice(jk, 6, (3,), replace=False, p=p)),
        )
    with pytest.raises(ValueError, match="larger sample"):
        trandom.choice(trandom.key(0), 3, (4,), replace=False)
    with pytest.raises(ValueError, match="p must be None or a vector"):
        trandom.choice(trandom.key(0), 3, (4,), p=np.ones(4) / 4)
