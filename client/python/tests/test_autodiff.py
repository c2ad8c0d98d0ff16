"""tessel.grad / value_and_grad / vjp against jax.grad on CPU (jax from
PyPI) and central finite differences in float64."""

import os

import numpy as np
import pytest

import tessel
import tessel.nn as tnn
import tessel.numpy as tnp
from tessel import lax

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy

RNG = np.random.default_rng(7)


def rand(*shape, lo=-1.0, hi=1.0):
    return RNG.uniform(lo, hi, shape).astype(np.float64)


def check_grad(f, *args, argnums=0, rtol=1e-9, atol=1e-10):
    """tessel.grad of f(tnp, ...) against jax.grad of f(jnp, ...)."""
    ours = tessel.jit(tessel.grad(lambda *a: f(tnp, *a), argnums=argnums))(*args)
    theirs = jax.grad(lambda *a: f(jnp, *a), argnums=argnums)(*args)
    ours = ours if isinstance(ours, tuple) else (ours,)
    theirs = theirs if isinstance(theirs, tuple) else (theirs,)
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=rtol, atol=atol)


UNARY = {
    "exp": lambda xp, x: xp.exp(x),
    "log": lambda xp, x: xp.log(xp.abs(x) + 0.5),
    "log1p": lambda xp, x: xp.log1p(x * x),
    "tanh": lambda xp, x: xp.tanh(x),
    "sigmoid": lambda xp, x: 1 / (1 + xp.exp(-x)),
    "sqrt": lambda xp, x: xp.sqrt(x * x + 1),
    "abs": lambda xp, x: xp.abs(x),
    "neg": lambda xp, x: -x,
    "square": lambda xp, x: x * x,
    "reciprocal": lambda xp, x: 1 / (x + 3),
    "power": lambda xp, x: (x + 2) ** 1.7,
    "power_y": lambda xp, x: 1.3**x,
    "maximum": lambda xp, x: xp.maximum(x, 0.1),
    "minimum": lambda xp, x: xp.minimum(x, -0.2),
    "where": lambda xp, x: xp.where(x > 0, x * 3, x * x),
    "clip": lambda xp, x: xp.clip(x, -0.5, 0.5),
    "floor": lambda xp, x: xp.floor(x * 3) * x,
    "remainder": lambda xp, x: xp.remainder(x * 5, 0.7),
    "astype": lambda xp, x: (x.astype(xp.float32) * 2).astype(xp.float64),
    "sin": lambda xp, x: xp.sin(x * 3),
    "cos": lambda xp, x: xp.cos(x * 3),
    "tan": lambda xp, x: xp.tan(x),
    "arcsin": lambda xp, x: xp.arcsin(x * 0.9),
    "arccos": lambda xp, x: xp.arccos(x * 0.9),
    "arctan": lambda xp, x: xp.arctan(x * 2),
    "sinh": lambda xp, x: xp.sinh(x * 2),
    "cosh": lambda xp, x: xp.cosh(x * 2),
    "arcsinh": lambda xp, x: xp.arcsinh(x * 3),
    "arccosh": lambda xp, x: xp.arccosh(x * x + 1.5),
    "arctanh": lambda xp, x: xp.arctanh(x * 0.9),
    "expm1": lambda xp, x: xp.expm1(x),
    "log2": lambda xp, x: xp.log2(x * x + 0.5),
    "arctan2": lambda xp, x: xp.arctan2(x, x * x + 0.3),
    "cbrt": lambda xp, x: xp.cbrt(x * x + 0.5),
    "erf": lambda xp, x: (lax.erf if xp is tnp else jax.lax.erf)(x * 2),
}

# The same functions in forward mode (jax.jvp), where a rule exists apart
# from the reverse one.
FORWARD = [
    "sin",
    "cos",
    "tan",
    "arcsin",
    "arccos",
    "arctan",
    "sinh",
    "cosh",
    "arcsinh",
    "arccosh",
    "arctanh",
    "expm1",
    "arctan2",
    "erf",
    "cbrt",
]


def check_tangent(f):
    """tessel.jvp of f(tnp, x) against jax.jvp of f(jnp, x) at a random point."""
    x, t = rand(3, 4), rand(3, 4)
    _, tan = tessel.jit(lambda x, t: tessel.jvp(lambda v: f(tnp, v), (x,), (t,)))(x, t)
    _, jtan = jax.jvp(lambda v: f(jnp, v), (x,), (t,))
    np.testing.assert_allclose(tan.fetch(), np.asarray(jtan), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", FORWARD)
def test_elementwise_tangents_match_jax(session, name):
    check_tangent(UNARY[name])


@pytest.mark.parametrize("name", list(UNARY))
def test_elementwise_gradients_match_jax(session, name):
    x, w = rand(3, 4), rand(3, 4)
    f = UNARY[name]
    check_grad(lambda xp, x, w: (f(xp, x) * w).sum(), x, w, rtol=1e-6 if name == "astype" else 1e-9)


LAYOUT = {
    "reshape": lambda xp, x: x.reshape(6, 2),
    "transpose": lambda xp, x: x.T,
    "slice": lambda xp, x: x[1:, ::2],
    "pad": lambda xp, x: xp.pad(x, ((1, 2), (0, 1))),
    "concat": lambda xp, x: xp.concatenate([x, x * 2], axis=1),
    "broadcast": lambda xp, x: xp.broadcast_to(x[:, :1], (3, 4)) + x.sum(axis=0),
    "sum": lambda xp, x: x.sum(axis=1, keepdims=True) * x,
    "mean": lambda xp, x: x.mean(axis=0),
    "max": lambda xp, x: x.max(axis=1),
    "min": lambda xp, x: x.min(),
    "prod": lambda xp, x: (x + 2).prod(axis=0),
    "var": lambda xp, x: xp.var(x, axis=1),
    "matmul": lambda xp, x: x @ x.T,
    "einsum": lambda xp, x: xp.einsum("ij,kj->ik", x, x * x),
    "tensordot": lambda xp, x: xp.tensordot(x, x, axes=([1], [1])),
    "softmax": lambda xp, x: (tnn if xp is tnp else jax.nn).softmax(x, axis=-1),
    "log_softmax": lambda xp, x: (tnn if xp is tnp else jax.nn).log_softmax(x, axis=0),
    "flip": lambda xp, x: xp.flip(x, 1) * x,
    "negative_step": lambda xp, x: x[::-1, 3:0:-2],
    "roll": lambda xp, x: xp.roll(x, 1, axis=1) * x,
    "cumsum": lambda xp, x: xp.cumsum(x, axis=1) * x,
    "cumprod": lambda xp, x: xp.cumprod(x + 2, axis=0),
    "tile": lambda xp, x: xp.tile(x, (2, 1)),
    "repeat": lambda xp, x: xp.repeat(x, 2, axis=0),
    "logaddexp": lambda xp, x: xp.logaddexp(x, x * x),
    "logsumexp": lambda xp, x: (tnn if xp is tnp else jax.nn).logsumexp(x * 3, axis=1),
    "trunc": lambda xp, x: xp.trunc(x * 3) * x,
    "nansum": lambda xp, x: xp.nansum(x * x, axis=0),
    "sort": lambda xp, x: xp.sort(x, axis=1) * xp.arange(4.0),
    "sort_axis0": lambda xp, x: xp.sort(x * x, axis=0)[:2],
    "top_k": lambda xp, x: (tessel.lax if xp is tnp else jax.lax).top_k(x, 2)[0],
    "fancy": lambda xp, x: x[np.array([2, 0, 2, 1])] * x[0],
    "fancy_pair": lambda xp, x: x[np.array([0, 2, 2]), np.array([3, 1, 3])],
    "take_along": lambda xp, x: xp.take_along_axis(x, np.array([[3, 0, 0], [1, 1, 2], [0, 3, 2]]), axis=1),
    "at_set": lambda xp, x: x.at[np.array([1, 1, 0])].set(x[2] * 2),
    "at_add": lambda xp, x: x.at[:, np.array([0, 0, 3])].add(x[:, :3] ** 2),
    "dynamic_slice": lambda xp, x: (tessel.lax if xp is tnp else jax.lax).dynamic_slice(
        x, (1, xp.argmax(x[0])), (2, 2)
    ),
    "dynamic_update": lambda xp, x: (tessel.lax if xp is tnp else jax.lax).dynamic_update_slice(
        x, x[:2, :2] ** 2, (xp.argmin(x[:, 0]), 1)
    ),
}

FORWARD_LAYOUT = [
    "flip",
    "negative_step",
    "cumsum",
    "logsumexp",
    "sort",
    "sort_axis0",
    "top_k",
    "fancy",
    "fancy_pair",
    "take_along",
    "at_set",
    "at_add",
    "dynamic_slice",
    "dynamic_update",
]


@pytest.mark.parametrize("name", FORWARD_LAYOUT)
def test_structural_tangents_match_jax(session, name):
    check_tangent(LAYOUT[name])


@pytest.mark.parametrize("name", list(LAYOUT))
def test_structural_gradients_match_jax(session, name):
    x = rand(3, 4)
    f = LAYOUT[name]
    check_grad(lambda xp, x: (f(xp, x) ** 2).sum(), x)


def test_batched_dot_general_gradients_match_jax(session):
    a, b = rand(2, 3, 4), rand(2, 4, 5)
    check_grad(lambda xp, a, b: xp.tanh(xp.einsum("bij,bjk->bik", a, b)).sum(), a, b, argnums=(0, 1))


def test_mlp_loss_gradients_match_finite_differences(session):
    x, t = rand(8, 5), rand(8, 1)
    w1, w2 = rand(5, 6), rand(6, 1)

    def loss(xp, w1, w2):
        h = xp.maximum(x @ w1, 0.0)
        return ((h @ w2 - t) ** 2).mean()

    g1, g2 = tessel.jit(tessel.grad(lambda a, b: loss(tnp, a, b), argnums=(0, 1)))(w1, w2)
    eps = 1e-6
    for g, w, k in ((g1.fetch(), w1, 0), (g2.fetch(), w2, 1)):
        fd = np.zeros_like(w)
        for idx in np.ndindex(w.shape):
            hi, lo = w.copy(), w.copy()
            hi[idx] += eps
            lo[idx] -= eps
            args_hi = (hi, w2) if k == 0 else (w1, hi)
            args_lo = (lo, w2) if k == 0 else (w1, lo)
            fd[idx] = (loss(np, *args_hi) - loss(np, *args_lo)) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-8)


def test_value_and_grad_over_pytrees_with_aux_and_argnums(session):
    params = {"w": rand(4, 3), "b": rand(3)}
    x = rand(5, 4)

    def loss(xp, p, x):
        y = xp.tanh(x @ p["w"] + p["b"])
        return (y * y).sum(), y.mean()

    (v, aux), g = tessel.jit(tessel.value_and_grad(lambda p, x: loss(tnp, p, x), has_aux=True))(params, x)
    (jv, jaux), jg = jax.value_and_grad(lambda p, x: loss(jnp, p, x), has_aux=True)(params, x)
    np.testing.assert_allclose(float(v.fetch()), float(jv), rtol=1e-12)
    np.testing.assert_allclose(float(aux.fetch()), float(jaux), rtol=1e-12)
    for k in ("w", "b"):
        np.testing.assert_allclose(g[k].fetch(), np.asarray(jg[k]), rtol=1e-9)
    # Eagerly, on arrays, and with respect to the second argument.
    gx = tessel.grad(lambda p, x: loss(tnp, p, x)[0], argnums=1)(params, tessel.device_put(x))
    np.testing.assert_allclose(
        gx.fetch(), np.asarray(jax.grad(lambda p, x: loss(jnp, p, x)[0], argnums=1)(params, x)), rtol=1e-9
    )


def test_vjp_inside_jit(session):
    x, ct = rand(3, 4), rand(4, 3)

    @tessel.jit
    def f(x, ct):
        y, back = tessel.vjp(lambda a: tnp.tanh(a).T, x)
        return y, back(ct)[0]

    y, dx = f(x, ct)
    jy, jback = jax.vjp(lambda a: jnp.tanh(a).T, x)
    np.testing.assert_allclose(y.fetch(), np.asarray(jy), rtol=1e-12)
    np.testing.assert_allclose(dx.fetch(), np.asarray(jback(ct)[0]), rtol=1e-9)


def test_sgd_with_autodiff_gradients_in_a_device_loop_matches_jax(session):
    X, y = rand(32, 4), rand(32)

    def loss(xp, w):
        return ((X @ w - y) ** 2).mean()

    def train(xp, g, L, w):
        return L.fori_loop(0, 20, lambda i, w: w - 0.1 * g(lambda w: loss(xp, w))(w), w)

    ours = tessel.jit(lambda w: train(tnp, tessel.grad, lax, w))(np.zeros(4)).fetch()
    theirs = np.asarray(jax.jit(lambda w: train(jnp, jax.grad, jax.lax, w))(np.zeros(4)))
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)


def test_gradient_errors_say_what_is_wrong(session):
    with pytest.raises(TypeError, match="not a real scalar"):
        tessel.jit(tessel.grad(lambda x: x * 2))(rand(3))
    with pytest.raises(TypeError, match="floating-point"):
        tessel.jit(tessel.grad(lambda x: (x * 2).sum()))(np.arange(3))
    with pytest.raises(tessel.InvalidArgumentError, match="reverse mode needs a trip count known at compile time"):
        tessel.jit(tessel.grad(lambda x: lax.while_loop(lambda v: v < 10.0, lambda v: v * 2, x)))(np.float64(1.5))


def test_gradients_through_scan_fori_loop_and_cond_match_jax(session):
    xs, w0 = rand(6, 3), rand(3)

    def rnn(xp, L, w, xs):
        def step(h, x):
            h = xp.tanh(h * w + x)
            return h, (h * h).sum()

        h, ys = L.scan(step, xp.zeros(3), xs)
        return h.sum() + ys.sum()

    def loop(xp, L, w, xs):
        return L.fori_loop(0, 4, lambda i, v: xp.tanh(v) * w + i, xs[0]).sum()

    def branch(xp, L, w, xs):
        return L.cond(xs.sum() > 0, lambda a: (a * a).sum(), lambda a: xp.exp(a).sum(), w * 2)

    for f in (rnn, loop, branch):
        ours = tessel.jit(tessel.grad(lambda w, xs: f(tnp, lax, w, xs), argnums=(0, 1)))(w0, xs)
        theirs = jax.grad(lambda w, xs: f(jnp, jax.lax, w, xs), argnums=(0, 1))(w0, xs)
        for o, t in zip(ours, theirs):
            np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=1e-9, atol=1e-12, err_msg=f.__name__)
    # Both branches, and reverse scans.
    ours = tessel.jit(tessel.grad(lambda w: branch(tnp, lax, w, -xs)))(w0)
    np.testing.assert_allclose(
        ours.fetch(), np.asarray(jax.grad(lambda w: branch(jnp, jax.lax, w, -xs))(w0)), rtol=1e-9
    )
    rev = lambda xp, L, w: L.scan(lambda c, x: (c * w + x, c), xp.zeros(3), xs, reverse=True)[1].sum()  # noqa: E731
    np.testing.assert_allclose(
        tessel.jit(tessel.grad(lambda w: rev(tnp, lax, w)))(w0).fetch(),
        np.asarray(jax.grad(lambda w: rev(jnp, jax.lax, w))(w0)),
        rtol=1e-9,
    )


# ---------------------------------------------------------------- random programs

from hypothesis import given, settings, HealthCheck, strategies as st  # noqa: E402

# Differentiable steps over values of one shape (3, 4): (name, fn(xp, a, b)).
STEPS = [
    ("add", lambda xp, a, b: a + b),
    ("sub", lambda xp, a, b: a - b),
    ("mul", lambda xp, a, b: a * b),
    ("div", lambda xp, a, b: a / (b * b + 1)),
    ("tanh", lambda xp, a, b: xp.tanh(a)),
    ("exp", lambda xp, a, b: xp.exp(xp.tanh(a))),
    ("log", lambda xp, a, b: xp.log(a * a + 1)),
    ("sqrt", lambda xp, a, b: xp.sqrt(a * a + 0.5)),
    ("max", lambda xp, a, b: xp.maximum(a, b)),
    ("min", lambda xp, a, b: xp.minimum(a, b * 0.5)),
    ("where", lambda xp, a, b: xp.where(a > b, a * b, a - b)),
    ("abs", lambda xp, a, b: xp.abs(a) * b),
    ("clip", lambda xp, a, b: xp.clip(a, -0.3, 0.6)),
    ("rowsum", lambda xp, a, b: a.sum(axis=1, keepdims=True) * b),
    ("colmax", lambda xp, a, b: a.max(axis=0) + b),
    ("mean", lambda xp, a, b: a - a.mean()),
    ("matmul", lambda xp, a, b: (a @ b.T) @ a * 0.3),
    ("transpose", lambda xp, a, b: (b.T @ a * 0.2)[:3]),
    ("flip_rows", lambda xp, a, b: xp.concatenate([a[2:], a[:2]], axis=0) * b),
    ("strided", lambda xp, a, b: xp.pad(a[:, ::2], ((0, 0), (0, 2))) + b),
    ("reshape", lambda xp, a, b: a.reshape(4, 3).T * b),
    ("pow", lambda xp, a, b: (a * a + 1) ** 1.5),
]


@st.composite
def grad_programs(draw):
    n_in = draw(st.integers(1, 3))
    steps = []
    for k in range(draw(st.integers(1, 8))):
        name = draw(st.sampled_from([s[0] for s in STEPS]))
        i, j = draw(st.integers(0, n_in + k - 1)), draw(st.integers(0, n_in + k - 1))
        steps.append((name, i, j))
    seed = draw(st.integers(0, 2**31))
    return n_in, steps, seed


def _run_program(xp, steps, inputs, weights):
    table = dict(STEPS)
    vals = list(inputs)
    for name, i, j in steps:
        vals.append(table[name](xp, vals[i], vals[j]))
    return (vals[-1] * weights).sum()


@settings(
    max_examples=int(os.environ.get("TESSEL_GRAD_PROGRAMS", "60")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
@given(grad_programs())
def test_random_programs_have_jaxs_gradients(session, program):
    n_in, steps, seed = program
    rng = np.random.default_rng(seed)
    inputs = [rng.uniform(-1, 1, (3, 4)) for _ in range(n_in)]
    weights = rng.uniform(-1, 1, (3, 4))
    argnums = tuple(range(n_in))
    ours = tessel.jit(tessel.grad(lambda *a: _run_program(tnp, steps, a, weights), argnums=argnums))(*inputs)
    theirs = jax.grad(lambda *a: _run_program(jnp, steps, a, weights), argnums=argnums)(*inputs)
    for k, (o, t) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(
            o.fetch(), np.asarray(t), rtol=1e-8, atol=1e-10, err_msg=f"input {k} of {steps} (seed {seed})"
        )


# ---------------------------------------------------------------- forward mode


def test_jvp_matches_jax_through_ops_scans_and_while_loops(session):
    x, t, w = rand(3, 4), rand(3, 4), rand(4, 3)

    def plain(xp, L, x):
        return xp.tanh(x @ w).sum(axis=0) * xp.maximum(x, 0.1).max() + (x**2).mean()

    def scanned(xp, L, x):
        return L.scan(lambda c, r: (xp.tanh(c * r + 1), c * 2), xp.ones(4), x)

    def looped(xp, L, x):  # a while loop: forward mode differentiates it (reverse mode cannot)
        return L.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, xp.tanh(c[1] * 1.3) + 0.1), (0, x))[1]

    for f in (plain, scanned, looped):
        out, tan = tessel.jit(lambda x, t: tessel.jvp(lambda v: f(tnp, lax, v), (x,), (t,)))(x, t)
        jout, jtan = jax.jvp(lambda v: f(jnp, jax.lax, v), (x,), (t,))
        for o, j in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(jout)):
            np.testing.assert_allclose(o.fetch(), np.asarray(j), rtol=1e-12, err_msg=f.__name__)
        for o, j in zip(jax.tree_util.tree_leaves(tan), jax.tree_util.tree_leaves(jtan)):
            np.testing.assert_allclose(o.fetch(), np.asarray(j), rtol=1e-9, atol=1e-12, err_msg=f.__name__)
    # Eagerly, too.
    out, tan = tessel.jvp(lambda v: plain(tnp, lax, v), (tessel.device_put(x),), (t,))
    np.testing.assert_allclose(
        tan.fetch(), np.asarray(jax.jvp(lambda v: plain(jnp, jax.lax, v), (x,), (t,))[1]), rtol=1e-9
    )


@settings(
    max_examples=int(os.environ.get("TESSEL_GRAD_PROGRAMS", "60")) // 2,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
@given(grad_programs())
def test_random_programs_have_jaxs_jvps(session, program):
    n_in, steps, seed = program
    rng = np.random.default_rng(seed)
    inputs = [rng.uniform(-1, 1, (3, 4)) for _ in range(n_in)]
    tangents = [rng.uniform(-1, 1, (3, 4)) for _ in range(n_in)]
    weights = rng.uniform(-1, 1, (3, 4))
    _, ours = tessel.jit(lambda p, t: tessel.jvp(lambda *a: _run_program(tnp, steps, a, weights), p, t))(
        tuple(inputs), tuple(tangents)
    )
    _, theirs = jax.jvp(lambda *a: _run_program(jnp, steps, a, weights), tuple(inputs), tuple(tangents))
    np.testing.assert_allclose(
        float(ours.fetch()), float(theirs), rtol=1e-8, atol=1e-10, err_msg=f"{steps} (seed {seed})"
    )


@pytest.mark.skipif(
    os.environ.get("TESSEL_DEVICE_KIND", "cpu") != "cpu",
    reason="the CUDA suite's workers share their GPUs, and NCCL needs one GPU per device",
)
def test_data_parallel_gradients_of_a_split_batch(session):
    """grad under jit with the batch split over the mesh: the partitioner
    turns each weight gradient's partial sums into one all_reduce, with its
    reason, and the values are JAX's."""
    n = 4 if len(tessel.devices()) >= 4 else 2
    mesh = tessel.Mesh({"data": n})
    P = tessel.P
    x, t, w = rand(4 * n, 5), rand(4 * n, 1), rand(5, 1)

    def loss(xp, w, x, t):
        return ((xp.tanh(x @ w) - t) ** 2).mean()

    f = tessel.jit(tessel.grad(lambda w, x, t: loss(tnp, w, x, t)))
    args = (
        tessel.device_put(w, tessel.NamedSharding(mesh, P())),
        tessel.device_put(x, tessel.NamedSharding(mesh, P("data"))),
        tessel.device_put(t, tessel.NamedSharding(mesh, P("data"))),
    )
    np.testing.assert_allclose(f(*args).fetch(), np.asarray(jax.grad(lambda w: loss(jnp, w, x, t))(w)), rtol=1e-9)
    reduces = [c for c in f.lower(*args).collectives if c["op"] == "all_reduce"]
    assert len(reduces) >= 1 and all(c["reason"] for c in reduces), f.lower(*args).collectives


def test_custom_vjp_uses_the_users_rule_as_jax_does(session):
    def make(lib, xp):
        f = lib.custom_vjp(lambda x, s: xp.tanh(x) * s)
        # The rule keeps tanh(x) and doubles the true gradient wrt x: a wrong
        # rule on purpose, so that the result shows which one ran.
        f.defvjp(
            lambda x, s: (xp.tanh(x) * s, (xp.tanh(x), s)),
            lambda res, ct: (2 * ct * res[1] * (1 - res[0] * res[0]), (ct * res[0]).sum(axis=0)),
        )
        return f

    ours_f, theirs_f = make(tessel, tnp), make(jax, jnp)
    x, s = rand(3, 4), rand(4)
    loss = lambda f, xp: lambda x, s: (f(x, s) ** 2).sum()  # noqa: E731
    ours = tessel.jit(tessel.grad(loss(ours_f, tnp), argnums=(0, 1)))(x, s)
    theirs = jax.grad(loss(theirs_f, jnp), argnums=(0, 1))(x, s)
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=1e-12)
    # Outside a gradient it is the function, eagerly too.
    np.testing.assert_allclose(tessel.jit(ours_f)(x, s).fetch(), np.tanh(x) * s, rtol=1e-12)
    np.testing.assert_allclose(ours_f(tessel.device_put(x), s).fetch(), np.tanh(x) * s, rtol=1e-12)
    with pytest.raises(tessel.InvalidArgumentError, match="custom VJP, which forward mode cannot use"):
        tessel.jit(lambda x: tessel.jvp(lambda v: ours_f(v, s), (x,), (x,)))(x)


def test_custom_jvp_uses_the_users_rule_in_both_modes_as_jax_does(session):
    def make(lib, xp):
        f = lib.custom_jvp(lambda x, s: xp.tanh(x) * s)

        # Triples the true tangent through x: a wrong rule on purpose, so that
        # the result shows which one ran. It calls f itself, as JAX allows.
        @f.defjvp
        def rule(primals, tangents):
            x, s = primals
            tx, ts = tangents
            return f(x, s), 3 * tx * s * (1 - xp.tanh(x) ** 2) + xp.tanh(x) * ts

        return f

    ours_f, theirs_f = make(tessel, tnp), make(jax, jnp)
    x, s = rand(3, 4), rand(4)
    tx, ts = rand(3, 4), rand(4)
    loss = lambda f, xp: lambda x, s: (f(x, s) ** 3).sum()  # noqa: E731
    ours = tessel.jit(tessel.grad(loss(ours_f, tnp), argnums=(0, 1)))(x, s)
    theirs = jax.grad(loss(theirs_f, jnp), argnums=(0, 1))(x, s)
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=1e-12)
    out, tangent = tessel.jit(lambda x, s, tx, ts: tessel.jvp(loss(ours_f, tnp), (x, s), (tx, ts)))(x, s, tx, ts)
    want_out, want_tangent = jax.jvp(loss(theirs_f, jnp), (x, s), (tx, ts))
    np.testing.assert_allclose(float(out.fetch()), float(want_out), rtol=1e-12)
    np.testing.assert_allclose(float(tangent.fetch()), float(want_tangent), rtol=1e-12)
    # Outside a derivative it is the function.
    np.testing.assert_allclose(tessel.jit(ours_f)(x, s).fetch(), np.tanh(x) * s, rtol=1e-12)


def test_custom_jvp_rule_of_the_wrong_shape_is_a_clear_error(session):
    f = tessel.custom_jvp(lambda x: tnp.tanh(x))
    f.defjvp(lambda primals, tangents: (f(*primals), tnp.sum(tangents[0])))
    with pytest.raises(
        TypeError, match="custom_jvp <lambda> rule: result.* is float64\\[\\]; expected float64\\[3,4\\]"
    ):
        tessel.jit(tessel.grad(lambda x: tnp.sum(f(x))))(rand(3, 4))


def test_gradients_of_gradients_and_hessian_vector_products_match_jax(session):
    w, x, v = rand(4), rand(3, 4), rand(4)

    def loss(xp):
        return lambda w, x: xp.sum(xp.tanh(x @ w) ** 2) + xp.sum(w * w * w)

    # d/dw of (grad . v): the Hessian times v, reverse over reverse.
    def hvp_rr(lib, xp):
        return lib.grad(lambda w, x: xp.sum(lib.grad(loss(xp))(w, x) * v))

    ours = tessel.jit(hvp_rr(tessel, tnp))(w, x)
    theirs = hvp_rr(jax, jnp)(w, x)
    np.testing.assert_allclose(ours.fetch(), np.asarray(theirs), rtol=1e-10)
    # forward over reverse
    ours = tessel.jit(lambda w, x: tessel.jvp(lambda u: tessel.grad(loss(tnp))(u, x), (w,), (v,))[1])(w, x)
    theirs = jax.jvp(lambda u: jax.grad(loss(jnp))(u, x), (w,), (v,))[1]
    np.testing.assert_allclose(ours.fetch(), np.asarray(theirs), rtol=1e-10)
    # third derivative of a scalar function, and through a scan
    f3 = lambda lib, xp: lib.grad(lib.grad(lib.grad(lambda s: xp.tanh(s) * s)))  # noqa: E731
    np.testing.assert_allclose(float(tessel.jit(f3(tessel, tnp))(0.3).fetch()), float(f3(jax, jnp)(0.3)), rtol=1e-10)

    def scanned(lib_lax, xp):
        def f(w):
            c, _ = lib_lax.scan(lambda c, xi: (xp.tanh(c * w + xi), None), w * 0.0, np.array([0.1, -0.2, 0.3]))
            return c

        return f

    gg = lambda lib, lib_lax, xp: lib.grad(lib.grad(scanned(lib_lax, xp)))  # noqa: E731
    np.testing.assert_allclose(
        float(tessel.jit(gg(tessel, lax, tnp))(0.7).fetch()), float(gg(jax, jax.lax, jnp)(0.7)), rtol=1e-10
    )


def test_custom_rules_hold_inside_a_gradient_of_a_gradient(session):
    # The inner gradient uses the custom rule; the outer one differentiates
    # that rule's backward function (as JAX does), not the plain function.
    def make(lib, xp):
        f = lib.custom_vjp(lambda x: xp.tanh(x))
        f.defvjp(lambda x: (xp.tanh(x), (x,)), lambda res, ct: (3 * ct * res[0] * res[0],))
        return f

    ours_f, theirs_f = make(tessel, tnp), make(jax, jnp)
    gg = lambda lib, f: lib.grad(lib.grad(lambda s: f(s) * s))  # noqa: E731
    np.testing.assert_allclose(
        float(tessel.jit(gg(tessel, ours_f))(0.4).fetch()), float(gg(jax, theirs_f)(0.4)), rtol=1e-10
    )


def test_a_python_argument_not_differentiated_passes_through(cluster):
    """As in JAX: an int that shapes the computation and a flag that picks
    a branch reach the function as Python values, called eagerly or under jit."""

    def f(np_, x, n, square):
        y = np_.reshape(x, (n, -1))
        return np_.sum(y[0] ** 2) if square else np_.sum(np_.sin(y))

    x = rand(6)
    for n, square in ((2, True), (3, False)):
        theirs = jax.grad(lambda x, n, s: f(jnp, x, n, s))(x, n, square)
        ours = tessel.grad(lambda x, n, s: f(tnp, x, n, s))(x, n, square)
        np.testing.assert_allclose(ours.fetch(), np.asarray(theirs), rtol=1e-12)
        jitted = tessel.jit(lambda x: tessel.grad(lambda x, n, s: f(tnp, x, n, s))(x, n, square))(x)
        np.testing.assert_allclose(jitted.fetch(), np.asarray(theirs), rtol=1e-12)


def test_jvp_of_cond_and_switch_matches_jax(session):
    """Forward mode through a conditional: the same conditional over the
    operands and their tangents, each branch its own JVP."""
    x, t = rand(4), rand(4)

    def f(L, np_, x):
        a, s = L.cond(x.sum() > 0, lambda v: (np_.sin(v) * 2, v.sum()), lambda v: (v**3, -v.sum()), x)
        b = L.switch((x[0] > 0).astype(np.int32) + 1, [lambda v: v, lambda v: np_.exp(v), lambda v: np_.tanh(v) * v], x)
        return a + b, s, (x > 0).astype(np.int32)

    for sign in (1.0, -1.0):
        ours = tessel.jit(lambda x, t: tessel.jvp(lambda x: f(lax, tnp, x), (x,), (t,)))(sign * x, t)
        theirs = jax.jvp(lambda x: f(jax.lax, jnp, x), (sign * x,), (t,))
        for o, th in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
            if np.asarray(th).dtype == jax.dtypes.float0:  # an integer result's tangent: JAX's float0, ours zeros
                assert not o.fetch().any()
                continue
            np.testing.assert_allclose(o.fetch(), np.asarray(th), rtol=1e-12, atol=1e-14)
