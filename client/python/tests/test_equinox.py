"""Equinox models on a Tessel cluster: a module's arrays partitioned from its
static fields through tessel.jax.jit (the jax.jit idiom), and whole modules
passed and returned through tessel.jax.filter_jit (equinox.filter_jit's);
each step against the same step under JAX on CPU."""

import numpy as np
import pytest

import tessel

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")
jnp = jax.numpy
tjax = pytest.importorskip("tessel.jax")

RNG = np.random.default_rng(31)


def floats(*shape):
    """Inputs in the dtype Equinox's parameters take (float64 where another
    suite has turned on jax_enable_x64)."""
    return RNG.normal(size=shape).astype(jnp.asarray(0.0).dtype)


class CNN(eqx.Module):
    """A convolution, a layer norm, a max pool and an MLP with GELU."""

    conv: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
        self.norm = eqx.nn.LayerNorm((4, 8, 8))
        self.mlp = eqx.nn.MLP(4 * 4 * 4, 3, 16, 2, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):
        x = jax.nn.relu(self.norm(self.conv(x)))
        x = eqx.nn.MaxPool2d(2, 2)(x)
        return self.mlp(x.reshape(-1))


def assert_trees_close(ours, theirs, rtol, atol):
    o_leaves, o_tree = jax.tree_util.tree_flatten(ours)
    t_leaves, t_tree = jax.tree_util.tree_flatten(theirs)
    assert o_tree == t_tree
    for o, t in zip(o_leaves, t_leaves):
        if isinstance(o, tessel.Array):
            np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=rtol, atol=atol)
        else:
            assert o is t or o == t


def test_a_cnn_partitioned_into_arrays_and_static_trains_with_adam(session):
    """eqx.partition / eqx.combine around tessel.jax.jit: the parameters
    and Adam's state donated; three steps match jax.jit's."""
    params, static = eqx.partition(CNN(jax.random.PRNGKey(0)), eqx.is_array)
    tx = optax.adam(1e-2)

    def step(params, opt, x, y):
        def loss(p):
            logits = jax.vmap(eqx.combine(p, static))(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, g = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(g, opt, params)
        return eqx.apply_updates(params, updates), opt, value

    x = floats(8, 1, 8, 8)
    y = RNG.integers(0, 3, 8).astype(np.int32)
    run = tjax.jit(step, donate_argnums=(0, 1))
    ours = theirs = (params, tx.init(params))
    for _ in range(3):
        *ours, loss = run(*ours, x, y)
        *theirs, j_loss = jax.jit(step)(*theirs, x, y)
        np.testing.assert_allclose(float(loss.fetch()), float(j_loss), rtol=1e-5)
    assert all(r["reused"] for r in run.donation_receipts())
    assert_trees_close(ours[0], theirs[0], rtol=2e-4, atol=2e-5)


def test_filter_jit_takes_and_returns_whole_modules(session):
    """tessel.jax.filter_jit as equinox.filter_jit: the model goes in whole
    (its activation function a static leaf), comes back an MLP with the
    same function, its arrays on the cluster; donate="all" reuses every
    buffer, and the losses follow equinox.filter_jit's."""
    model = eqx.nn.MLP(4, 2, 8, 2, activation=jax.nn.tanh, key=jax.random.PRNGKey(1))
    tx = optax.sgd(0.1)

    def step(model, opt, x, y):
        value, g = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, opt = tx.update(g, opt, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt, value

    x, y = floats(8, 4), floats(8, 2)
    ours_step, theirs_step = tjax.filter_jit(step, donate="all"), eqx.filter_jit(step)
    opt = tx.init(eqx.filter(model, eqx.is_array))
    ours, theirs = (model, opt), (model, opt)
    for _ in range(3):
        *ours, loss = ours_step(*ours, x, y)
        *theirs, j_loss = theirs_step(*theirs, x, y)
        np.testing.assert_allclose(float(loss.fetch()), float(j_loss), rtol=1e-5)
    assert type(ours[0]) is eqx.nn.MLP and ours[0].activation is model.activation
    assert isinstance(ours[0].layers[0].weight, tessel.Array)
    # "all" donates the batch too: the model's and the optimizer's buffers
    # are reused; x and y, with no output of their type, are not.
    receipts = ours_step.donation_receipts()
    n_state = sum(isinstance(v, tessel.Array) for v in jax.tree_util.tree_leaves(ours))
    assert [r["reused"] for r in receipts] == [True] * n_state + [False, False], receipts
    assert_trees_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


def test_filter_jit_holds_python_values_static_and_donates_all_but_the_first(session):
    """A Python number is static (a new value traces anew, as Equinox's);
    "all-except-first" keeps the first argument's arrays; an unknown
    donate mode is an error naming it."""

    def f(scale, x, n):
        return {"y": scale * x * n, "n": n}

    run = tjax.filter_jit(f, donate="all-except-first")
    scale, x = tessel.device_put(np.float32(2.0)), tessel.device_put(np.arange(3, dtype=np.float32))
    out = run(scale, x, 3)
    assert out["n"] == 3
    np.testing.assert_array_equal(out["y"].fetch(), np.arange(3) * 6.0)
    assert not scale.is_deleted() and x.is_deleted()
    out = run(scale, tessel.device_put(np.ones(3, np.float32)), 5)
    assert out["n"] == 5
    np.testing.assert_array_equal(out["y"].fetch(), np.full(3, 10.0))
    with pytest.raises(ValueError, match=r"donate='some'; expected one of"):
        tjax.filter_jit(f, donate="some")


def test_an_mlp_trains_on_a_2x2_mesh_given_in_jaxs_own_shardings(session):
    """An Equinox MLP as a JAX user shards it: a 2x2 mesh (data x model)
    from jax.make_mesh, the batch split over data, the hidden layers'
    weights over model (in_shardings as JAX NamedShardings over the
    partitioned module, a pytree of it), and the hidden activation
    constrained inside the step. Three Adam steps with donation; losses and
    every leaf against jax.jit's run of the same shardings on four host
    devices, and the weights come back laid out as asked."""
    if len(tessel.devices()) < 4:
        pytest.skip("a 2x2 mesh needs four devices")
    JS, JP = jax.sharding.NamedSharding, jax.sharding.PartitionSpec
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = eqx.nn.MLP(5, 3, 16, 2, activation=jax.nn.tanh, key=jax.random.PRNGKey(2))
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.adam(1e-2)

    def step(params, opt, x, y):
        def loss(p):
            m = eqx.combine(p, static)
            h = jax.vmap(lambda v: m.activation(m.layers[0](v)))(x)
            h = jax.lax.with_sharding_constraint(h, JS(mesh, JP("data", "model")))
            for layer in m.layers[1:-1]:
                h = jax.vmap(lambda v, layer=layer: m.activation(layer(v)))(h)
            logits = jax.vmap(m.layers[-1])(h)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, g = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(g, opt, params)
        return eqx.apply_updates(params, updates), opt, value

    # Output features of the first layer and input features of the second
    # over model: the Megatron pair; the last layer and the biases replicated.
    first, second = params.layers[0].weight, params.layers[1].weight
    param_shardings = jax.tree_util.tree_map(
        lambda leaf: JS(mesh, JP("model", None))
        if leaf is first
        else JS(mesh, JP(None, "model"))
        if leaf is second
        else JS(mesh, JP()),
        params,
    )
    shardings = (param_shardings, None, JS(mesh, JP("data")), JS(mesh, JP("data")))
    x = floats(8, 5)
    y = RNG.integers(0, 3, 8).astype(np.int32)
    opt = tx.init(params)
    run = tjax.jit(step, in_shardings=shardings, out_shardings=(param_shardings, None, None), donate_argnums=(0, 1))
    theirs_run = jax.jit(step, in_shardings=shardings, out_shardings=(param_shardings, None, None))
    ours = theirs = (params, opt)
    # Model parallel for real: the second layer contracts the split hidden
    # features, a partial sum over model.
    reductions = [c["axes"] for c in run.lower(*ours, x, y).collectives if c["op"] == "all_reduce"]
    assert ("model",) in reductions, reductions
    for _ in range(3):
        *ours, loss = run(*ours, x, y)
        *theirs, j_loss = theirs_run(*theirs, x, y)
        np.testing.assert_allclose(float(loss.fetch()), float(j_loss), rtol=1e-5)
    assert all(r["reused"] for r in run.donation_receipts())
    assert_trees_close(ours[0], theirs[0], rtol=1e-4, atol=1e-6)
    assert_trees_close(ours[1], theirs[1], rtol=1e-4, atol=1e-6)
    tm = tessel.Mesh({"data": 2, "model": 2})
    assert ours[0].layers[0].weight.sharding == tessel.NamedSharding(tm, tessel.P("model", None))
    assert ours[0].layers[1].weight.sharding == tessel.NamedSharding(tm, tessel.P(None, "model"))
