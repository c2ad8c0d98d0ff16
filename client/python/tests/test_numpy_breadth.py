"""Layout, classification, statistics and tessel.nn, each against an oracle
nobody here wrote: numpy for tessel.numpy (traced under jit and run eagerly
on Arrays), jax.nn on CPU for tessel.nn."""
import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from test_ops import check, sample

LAYOUT = {
    "squeeze": lambda m, x: m.squeeze(x),
    "squeeze_axis": lambda m, x: m.squeeze(x, axis=(0, 2)),
    "ravel": lambda m, x: m.ravel(x),
    "swapaxes": lambda m, x: m.swapaxes(x, 0, -1),
    "moveaxis": lambda m, x: m.moveaxis(x, 0, -1),
    "moveaxis_many": lambda m, x: m.moveaxis(x, (0, 3), (-1, 1)),
    "tril": lambda m, x: m.tril(x[0, :, 0, :]),
    "triu_k": lambda m, x: m.triu(x[0, :, 0, :], 1),
    "tril_batched_neg_k": lambda m, x: m.tril(x.reshape(3, 2, 2), -1),
    "tril_1d": lambda m, x: m.tril(x.reshape(-1)[:4]),
    "outer": lambda m, x: m.outer(x[0, :, 0, 0], x.reshape(-1)[:5]),
    # np.newaxis, with slices, integers and an ellipsis around it
    "newaxis_middle": lambda m, x: x[:, None],
    "newaxis_first": lambda m, x: x[None],
    "newaxis_int": lambda m, x: x[None, 0, ..., 1:3, None],
    "newaxis_ellipsis": lambda m, x: x[..., None, 2],
    "newaxis_many": lambda m, x: x[None, None, ::2, None],
}


@pytest.mark.parametrize("dtype", ["float32", "int32", "bool"])
@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_layout_compositions_match_numpy(session, name, dtype):
    check(LAYOUT[name], sample(dtype, (1, 3, 1, 4)))


@pytest.mark.parametrize("axes", [2, 1, 0, ([1, 0], [0, 1]), ([2], [0])])
def test_tensordot_matches_numpy(session, axes):
    a = sample("float64", (3, 4, 5))
    b = sample("float64", (4, 5, 2)) if axes in (2, 1, 0) else sample("float64", (4, 3, 2)) \
        if axes == ([1, 0], [0, 1]) else sample("float64", (5, 2))
    if axes == 1:
        b = sample("float64", (5, 2))
    check(lambda m, a, b: m.tensordot(a, b, axes=axes), a, b, rtol=1e-12)


def test_creation_matches_numpy(session):
    for args in [(3,), (3, 5), (4, 2, 1), (4, 4, -2), (2, 3, 7)]:
        check(lambda m, *_: m.eye(*args))
        check(lambda m, *_: m.tri(*args))
    check(lambda m, *_: m.eye(3, dtype=np.int32))
    check(lambda m, *_: m.tri(3, 4, dtype=np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "uint8", "bool"])
def test_float_classification_matches_numpy(session, dtype):
    x = sample(dtype, (24,))
    if np.dtype(dtype).kind == "f":
        x[:6] = [np.nan, np.inf, -np.inf, -0.0, np.finfo(dtype).max, np.finfo(dtype).tiny]
    for fn in ("isnan", "isinf", "isfinite"):
        check(lambda m, x: getattr(m, fn)(x), x)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_var_and_std_match_numpy(session, dtype):
    x = sample(dtype, (4, 6))
    for kw in [{}, {"axis": 0}, {"axis": 1, "keepdims": True}, {"axis": (0, 1), "ddof": 1}]:
        check(lambda m, x: m.var(x, **kw), x, rtol=1e-5 if dtype == "float32" else 1e-12)
        check(lambda m, x: m.std(x, **kw), x, rtol=1e-5 if dtype == "float32" else 1e-12)


def test_eager_layout_ops_on_arrays(session):
    x = sample("float32", (1, 3, 1, 4))
    a = tessel.device_put(x)
    np.testing.assert_array_equal(tnp.squeeze(a).fetch(), np.squeeze(x))
    np.testing.assert_array_equal(tnp.moveaxis(a, 0, -1).fetch(), np.moveaxis(x, 0, -1))
    np.testing.assert_array_equal(tnp.tril(tnp.squeeze(a)).fetch(), np.tril(np.squeeze(x)))


def test_bad_axes_are_clear_errors(session):
    x = tessel.device_put(sample("float32", (2, 3)))
    with pytest.raises(ValueError, match="size not equal to one"):
        tnp.squeeze(x, axis=0)
    with pytest.raises(np.exceptions.AxisError, match="axis 5 is out of bounds"):
        tnp.swapaxes(x, 0, 5)
    with pytest.raises(ValueError, match="shape-mismatch"):
        tnp.tensordot(x, x, axes=([0], [0, 1]))


# ---------------------------------------------------------------- tessel.nn against jax.nn

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)

NN = {
    "relu": lambda nn, x: nn.relu(x),
    "sigmoid": lambda nn, x: nn.sigmoid(x),
    "silu": lambda nn, x: nn.silu(x),
    "gelu": lambda nn, x: nn.gelu(x),
    "gelu_exact": lambda nn, x: nn.gelu(x, approximate=False),
    "softmax": lambda nn, x: nn.softmax(x),
    "softmax_axis0": lambda nn, x: nn.softmax(x, axis=0),
    "log_softmax": lambda nn, x: nn.log_softmax(x),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(NN))
def test_nn_matches_jax_nn(session, name, dtype):
    x = sample(dtype, (5, 7))
    x[0, :3] = [30.0, -30.0, 0.0]  # saturated and exact corners
    want = np.asarray(NN[name](jax.nn, jax.numpy.asarray(x)))
    got = tessel.jit(lambda x: NN[name](tessel.nn, x))(x).fetch()
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = np.finfo(dtype).eps
    # gelu's 1 + tanh(...) cancels for negative x: an ulp of tanh near -1,
    # times |x|, is the error there.
    atol = 8 * eps * np.abs(x).max() if name == "gelu" else 4 * eps
    np.testing.assert_allclose(got, want, rtol=8 * eps, atol=atol)


def test_one_hot_matches_jax_nn(session):
    idx = np.array([[0, 3, -1], [2, 4, 1]], np.int32)  # -1 and 4 are outside: all zeros
    for kw in [{}, {"dtype": np.int32}, {"axis": 0}]:
        # The default dtype is float32, JAX's default without x64 (this
        # module turns x64 on for the float64 cases above).
        want = np.asarray(jax.nn.one_hot(jax.numpy.asarray(idx), 4, **{"dtype": np.float32, **kw}))
        got = tessel.jit(lambda i: tessel.nn.one_hot(i, 4, **kw))(idx).fetch()
        assert got.dtype == want.dtype, kw
        np.testing.assert_array_equal(got, want, err_msg=str(kw))


TRIG = {
    "sin": np.sin, "cos": np.cos, "tan": lambda x: np.tan(x * 0.3), "arcsin": lambda x: np.arcsin(x * 0.2),
    "arccos": lambda x: np.arccos(x * 0.2), "arctan": np.arctan, "sinh": np.sinh, "cosh": np.cosh,
    "arcsinh": np.arcsinh, "arccosh": lambda x: np.arccosh(x * x + 1), "arctanh": lambda x: np.arctanh(x * 0.2),
    "expm1": np.expm1, "log2": lambda x: np.log2(x * x + 0.5), "log10": lambda x: np.log10(x * x + 0.5),
}


@pytest.mark.parametrize("name", sorted(TRIG))
def test_trig_and_hyperbolic_sharded_and_eager_match_numpy(session, name):
    """Each op on an array split over a 2x2 mesh under jit (no collective:
    an elementwise op keeps its operand's split) and eagerly on an Array."""
    from tessel import Mesh, NamedSharding, P
    x = np.linspace(-4, 4, 64, dtype=np.float32).reshape(8, 8)
    want = TRIG[name](x.astype(np.float64)).astype(np.float32)
    tfn = {
        "sin": tnp.sin, "cos": tnp.cos, "tan": lambda v: tnp.tan(v * 0.3), "arcsin": lambda v: tnp.arcsin(v * 0.2),
        "arccos": lambda v: tnp.arccos(v * 0.2), "arctan": tnp.arctan, "sinh": tnp.sinh, "cosh": tnp.cosh,
        "arcsinh": tnp.arcsinh, "arccosh": lambda v: tnp.arccosh(v * v + 1),
        "arctanh": lambda v: tnp.arctanh(v * 0.2), "expm1": tnp.expm1,
        "log2": lambda v: tnp.log2(v * v + 0.5), "log10": lambda v: tnp.log10(v * v + 0.5)}[name]
    mesh = Mesh({"data": 2, "model": 2})
    a = tessel.device_put(x, NamedSharding(mesh, P("data", "model")))
    before = tessel.stats()
    got = tessel.jit(tfn)(a)
    assert tessel.stats()["bytes_device_to_device"] == before["bytes_device_to_device"]
    np.testing.assert_allclose(got.fetch(), want, rtol=4e-6, atol=4e-6)
    eager = tfn(tessel.device_put(x))
    assert isinstance(eager, tessel.Array)
    np.testing.assert_allclose(eager.fetch(), want, rtol=4e-6, atol=4e-6)
