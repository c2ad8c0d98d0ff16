"""The Array API standard's names in tessel.numpy, against numpy 2's own
(traced under jit and run at once on Arrays), and jax.numpy's for the
`size=` forms of the value-dependent searches."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from test_ops import check, sample

X = sample("float32", (3, 4))
I = sample("int32", (2, 3, 4))
B = sample("bool", (3, 4))

CASES = {
    "concat": (lambda m, x: m.concat([x, x[:1] * 2], axis=0), X),
    "concat_flat": (lambda m, x: m.concat([x, x[0]], axis=None), X),
    "permute_dims": (lambda m, x: m.permute_dims(x, (2, 0, 1)), I),
    "matrix_transpose": (lambda m, x: m.matrix_transpose(x), I),
    "mT": (lambda m, x: x.mT + 1, I),
    "unstack": (lambda m, x: m.unstack(x, axis=1), I),
    "unstack_last": (lambda m, x: m.unstack(x, axis=-1), X),
    "broadcast_arrays": (lambda m, x: m.broadcast_arrays(x, x[:1, None, :], m.float32(2)), X),
    "meshgrid_xy": (lambda m, x: m.meshgrid(x[0], x[1, :3], x[2, :2]), X),
    "meshgrid_ij": (lambda m, x: m.meshgrid(x[0], x[1, :3], indexing="ij"), X),
    "meshgrid_sparse": (lambda m, x: m.meshgrid(x[0], x[1, :3], sparse=True), X),
    "vecdot": (lambda m, x: m.vecdot(x, x[1]), X),
    "vecdot_axis": (lambda m, x: m.vecdot(x, x, axis=0), I),
    "vecdot_bool": (lambda m, x: m.vecdot(x, x[::-1]), B),
    "vecdot_int8": (lambda m, x: m.vecdot(x.astype(m.int8), x.astype(m.int8)), I),
    "diff": (lambda m, x: m.diff(x), X),
    "diff_n_axis": (lambda m, x: m.diff(x, n=2, axis=0), I),
    "diff_bool": (lambda m, x: m.diff(x, axis=1), B),
    "diff_uint8": (lambda m, x: m.diff(x.astype(m.uint8)), I),
    "diff_ends": (lambda m, x: m.diff(x, prepend=0, append=x[..., :1]), I),
    "diff_zero": (lambda m, x: m.diff(x, n=0), X),
    "count_nonzero": (lambda m, x: m.count_nonzero(x), I),
    "count_nonzero_axis": (lambda m, x: m.count_nonzero(x, axis=(0, 2), keepdims=True), I),
    "count_nonzero_bool": (lambda m, x: m.count_nonzero(x, axis=1), B),
    "pow": (lambda m, x: m.pow(m.abs(x), 1.5), X),
    "positive": (lambda m, x: m.positive(x), I),
    "bitwise_invert": (lambda m, x: m.bitwise_invert(x), I),
    "hypot": (lambda m, x: m.hypot(x, x[::-1] * 3), X),
    "hypot_int": (lambda m, x: m.hypot(x, x + 1), I),
    "hypot_edges": (
        lambda m, x: m.hypot(
            m.asarray([0.0, np.inf, -np.inf, np.nan, 1e30, 3.0], m.float32),
            m.asarray([0.0, np.nan, 2.0, 1.0, 1e30, -4.0], m.float32),
        ),
        X,
    ),
    "full_like": (lambda m, x: m.full_like(x, 7), I),
    "full_like_dtype": (lambda m, x: m.full_like(x, 2.5, dtype=m.float32), I),
    "empty_like_shape": (lambda m, x: m.empty_like(x).shape == x.shape, I),
    "real_imag_conj": (lambda m, x: (m.real(x), m.imag(x), m.conj(x)), X),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_array_api_names_match_numpy(session, name):
    fn, x = CASES[name]
    if name == "empty_like_shape":
        assert fn(tnp, x) and tnp.empty((2, 3)).shape == (2, 3) and tnp.empty_like(x).dtype == x.dtype
        return
    check(fn, x)


@pytest.mark.parametrize("name", ["concat", "unstack", "diff_ends", "vecdot", "hypot", "count_nonzero_axis"])
def test_array_api_names_run_at_once_on_arrays(session, name):
    fn, x = CASES[name]
    want = fn(np, x)
    got = fn(tnp, tessel.device_put(x))
    for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        assert isinstance(g, tessel.Array)
        np.testing.assert_allclose(g.fetch(), w, rtol=1e-6)


VALUES = np.array([3.0, np.nan, 1.0, 3.0, np.nan, -0.0, 0.0, 2.0, 1.0], np.float32)
INTS = np.array([[5, 0, 2], [2, 0, 7], [5, 5, 0]], np.int32)


@pytest.mark.parametrize("x", [VALUES, INTS, INTS.astype(np.uint8) > 2], ids=["floats", "ints", "bools"])
def test_unique_and_nonzero_at_once_match_numpy(session, x):
    """Called at once without a size: the count is fetched, then numpy's
    answer, sorted (numpy.unique with equal_nan=False: NaNs each distinct,
    -0.0 equal to 0.0; numpy 2.3's unique_* may leave integers unsorted,
    which the standard allows)."""
    a = tessel.device_put(x)
    values, indices, inverse, counts = np.unique(
        x, return_index=True, return_inverse=True, return_counts=True, equal_nan=False
    )
    want = {"values": values, "indices": indices, "inverse_indices": inverse.reshape(x.shape), "counts": counts}
    for name in ("unique_all", "unique_counts", "unique_inverse"):
        got = getattr(tnp, name)(a)
        assert type(got).__name__ == type(getattr(np, name)(x)).__name__
        assert got._fields == getattr(np, name)(x)._fields
        for field in got._fields:
            g, w = getattr(got, field).fetch(), want[field]
            assert g.shape == w.shape and g.dtype == w.dtype, (name, field, g, w)
            np.testing.assert_array_equal(g, w, err_msg=f"{name}.{field}")
    np.testing.assert_array_equal(tnp.unique_values(a).fetch(), values)
    for g, w in zip(tnp.nonzero(a), np.nonzero(x)):
        np.testing.assert_array_equal(g.fetch(), w)
    np.testing.assert_array_equal(tnp.argwhere(a).fetch(), np.argwhere(x))


@pytest.mark.parametrize("size", [2, 4, 6])
@pytest.mark.parametrize("fill", [None, 9])
def test_sized_unique_and_nonzero_under_jit_match_jax(session, size, fill):
    """With size= (fewer, as many, and more than there are), padded as
    jax.numpy pads: values with the fill (default the smallest), indices
    with the smallest's, counts with 0."""
    x = np.array([3, 1, 3, 2, 1, 3], np.int32)

    def f(m, v):
        u = m.unique_all(v, size=size, fill_value=fill)
        nz = m.nonzero(v - 1, size=size, fill_value=fill)
        return tuple(u) + tuple(nz)

    want = jax.jit(lambda v: f(jnp, v))(x)  # values compared: jax's index dtype follows jax_enable_x64
    got = tessel.jit(lambda v: f(tnp, v))(x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.fetch(), np.asarray(w))


def test_value_dependent_shapes_in_a_trace_ask_for_a_size(session):
    with pytest.raises(ValueError, match=r"nonzero: the size of its result depends on the values.*size="):
        tessel.jit(lambda v: tnp.nonzero(v))(INTS)
    with pytest.raises(ValueError, match=r"unique_values: .*pass size="):
        tessel.jit(lambda v: tnp.unique_values(v))(INTS)
    with pytest.raises(ValueError, match="nonzero on 0d arrays"):
        tnp.nonzero(tessel.device_put(np.int32(3)), size=1)


def test_dtype_queries_match_numpy():
    dtypes = [np.bool_, np.int8, np.int32, np.uint8, np.uint64, np.float16, np.float32, np.float64]
    for a in dtypes:
        for b in dtypes:
            assert tnp.can_cast(a, b) == np.can_cast(a, b), (a, b)
            assert tnp.result_type(a, b) == np.result_type(a, b), (a, b)
        for kind in ["bool", "signed integer", "unsigned integer", "integral", "real floating", "numeric"]:
            assert tnp.isdtype(a, kind) == np.isdtype(np.dtype(a), kind), (a, kind)
        assert tnp.result_type(a, 1.0) == np.result_type(a, 1.0), a
    assert tnp.isdtype(np.float32, ("bool", np.float32)) and not tnp.isdtype(np.int8, (np.float32, "bool"))
    bf16 = tnp.bfloat16
    assert tnp.isdtype(bf16, "real floating") and tnp.can_cast(bf16, np.float32) and not tnp.can_cast(bf16, np.int8)
    assert tnp.result_type(bf16, np.float16) == np.float32
    with pytest.raises(ValueError, match="unknown kind 'floats'"):
        tnp.isdtype(np.float32, "floats")


def test_namespace_members_and_device(session):
    x = tessel.device_put(X)
    assert x.__array_namespace__() is tnp and tnp.__array_api_version__ == "2024.12"
    assert (tnp.e, tnp.pi, tnp.inf, tnp.newaxis) == (np.e, np.pi, np.inf, None) and np.isnan(tnp.nan)
    info = tnp.__array_namespace_info__()
    assert info.default_dtypes()["indexing"] == np.int64 and "bfloat16" in info.dtypes()
    assert set(info.dtypes(kind="integral")) == {
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
    }
    assert [d.id for d in info.devices()] == [d.id for d in tessel.devices()]
    # device= on creation, from another array's .device; to_device moves it.
    z = tnp.zeros((3, 4), tnp.float32, device=x.device)
    assert z.sharding == x.sharding
    last = tessel.devices()[-1]
    moved = x.to_device(tessel.SingleDeviceSharding(last.id))
    assert moved.devices() == (last.id,)
    np.testing.assert_array_equal(moved.fetch(), X)
    y = tnp.full_like(x, 3.0, device=moved.device)
    assert y.devices() == (last.id,) and (y.fetch() == 3).all()

    @tessel.jit
    def traced(v):
        assert v.__array_namespace__() is tnp
        return v.mT

    np.testing.assert_array_equal(traced(X).fetch(), X.T)


SIGNATURES = {
    "std_correction": (lambda m, x: m.std(x, axis=0, correction=1), X),
    "var_correction": (lambda m, x: m.var(x, correction=2), X),
    "cumulative_sum_initial": (lambda m, x: m.cumulative_sum(x, axis=1, include_initial=True), I),
    "cumulative_prod_initial": (lambda m, x: m.cumulative_prod(x[0, 0], include_initial=True), I),
    "cumulative_sum_1d": (lambda m, x: m.cumulative_sum(x[1]), X),
    "clip_min_max": (lambda m, x: m.clip(x, min=-1, max=2), X),
    "clip_max_only": (lambda m, x: m.clip(x, max=0.5), X),
    "reshape_shape": (lambda m, x: m.reshape(x, shape=(4, 3)), X),
    "astype_copy": (lambda m, x: m.astype(x, m.int16, copy=False), I),
    "asarray_copy": (lambda m, x: m.asarray(x, copy=True) + 1, I),
    "zeros_default": (lambda m, x: m.zeros((2, 3)) + m.zeros(2, dtype=None)[:, None], X),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_array_api_signatures_match_numpy(session, name):
    fn, x = SIGNATURES[name]
    check(fn, x)


def test_array_api_signature_errors_name_the_argument(session):
    with pytest.raises(ValueError, match="cumulative_sum: axis is required for an array of 3 dimensions"):
        tnp.cumulative_sum(tessel.device_put(I))
    with pytest.raises(NotImplementedError, match="order='F'"):
        tnp.reshape(tessel.device_put(X), (4, 3), order="F")
    assert [10, 20, 30][tessel.device_put(np.int32(2))] == 30  # __index__
    with pytest.raises(TypeError, match="__index__ of a float32 array"):
        [1, 2][tessel.device_put(np.float32(1))]


def _edges(dtype):
    """Values at a float dtype's edges: signed zeros and NaNs, infinities,
    subnormals, the largest and the smallest normal, and some ordinary ones."""
    d = np.dtype(dtype)
    info = ml_dtypes.finfo(d)
    tiny, big = float(info.tiny), float(info.max)
    sub = float(info.smallest_subnormal)
    v = [0.0, -0.0, np.inf, -np.inf, np.nan, sub, -sub, tiny, -tiny, big, -big, 1.0, -1.5, 3.25, 1e-3]
    out = np.array(v, np.float64).astype(d)
    neg_nan = np.copysign(np.array(np.nan, np.float64), -1.0).astype(d)
    return np.concatenate([out, [neg_nan]])


FLOATS = ["float16", "float32", "float64"]


@pytest.mark.parametrize("dtype", FLOATS + ["bfloat16"])
def test_bitcasts_read_the_bits_as_numpy_view_does(session, dtype):
    """jax.lax.bitcast_convert_type (CONVERT with bitcast) against numpy's
    view: to the unsigned and signed integers of the width and back, to a
    narrower dtype (a new last dimension) and from it (taking it away)."""
    d = np.dtype(tnp.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = _edges(d)
    w = d.itemsize
    for to in (f"u{w}", f"i{w}"):
        got = tessel.jit(lambda v: tessel.lax.bitcast_convert_type(v, to))(x).fetch()
        np.testing.assert_array_equal(got, x.view(to))
        back = tessel.jit(lambda v: tessel.lax.bitcast_convert_type(v, d))(x.view(to)).fetch()
        np.testing.assert_array_equal(back.view(to), x.view(to))  # every bit, NaN payloads included
    if w > 1:
        got = tessel.jit(lambda v: tessel.lax.bitcast_convert_type(v, np.uint8))(x).fetch()
        np.testing.assert_array_equal(got, x.view(np.uint8).reshape(x.shape + (w,)))
        wide = tessel.jit(lambda v: tessel.lax.bitcast_convert_type(v, d))(x.view(np.uint8).reshape(-1, w)).fetch()
        np.testing.assert_array_equal(wide.view(f"u{w}"), x.view(f"u{w}"))
    # jax.lax's own answer, on the float32 bits
    if d == np.float32:
        want = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.uint8))
        np.testing.assert_array_equal(tessel.lax.bitcast_convert_type(tessel.device_put(x), np.uint8).fetch(), want)


def test_bitcast_errors_name_both_dtypes_and_its_derivative_is_zero(session):
    with pytest.raises(ValueError, match=r"a wider dtype takes a last dimension of 4.*got \[3\]"):
        tessel.lax.bitcast_convert_type(tessel.device_put(np.zeros(3, np.uint8)), np.float32)
    with pytest.raises(TypeError, match="bool has no bits"):
        tessel.lax.bitcast_convert_type(tessel.device_put(np.zeros(3, bool)), np.uint8)
    x = np.array([1.5, -2.0, 3.0], np.float32)
    # d/dx sum(x * bitcast(bitcast(x, i32), f32)): JAX's zero for the bitcast path, so 1 * x.
    g = tessel.jit(
        tessel.grad(
            lambda v: tnp.sum(
                v * tessel.lax.bitcast_convert_type(tessel.lax.bitcast_convert_type(v, np.int32), v.dtype)
            )
        )
    )(x).fetch()
    want = jax.grad(
        lambda v: jnp.sum(v * jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(v, jnp.int32), v.dtype))
    )(x)
    np.testing.assert_array_equal(g, np.asarray(want))


@pytest.mark.parametrize("dtype", FLOATS)
def test_signbit_copysign_and_nextafter_match_numpy_at_the_edges(session, dtype):
    """Every pair of edge values (signed zeros and NaNs, infinities,
    subnormals, the extremes): numpy's answer, bit for bit."""
    x = _edges(dtype)
    a, b = np.repeat(x, len(x)), np.tile(x, len(x))
    u = f"u{np.dtype(dtype).itemsize}"
    got = tessel.jit(lambda p, q: (tnp.signbit(p), tnp.copysign(p, q), tnp.nextafter(p, q)))(a, b)
    np.testing.assert_array_equal(got[0].fetch(), np.signbit(a))
    np.testing.assert_array_equal(got[1].fetch().view(u), np.copysign(a, b).view(u))
    want = np.nextafter(a, b)
    have = got[2].fetch()
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(have), nan)
    np.testing.assert_array_equal(have[~nan].view(u), want[~nan].view(u))


def test_signbit_copysign_nextafter_of_integers_and_bools_match_numpy(session):
    i = np.array([-3, 0, 2, 7], np.int32)
    u8 = np.array([0, 1, 200, 255], np.uint8)
    check(lambda m, v: (m.signbit(v), m.copysign(v, -v), m.nextafter(v, v + 1)), i)
    check(lambda m, v: (m.signbit(v), m.copysign(v, 1), m.nextafter(v, 0)), u8)
    check(lambda m, v: m.signbit(v), np.array([True, False]))
