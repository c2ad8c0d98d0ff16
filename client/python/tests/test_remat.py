"""tessel.checkpoint (remat) against jax.checkpoint on CPU (jax from PyPI):
the same gradients under every policy, and a backward pass that keeps less:
the device's peak memory over a 4-layer MLP step falls with remat."""

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy
from jax.ad_checkpoint import checkpoint_name as jax_checkpoint_name  # noqa: E402

RNG = np.random.default_rng(5)
WIDTH, DEPTH, BATCH = 256, 4, 128


def params():
    return [(RNG.normal(size=(WIDTH, WIDTH)) / 16, RNG.normal(size=WIDTH) / 4) for _ in range(DEPTH)]


def block(np_, name_fn, w, b, h):
    z = name_fn(h @ w, "pre")
    return np_.tanh(z + b) * np_.sin(z)


def loss(np_, checkpoint, name_fn, ps, x):
    h = x
    for w, b in ps:
        h = checkpoint(lambda w, b, h: block(np_, name_fn, w, b, h))(w, b, h)
    return np_.mean(h * h)


POLICIES = {
    "default": (None, None),
    "nothing_saveable": ("nothing_saveable", ()),
    "dots_saveable": ("dots_saveable", ()),
    "dots_with_no_batch_dims_saveable": ("dots_with_no_batch_dims_saveable", ()),
    "save_only_these_names": ("save_only_these_names", ("pre",)),
    "everything_saveable": ("everything_saveable", ()),
}


def _policy(ns, name, args):
    if name is None:
        return None
    p = getattr(ns, name)
    return p(*args) if name.startswith("save_") else p


@pytest.mark.parametrize("policy", list(POLICIES))
def test_gradients_match_jax_checkpoint(cluster, policy):
    ps, x = params(), RNG.normal(size=(BATCH, WIDTH))
    name, args = POLICIES[policy]
    ours_policy = _policy(tessel.checkpoint_policies, name, args)
    theirs_policy = _policy(jax.checkpoint_policies, name, args)

    def ours(ps, x):
        return loss(tnp, lambda f: tessel.checkpoint(f, policy=ours_policy), tessel.checkpoint_name, ps, x)

    def theirs(ps, x):
        return loss(jnp, lambda f: jax.checkpoint(f, policy=theirs_policy), jax_checkpoint_name, ps, x)

    value, grads = tessel.jit(tessel.value_and_grad(ours))(ps, x)
    j_value, j_grads = jax.jit(jax.value_and_grad(theirs))(ps, x)
    np.testing.assert_allclose(value.fetch(), np.asarray(j_value), rtol=1e-12)
    for (gw, gb), (jw, jb) in zip(grads, j_grads):
        np.testing.assert_allclose(gw.fetch(), np.asarray(jw), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(gb.fetch(), np.asarray(jb), rtol=1e-9, atol=1e-12)


def test_outside_a_gradient_the_function_runs_as_written(cluster):
    x = RNG.normal(size=(3, 4))
    f = tessel.checkpoint(lambda x, n: tnp.tanh(x) * n, static_argnums=1)
    np.testing.assert_allclose(tessel.jit(lambda x: f(x, 3))(x).fetch(), np.tanh(x) * 3, rtol=1e-12)


def device_peak(checkpoint, batch):
    """The device's peak bytes over one gradient step of the MLP, in a
    cluster of its own (the peak counts from the worker's start)."""
    previous = tessel._context.default_session_or_none()
    try:
        with tessel.local_cluster(workers=1, devices_per_worker=1):
            ps = [(tessel.device_put(w), tessel.device_put(b)) for w, b in params()]
            x = tessel.device_put(RNG.normal(size=(batch, WIDTH)))
            step = tessel.jit(tessel.grad(lambda ps, x: loss(tnp, checkpoint, lambda v, n: v, ps, x)))
            step(ps, x)[0][0].fetch()
            (device,) = tessel.memory_stats()["devices"].values()
            return device["peak_bytes_in_use"]
    finally:
        tessel._context.set_default_session(previous)


def test_remat_lowers_the_peak_memory_of_a_step():
    """Without remat the backward pass keeps every layer's activations (the
    product, its tanh and its sin) at once; with it, each layer's input,
    and the backward pass recomputes the rest one layer at a time."""
    batch = 2048  # activations (4 MiB each) outweigh the weights (512 KiB each)
    plain = device_peak(lambda f: f, batch)
    remat = device_peak(tessel.checkpoint, batch)
    dots = device_peak(lambda f: tessel.checkpoint(f, policy=tessel.checkpoint_policies.dots_saveable), batch)
    assert remat < 0.6 * plain, (remat, plain)
    assert remat < dots < plain, (remat, dots, plain)
