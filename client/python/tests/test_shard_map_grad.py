"""Reverse mode through shard_map on the suite's cluster (2 workers x 2
devices, mesh {data: 2, model: 2}): the backward pass of a manual region is
a manual region; its collectives transpose as JAX's shard_map does after
JEP 17111, and varying-axis tracking decides where a cotangent is summed.

Oracles: jax.grad of the same computation written without shard_map (the
global program a shard_map program stands for), and numpy. Plans are read
for the collectives each backward pass costs, with their reasons."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import Mesh, NamedSharding, P

jax.config.update("jax_enable_x64", True)

MESH = Mesh({"data": 2, "model": 2})
COPY_SOURCE = (
    'extern "C" __global__ void copy(const __nv_bfloat16* a, __nv_bfloat16* b, long n) '
    "{ long i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) b[i] = a[i]; }"
)


def all_reduces(plan):
    return [c for c in plan.collectives if c["op"] == "all_reduce"]


def put(x, spec):
    return tessel.device_put(x, NamedSharding(MESH, spec))


# ------------------------------------------------------------------ seed 002


def seed_002(replication):
    """Seed 002 as its user wrote it, in Tessel terms: grad of the sum of a
    copy kernel under custom_vjp inside shard_map, bf16 [4, 128] split over
    data on the {data: 2, model: 2} mesh (mp = 2)."""
    copy_kernel = tessel.custom_kernel("copy", lambda a: a + 0, cuda_source=COPY_SOURCE, replication=replication)

    @tessel.custom_vjp
    def simple_func(inputs):
        return copy_kernel(inputs)

    simple_func.defvjp(lambda x: (simple_func(x), (x,)), lambda _, out_grad: (simple_func(out_grad),))

    func = tessel.shard_map(simple_func, MESH, in_specs=P("data", None), out_specs=P("data", None))

    def grad_func(x):
        return tnp.sum(func(x))

    inputs = jax.random.normal(jax.random.PRNGKey(0), (4, 128), dtype=jnp.bfloat16)
    xs = put(np.asarray(inputs), P("data", None))
    f = tessel.jit(tessel.grad(grad_func), out_shardings=NamedSharding(MESH, P("data", None)))
    plan = f.lower(xs)
    grad = f(xs).fetch()
    assert grad.dtype == ml_dtypes.bfloat16
    # jax.grad of the global program: d sum(x) / dx.
    want = jax.grad(lambda x: jnp.sum(x))(inputs)
    np.testing.assert_array_equal(grad.astype(np.float32), np.asarray(want, np.float32))
    return plan


def test_seed_002_with_the_replication_rule_plans_no_all_reduce_forward_or_backward(session):
    plan = seed_002(("follow", 0))
    assert all_reduces(plan) == [], plan.as_text()
    assert "-- backward pass of vjp" in plan.as_text()


def test_seed_002_without_a_rule_plans_the_defensive_all_reduce_naming_the_kernel(session):
    plan = seed_002(None)
    reduces = all_reduces(plan)
    assert len(reduces) == 1, plan.as_text()
    assert reduces[0]["axes"] == ("model",)
    assert "custom kernel 'copy' has no replication rule" in reduces[0]["reason"], reduces[0]["reason"]


# ----------------------------------------------- data-parallel MLP training


def mlp_params(rng):
    return [
        rng.standard_normal((8, 16)) * 0.3,
        rng.standard_normal(16) * 0.1,
        rng.standard_normal((16, 4)) * 0.3,
        rng.standard_normal(4) * 0.1,
    ]


def mlp_loss_global(params, x, y, np_=jnp):
    w1, b1, w2, b2 = params
    h = np_.tanh(x @ w1 + b1)
    return np_.sum((h @ w2 + b2 - y) ** 2) / x.shape[0]


def test_data_parallel_mlp_backward_sends_its_gradients_in_one_all_reduce(session):
    rng = np.random.default_rng(1)
    params = mlp_params(rng)
    x, y = rng.standard_normal((16, 8)), rng.standard_normal((16, 4))
    n = x.shape[0]

    def local_loss(w1, b1, w2, b2, xb, yb):
        h = tnp.tanh(xb @ w1 + b1)
        return tessel.psum(tnp.sum((h @ w2 + b2 - yb) ** 2), "data") / n

    def loss(params, x, y):
        return tessel.shard_map(local_loss, MESH, in_specs=(P(), P(), P(), P(), P("data"), P("data")), out_specs=P())(
            *params, x, y
        )

    step = tessel.jit(tessel.value_and_grad(loss))
    args = ([put(p, P()) for p in params], put(x, P("data")), put(y, P("data")))
    plan = step.lower(*args)
    value, grads = step(*args)
    want_value, want_grads = jax.value_and_grad(mlp_loss_global)([jnp.asarray(p) for p in params], x, y)
    np.testing.assert_allclose(float(value.fetch()), float(want_value), rtol=1e-10)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g.fetch(), np.asarray(w), rtol=1e-9, atol=1e-12)
    # The loss's own psum in the forward pass and one all_reduce per weight
    # gradient over data in the backward (nothing on the replicated
    # cotangent of the loss): five values, none needing another, which the
    # plan carries in one all_reduce naming them.
    reduces = all_reduces(plan)
    assert len(reduces) == 1 and reduces[0]["axes"] == ("data",), plan.as_text()
    assert "one all_reduce for 5 values" in reduces[0]["reason"], plan.as_text()
    # grad alone: the forward's psum is dead; the four gradients' are one.
    (only,) = all_reduces(tessel.jit(tessel.grad(loss)).lower(*args))
    assert "one all_reduce for 4 values" in only["reason"] and "reverse mode" in only["reason"]


# ----------------------------------- each collective's transpose vs jax.grad


def check_grads(f_tessel, f_global, args, specs, out_spec=P()):
    """grad of sum(c * shard_map(f_tessel)(args)) vs jax.grad of the global program."""
    region = tessel.shard_map(f_tessel, MESH, in_specs=tuple(specs), out_specs=out_spec)
    out_shape = jax.eval_shape(f_global, *args).shape
    c = np.random.default_rng(7).standard_normal(out_shape)
    argnums = tuple(range(len(args)))
    g = tessel.jit(tessel.grad(lambda *a: tnp.sum(region(*a) * c), argnums=argnums))
    placed = [put(a, s) for a, s in zip(args, specs)]
    plan = g.lower(*placed)
    got = g(*placed)
    want = jax.grad(lambda *a: jnp.sum(f_global(*a) * c), argnums=argnums)(*args)
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a.fetch(), np.asarray(b), rtol=1e-10, atol=1e-12, err_msg=f"argument {k}")
    return plan


def test_all_gather_transposes_to_a_slice_of_the_replicated_cotangent(session):
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((8, 4)), rng.standard_normal((8, 4))
    plan = check_grads(
        lambda xb, wr: tessel.all_gather(tnp.tanh(xb), "data") * wr,
        lambda x, w: jnp.tanh(x) * w,
        [x, w],
        [P("data"), P()],
    )
    # the cotangent of the gathered value is already the same everywhere:
    # no collective for it; w's cotangent is the same too.
    assert all_reduces(plan) == [] and not [c for c in plan.collectives if c["op"] == "reduce_scatter"], plan.as_text()


def test_all_gather_of_a_value_used_per_device_transposes_to_one_reduce_scatter(session):
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((8, 4)), rng.standard_normal((16, 4))
    # Each data shard multiplies the whole gathered x by its own block of w:
    # the gathered value's cotangent differs per device and is summed and
    # split in one reduce_scatter.
    plan = check_grads(
        lambda xb, wb: tessel.all_gather(xb, "data") * wb,
        lambda x, w: jnp.concatenate([x * w[:8], x * w[8:]]),
        [x, w],
        [P("data"), P("data")],
        out_spec=P("data"),
    )
    ops = [c["op"] for c in plan.collectives if "reverse mode" in c["reason"]]
    assert ops == ["reduce_scatter"], plan.as_text()


def test_psum_scatter_of_a_replicated_value_counts_its_copies(session):
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((8, 4)), rng.standard_normal((8, 4))
    # x is the same on both data devices: psum_scatter sums two copies.
    check_grads(
        lambda xr, wb: tessel.psum_scatter(xr * xr, "data") * wb,
        lambda x, w: 2 * x * x * w,
        [x, w],
        [P(), P("data")],
        out_spec=P("data"),
    )


def test_psum_of_a_replicated_value_counts_its_copies(session):
    x = np.random.default_rng(5).standard_normal((4, 4))
    check_grads(lambda xr: tessel.psum(tnp.tanh(xr), "data"), lambda x: 2 * jnp.tanh(x), [x], [P()])


def test_ppermute_transposes_to_its_inverse(session):
    x = np.random.default_rng(6).standard_normal((8, 4))
    check_grads(
        lambda xb: tessel.ppermute(xb * xb, "data", [(0, 1), (1, 0)]),
        lambda x: jnp.concatenate([x[4:] ** 2, x[:4] ** 2]),
        [x],
        [P("data")],
        out_spec=P("data"),
    )


def test_all_to_all_transposes_to_its_reverse(session):
    x = np.random.default_rng(8).standard_normal((4, 8))
    # Rows split over data, then columns: the same global array.
    check_grads(
        lambda xb: tnp.tanh(tessel.all_to_all(xb, "data", 1, 0)),
        lambda x: jnp.tanh(x),
        [x],
        [P("data", None)],
        out_spec=P(None, "data"),
    )


def test_reverse_mode_through_pmax_is_an_error_saying_why(session):
    x = put(np.ones((4, 4)), P("data"))
    region = tessel.shard_map(lambda xb: tessel.pmax(xb, "data"), MESH, in_specs=P("data"), out_specs=P())
    with pytest.raises(tessel.InvalidArgumentError, match="only psum is linear"):
        tessel.jit(tessel.grad(lambda a: tnp.sum(region(a)))).lower(x)


# ------------------------------------------------------------- forward mode


def test_jvp_through_shard_map_with_collectives_matches_jax(session):
    rng = np.random.default_rng(9)
    x, w = rng.standard_normal((8, 4)), rng.standard_normal((4, 4))
    tx, tw = rng.standard_normal((8, 4)), rng.standard_normal((4, 4))

    def body(xb, wr):
        g = tessel.all_gather(tnp.tanh(xb @ wr), "data")
        v = tessel.psum(tnp.sum(g * g), "model") + tnp.sum(tessel.ppermute(xb, "data", [(0, 1), (1, 0)]))
        return tnp.reshape(v, (1,))

    region = tessel.shard_map(body, MESH, in_specs=(P("data"), P()), out_specs=P("data"))

    def f(x, w):
        return region(x, w)

    def f_global(x, w):
        g = jnp.tanh(x @ w)
        return jnp.stack([2 * jnp.sum(g * g) + jnp.sum(x[4:]), 2 * jnp.sum(g * g) + jnp.sum(x[:4])])

    # The result is [2] split over data: data shard k holds its own sum.
    out, tangent = tessel.jit(lambda x, w, tx, tw: tessel.jvp(f, (x, w), (tx, tw)))(
        put(x, P("data")), put(w, P()), put(tx, P("data")), put(tw, P())
    )
    want_out, want_tangent = jax.jvp(f_global, (x, w), (tx, tw))
    np.testing.assert_allclose(out.fetch(), np.asarray(want_out), rtol=1e-10)
    np.testing.assert_allclose(tangent.fetch(), np.asarray(want_tangent), rtol=1e-10)


# ------------------------------------------------------ several results


def test_a_region_of_several_results_runs_and_differentiates_both_ways(session):
    rng = np.random.default_rng(10)
    x, w = rng.standard_normal((8, 4)), rng.standard_normal((4, 4))
    tx, tw = rng.standard_normal((8, 4)), rng.standard_normal((4, 4))

    def body(xb, wr):
        h = tnp.tanh(xb @ wr)
        return tessel.psum(tnp.sum(h, axis=0), "data"), {"h": h * xb}

    region = tessel.shard_map(body, MESH, in_specs=(P("data"), P()), out_specs=(P(), P("data")))

    def loss(x, w):
        s, d = region(x, w)
        return tnp.sum(s * s) + tnp.sum(d["h"] ** 2)

    def loss_global(x, w):
        h = jnp.tanh(x @ w)
        return jnp.sum(jnp.sum(h, axis=0) ** 2) + jnp.sum((h * x) ** 2)

    args = (put(x, P("data")), put(w, P()))
    s, d = tessel.jit(region)(*args)
    np.testing.assert_allclose(s.fetch(), np.tanh(x @ w).sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(d["h"].fetch(), np.tanh(x @ w) * x, rtol=1e-12)
    value, grads = tessel.jit(tessel.value_and_grad(loss, argnums=(0, 1)))(*args)
    want_value, want_grads = jax.value_and_grad(loss_global, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(float(value.fetch()), float(want_value), rtol=1e-12)
    for g, want in zip(grads, want_grads):
        np.testing.assert_allclose(g.fetch(), np.asarray(want), rtol=1e-10, atol=1e-12)
    _, tangent = tessel.jit(lambda *a: tessel.jvp(loss, a[:2], a[2:]))(*args, put(tx, P("data")), put(tw, P()))
    np.testing.assert_allclose(float(tangent.fetch()), float(jax.jvp(loss_global, (x, w), (tx, tw))[1]), rtol=1e-10)


# --------------------------------- random programs vs JAX's own shard_map

STEPS = {
    "tanh": (lambda h, w, v, L: L.np.tanh(h)),
    "matmul_w": (lambda h, w, v, L: h @ w),
    "mul_v": (lambda h, w, v, L: h * v),
    "psum_model": (lambda h, w, v, L: L.psum(h, "model")),
    "psum_data": (lambda h, w, v, L: L.psum(h, "data") * 0.5),
    "ppermute_data": (lambda h, w, v, L: L.ppermute(h, "data", [(0, 1), (1, 0)])),
    "gather_scatter": (lambda h, w, v, L: L.psum_scatter(L.all_gather(h, "data", 0), "data", 0)),
    "all_to_all": (lambda h, w, v, L: L.all_to_all(L.all_to_all(h, "data", 1, 0) * 1.5, "data", 0, 1)),
    "gathered_slice": (lambda h, w, v, L: L.all_gather(h, "model", 0)[:4] * 2),
    "by_model_index": (lambda h, w, v, L: h * (L.axis_index("model") + 1.0)),
    # a loop carrying a psum, and a gradient taken on each device's block
    "fori_psum": (lambda h, w, v, L: L.fori_loop(0, 2, lambda i, c: L.np.tanh(c * v) + 0.25 * L.psum(c, "data"), h)),
    "per_shard_grad": (lambda h, w, v, L: h * L.grad(lambda u: L.np.sum(L.np.sin(u * h)))(v)),
}


class _Tessel:
    np = tnp
    psum, ppermute, psum_scatter, all_gather = (
        staticmethod(tessel.psum),
        staticmethod(tessel.ppermute),
        staticmethod(tessel.psum_scatter),
        staticmethod(tessel.all_gather),
    )
    all_to_all = staticmethod(tessel.all_to_all)
    axis_index = staticmethod(lambda a: tnp.astype(tessel.axis_index(a), tnp.float64))
    fori_loop, grad = staticmethod(tessel.lax.fori_loop), staticmethod(tessel.grad)


class _Jax:
    np = jnp
    psum = staticmethod(jax.lax.psum)
    ppermute = staticmethod(lambda h, a, perm: jax.lax.ppermute(h, a, perm))
    psum_scatter = staticmethod(lambda h, a, d: jax.lax.psum_scatter(h, a, scatter_dimension=d, tiled=True))
    all_gather = staticmethod(lambda h, a, d: jax.lax.all_gather(h, a, axis=d, tiled=True))
    all_to_all = staticmethod(lambda h, a, s, c: jax.lax.all_to_all(h, a, s, c, tiled=True))
    axis_index = staticmethod(lambda a: jax.lax.axis_index(a).astype(jnp.float64))
    fori_loop, grad = staticmethod(jax.lax.fori_loop), staticmethod(jax.grad)


def random_body(steps, L):
    def body(xb, w, v):
        h = xb
        for s in steps:
            h = STEPS[s](h, w, v, L)
        return L.psum(L.psum(L.np.sum(h * h), "data"), "model")

    return body


@pytest.mark.parametrize("seed", range(24))
def test_random_region_programs_differentiate_as_jax_shard_map(session, seed):
    rng = np.random.default_rng(100 + seed)
    steps = list(rng.choice(sorted(STEPS), size=int(rng.integers(2, 6))))
    x, w, v = rng.standard_normal((8, 4)) * 0.5, rng.standard_normal((4, 4)) * 0.5, rng.standard_normal(4)
    specs = (P("data"), P(), P())
    ours = tessel.shard_map(random_body(steps, _Tessel), MESH, in_specs=specs, out_specs=P())
    got = tessel.jit(tessel.value_and_grad(lambda *a: ours(*a), argnums=(0, 1, 2)))(
        *[put(a, s) for a, s in zip((x, w, v), specs)]
    )
    jmesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    JP = jax.sharding.PartitionSpec
    theirs = jax.shard_map(random_body(steps, _Jax), mesh=jmesh, in_specs=(JP("data"), JP(), JP()), out_specs=JP())
    want = jax.value_and_grad(theirs, argnums=(0, 1, 2))(x, w, v)
    np.testing.assert_allclose(float(got[0].fetch()), float(want[0]), rtol=1e-10, err_msg=str(steps))
    for k, (g, t) in enumerate(zip(got[1], want[1])):
        np.testing.assert_allclose(g.fetch(), np.asarray(t), rtol=1e-9, atol=1e-12, err_msg=f"{steps} argument {k}")


def test_a_while_loop_in_shard_map_runs_each_shard_to_its_own_trip_count(session):
    """A while_loop whose condition reads the local block stops on each
    device at its own iteration, as in JAX's shard_map, when no iteration
    meets another device in a collective; with a psum in the body it is an
    error naming the axis and the body."""
    x = np.array([1.0, 2, 5, 9, 0.5, 0.25, 3, 7])

    def local(u):
        return tessel.lax.while_loop(lambda c: tnp.sum(c) < 20, lambda c: c * 2, u)

    got = tessel.jit(lambda v: tessel.shard_map(local, MESH, P("data"), P("data"))(v))(put(x, P("data")))
    jmesh = jax.make_mesh((MESH.shape["data"],), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    JP = jax.sharding.PartitionSpec

    def jax_local(u):
        return jax.lax.while_loop(lambda c: jnp.sum(c) < 20, lambda c: c * 2, u)

    want = jax.jit(jax.shard_map(jax_local, mesh=jmesh, in_specs=JP("data"), out_specs=JP("data")))(x)
    np.testing.assert_array_equal(got.fetch(), np.asarray(want))

    def meets(u):
        return tessel.lax.while_loop(lambda c: tnp.sum(c) < 20, lambda c: c * 2 + tessel.psum(c, "data"), u)

    with pytest.raises(tessel.errors.InvalidArgumentError, match="varies over mesh axis 'data'.*runs a collective"):
        tessel.jit(lambda v: tessel.shard_map(meets, MESH, P("data"), P("data"))(v))(put(x, P("data")))


def test_forward_mode_through_a_loop_with_a_psum_in_shard_map(session):
    """The tangent of a shard_map whose body loops over a psum (fori_loop):
    the loop's body, which runs a collective, is checked over the mesh as
    the region's body is, and its tangent matches central differences of
    the same loop in numpy."""
    x = np.arange(8.0) / 10

    def body(u):
        return tessel.lax.fori_loop(0, 2, lambda i, c: tnp.sin(c) + tessel.psum(c, "data"), u)

    def f(v):
        return tessel.shard_map(body, MESH, P("data"), P("data"))(v)

    def ref(v):
        c = v.reshape(2, 4)
        for _ in range(2):
            c = np.sin(c) + c.sum(0, keepdims=True)
        return c.reshape(-1)

    primal, tangent = tessel.jit(lambda v: tessel.jvp(f, (v,), (tnp.ones_like(v),)))(put(x, P("data")))
    eps = 1e-6
    np.testing.assert_allclose(primal.fetch(), ref(x), rtol=1e-12)
    np.testing.assert_allclose(tangent.fetch(), (ref(x + eps) - ref(x - eps)) / (2 * eps), rtol=1e-6, atol=1e-8)


# Bodies written once against (lax, numpy): tessel.lax and tessel.numpy, or
# jax.lax and jax.numpy. Each loops or branches over a collective, or takes
# a gradient on each device's blocks before one; `x` is split over data,
# `w` replicated.
LOOP_BODIES = {
    "fori_psum_data": lambda L, N, x, w: L.fori_loop(0, 3, lambda i, c: c + L.psum(N.sin(c * w), "data"), x),
    # a psum over model adds copies of a value replicated over it
    "fori_psum_model": lambda L, N, x, w: L.fori_loop(0, 2, lambda i, c: N.tanh(c) * L.psum(w, "model"), x),
    "scan_xs_psum": lambda L, N, x, w: L.scan(
        lambda c, r: (c * 0.5 + L.psum(N.sum(r * c), "data"), N.cos(r * c)), w, x
    )[1],
    "cond_psum": lambda L, N, x, w: L.cond(
        N.sum(w) > 0, lambda u: L.psum(u * u, "data"), lambda u: L.pmean(N.exp(u), "data"), x * w
    ),
    "nested_loops": lambda L, N, x, w: L.fori_loop(
        0, 2, lambda i, c: L.fori_loop(0, 2, lambda j, d: N.sin(d) + L.psum(d * w, "data"), c), x
    ),
    "ppermute_in_loop": lambda L, N, x, w: L.fori_loop(
        0, 2, lambda i, c: N.tanh(L.ppermute(c, "data", [(0, 1), (1, 0)])) * w, x
    ),
    "grad_then_pmean": lambda L, N, x, w: L.pmean(
        N.sum(_grad(L)(lambda u: N.sum(N.tanh(u * x) ** 2))(w), axis=0), "data"
    ),
    "value_and_grad_then_psum": lambda L, N, x, w: (lambda lg: L.psum(lg[0] + lg[1] * x, "data"))(
        _value_and_grad(L)(lambda u: N.sum(N.sin(u) * x))(w)
    ),
    "grad_of_a_psum": lambda L, N, x, w: _grad(L)(lambda u: N.sum(L.psum(u * x, "data") ** 2))(w) * x,
    "grad_of_a_loop": lambda L, N, x, w: L.psum(
        _grad(L)(lambda u: N.sum(L.fori_loop(0, 2, lambda i, c: N.tanh(c * u), x)))(w), "data"
    ),
}


def _grad(L):
    return tessel.grad if L is tessel.lax else jax.grad


def _value_and_grad(L):
    return tessel.value_and_grad if L is tessel.lax else jax.value_and_grad


@pytest.mark.parametrize("name", sorted(LOOP_BODIES))
def test_reverse_mode_through_loops_branches_and_per_shard_gradients_matches_jax(session, name):
    """grad of a shard_map whose body loops or branches over collectives,
    or takes a per-device gradient before one, against jax.grad of
    jax.shard_map with the same body on 4 CPU devices: the loop's and the
    branch's backward bodies transpose their collectives with the varying
    axes of the values they carry."""
    body = LOOP_BODIES[name]
    rng = np.random.default_rng(11)
    x, w = rng.standard_normal((8, 4)) * 0.5, rng.standard_normal((4, 4)) * 0.5
    specs = (P("data"), P())
    ours = tessel.shard_map(lambda a, b: body(tessel.lax, tnp, a, b), MESH, in_specs=specs, out_specs=P("data"))
    jmesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    JP = jax.sharding.PartitionSpec
    theirs = jax.shard_map(
        lambda a, b: body(jax.lax, jnp, a, b), mesh=jmesh, in_specs=(JP("data"), JP()), out_specs=JP("data")
    )
    c = rng.standard_normal(jax.eval_shape(theirs, x, w).shape)
    got = tessel.jit(tessel.value_and_grad(lambda a, b: tnp.sum(ours(a, b) * c), argnums=(0, 1)))(
        put(x, P("data")), put(w, P())
    )
    want = jax.value_and_grad(lambda a, b: jnp.sum(theirs(a, b) * c), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(float(got[0].fetch()), float(want[0]), rtol=1e-10)
    for k, (g, t) in enumerate(zip(got[1], want[1])):
        np.testing.assert_allclose(g.fetch(), np.asarray(t), rtol=1e-9, atol=1e-12, err_msg=f"argument {k}")
