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
    # reversal: flip and negative-step slices
    "flip": lambda m, x: m.flip(x),
    "flip_axes": lambda m, x: m.flip(x, (1, -1)),
    "fliplr": lambda m, x: m.fliplr(x[0, :, 0, :]),
    "flipud": lambda m, x: m.flipud(x[0, :, 0, :]),
    "negative_step": lambda m, x: x[:, ::-1],
    "negative_steps": lambda m, x: x[..., 3:0:-2],
    "negative_step_empty": lambda m, x: x[:, 0:2:-1],
    "negative_step_int": lambda m, x: x[0, ::-2, 0, -1::-3],
    # compositions
    "roll": lambda m, x: m.roll(x, 2, axis=3),
    "roll_negative": lambda m, x: m.roll(x, -5, axis=1),
    "roll_flat": lambda m, x: m.roll(x, 5),
    "roll_many": lambda m, x: m.roll(x, (1, -1), axis=(1, 3)),
    "tile": lambda m, x: m.tile(x[0, :, 0, :], (2, 3)),
    "tile_more_dims": lambda m, x: m.tile(x[0, 0, 0], (2, 1, 2)),
    "tile_int": lambda m, x: m.tile(x, 2),
    "repeat": lambda m, x: m.repeat(x, 2, axis=1),
    "repeat_flat": lambda m, x: m.repeat(x, 3),
    "repeat_counts": lambda m, x: m.repeat(x, [2, 0, 1], axis=1),
}


@pytest.mark.parametrize("dtype", ["float32", "int32", "bool"])
@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_layout_compositions_match_numpy(session, name, dtype):
    check(LAYOUT[name], sample(dtype, (1, 3, 1, 4)))


@pytest.mark.parametrize("axes", [2, 1, 0, ([1, 0], [0, 1]), ([2], [0])])
def test_tensordot_matches_numpy(session, axes):
    a = sample("float64", (3, 4, 5))
    b = (
        sample("float64", (4, 5, 2))
        if axes in (2, 1, 0)
        else sample("float64", (4, 3, 2))
        if axes == ([1, 0], [0, 1])
        else sample("float64", (5, 2))
    )
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
    "sin": np.sin,
    "cos": np.cos,
    "tan": lambda x: np.tan(x * 0.3),
    "arcsin": lambda x: np.arcsin(x * 0.2),
    "arccos": lambda x: np.arccos(x * 0.2),
    "arctan": np.arctan,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "arcsinh": np.arcsinh,
    "arccosh": lambda x: np.arccosh(x * x + 1),
    "arctanh": lambda x: np.arctanh(x * 0.2),
    "expm1": np.expm1,
    "log2": lambda x: np.log2(x * x + 0.5),
    "log10": lambda x: np.log10(x * x + 0.5),
}


@pytest.mark.parametrize("name", sorted(TRIG))
def test_trig_and_hyperbolic_sharded_and_eager_match_numpy(session, name):
    """Each op on an array split over a 2x2 mesh under jit (no collective:
    an elementwise op keeps its operand's split) and eagerly on an Array."""
    from tessel import Mesh, NamedSharding, P

    x = np.linspace(-4, 4, 64, dtype=np.float32).reshape(8, 8)
    want = TRIG[name](x.astype(np.float64)).astype(np.float32)
    tfn = {
        "sin": tnp.sin,
        "cos": tnp.cos,
        "tan": lambda v: tnp.tan(v * 0.3),
        "arcsin": lambda v: tnp.arcsin(v * 0.2),
        "arccos": lambda v: tnp.arccos(v * 0.2),
        "arctan": tnp.arctan,
        "sinh": tnp.sinh,
        "cosh": tnp.cosh,
        "arcsinh": tnp.arcsinh,
        "arccosh": lambda v: tnp.arccosh(v * v + 1),
        "arctanh": lambda v: tnp.arctanh(v * 0.2),
        "expm1": tnp.expm1,
        "log2": lambda v: tnp.log2(v * v + 0.5),
        "log10": lambda v: tnp.log10(v * v + 0.5),
    }[name]
    mesh = Mesh({"data": 2, "model": 2})
    a = tessel.device_put(x, NamedSharding(mesh, P("data", "model")))
    before = tessel.stats()
    got = tessel.jit(tfn)(a)
    assert tessel.stats()["bytes_device_to_device"] == before["bytes_device_to_device"]
    np.testing.assert_allclose(got.fetch(), want, rtol=4e-6, atol=4e-6)
    eager = tfn(tessel.device_put(x))
    assert isinstance(eager, tessel.Array)
    np.testing.assert_allclose(eager.fetch(), want, rtol=4e-6, atol=4e-6)


def test_split_matches_numpy(session):
    x = sample("float32", (6, 4))
    for args in [(3,), ([1, 4],), ([2, 2, 5],), ([-2],), (2, 1)]:
        check(lambda m, x: tuple(m.split(x, *args)), x)
    check(lambda m, x: tuple(m.array_split(x, 4)), x)
    check(lambda m, x: tuple(m.array_split(x, 3, axis=1)), x)
    with pytest.raises(ValueError, match="equal division"):
        tessel.jit(lambda v: tnp.split(v, 4))(x)


def test_arange_and_linspace_match_numpy(session):
    for args, kw in [
        ((5,), {}),
        ((2, 9, 3), {}),
        ((5, 1, -1), {}),
        ((0.5, 3.2, 0.7), {}),
        ((1, 4, 0.5), {}),
        ((3,), {"dtype": np.float32}),
        ((4, 4), {}),
    ]:
        check(lambda m, *_: m.arange(*args, **kw))
    for args, kw in [
        ((0, 1, 5), {}),
        ((2.0, 5.0), {}),
        ((2, 5, 1), {}),
        ((2, 5, 0), {}),
        ((-1, 1, 7), {"endpoint": False}),
        ((0, 1, 5), {"dtype": np.int32}),
        ((1, -3, 9), {"dtype": np.float32}),
        ((3, 3, 4), {}),
    ]:
        check(lambda m, *_: m.linspace(*args, **kw), rtol=1e-15)
    got, step = tessel.jit(lambda: tnp.linspace(0, 2, 5, retstep=True))()
    assert step == np.linspace(0, 2, 5, retstep=True)[1]
    np.testing.assert_array_equal(got.fetch(), np.linspace(0, 2, 5))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "bool"])
def test_rounding_matches_numpy(session, dtype):
    x = sample(dtype, (40,))
    if np.dtype(dtype).kind == "f":
        # ties both ways, signed zeros, the largest values and the non-finite
        x[:16] = [
            0.5,
            1.5,
            2.5,
            -0.5,
            -1.5,
            -2.5,
            -0.4,
            0.49999997,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            np.finfo(dtype).max,
            -np.finfo(dtype).max,
            2.675,
            -7.125,
        ]
    for fn in [
        lambda m, x: m.round(x),
        lambda m, x: m.rint(x),
        lambda m, x: m.trunc(x),
        lambda m, x: m.fix(x),
        lambda m, x: m.round(x, 2),
        lambda m, x: m.around(x, -1),
    ]:
        if dtype == "bool" and fn is not None:
            try:
                fn(np, x)
            except TypeError:
                continue
        check(fn, x, rtol=0)
        if np.dtype(dtype).kind == "f":  # the sign of a zero result too
            got = tessel.jit(lambda v: fn(tnp, v))(x).fetch()
            np.testing.assert_array_equal(np.signbit(got), np.signbit(fn(np, x)))


def test_integer_round_to_negative_decimals_matches_numpy(session):
    x = np.array([15, 25, -15, -25, 35, 14, -16, 5, -5, 0], np.int64)
    check(lambda m, x: m.round(x, -1), x)
    check(lambda m, x: m.round(x, -2), x * 7)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_reciprocal_nan_to_num_and_logaddexp_match_numpy(session, dtype):
    x = sample(dtype, (30,), nonzero=True)
    y = sample(dtype, (30,))
    if np.dtype(dtype).kind == "f":
        x[:5] = [np.nan, np.inf, -np.inf, 1e30, -0.0]
        y[:6] = [np.inf, np.inf, -np.inf, 1e30, -np.inf, np.nan]
        check(lambda m, x: m.reciprocal(x[5:]), x)
        check(lambda m, x: m.nan_to_num(x), x)
        check(lambda m, x: m.nan_to_num(x, nan=-1.0, posinf=9.0, neginf=-9.0), x)
    else:
        check(lambda m, x: m.reciprocal(x), x)
        check(lambda m, x: m.nan_to_num(x), x)
    with np.errstate(invalid="ignore"):
        check(lambda m, x, y: m.logaddexp(x, y), x, y)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_nan_reductions_match_numpy(session, dtype):
    x = sample(dtype, (5, 6))
    if np.dtype(dtype).kind == "f":
        x[0, :] = np.nan
        x[2, 1] = x[3, 4] = np.nan
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns of the all-NaN row
        for kw in [{}, {"axis": 1}, {"axis": 0, "keepdims": True}]:
            for fn in ("nansum", "nanprod", "nanmean", "nanmax", "nanmin"):
                check(lambda m, x: getattr(m, fn)(x, **kw), x, rtol=1e-5 if dtype == "float32" else 1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "uint8", "bool"])
def test_cumulative_sums_and_products_match_numpy(session, dtype):
    """Unsigned sums accumulate in int64 here, where numpy's is uint64 (not
    a dtype Tessel has yet): the values are compared, not the dtype."""
    x = sample(dtype, (5, 7), low=-2, high=2)
    exact = dtype != "uint8"
    for kw in [{}, {"axis": 0}, {"axis": -1}, {"axis": 1, "dtype": np.float64}]:
        check(lambda m, x: m.cumsum(x, **kw), x, rtol=1e-5 if dtype == "float32" else 1e-12, exact_dtype=exact)
        check(lambda m, x: m.cumprod(x, **kw), x, rtol=1e-5 if dtype == "float32" else 1e-12, exact_dtype=exact)
    long = sample(dtype, (1000,), low=0, high=3)
    check(lambda m, x: m.cumsum(x), long, rtol=1e-5 if dtype == "float32" else 1e-12, exact_dtype=exact)


def test_logsumexp_matches_jax_nn(session):
    jnn = pytest.importorskip("jax.nn")
    x = sample("float32", (4, 6), low=-50, high=50)
    x[0, :] = -np.inf
    x[1, 2] = np.inf
    x[2, :] = 1000.0
    for kw in [{}, {"axis": 1}, {"axis": 0, "keepdims": True}, {"axis": (0, 1)}]:
        want = np.asarray(jnn.logsumexp(x, **kw))
        got = tessel.jit(lambda v: tessel.nn.logsumexp(v, **kw))(x).fetch()
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=str(kw))


def test_flip_of_a_split_dimension_moves_each_block_to_its_mirror(session):
    """Reversing a dimension split over a mesh axis: each device reverses its
    own block and one collective_permute swaps mirrored blocks; nothing is
    gathered. The result stays split as its operand was."""
    from tessel import Mesh, NamedSharding, P

    mesh = Mesh({"data": 2, "model": 2})
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    a = tessel.device_put(x, NamedSharding(mesh, P("data", "model")))
    f = tessel.jit(lambda v: tnp.flip(v, 0) * 2 + v[:, ::-1])
    plan = f.lower(a)
    ops = sorted(c["op"] for c in plan.collectives)
    assert ops == ["collective_permute", "collective_permute"], plan.as_text()
    assert all("mirrored device" in c["reason"] for c in plan.collectives), plan.collectives
    np.testing.assert_array_equal(f(a).fetch(), np.flip(x, 0) * 2 + x[:, ::-1])
    # Both dimensions at once: mirroring each axis mirrors the flat device
    # index over both, so one permute does it.
    both = tessel.jit(lambda v: tnp.flip(v) + 1)
    assert [c["op"] for c in both.lower(a).collectives] == ["collective_permute"], both.lower(a).as_text()
    got = both(a)
    np.testing.assert_array_equal(got.fetch(), np.flip(x) + 1)
    assert got.sharding.spec == P("data", "model")
    eager = tnp.flip(tessel.device_put(x))
    np.testing.assert_array_equal(eager.fetch(), np.flip(x))


def test_eager_compositions_on_arrays(session):
    x = sample("float32", (4, 6))
    a = tessel.device_put(x)
    np.testing.assert_array_equal(tnp.roll(a, 1, axis=0).fetch(), np.roll(x, 1, axis=0))
    np.testing.assert_allclose(tnp.cumsum(a, axis=1).fetch(), np.cumsum(x, axis=1), rtol=1e-5)
    np.testing.assert_array_equal(tnp.round(a, 1).fetch(), np.round(x, 1))
    np.testing.assert_array_equal(tnp.asarray(a, np.float64).fetch(), x.astype(np.float64))
    parts = tnp.split(a, 2, axis=1)
    for got, want in zip(parts, np.split(x, 2, axis=1)):
        np.testing.assert_array_equal(got.fetch(), want)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8", "bool"])
def test_sort_and_argsort_match_numpys_stable_sort(session, dtype):
    x = sample(dtype, (5, 9), low=-3, high=3)  # small integers: many ties
    if np.dtype(dtype).kind == "f":
        x[0, :5] = [np.nan, -0.0, 0.0, np.inf, -np.inf]
        x[3, 2] = np.nan
    for kw in [{}, {"axis": 0}, {"axis": None}, {"axis": -1}]:
        check(lambda m, x: m.sort(x, **kw) if m is tnp else np.sort(x, kind="stable", **kw), x)
        check(lambda m, x: m.argsort(x, **kw) if m is tnp else np.argsort(x, kind="stable", **kw), x)
    # descending: the largest first, NaN first, equal keys in their order
    # (numpy has no descending sort: the stable sort of the negated ranks).
    if np.dtype(dtype).kind == "f":
        ranks = np.argsort(np.argsort(np.where(np.isnan(x), -np.inf, -x), axis=1, kind="stable"), axis=1)
        want_idx = np.argsort(np.where(np.isnan(x), -1, ranks), axis=1, kind="stable")
    else:
        want_idx = np.argsort(-x.astype(np.int64), axis=1, kind="stable")
    got_idx = tessel.jit(lambda v: tnp.argsort(v, axis=1, descending=True))(x).fetch()
    np.testing.assert_array_equal(got_idx, want_idx)
    got = tessel.jit(lambda v: tnp.sort(v, axis=1, descending=True))(x).fetch()
    np.testing.assert_array_equal(got, np.take_along_axis(x, want_idx, axis=1))


def test_top_k_matches_jax(session):
    lax = pytest.importorskip("jax.lax")
    # + 0.0: no -0.0, which XLA's top_k orders below 0.0 and Tessel (as
    # numpy's sort) counts equal to it.
    x = sample("float32", (4, 10), low=-3, high=3).round() + np.float32(0.0)
    x[1, 4] = np.nan
    for k in (1, 3, 10):
        want_v, want_i = lax.top_k(x, k)
        got_v, got_i = tessel.jit(lambda v: tessel.lax.top_k(v, k))(x)
        np.testing.assert_array_equal(got_v.fetch(), np.asarray(want_v))
        np.testing.assert_array_equal(got_i.fetch(), np.asarray(want_i))
        assert got_i.dtype == np.asarray(want_i).dtype
    with pytest.raises(ValueError, match="out of range"):
        tessel.lax.top_k(x, 11)


def test_sort_of_a_split_dimension_is_an_all_to_all_and_a_local_sort(session):
    """Rows split over the mesh: the split moves to another dimension
    (all_to_all), each device sorts whole rows, and nothing is gathered.
    With no other dimension to take the split, the rows are gathered, and
    the plan says why."""
    from tessel import Mesh, NamedSharding, P

    mesh = Mesh({"data": 4})
    x = sample("float32", (8, 12))
    a = tessel.device_put(x, NamedSharding(mesh, P(None, "data")))
    f = tessel.jit(lambda v: tnp.sort(v, axis=1))
    plan = f.lower(a)
    assert [c["op"] for c in plan.collectives] == ["all_to_all"], plan.as_text()
    assert "sort" in plan.collectives[0]["reason"], plan.collectives
    np.testing.assert_array_equal(f(a).fetch(), np.sort(x, axis=1))
    g = tessel.jit(lambda v: tnp.argsort(v, axis=1))
    np.testing.assert_array_equal(g(a).fetch(), np.argsort(x, axis=1, kind="stable"))
    v = sample("float32", (12,))
    b = tessel.device_put(v, NamedSharding(mesh, P("data")))
    h = tessel.jit(lambda v: tnp.sort(v))
    assert [c["op"] for c in h.lower(b).collectives] == ["all_gather"], h.lower(b).as_text()
    np.testing.assert_array_equal(h(b).fetch(), np.sort(v))
    np.testing.assert_array_equal(tnp.sort(tessel.device_put(x), axis=0).fetch(), np.sort(x, axis=0))


AT = {
    # name: (index, values, numpy's in-place form)
    "set_int": (1, 7.5, lambda a, i, v: a.__setitem__(i, v)),
    "set_slice": ((slice(1, 3), slice(None, None, 2)), [[1.0, 2.0, 3.0]], lambda a, i, v: a.__setitem__(i, v)),
    "set_reversed": ((slice(None, None, -2), 0), [9.0, 8.0], lambda a, i, v: a.__setitem__(i, v)),
    "set_ellipsis": ((Ellipsis, -1), 0.0, lambda a, i, v: a.__setitem__(i, v)),
    "add": ((slice(0, 4, 3), slice(1, 5)), 2.0, lambda a, i, v: a.__setitem__(i, a[i] + v)),
    "multiply": ((2, slice(None, None, -1)), -3.0, lambda a, i, v: a.__setitem__(i, a[i] * v)),
    "min": ((slice(None), 1), 0.25, lambda a, i, v: a.__setitem__(i, np.minimum(a[i], v))),
    "max": (slice(1, None), 0.5, lambda a, i, v: a.__setitem__(i, np.maximum(a[i], v))),
    "empty": ((slice(2, 2),), 5.0, lambda a, i, v: a.__setitem__(i, v)),
}


def test_at_add_keeps_negative_zeros_outside_the_region(session):
    """The region is spread with the additive identity, -0.0: +0.0 would
    turn every -0.0 outside the region into +0.0."""
    x = np.array([[-0.0, 1.0, -0.0], [np.nan, -0.0, -np.inf]], np.float32)
    want = x.copy()
    want[:, 1] += 2
    got = tessel.jit(lambda v: v.at[:, 1].add(2))(x).fetch()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("name", sorted(AT))
def test_at_updates_match_numpys_in_place_updates(session, name, dtype):
    """x.at[i].set/add/multiply/min/max against the same update made in
    place on a numpy copy; the original stays as it was."""
    idx, values, inplace = AT[name]
    x = sample(dtype, (4, 6))
    want = x.copy()
    inplace(want, idx, np.asarray(values).astype(dtype))
    mode = name.split("_")[0] if name.split("_")[0] in ("add", "multiply", "min", "max") else "set"
    got = tessel.jit(lambda v: getattr(v.at[idx], mode)(np.asarray(values).astype(dtype)))(x).fetch()
    np.testing.assert_array_equal(got, want)
    a = tessel.device_put(x)
    eager = getattr(a.at[idx], mode)(np.asarray(values).astype(dtype))
    np.testing.assert_array_equal(eager.fetch(), want)
    np.testing.assert_array_equal(a.fetch(), x)
    np.testing.assert_array_equal(tessel.jit(lambda v: v.at[idx].get())(x).fetch(), x[idx])


def test_at_update_of_a_traced_value_and_its_gradient(session):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    x = sample("float64", (4, 5))

    def f(m, v):
        return (v.at[1:3, ::2].set(v[0, :3] * 2).at[-1].add(v[0]) ** 2).sum()

    got = tessel.jit(tessel.grad(lambda v: f(tnp, v)))(x).fetch()
    want = np.asarray(jax.grad(lambda v: f(jax.numpy, v))(x))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    with pytest.raises(ValueError, match="do not broadcast"):
        tessel.jit(lambda v: v.at[0].set(np.ones(3)))(x)


def test_clip_with_one_bound_and_the_clip_method(session):
    x = sample("float32", (3, 5))
    check(lambda m, x: m.clip(x, None, 1.0), x)
    check(lambda m, x: m.clip(x, -1.0, None), x)
    check(lambda m, x: x.clip(-0.5, 0.5), x)
    check(lambda m, x: x.clip(max=0.0), x)


@pytest.mark.parametrize("mode", ["edge", "reflect", "symmetric", "wrap"])
@pytest.mark.parametrize("dtype", ["float32", "int32", "bool"])
def test_pad_modes_match_numpy(session, mode, dtype):
    x = sample(dtype, (3, 4))
    for widths in [((1, 2), (0, 3)), 2, ((0, 0), (5, 7)), ((4, 0), (1, 1))]:  # wider than the axis too
        check(lambda m, x: m.pad(x, widths, mode=mode), x)
    with pytest.raises(NotImplementedError, match="linear_ramp"):
        tessel.jit(lambda v: tnp.pad(v, 1, mode="linear_ramp"))(x)


def test_take_with_static_indices_matches_numpy(session):
    x = sample("float32", (4, 5, 3))
    for idx, kw in [
        ([0, 2, 2, 1], {"axis": 1}),
        ([[3, -1], [0, 0]], {"axis": 0}),
        ([7, 0, 59, 58, 57], {}),
        (np.array([4, 3, 2, 1, 0]), {"axis": 1}),
        ([9, -7], {"axis": 1, "mode": "wrap"}),
        ([9, -7], {"axis": 1, "mode": "clip"}),
        ([], {"axis": 2}),
    ]:
        check(lambda m, x: m.take(x, idx, **kw), x)
    with pytest.raises(IndexError, match="index 5 is out of bounds for axis 1 with size 5"):
        tessel.jit(lambda v: tnp.take(v, [5], axis=1))(x)
    many = [4, 0, 2, 1, 3, 0, 4, 2]  # more runs than slices pay for: a gather
    check(lambda m, x: m.take(x, many, axis=1), x)
    assert "gather(" in tessel.jit(lambda v: tnp.take(v, many, axis=1)).lower(x).as_text()


# Index arrays, boolean masks and integers beside them (numpy's advanced
# indexing): index values known when tracing (numpy's rules, out of range
# raises), then the same indices traced (passed as arguments).
FANCY = {
    "one_axis": (lambda i: (i,), [3, -1, 0, 2, 2]),
    "middle_axis": (lambda i: (slice(None), i), [[4, 0], [1, 1]]),
    "adjacent_pair": (lambda i: (slice(None), i, i % 3), [4, -2, 0]),
    "separated_pair": (lambda i: (i, slice(1, None), i), [2, 0, 2]),
    "int_beside_array": (lambda i: (1, slice(None), i % 3), [2, 0, -1]),
    "ellipsis": (lambda i: (Ellipsis, i % 3), [[0, 2], [1, 1]]),
    "reversed_slice": (lambda i: (slice(None, None, -1), i), [1, 3]),
}


@pytest.mark.parametrize("dtype", ["float32", "int32", "bool"])
@pytest.mark.parametrize("name", sorted(FANCY))
def test_advanced_indexing_matches_numpy(session, name, dtype):
    make, values = FANCY[name]
    x = sample(dtype, (4, 5, 3))
    static = make(np.array(values))
    check(lambda m, x: x[static], x)
    want = x[static]
    got = tessel.jit(lambda v, i: v[make(i)])(x, np.array(values)).fetch()  # the indices traced
    np.testing.assert_array_equal(got, want)
    eager = tessel.device_put(x)[make(tessel.device_put(np.array(values)))]
    np.testing.assert_array_equal(eager.fetch(), want)


def test_boolean_masks_match_numpy(session):
    x = sample("float32", (4, 5, 3))
    for mask in [x[:, 0, 0] > 0, x[..., 0] > 0, x > 0, np.zeros(4, bool)]:
        check(lambda m, v: v[mask], x)
    check(lambda m, v: v[:, x[0, :, 0] > 0, 1], x)
    np.testing.assert_array_equal(tessel.jit(lambda v: v.at[x > 0].set(0))(x).fetch(), np.where(x > 0, 0, x))
    with pytest.raises(IndexError, match="boolean mask with traced or device values"):
        tessel.jit(lambda v: v[v > 0])(x)
    with pytest.raises(IndexError, match="boolean index did not match indexed array along axis 0"):
        tessel.jit(lambda v: v[np.ones(3, bool)])(x)


def test_traced_indices_follow_jax(session):
    """Out-of-range traced indices cannot raise: they follow jax.numpy.
    Indexing clamps; take fills (NaN, the lowest int) or clips or wraps;
    .at drops the updates; take_along_axis broadcasts the other axes."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    x = sample("float64", (5, 6))
    xi = sample("int32", (5, 6))
    far = np.array([[7, -1], [0, -9]])
    np.testing.assert_array_equal(tessel.jit(lambda v, i: v[i])(x, far).fetch(), np.asarray(jnp.asarray(x)[far]))
    np.testing.assert_array_equal(
        tessel.jit(lambda v, i, j: v[i, j])(x, far, far.T).fetch(), np.asarray(jnp.asarray(x)[far, far.T])
    )
    for a in (x, xi):
        for mode in (None, "fill", "clip", "wrap"):
            got = tessel.jit(lambda v, i: tnp.take(v, i, axis=1, mode=mode))(a, far).fetch()
            np.testing.assert_array_equal(got, np.asarray(jnp.take(jnp.asarray(a), far, axis=1, mode=mode)))
    got = tessel.jit(lambda v, i: tnp.take(v, i, fill_value=-5.0))(x, far).fetch()
    np.testing.assert_array_equal(got, np.asarray(jnp.take(jnp.asarray(x), far, fill_value=-5.0)))
    order = np.argsort(x, axis=0)
    check(lambda m, v, i: m.take_along_axis(v, i, axis=0), x, order)
    check(lambda m, v, i: m.take_along_axis(v, i[:, :1], axis=1), x, order)  # broadcast along axis 0
    idx = np.array([1, 1, 4, -1, 9, -8])
    for mode in ("set", "add", "multiply", "min", "max"):
        for a in (x, xi):
            vals = np.arange(36).reshape(6, 6).astype(a.dtype)
            got = tessel.jit(lambda v, i, u: getattr(v.at[i], mode)(u))(a, idx, vals).fetch()
            np.testing.assert_array_equal(got, np.asarray(getattr(jnp.asarray(a).at[idx], mode)(vals)), err_msg=mode)
            got = tessel.jit(lambda v, i: getattr(v.at[i, i % 6], mode)(7))(a, idx).fetch()
            np.testing.assert_array_equal(
                got, np.asarray(getattr(jnp.asarray(a).at[idx, idx % 6], mode)(7)), err_msg=mode
            )
    with pytest.raises(NotImplementedError, match="partial slice"):
        tessel.jit(lambda v: v.at[np.array([0, 4]), :3].set(1.0))(x)
    with pytest.raises(IndexError, match="index arrays must be integers"):
        tessel.jit(lambda v, i: v[i])(x, np.array([0.5]))
    with pytest.raises(NotImplementedError, match="None"):
        tessel.jit(lambda v, i: v[None, i])(x, np.array([0]))


def test_dynamic_slices_match_jax_lax(session):
    """Starts traced or static, negative (from the end) or past the end
    (clamped so the window fits), also inside a loop."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    from tessel import lax

    x = sample("float64", (5, 6, 4))
    upd = sample("float64", (2, 6, 3))
    for st in [(1, 2, 0), (4, 5, 3), (-3, 1, -2), (-9, 0, 9)]:
        want = np.asarray(jax.lax.dynamic_slice(x, st, (2, 3, 4)))
        np.testing.assert_array_equal(tessel.jit(lambda v: lax.dynamic_slice(v, st, (2, 3, 4)))(x).fetch(), want)
        got = tessel.jit(lambda v, i, j: lax.dynamic_slice(v, (i, j, 0), (2, 3, 4)))(
            x, np.int64(st[0]), np.int32(st[1])
        )
        np.testing.assert_array_equal(got.fetch(), np.asarray(jax.lax.dynamic_slice(x, (st[0], st[1], 0), (2, 3, 4))))
        want = np.asarray(jax.lax.dynamic_update_slice(x, upd, (st[0], 0, st[2])))
        got = tessel.jit(lambda v, u: lax.dynamic_update_slice(v, u, (st[0], 0, st[2])))(x, upd)
        np.testing.assert_array_equal(got.fetch(), want)
        got = tessel.jit(lambda v, u, i, k: lax.dynamic_update_slice(v, u, (i, 0, k)))(
            x, upd, np.int64(st[0]), np.int64(st[2])
        )
        np.testing.assert_array_equal(got.fetch(), want)

    def rows(xp, L):
        return lambda i, acc: L.dynamic_update_index_in_dim(
            acc, xp.sin(L.dynamic_index_in_dim(acc, i, 0, False)) + i, i, 0
        )

    got = tessel.jit(lambda v: lax.fori_loop(0, 5, rows(tnp, lax), v))(x).fetch()
    np.testing.assert_allclose(got, np.asarray(jax.lax.fori_loop(0, 5, rows(jax.numpy, jax.lax), x)), rtol=1e-15)
    with pytest.raises(TypeError, match="size 7 of dimension 1 is outside"):
        tessel.jit(lambda v: lax.dynamic_slice(v, (0, 0, 0), (1, 7, 1)))(x)


def test_gather_and_scatter_on_a_mesh_plan_only_what_they_must(session):
    """Indexing a dimension that is not split needs no collective. Reading
    a few rows of a table split by rows (an embedding lookup) reads each row
    where it lives and completes the result with one all_reduce (max: the
    other devices put the lowest value, so -0.0 and NaN come through); more
    rows than the table holds gather the table instead. A scatter updates
    each block where it lives: no collective. The results equal numpy's
    whatever the layout, and the gradient too."""
    from tessel import Mesh, NamedSharding, P

    mesh = Mesh({"data": 4})
    x = sample("float32", (16, 6))
    x[3, 1], x[5, 2] = -0.0, np.nan
    a = tessel.device_put(x, NamedSharding(mesh, P("data", None)))
    idx = np.array([3, 5, 15, -1, 20])  # traced: -1 is the last row, 20 clamps to it
    rows = np.clip(np.where(idx < 0, idx + 16, idx), 0, 15)
    f = tessel.jit(lambda v, i: v[:, i % 6])
    assert f.lower(a, idx).collectives == [], f.lower(a, idx).as_text()
    np.testing.assert_array_equal(f(a, idx).fetch(), x[:, idx % 6])
    g = tessel.jit(lambda v, i: v[i])
    plan = g.lower(a, idx)
    assert [(c["op"], c["bytes_per_device"] > 0) for c in plan.collectives] == [("all_reduce", True)], plan.as_text()
    got = g(a, idx).fetch()
    np.testing.assert_array_equal(got, x[rows])
    assert np.signbit(got[0, 1])
    for dtype in ("int32", "bool"):
        xi = sample(dtype, (16, 6))
        np.testing.assert_array_equal(
            g(tessel.device_put(xi, NamedSharding(mesh, P("data", None))), idx).fetch(), xi[rows]
        )
    many = np.arange(40) % 16
    assert [c["op"] for c in g.lower(a, many).collectives] == ["all_gather"], g.lower(a, many).as_text()
    np.testing.assert_array_equal(g(a, many).fetch(), x[many])
    kept = np.where(idx < 0, idx + 16, idx)
    kept = kept[kept < 16]
    for mode, want in (("add", lambda w: np.add.at(w, kept, 1.5)), ("set", lambda w: w.__setitem__(kept, 1.5))):
        h = tessel.jit(lambda v, i: getattr(v.at[i], mode)(1.5))
        assert h.lower(a, idx).collectives == [], h.lower(a, idx).as_text()
        w = x.copy()
        want(w)
        np.testing.assert_array_equal(h(a, idx).fetch(), w)
    grad = tessel.jit(tessel.grad(lambda v, i: (v[i] ** 2).sum()))(a, idx).fetch()
    want = np.zeros_like(x)
    np.add.at(want, rows, 2 * x[rows])
    np.testing.assert_array_equal(grad, want)


def test_eager_arrays_inside_index_tuples_and_keywords_are_traced_not_keyed_by_repr(session):
    """numpy abbreviates the repr of a large array: two index arrays (or
    masks) that differ only in the middle must not share a compiled op.
    Numpy arrays in an index stay static, as under jit (numpy's rules)."""
    x = tessel.device_put(np.arange(2000, dtype=np.float32).reshape(1000, 2))
    m1 = np.zeros((1000, 2), bool)
    m2 = m1.copy()
    m2[500, 1] = True
    assert float(tnp.sum(x, where=m1)) == 0.0
    assert float(tnp.sum(x, where=m2)) == 1001.0
    i1 = np.zeros(1500, np.int64)
    i2 = i1.copy()
    i2[700] = 3
    assert float(x[i1, 1].sum()) == 1500.0
    assert float(x[i2, 1].sum()) == 1506.0
    assert float(x[np.arange(1000) == 3].sum()) == 13.0  # a numpy mask, eagerly
    with pytest.raises(IndexError, match="index 1000 is out of bounds for axis 0 with size 1000"):
        x[np.array([1000])]


def test_searchsorted_matches_numpy(session):
    a = np.array([-np.inf, -1.0, 0.0, 0.0, 2.5, np.nan])
    v = np.array([[-2.0, 0.0, np.nan], [np.inf, 2.5, -np.inf]])
    for side in ("left", "right"):
        check(lambda m, a, v: m.searchsorted(a, v, side=side), a, v, exact_dtype=False)
    ints = np.array([1, 3, 3, 7], np.int32)
    check(lambda m, a: m.searchsorted(a, 3), ints, exact_dtype=False)
    check(
        lambda m, a: m.searchsorted(a, [0, 3, 8], side="right", sorter=m.argsort(a)),
        ints[::-1].copy(),
        exact_dtype=False,
    )


def test_reduction_keywords_match_numpy(session):
    x = sample("float32", (4, 6))
    mask = sample("bool", (4, 6))
    mask[0] = False  # a row with nothing selected: its mean is NaN, as numpy's
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        check(lambda m, x, w: m.sum(x, axis=1, where=w), x, mask)
        check(lambda m, x, w: m.prod(x, where=w), x, mask)
        check(lambda m, x, w: m.mean(x, axis=1, where=w), x, mask)
        check(lambda m, x, w: x.sum(0, where=w[0]), x, mask)
    check(lambda m, x: m.mean(x, axis=0, dtype=m.float64), x)
    check(lambda m, x: m.mean(x.astype(m.int32), dtype=m.float32), x)
    check(lambda m, x: (m.argmax(x, axis=1, keepdims=True), m.argmin(x, keepdims=True), x.argmax(0, keepdims=True)), x)
    check(lambda m, x: m.concatenate([x, x[:2]], axis=None), x)


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8"])
def test_shifts_match_numpy(session, dtype):
    info = np.iinfo(dtype)
    x = np.array([0, 1, -1, 5, -6, 77, info.max, info.min, 3, -3][:10], dtype=np.int64)
    x = x.astype(dtype) if dtype != "uint8" else np.abs(x).astype(dtype)
    bits = 8 * np.dtype(dtype).itemsize
    n = np.array([0, 1, 3, bits - 2, bits - 1, bits, bits + 5, 2, 7, 1], dtype=dtype)
    check(lambda m, a, b: (m.left_shift(a, b), m.right_shift(a, b), a << 2, a >> 1), x, n)
    check(lambda m, v: (m.left_shift(v, 1), m.right_shift(v, 1)), np.array([True, False]))
    with pytest.raises(TypeError, match="integers or bools only"):
        tessel.jit(lambda v: tnp.left_shift(v, 1))(np.array([1.5]))


# ---------------------------------------------------------------- narrow and unsigned integers

NEW_INTS = ["int8", "int16", "uint16", "uint32", "uint64"]


def full_range(dtype, shape, rng=np.random.default_rng(22)):
    """Every bit pattern is equally likely: sums and products wrap, uint64
    values past 2^63 and the most negative values all appear."""
    d = np.dtype(dtype)
    return rng.integers(0, 256, size=(int(np.prod(shape)) * d.itemsize,), dtype=np.uint8).view(d).reshape(shape)


INT_OPS = {
    "add": lambda m, x, y: x + y,
    "subtract": lambda m, x, y: x - y,
    "multiply": lambda m, x, y: x * y,
    "floor_divide": lambda m, x, y: m.floor_divide(x, m.where(y == 0, 1, y)),
    "remainder": lambda m, x, y: m.remainder(x, m.where(y == 0, 1, y)),
    "maximum": lambda m, x, y: m.maximum(x, y),
    "bitwise": lambda m, x, y: (x & y) ^ (x | ~y),
    "compare": lambda m, x, y: m.stack([x < y, x >= y, x == y]),
    "negative_abs_sign": lambda m, x, y: m.stack([-x, m.abs(x), m.sign(x)]),
    "python_scalar_stays_weak": lambda m, x, y: x * 3 + 1,
    "sum_accumulates_in_64_bits": lambda m, x, y: m.sum(x, axis=1),
    "prod_and_cumsum": lambda m, x, y: (m.prod(x, axis=0), m.cumsum(y, axis=1)),
    "mean_is_float64": lambda m, x, y: m.mean(x, axis=0),
    "max_argmin": lambda m, x, y: (m.max(x, axis=1), m.argmin(y, axis=0)),
    "sort": lambda m, x, y: m.sort(x, axis=1),
    "matmul_wraps": lambda m, x, y: x @ y.T,
    "to_float32_and_back": lambda m, x, y: (x.astype(np.float32), (x.astype(np.float64) * 0.5).astype(x.dtype)),
    "to_bool_and_int8": lambda m, x, y: (x.astype(bool), x.astype(np.int8), x.astype(np.uint64)),
    "take_with_own_indices": lambda m, x, y: m.take(x, (y % 7).astype(y.dtype), axis=1),
}


@pytest.mark.parametrize("dtype", NEW_INTS)
@pytest.mark.parametrize("name", sorted(INT_OPS))
def test_narrow_and_unsigned_integers_match_numpy(session, name, dtype):
    x, y = full_range(dtype, (5, 7)), full_range(dtype, (5, 7))
    y[0, :3] = 0  # the divisions replace zeros with ones
    x[1, :2] = np.iinfo(dtype).min
    y[1, :2] = -1 if np.dtype(dtype).kind == "i" else np.iinfo(dtype).max
    if name == "floor_divide" and np.dtype(dtype).kind == "i":  # numpy's MIN // -1 is undefined: it warns
        x[1, :2] = np.iinfo(dtype).min + 1
    with np.errstate(over="ignore"):
        check(INT_OPS[name], x, y)


@pytest.mark.parametrize(
    "pair",
    [
        ("int8", "uint8"),
        ("int16", "uint16"),
        ("uint32", "int32"),
        ("uint64", "int64"),
        ("uint64", "uint8"),
        ("int8", "float16"),
        ("int16", "float16"),
        ("uint16", "float32"),
        ("uint32", "bool"),
        ("int16", "int8"),
    ],
)
def test_mixed_integer_promotion_matches_numpy(session, pair):
    """numpy's table: int8 + uint8 is int16, uint64 + int64 is float64,
    int16 + float16 is float32, and so on."""
    x, y = sample(pair[0], (4, 3)), sample(pair[1], (4, 3))
    check(lambda m, a, b: (a + b, a * b, m.maximum(a, b), m.where(a > 0, a, b)), x, y)


@pytest.mark.parametrize("dtype", NEW_INTS + ["bool"])
def test_shifts_of_every_integer_width_match_numpy(session, dtype):
    """Shifts by every count from -1 to past the width; bools shift as int8."""
    bits = 8 * np.dtype(dtype).itemsize
    x = full_range(dtype, (bits + 3,)) if dtype != "bool" else np.arange(bits + 3) % 2 == 0
    n = (np.arange(bits + 3) - 1).astype(dtype if dtype != "bool" else np.int8)
    if np.dtype(n.dtype).kind == "u":
        n[0] = 0
    check(lambda m, a, k: (m.left_shift(a, k), m.right_shift(a, k)), x, n if dtype != "bool" else x)


def test_python_ints_out_of_a_narrow_range_raise_as_in_numpy(session):
    """NEP 50: a Python int the array's dtype cannot hold is an OverflowError."""
    x = tessel.device_put(np.arange(4, dtype=np.int8))
    with pytest.raises(OverflowError, match="out of bounds for int8"):
        tessel.jit(lambda a: a + 300)(x)
    u = tessel.device_put(np.arange(4, dtype=np.uint64))
    np.testing.assert_array_equal(
        tessel.jit(lambda a: a + (2**64 - 1))(u).fetch(), np.arange(4, dtype=np.uint64) + np.uint64(2**64 - 1)
    )


@pytest.mark.parametrize("dtype", ["int8", "uint16", "uint64"])
def test_new_integer_dtypes_sharded_and_eager_match_numpy(session, dtype):
    """A sum over a split dimension (an all_reduce in the array's dtype
    through Gloo) and an eager op on an Array, against numpy."""
    from tessel import Mesh, NamedSharding, P

    x = full_range(dtype, (8, 6))
    mesh = Mesh({"data": 2, "model": 2})
    a = tessel.device_put(x, NamedSharding(mesh, P("data", "model")))
    got = tessel.jit(lambda v: (tnp.sum(v, axis=0, dtype=v.dtype), tnp.max(v, axis=0), v * v))(a)
    with np.errstate(over="ignore"):
        want = (np.sum(x, axis=0, dtype=x.dtype), np.max(x, axis=0), x * x)
    for g, w in zip(got, want):
        out = g.fetch()
        assert out.dtype == w.dtype
        np.testing.assert_array_equal(out, w)
    eager = tnp.sum(tessel.device_put(x))
    assert eager.fetch().dtype == np.sum(x).dtype
    np.testing.assert_array_equal(eager.fetch(), np.sum(x))


@pytest.mark.parametrize("offset", [0, 1, -2, 5, -4])
@pytest.mark.parametrize("axes", [(0, 1), (1, 0), (2, 0), (-1, 1)])
def test_diagonal_and_trace_match_numpy(session, offset, axes):
    """Every offset, past the edge too (an empty diagonal), over any pair of
    axes in either order, on integers (trace accumulates as sum does)."""
    x = sample("int16", (4, 5, 3))
    check(lambda m, a: (m.diagonal(a, offset, *axes), m.trace(a, offset, *axes)), x)


def test_ufuncs_without_a_bool_loop_take_int8s_on_bools(session):
    """numpy has no bool loop for power, floor_divide, remainder, square,
    reciprocal and the shifts: bools go through int8's, and so the result
    is int8 (x // False and x % False: XLA's -1 and x, as documented)."""
    t, u = np.array([True, False, True, False]), np.array([True, True, True, True])
    with np.errstate(all="ignore"):
        check(
            lambda m, a, b: (
                m.power(a, b),
                m.floor_divide(a, b),
                m.remainder(a, b),
                m.square(a),
                m.reciprocal(b),
                m.left_shift(a, b),
                m.right_shift(a, b),
            ),
            t,
            u,
        )
