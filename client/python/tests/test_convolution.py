"""Convolutions and pooling windows against JAX on CPU (jax from PyPI):
lax.conv_general_dilated over layouts, strides, paddings, dilations and
groups; lax.reduce_window; tessel.nn's max_pool and avg_pool; their
gradients and vmap; and a small CNN's training step."""

import numpy as np
import pytest

import tessel
import tessel.nn as tnn
import tessel.numpy as tnp
from tessel import lax

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)
jnp, jlax = jax.numpy, jax.lax

RNG = np.random.default_rng(17)


def rand(*shape):
    return RNG.normal(size=shape)


CONVS = {
    # name: (lhs shape, rhs shape, keyword arguments)
    "nchw_valid": ((2, 3, 7, 6), (4, 3, 3, 2), dict(window_strides=(1, 1), padding="VALID")),
    "nhwc_same_stride2": (
        (2, 8, 7, 3),
        (3, 3, 3, 5),
        dict(window_strides=(2, 2), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
    ),
    "explicit_padding_rhs_dilation": (
        (1, 2, 9, 8),
        (3, 2, 3, 3),
        dict(window_strides=(1, 2), padding=((1, 2), (0, 1)), rhs_dilation=(2, 1)),
    ),
    "transposed_lhs_dilation": (
        (2, 3, 5, 4),
        (2, 3, 3, 3),
        dict(window_strides=(1, 1), padding=((2, 2), (1, 2)), lhs_dilation=(2, 2)),
    ),
    "negative_padding": ((1, 2, 8, 8), (2, 2, 2, 2), dict(window_strides=(1, 1), padding=((-1, 0), (1, -2)))),
    "depthwise": (
        (2, 6, 6, 4),
        (3, 3, 1, 4),
        dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=4),
    ),
    "grouped": ((2, 4, 5, 5), (6, 2, 2, 2), dict(window_strides=(1, 1), padding="VALID", feature_group_count=2)),
    "batch_grouped": ((4, 3, 5, 5), (6, 3, 2, 2), dict(window_strides=(1, 1), padding="VALID", batch_group_count=2)),
    "1d_nwc": (
        (3, 10, 2),
        (3, 2, 4),
        dict(window_strides=(2,), padding="SAME", dimension_numbers=("NWC", "WIO", "NWC")),
    ),
    "3d_ndhwc": (
        (1, 5, 4, 6, 2),
        (2, 2, 3, 2, 3),
        dict(window_strides=(1, 2, 1), padding="VALID", dimension_numbers=("NDHWC", "DHWIO", "NDHWC")),
    ),
    "output_layout_differs": (
        (2, 3, 6, 5),
        (2, 2, 3, 4),
        dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NCHW", "HWIO", "NHWC")),
    ),
}


@pytest.mark.parametrize("case", list(CONVS))
def test_conv_general_dilated_matches_jax(cluster, case):
    ls, rs, kw = CONVS[case]
    x, k = rand(*ls), rand(*rs)
    ours = tessel.jit(lambda x, k: lax.conv_general_dilated(x, k, **kw))(x, k).fetch()
    theirs = np.asarray(jlax.conv_general_dilated(x, k, **kw))
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", list(CONVS))
def test_float32_convolutions_and_their_gradients_match_jax(cluster, case):
    """float32 runs on oneDNN (with input dilation and negative padding
    materialized, batch groups one call each); the gradients are
    convolutions of their own."""
    ls, rs, kw = CONVS[case]
    x, k = rand(*ls).astype(np.float32), rand(*rs).astype(np.float32)

    def loss(conv, x, k):
        y = conv(x, k, **kw)
        return (y * y).sum() / y.size

    ours = tessel.jit(lambda x, k: lax.conv_general_dilated(x, k, **kw))(x, k).fetch()
    theirs = np.asarray(jlax.conv_general_dilated(x, k, **kw))
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-5)
    ours_g = tessel.jit(tessel.grad(lambda x, k: loss(lax.conv_general_dilated, x, k), argnums=(0, 1)))(x, k)
    theirs_g = jax.grad(lambda x, k: loss(jlax.conv_general_dilated, x, k), argnums=(0, 1))(x, k)
    for o, t in zip(ours_g, theirs_g):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16", np.int32])
def test_narrow_and_integer_convolutions_match_jax(cluster, dtype):
    """Other dtypes take the direct loop: halves accumulate in float32 as
    XLA's do, integers wrap."""
    ls, rs, kw = CONVS["nhwc_same_stride2"]
    dt = jnp.dtype(dtype)
    if np.issubdtype(dt, np.integer):
        x, k = RNG.integers(-5, 6, ls).astype(dt), RNG.integers(-5, 6, rs).astype(dt)
    else:
        x, k = np.asarray(jnp.asarray(rand(*ls), dt)), np.asarray(jnp.asarray(rand(*rs), dt))
    ours = tessel.jit(lambda x, k: lax.conv_general_dilated(x, k, **kw))(x, k).fetch()
    theirs = np.asarray(jlax.conv_general_dilated(x, k, **kw))
    assert ours.dtype == theirs.dtype
    tol = 0 if np.issubdtype(dt, np.integer) else 2e-2
    np.testing.assert_allclose(ours.astype(np.float64), theirs.astype(np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", ["nhwc_same_stride2", "transposed_lhs_dilation", "depthwise", "batch_grouped"])
def test_conv_gradients_match_jax(cluster, case):
    ls, rs, kw = CONVS[case]
    x, k = rand(*ls), rand(*rs)

    def loss(conv, x, k):
        y = conv(x, k, **kw)
        return (y * y).sum() / y.size + (y.sum() ** 2) * 1e-3

    ours = tessel.jit(tessel.grad(lambda x, k: loss(lax.conv_general_dilated, x, k), argnums=(0, 1)))(x, k)
    theirs = jax.grad(lambda x, k: loss(jlax.conv_general_dilated, x, k), argnums=(0, 1))(x, k)
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=1e-9, atol=1e-12)


def test_vmap_of_a_convolution_matches_jax(cluster):
    ls, rs, kw = CONVS["nhwc_same_stride2"]
    xs, k = rand(3, *ls), rand(*rs)
    ours = tessel.jit(tessel.vmap(lambda x: lax.conv_general_dilated(x, k, **kw)))(xs).fetch()
    theirs = np.asarray(jax.vmap(lambda x: jlax.conv_general_dilated(x, k, **kw))(xs))
    np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batched", ["kernel", "both"])
def test_vmap_over_kernels_matches_jax(cluster, batched):
    """A batched kernel joins the output features; both batched, the batch
    becomes feature groups (JAX's rule)."""
    ls, rs, kw = CONVS["grouped"] if batched == "both" else CONVS["nchw_valid"]
    ks = rand(3, *rs)
    x = rand(3, *ls) if batched == "both" else rand(*ls)
    in_axes = (0, 0) if batched == "both" else (None, 0)
    ours = tessel.jit(tessel.vmap(lambda x, k: lax.conv_general_dilated(x, k, **kw), in_axes=in_axes))(x, ks)
    theirs = jax.vmap(lambda x, k: jlax.conv_general_dilated(x, k, **kw), in_axes=in_axes)(x, ks)
    np.testing.assert_allclose(ours.fetch(), np.asarray(theirs), rtol=1e-10, atol=1e-12)


def test_preferred_element_type_of_a_convolution(cluster):
    x, k = rand(1, 2, 5, 5).astype(np.float32), rand(3, 2, 2, 2).astype(np.float32)
    ours = tessel.jit(lambda x, k: lax.conv(x, k, (1, 1), "VALID", preferred_element_type=np.float64))(x, k).fetch()
    theirs = np.asarray(jlax.conv(x, k, (1, 1), "VALID", preferred_element_type=np.float64))
    assert ours.dtype == theirs.dtype == np.float64
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)


def test_convolution_errors_name_the_mismatch(cluster):
    x, k = rand(1, 3, 5, 5), rand(2, 4, 3, 3)
    with pytest.raises(ValueError, match="lhs has 3 input features; rhs's 4 input features"):
        tessel.jit(lambda x, k: lax.conv(x, k, (1, 1), "VALID"))(x, k)
    with pytest.raises(ValueError, match="window_strides needs 2 positive entries"):
        tessel.jit(lambda x, k: lax.conv(x, k, (1,), "VALID"))(x, rand(2, 3, 3, 3))
    with pytest.raises(ValueError, match="need the same rank"):
        tessel.jit(lambda x, k: lax.conv(x, k, (1, 1), "VALID"))(x, rand(2, 3, 3))


WINDOWS = {
    "max_2x2_stride2": ("max", -np.inf, (1, 2, 2, 1), (1, 2, 2, 1), "VALID", None, None),
    "max_3x3_same": ("max", -np.inf, (1, 3, 3, 1), (1, 1, 1, 1), "SAME", None, None),
    "add_padded_strided": ("add", 0.0, (1, 3, 2, 1), (1, 2, 1, 1), ((0, 0), (1, 1), (0, 2), (0, 0)), None, None),
    "min_window_dilation": ("min", np.inf, (1, 2, 2, 1), (1, 1, 1, 1), "VALID", None, (1, 2, 3, 1)),
    "add_base_dilation": ("add", 0.0, (1, 2, 2, 1), (1, 1, 1, 1), "VALID", (1, 2, 1, 1), None),
    "max_init_above_identity": ("max", 0.25, (1, 2, 2, 1), (1, 1, 1, 1), "VALID", None, None),
}


@pytest.mark.parametrize("case", list(WINDOWS))
def test_reduce_window_matches_jax(cluster, case):
    kind, init, dims, strides, padding, base, wdil = WINDOWS[case]
    x = rand(2, 7, 6, 3)
    ours_fn = {"max": lax.max, "min": lax.min, "add": lax.add}[kind]
    theirs_fn = {"max": jlax.max, "min": jlax.min, "add": jlax.add}[kind]
    ours = tessel.jit(lambda x: lax.reduce_window(x, init, ours_fn, dims, strides, padding, base, wdil))(x).fetch()
    theirs = np.asarray(jlax.reduce_window(x, init, theirs_fn, dims, strides, padding, base, wdil))
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)


@pytest.mark.parametrize("case", ["max_2x2_stride2", "max_3x3_same", "add_padded_strided"])
def test_reduce_window_gradients_match_jax(cluster, case):
    kind, init, dims, strides, padding, base, wdil = WINDOWS[case]
    x = rand(2, 7, 6, 3)  # random: no ties inside a window
    ours_fn = {"max": lax.max, "add": lax.add}[kind]
    theirs_fn = {"max": jlax.max, "add": jlax.add}[kind]
    w = rand(*np.asarray(jlax.reduce_window(x, init, theirs_fn, dims, strides, padding)).shape)
    ours = tessel.jit(tessel.grad(lambda x: (lax.reduce_window(x, init, ours_fn, dims, strides, padding) * w).sum()))(x)
    theirs = jax.grad(lambda x: (jlax.reduce_window(x, init, theirs_fn, dims, strides, padding) * w).sum())(x)
    np.testing.assert_allclose(ours.fetch(), np.asarray(theirs), rtol=1e-12)


def _flax_pool(x, init, fn, window, strides, padding):
    """flax.linen.pooling.pool, written against jax.lax."""
    dims = (1,) + window + (1,)
    steps = (1,) + (strides or (1,) * len(window)) + (1,)
    if not isinstance(padding, str):
        padding = ((0, 0),) + tuple(padding) + ((0, 0),)
    return jlax.reduce_window(x, init, fn, dims, steps, padding)


def test_max_pool_and_avg_pool_match_flax_formulas(cluster):
    x = rand(2, 9, 8, 4)
    for window, strides, padding in (
        ((2, 2), (2, 2), "VALID"),
        ((3, 3), (1, 1), "SAME"),
        ((3, 2), (2, 1), ((1, 1), (0, 1))),
    ):
        ours = tessel.jit(lambda x: tnn.max_pool(x, window, strides, padding))(x).fetch()
        theirs = np.asarray(_flax_pool(x, -jnp.inf, jlax.max, window, strides, padding))
        np.testing.assert_allclose(ours, theirs, rtol=1e-12)
        ours = tessel.jit(lambda x: tnn.avg_pool(x, window, strides, padding))(x).fetch()
        theirs = np.asarray(_flax_pool(x, 0.0, jlax.add, window, strides, padding)) / np.prod(window)
        np.testing.assert_allclose(ours, theirs, rtol=1e-12)
        ours = tessel.jit(lambda x: tnn.avg_pool(x, window, strides, padding, count_include_pad=False))(x).fetch()
        counts = _flax_pool(jnp.ones((1,) + x.shape[1:3] + (1,)), 0.0, jlax.add, window, strides, padding)
        theirs = np.asarray(_flax_pool(x, 0.0, jlax.add, window, strides, padding) / counts)
        np.testing.assert_allclose(ours, theirs, rtol=1e-12)


def test_a_small_cnn_trains_as_in_jax(cluster):
    """conv 3x3 -> relu -> max_pool 2x2 -> conv 3x3 stride 2 -> relu ->
    mean over space -> dense: three SGD steps, parameters and losses
    against JAX's."""
    x, labels = rand(8, 12, 12, 3), RNG.integers(0, 5, 8)
    params = {
        "k1": rand(3, 3, 3, 8) * 0.3,
        "k2": rand(3, 3, 8, 16) * 0.2,
        "w": rand(16, 5) * 0.3,
        "b": np.zeros(5),
    }
    dn = ("NHWC", "HWIO", "NHWC")

    def make(L, N, pool, log_softmax):
        def loss(p, x, labels):
            h = N.maximum(L.conv_general_dilated(x, p["k1"], (1, 1), "SAME", dimension_numbers=dn), 0)
            h = pool(h)
            h = N.maximum(L.conv_general_dilated(h, p["k2"], (2, 2), "SAME", dimension_numbers=dn), 0)
            logits = h.mean(axis=(1, 2)) @ p["w"] + p["b"]
            return -N.take_along_axis(log_softmax(logits), labels[:, None], axis=1).mean()

        return loss

    ours_loss = make(lax, tnp, lambda h: tnn.max_pool(h, (2, 2), (2, 2)), tnn.log_softmax)
    theirs_loss = make(
        jlax, jnp, lambda h: _flax_pool(h, -jnp.inf, jlax.max, (2, 2), (2, 2), "VALID"), jax.nn.log_softmax
    )

    @tessel.jit
    def ours_step(p, x, labels):
        value, g = tessel.value_and_grad(ours_loss)(p, x, labels)
        return value, {k: p[k] - 0.1 * g[k] for k in p}

    @jax.jit
    def theirs_step(p, x, labels):
        value, g = jax.value_and_grad(theirs_loss)(p, x, labels)
        return value, {k: p[k] - 0.1 * g[k] for k in p}

    ours_p, theirs_p = dict(params), dict(params)
    for _ in range(3):
        ours_v, ours_p = ours_step(ours_p, x, labels)
        theirs_v, theirs_p = theirs_step(theirs_p, x, labels)
        np.testing.assert_allclose(ours_v.fetch(), np.asarray(theirs_v), rtol=1e-10)
    for k in params:
        np.testing.assert_allclose(ours_p[k].fetch(), np.asarray(theirs_p[k]), rtol=1e-9, atol=1e-12)


def test_a_batch_split_convolution_needs_no_communication(cluster):
    """Split over the batch, each device convolves its own images: the plan
    holds no collective, and the values are JAX's."""
    mesh = tessel.Mesh({"data": 2})
    ls, rs, kw = CONVS["nhwc_same_stride2"]
    x, k = rand(4, *ls[1:]), rand(*rs)
    f = tessel.jit(lambda x, k: lax.conv_general_dilated(x, k, **kw))
    args = (
        tessel.device_put(x, tessel.NamedSharding(mesh, tessel.P("data"))),
        tessel.device_put(k, tessel.NamedSharding(mesh, tessel.P())),
    )
    out = f(*args)
    np.testing.assert_allclose(out.fetch(), np.asarray(jlax.conv_general_dilated(x, k, **kw)), rtol=1e-10)
    assert f.lower(*args).collectives == []
    assert out.sharding.spec[0] == "data"


def test_feature_split_convolutions_plan_as_a_matmul_would(cluster):
    """Output features split over the mesh need no communication; input
    features split on both operands leave a partial sum, completed by one
    all_reduce."""
    mesh = tessel.Mesh({"model": 2})
    ls, rs, kw = CONVS["nhwc_same_stride2"]
    x, k = rand(*ls[:3], 4), rand(*rs[:2], 4, 6)
    ref = np.asarray(jlax.conv_general_dilated(x, k, **kw))
    f = tessel.jit(lambda x, k: lax.conv_general_dilated(x, k, **kw))
    out_split = (
        tessel.device_put(x, tessel.NamedSharding(mesh, tessel.P())),
        tessel.device_put(k, tessel.NamedSharding(mesh, tessel.P(None, None, None, "model"))),
    )
    out = f(*out_split)
    np.testing.assert_allclose(out.fetch(), ref, rtol=1e-10)
    assert f.lower(*out_split).collectives == []
    assert out.sharding.spec[3] == "model"
    in_split = (
        tessel.device_put(x, tessel.NamedSharding(mesh, tessel.P(None, None, None, "model"))),
        tessel.device_put(k, tessel.NamedSharding(mesh, tessel.P(None, None, "model"))),
    )
    g = tessel.jit(
        lambda x, k: lax.conv_general_dilated(x, k, **kw), out_shardings=tessel.NamedSharding(mesh, tessel.P())
    )
    np.testing.assert_allclose(g(*in_split).fetch(), ref, rtol=1e-10)
    kinds = [c["op"] for c in g.lower(*in_split).collectives]
    assert kinds == ["all_reduce"], kinds


def test_jvp_of_a_convolution_matches_jax(cluster):
    """Forward mode: a convolution is linear in each operand."""
    ls, rs, kw = CONVS["grouped"]
    x, k, dx, dk = rand(*ls), rand(*rs), rand(*ls), rand(*rs)
    ours = tessel.jit(lambda *a: tessel.jvp(lambda x, k: lax.conv_general_dilated(x, k, **kw), a[:2], a[2:]))(
        x, k, dx, dk
    )
    theirs = jax.jvp(lambda x, k: jlax.conv_general_dilated(x, k, **kw), (x, k), (dx, dk))
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=1e-10, atol=1e-12)


def test_a_spatial_split_exchanges_halos_instead_of_gathering(cluster):
    """Images split along their height over the mesh: a stride-1 SAME
    convolution reads its neighbours' edge rows by collective_permute and
    keeps the split; its weight gradient is a partial sum of the blocks'
    (one all_reduce); neither gathers the images. Values are JAX's; a
    stride-2 convolution, which the exchange does not serve, gathers."""
    mesh = tessel.Mesh({"data": 2})
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x, k, w = rand(2, 8, 6, 3), rand(3, 3, 3, 4), rand(2, 8, 6, 4)
    args = (
        tessel.device_put(x, tessel.NamedSharding(mesh, tessel.P(None, "data"))),
        tessel.device_put(k, tessel.NamedSharding(mesh, tessel.P())),
    )
    f = tessel.jit(lambda x, k: lax.conv_general_dilated(x, k, **kw))
    out = f(*args)
    np.testing.assert_allclose(out.fetch(), np.asarray(jlax.conv_general_dilated(x, k, **kw)), rtol=1e-10)
    assert out.sharding.spec[1] == "data"
    kinds = [c["op"] for c in f.lower(*args).collectives]
    assert kinds == ["collective_permute", "collective_permute"], kinds
    assert all("halo exchange" in c["reason"] for c in f.lower(*args).collectives)

    def loss(np_mod, conv):
        return lambda x, k: np_mod.sum(np_mod.tanh(conv(x, k, **kw)) * w)

    g = tessel.jit(tessel.grad(loss(tnp, lax.conv_general_dilated), (0, 1)))
    ours = g(*args)
    theirs = jax.grad(loss(jnp, jlax.conv_general_dilated), (0, 1))(x, k)
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=1e-9, atol=1e-11)
    kinds = [c["op"] for c in g.lower(*args).collectives]
    assert "all_gather" not in kinds and kinds.count("all_reduce") == 1, kinds
    s2 = dict(kw, window_strides=(2, 1))
    h = tessel.jit(lambda x, k: lax.conv_general_dilated(x, k, **s2))
    np.testing.assert_allclose(h(*args).fetch(), np.asarray(jlax.conv_general_dilated(x, k, **s2)), rtol=1e-10)
    assert "all_gather" in [c["op"] for c in h.lower(*args).collectives]
