"""The names JAX programs reach for, against JAX on CPU (jax from PyPI):
jax.lax's element-wise names (lax.div and lax.rem round toward zero, lax.round
away from zero), lax.dot_general, preferred_element_type on dot, matmul and
einsum, finfo and iinfo, and jax.Array's methods on arrays and tracers."""

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import lax

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)
jnp, jlax = jax.numpy, jax.lax

RNG = np.random.default_rng(11)


def both(f, *args, rtol=1e-12):
    """f(lax-like namespace, numpy-like namespace, *args) under tessel.jit
    and under jax.jit, compared."""
    ours = tessel.jit(lambda *a: f(lax, tnp, *a))(*args)
    theirs = jax.jit(lambda *a: f(jlax, jnp, *a))(*args)
    ours = ours.fetch() if hasattr(ours, "fetch") else ours
    assert np.asarray(ours).dtype == np.asarray(theirs).dtype, (np.asarray(ours).dtype, np.asarray(theirs).dtype)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=rtol)


@pytest.mark.parametrize(
    "name", ["add", "sub", "mul", "max", "min", "atan2", "pow", "eq", "ne", "lt", "le", "gt", "ge", "div", "rem"]
)
def test_binary_names_match_jax_lax(cluster, name):
    x = RNG.uniform(-4, 4, (3, 4))
    y = RNG.uniform(0.5, 3, (3, 4)) * np.where(RNG.random((3, 4)) < 0.5, -1, 1)
    if name == "pow":
        x = np.abs(x)
    both(lambda L, N, a, b: getattr(L, name)(a, b), x, y)


@pytest.mark.parametrize("name", ["div", "rem", "max", "min", "add", "mul", "bitwise_and", "shift_left"])
def test_integer_names_match_jax_lax(cluster, name):
    x = RNG.integers(-50, 50, (8,)).astype(np.int32)
    y = RNG.integers(1, 7, (8,)).astype(np.int32) * np.where(RNG.random(8) < 0.5, -1, 1).astype(np.int32)
    if name == "shift_left":
        y = np.abs(y)
    both(lambda L, N, a, b: getattr(L, name)(a, b), x, y)


@pytest.mark.parametrize(
    "name",
    [
        "neg", "abs", "sign", "floor", "ceil", "exp", "exp2", "expm1", "log1p", "sqrt", "rsqrt", "cbrt", "sin",
        "cos", "tan", "atan", "sinh", "cosh", "tanh", "asinh", "logistic", "is_finite", "square", "erf", "round",
    ],
)  # fmt: skip
def test_unary_names_match_jax_lax(cluster, name):
    x = np.array([[-2.5, -0.5, 0.5, 1.5], [2.5, 0.3, 3.0, 0.75]])
    if name in ("sqrt", "rsqrt", "log1p"):
        x = np.abs(x)
    both(lambda L, N, a: getattr(L, name)(a), x, rtol=1e-12)


def test_select_clamp_convert_and_rounding_to_even(cluster):
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 7.0])
    both(lambda L, N, a: L.select(a > 0, a, -a), x)
    both(lambda L, N, a: L.clamp(-1.0, a, 2.0), x)
    both(lambda L, N, a: L.convert_element_type(a, np.int32), x)
    both(lambda L, N, a: L.round(a, L.RoundingMethod.TO_NEAREST_EVEN), x)
    both(lambda L, N, a: L.integer_pow(a, 3), x)
    with pytest.raises(ValueError, match="rounding_method"):
        tessel.jit(lambda a: lax.round(a, 5))(x)


def test_dot_general_matches_jax(cluster):
    a, b = RNG.normal(size=(2, 3, 4)), RNG.normal(size=(2, 4, 5))
    dims = (((2,), (1,)), ((0,), (0,)))
    both(lambda L, N, x, y: L.dot_general(x, y, dims), a, b)
    c = RNG.normal(size=(4, 3))
    both(lambda L, N, x, y: L.dot_general(x, y, (((0,), (0,)), ((), ()))), c, RNG.normal(size=(4, 6)))
    with pytest.raises(ValueError, match="batch dimensions differ"):
        tessel.jit(lambda x, y: lax.dot_general(x, y, (((2,), (1,)), ((0,), (0,)))))(a, RNG.normal(size=(3, 4, 5)))


@pytest.mark.parametrize(
    "dtype, preferred", [(np.float32, np.float64), (np.int8, np.int32), (np.float64, np.float32), (np.int16, np.int64)]
)
def test_preferred_element_type_matches_jax(cluster, dtype, preferred):
    a = RNG.integers(-9, 9, (3, 4)).astype(dtype)
    b = RNG.integers(-9, 9, (4, 5)).astype(dtype)
    both(lambda L, N, x, y: N.dot(x, y, preferred_element_type=preferred), a, b, rtol=1e-6)
    both(lambda L, N, x, y: N.matmul(x, y, preferred_element_type=preferred), a, b, rtol=1e-6)
    both(lambda L, N, x, y: N.einsum("ij,jk->ik", x, y, preferred_element_type=preferred), a, b, rtol=1e-6)
    dims = (((1,), (0,)), ((), ()))
    both(lambda L, N, x, y: L.dot_general(x, y, dims, preferred_element_type=preferred), a, b, rtol=1e-6)


def test_preferred_element_type_of_bfloat16_accumulates_in_float32(cluster):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = RNG.normal(size=(8, 64)).astype(ml_dtypes.bfloat16)
    b = RNG.normal(size=(64, 8)).astype(ml_dtypes.bfloat16)
    ours = tessel.jit(lambda x, y: tnp.matmul(x, y, preferred_element_type=np.float32))(a, b).fetch()
    assert ours.dtype == np.float32
    exact = a.astype(np.float64) @ b.astype(np.float64)  # products of bf16 are exact in f32
    np.testing.assert_allclose(ours, exact, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="preferred_element_type int32 for operands of float32"):
        tessel.jit(lambda x: tnp.dot(x, x, preferred_element_type=np.int32))(np.ones((2, 2), np.float32))


def test_finfo_and_iinfo_match_jax():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for d in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16):
        ours, theirs = tnp.finfo(d), jnp.finfo(d)
        for field in ("eps", "max", "min", "tiny", "bits", "resolution"):
            assert float(getattr(ours, field)) == float(getattr(theirs, field)), (d, field)
    for d in (np.int8, np.uint8, np.int32, np.uint32, np.int64):
        assert (tnp.iinfo(d).min, tnp.iinfo(d).max) == (jnp.iinfo(d).min, jnp.iinfo(d).max)
    assert tnp.finfo(np.zeros(2, np.float32)).eps == np.finfo(np.float32).eps  # of an array


METHODS = [
    ("ravel", (), {}),
    ("flatten", (), {}),
    ("all", (), {"axis": 0}),
    ("any", (), {}),
    ("argsort", (), {"axis": 1}),
    ("sort", (), {"axis": 0}),
    ("cumsum", (), {"axis": 1}),
    ("cumprod", (), {"axis": 0}),
    ("var", (), {"axis": 1, "ddof": 1}),
    ("std", (), {}),
    ("ptp", (), {"axis": 0}),
    ("swapaxes", (0, 1), {}),
    ("repeat", (2,), {"axis": 1}),
    ("take", (np.array([2, 0]),), {"axis": 1}),
    ("diagonal", (), {"offset": 1}),
    ("trace", (), {}),
    ("round", (1,), {}),
    ("conj", (), {}),
]


@pytest.mark.parametrize("name, args, kwargs", METHODS, ids=[m[0] for m in METHODS])
def test_array_methods_match_jax(cluster, name, args, kwargs):
    x = np.round(RNG.uniform(-3, 3, (3, 4)), 3)
    theirs = np.asarray(getattr(jnp.asarray(x), name)(*args, **kwargs))
    traced = tessel.jit(lambda a: getattr(a, name)(*args, **kwargs))(x).fetch()
    on_array = getattr(tessel.device_put(x), name)(*args, **kwargs).fetch()
    for ours in (traced, on_array):
        assert ours.dtype == theirs.dtype
        np.testing.assert_allclose(ours, theirs, rtol=1e-12)


def test_array_properties_match_jax(cluster):
    x = RNG.normal(size=(2, 3, 4))
    a = tessel.device_put(x)
    j = jnp.asarray(x)
    np.testing.assert_array_equal(a.mT.fetch(), np.asarray(j.mT))
    assert (a.itemsize, a.nbytes) == (j.itemsize, j.nbytes)
    np.testing.assert_array_equal(a.real.fetch(), x)
    np.testing.assert_array_equal(a.imag.fetch(), np.zeros_like(x))
    assert tessel.jit(lambda t: t.squeeze().mT)(x[:1]).fetch().shape == np.asarray(j[:1].squeeze().mT).shape


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64])
def test_bit_counts_and_logical_shifts_match_jax(cluster, dtype):
    info = np.iinfo(dtype)
    x = np.concatenate(
        [
            np.array([0, 1, info.max, info.min, info.max // 3, 1 << (info.bits - 2)], dtype=dtype),
            RNG.integers(info.min, info.max, size=20, dtype=dtype, endpoint=True),
        ]
    )
    counts = np.array([0, 1, 3, info.bits - 1, info.bits, info.bits + 3] * 4 + [2, 5], dtype=dtype)
    both(lambda L, N, x: L.population_count(x), x, rtol=0)
    both(lambda L, N, x: L.clz(x), x, rtol=0)
    both(lambda L, N, x, n: L.shift_right_logical(x, n), x, counts, rtol=0)


def test_bit_counts_in_tessel_jax(cluster):
    tjax = pytest.importorskip("tessel.jax")
    x = RNG.integers(-(2**31), 2**31 - 1, size=16, dtype=np.int32)
    ours = tjax.jit(lambda x: (jlax.population_count(x), jlax.clz(x)))(x)
    theirs = jax.jit(lambda x: (jlax.population_count(x), jlax.clz(x)))(x)
    for o, t in zip(ours, theirs):
        np.testing.assert_array_equal(o.fetch(), np.asarray(t))


def test_copy_is_a_new_array_that_outlives_a_donation(cluster):
    a = tessel.device_put(np.arange(4.0))
    for c in (a.copy(), tnp.copy(a)):
        assert isinstance(c, tessel.Array) and c is not a
    kept = a.copy()
    tessel.jit(lambda x: x * 2, donate_argnums=0)(a)
    np.testing.assert_array_equal(kept.fetch(), np.arange(4.0))
    both(lambda L, N, x: (x.copy() + N.copy(x)) * 2, np.arange(3.0))
