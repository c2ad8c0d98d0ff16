"""tessel.lax against jax.lax on CPU (jax from PyPI) and numpy loops: loops
and branches run on the workers as one compiled program."""

import os

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import lax

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy


def close(a, b, rtol=1e-6, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def fetch(tree):
    return jax.tree_util.tree_map(lambda a: a.fetch() if hasattr(a, "fetch") else np.asarray(a), tree)


def both(fn, *args):
    """fn traced with tessel.lax (through tessel.jit) and with jax.lax (jax.jit)."""
    ours = fetch(tessel.jit(lambda *a: fn(lax, tnp, *a))(*args))
    theirs = jax.jit(lambda *a: fn(jax.lax, jnp, *a))(*args)
    return ours, jax.tree_util.tree_map(np.asarray, theirs)


def test_while_loop_over_a_pytree_with_a_closure(session):
    x = np.linspace(-1, 1, 12).astype(np.float32).reshape(3, 4)

    def fn(L, np_, x):
        def body(c):
            return {"i": c["i"] + 1, "v": np_.tanh(c["v"] * 1.5 + x), "s": c["s"] + c["v"].sum()}

        return L.while_loop(lambda c: c["i"] < 7, body, {"i": np.int32(0), "v": x, "s": np.float32(0)})

    ours, theirs = both(fn, x)
    assert int(ours["i"]) == 7
    close(ours["v"], theirs["v"], rtol=1e-5)
    close(ours["s"], theirs["s"], rtol=1e-5)


def test_zero_trip_loops_return_their_start(session):
    x = np.arange(5, dtype=np.float32)

    def fn(L, np_, x):
        w = L.while_loop(lambda c: c[0] > 100.0, lambda c: (c[0] * 2, c[1] + 1), (x.sum() * 0 + 1.0, np.int32(3)))
        f = L.fori_loop(4, 2, lambda i, v: v * 10, x)
        s, ys = L.scan(lambda c, _: (c + 1, c * 2), x, None, length=0)
        return w, f, s, ys

    ours, theirs = both(fn, x)
    close(ours[0][0], 1.0)
    assert int(ours[0][1]) == 3
    close(ours[1], x)
    close(ours[2], x)
    assert ours[3].shape == (0, 5) == theirs[3].shape


def test_nested_loops_match_jax(session):
    x = np.arange(6, dtype=np.float32) / 6

    def fn(L, np_, x):
        def outer(i, acc):
            def inner(j, a):
                return a * 0.5 + (i * 10 + j).astype(np.float32) + x

            return L.fori_loop(0, i + 1, inner, acc)  # a traced trip count: a while loop inside

        return L.fori_loop(0, 4, outer, np_.zeros_like(x))

    ours, theirs = both(fn, x)
    close(ours, theirs, rtol=1e-6)


def test_scan_with_stacked_outputs_forward_and_reverse(session):
    xs = np.random.default_rng(0).standard_normal((9, 3)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((3, 3)).astype(np.float32)

    for reverse in (False, True):

        def fn(L, np_, xs, w):
            def step(h, x):
                h = np_.tanh(h @ w + x)
                return h, (h.sum(), h * 2)

            return L.scan(step, np_.zeros((3,), np.float32), xs, reverse=reverse)

        ours, theirs = both(fn, xs, w)
        close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
        close(ours[1][0], theirs[1][0], rtol=1e-5, atol=1e-5)
        close(ours[1][1], theirs[1][1], rtol=1e-5, atol=1e-6)
        assert ours[1][1].shape == (9, 3)


def test_cond_and_switch_pick_branches_of_different_costs(session):
    x = np.arange(1, 9, dtype=np.float32).reshape(2, 4)
    for p in (True, False):

        def fn(L, np_, x, p):
            cheap = lambda x: x + 1
            dear = lambda x: np_.exp(np_.tanh(x @ x.T)).sum() * x
            return L.cond(p, dear, cheap, x)

        ours, theirs = both(fn, x, np.bool_(p))
        close(ours, theirs, rtol=1e-5)
    branches = [lambda a, b: a + b, lambda a, b: a * b, lambda a, b: a - b]
    for k in (-3, 0, 1, 2, 7):  # out of range clamps, as jax's switch does

        def fn(L, np_, k, x):
            return L.switch(k, branches, x, np_.float32(2) * x)

        ours, theirs = both(fn, np.int32(k), x)
        close(ours, theirs)


def test_while_in_an_eager_call_and_on_arrays(session):
    x = tessel.device_put(np.arange(4, dtype=np.float32))
    i, v = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (np.int32(0), x))
    assert int(i.fetch()) == 3
    close(v.fetch(), np.arange(4) * 8)


def test_elementwise_loops_match_jax_whatever_their_carries_do(session):
    """Loops of elementwise bodies over small values run whole on the CPU
    device (worker/cpu/device_loop.h), double-buffering their carries. The
    carry patterns that stress that: a carry passed through unchanged, two
    carries taking one value, carries that swap (left to the generic
    driver), mixed dtypes, a donated carry, and scans reading slices and
    stacking outputs, forwards and in reverse."""
    x = np.linspace(-2, 2, 7).astype(np.float32)

    def fn(L, np_, x):
        keep = L.while_loop(
            lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1], c[2] * 0.5 + c[1]), (np.int32(0), x, np_.zeros_like(x))
        )
        share = L.while_loop(
            lambda c: c[0] < 4, lambda c: (c[0] + 1, c[1] + c[2], c[1] + c[2]), (np.int32(0), x, x * 2)
        )
        fib = L.while_loop(
            lambda c: c[0] < 20, lambda c: (c[0] + 1, c[2], c[1] + c[2]), (np.int64(0), np.int64(0), np.int64(1))
        )
        mixed = L.fori_loop(
            0, 9, lambda i, c: (c[0] + 1, np_.where(c[1] > 0, c[1] - i, c[1] * 3)), (np.int32(0), x.astype(np.float64))
        )
        fwd = L.scan(lambda c, xs: (c * 0.9 + xs, (c - xs, xs > 0)), x[:3], x.reshape(7, 1) * x[:3])
        rev = L.scan(lambda c, xs: (c + xs, c * 2), np.float32(1), x, reverse=True)
        return keep, share, fib, mixed, fwd, rev

    ours, theirs = both(fn, x)
    flat_ours, flat_theirs = jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)
    assert len(flat_ours) == len(flat_theirs) == 16
    for a, b in zip(flat_ours, flat_theirs):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.shape(a) == np.shape(b)
        close(a, b, rtol=1e-6)
    assert int(ours[2][1]) == 6765  # fib(20)

    # A donated carry ends in its donated buffer with the loop's result.
    loop = tessel.jit(lambda v: lax.fori_loop(0, 50, lambda i, v: v * 0.5 + 1.0, v), donate_argnums=0)
    v = tessel.device_put(x)
    v.block_until_ready()
    before = tessel.stats()["donations_reused"]
    out = loop(v).fetch()
    assert tessel.stats()["donations_reused"] == before + 1
    ref = x.copy()
    for _ in range(50):
        ref = ref * np.float32(0.5) + np.float32(1.0)
    np.testing.assert_array_equal(out, ref)


def _float_step(xp, c):
    y = (
        xp.exp(xp.tanh(c) * 0.5)
        - xp.log1p(xp.abs(c))
        + xp.sqrt(xp.abs(c)) * xp.sign(c)
        + xp.floor(c * 3) / xp.ceil(c + 5)
        + xp.maximum(c, -0.5) * xp.minimum(c, 0.25)
        + xp.power(xp.abs(c) + 1, 0.3)
        + xp.where(c > 0.1, c, -c)
        + xp.clip(c, -0.75, 0.75)
        + xp.remainder(c * 7, 0.9)
        + (c * 1000).astype(np.int32).astype(c.dtype) / 997
    )
    return xp.tanh(y)


def _int_step(xp, c):
    a = c * 1103515245 + 12345
    return (
        (a // 7)
        ^ (a % 13)
        ^ xp.maximum(a, -5)
        ^ xp.minimum(a, 5)
        ^ xp.abs(a)
        ^ xp.sign(a)
        ^ -a
        ^ xp.power(c % 5, 3)
        ^ (a & 0x5555)
        ^ (a | 3)
        ^ xp.invert(a)
        ^ (a.astype(np.float32) * 0.001).astype(c.dtype)
    )


def _u8_step(xp, c):
    a = c * 3 + 7
    return (a // 5) ^ (a % 7) ^ xp.maximum(a, 9) ^ xp.minimum(a, 200) ^ xp.invert(a) ^ (a & 0x55) ^ (a | 1)


def _bool_step(xp, c):
    m = xp.arange(6) % 3 == 0
    return xp.logical_xor(xp.logical_not(c), xp.logical_and(c, m) | (m & ~c))


_STEPS = [
    (_float_step, np.float32),
    (_float_step, np.float64),
    (_int_step, np.int32),
    (_int_step, np.int64),
    (_u8_step, np.uint8),
    (_bool_step, np.bool_),
]


def _run_steps(starts):
    out = []
    for (step, dt), x in zip(_STEPS, starts):
        out.append(tessel.jit(lambda x, step=step: lax.fori_loop(0, 20, lambda i, c: step(tnp, c), x))(x).fetch())
    # a while over mixed carries and a scan reading slices
    w = tessel.jit(
        lambda x: lax.while_loop(
            lambda c: c[0] < 9,
            lambda c: (c[0] + 2, _float_step(tnp, c[1]), c[2] ^ (c[0] * 3)),
            (np.int32(0), x, np.int64(5)),
        )
    )(starts[0])
    out.extend(v.fetch() for v in w)
    sc = tessel.jit(lambda xs: lax.scan(lambda c, x: (_float_step(tnp, c + x), c * x), xs[0], xs, reverse=True))
    out.extend(v.fetch() for v in sc(starts[1].reshape(1, -1) * np.arange(1, 6).reshape(5, 1)))
    return out


def test_compiled_loops_give_the_interpreters_bits_for_every_op_and_dtype(session, cluster):
    """The CPU worker compiles elementwise loops to native code
    (worker/cpu/native_loop.h). The same loops, over every dtype it compiles
    and every op it emits, run on a worker that interprets them
    (TESSEL_NATIVE_LOOPS=0) and on one where the C compiler cannot be found:
    bit for bit the same results, and numpy's (to rounding for floats,
    exactly for integers and booleans)."""
    rng = np.random.default_rng(11)
    starts = [
        rng.uniform(-1, 1, 6).astype(np.float32),
        rng.uniform(-1, 1, 6).astype(np.float64),
        rng.integers(-(10**6), 10**6, 6).astype(np.int32),
        rng.integers(-(10**12), 10**12, 6).astype(np.int64),
        rng.integers(0, 256, 6).astype(np.uint8),
        rng.integers(0, 2, 6).astype(np.bool_),
    ]
    native = _run_steps(starts)
    logs = "".join(
        open(os.path.join(cluster.log_dir, f)).read() for f in os.listdir(cluster.log_dir) if f.startswith("worker")
    )
    assert "runs as native code" in logs

    for env, why in (
        (("TESSEL_NATIVE_LOOPS", "0"), "TESSEL_NATIVE_LOOPS=0"),
        (("CC", "/nonexistent/cc"), "cannot run the C compiler '/nonexistent/cc'"),
    ):
        old = os.environ.get(env[0])
        os.environ[env[0]] = env[1]
        try:
            with tessel.local_cluster(workers=1, devices_per_worker=1) as c:
                interpreted = _run_steps(starts)
                logs = "".join(open(os.path.join(c.log_dir, f)).read() for f in os.listdir(c.log_dir))
        finally:
            if old is None:
                del os.environ[env[0]]
            else:
                os.environ[env[0]] = old
        tessel._context.set_default_session(session)
        assert "runs as native code" not in logs and why in logs, logs[-2000:]
        assert len(native) == len(interpreted) == 11
        for k, (a, b) in enumerate(zip(native, interpreted)):
            assert a.dtype == b.dtype and a.shape == b.shape, k
            np.testing.assert_array_equal(
                a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8), err_msg=f"result {k} ({why})"
            )

    for (step, dt), x, got in zip(_STEPS, starts, native):
        want = x.copy()
        with np.errstate(over="ignore"):
            for _ in range(20):
                want = step(np, want)
        assert got.dtype == want.dtype == dt
        if np.issubdtype(dt, np.floating):
            np.testing.assert_allclose(got, want, rtol=1e-4 if dt == np.float32 else 1e-10)
        else:
            np.testing.assert_array_equal(got, want)


def test_a_loop_moves_no_bytes_until_the_fetch(session):
    """Under transfer_guard('disallow') a device-side loop runs: the
    predicate is never shipped to the client."""
    x = tessel.device_put(np.ones(16, np.float32))

    @tessel.jit
    def run(x):
        return lax.while_loop(lambda c: c[1].sum() < 1000.0, lambda c: (c[0] + 1, c[1] * 2), (np.int32(0), x))

    before = tessel.stats()
    with tessel.transfer_guard("disallow"):
        n, v = run(x)
        n2, v2 = run(v)
    after = tessel.stats()
    assert int(n.fetch()) == 6 and int(n2.fetch()) == 0
    close(v2.fetch(), np.full(16, 64.0))
    for k in ("bytes_device_to_host", "bytes_host_to_device", "bytes_device_to_device"):
        assert after[k] == before[k], (k, before[k], after[k])


def test_sgd_as_fori_loop_matches_host_dispatched_steps_bit_for_bit(session):
    rng = np.random.default_rng(3)
    X = rng.standard_normal((64, 8)).astype(np.float32)
    y = (X @ rng.standard_normal(8)).astype(np.float32)

    def step(w):
        err = X @ w - y
        return w - 0.01 * (X.T @ err) / 64

    w0 = np.zeros(8, np.float32)
    one = tessel.jit(step, donate_argnums=0)
    w = tessel.device_put(w0)
    for _ in range(100):
        w = one(w)
    host = w.fetch()

    loop = tessel.jit(lambda w: lax.fori_loop(0, 100, lambda i, w: step(w), w), donate_argnums=0)
    device = loop(tessel.device_put(w0)).fetch()
    np.testing.assert_array_equal(device, host)
    plan = loop.lower(w0)
    assert "= scan(" in plan.as_text(), plan.as_text()
    # The donated weights are the loop's carry, updated in place every step.
    assert plan.aliases == [{"parameter": 0, "output": 0, "reason": ""}], (plan.aliases, plan.as_text())
    w_in = tessel.device_put(w0)
    w_in.block_until_ready()  # a put still in flight holds its buffer: nothing to donate yet
    before = tessel.stats()["donations_reused"]
    loop(w_in).block_until_ready()  # the receipt comes with the step's completion
    assert tessel.stats()["donations_reused"] == before + 1


def test_carry_type_errors_name_the_carry(session):
    x = np.zeros(3, np.float32)
    with pytest.raises(TypeError, match=r"result\[1\] is float32\[4\]; expected float32\[3\]"):
        tessel.jit(
            lambda x: lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, tnp.zeros(4, np.float32)), (0, x))
        )(x)
    with pytest.raises(TypeError, match="boolean scalar"):
        tessel.jit(lambda x: lax.while_loop(lambda c: c, lambda c: c, x))(x)
    with pytest.raises(TypeError, match=r"branch 1"):
        tessel.jit(lambda x: lax.cond(x.sum() > 0, lambda v: v, lambda v: v.astype(np.int32), x))(x)


# ---------------------------------------------------------------- inside shard_map

# Collectives between GPUs run on NCCL, which needs one GPU per device; the
# CUDA suite's workers share their GPUs: these run on CPU devices.
needs_collectives = pytest.mark.skipif(
    os.environ.get("TESSEL_DEVICE_KIND", "cpu") != "cpu",
    reason="the CUDA suite's workers share their GPUs, and NCCL needs one GPU per device",
)


def _data_size():
    """The mesh axis the shard_map tests split over: 4 devices, or 2 where
    the suite's cluster has only 2 (the CUDA suite on one GPU)."""
    return 4 if len(tessel.devices()) >= 4 else 2


def _es_step(theta):
    """Seed 001's evolution-strategies pattern, per device: perturb, score,
    all_gather one scalar per device, stop once the best score is good
    enough (a condition every device computes alike)."""

    def cond(c):
        i, best, _ = c
        return (best < 10.0) & (i < 50)

    def body(c):
        i, _, th = c
        th = th * 1.5 + 0.25
        scores = tessel.all_gather(th.sum().reshape(1), "data")  # one per device, the same on every device
        return i + 1, scores.max(), th

    i, best, th = lax.while_loop(cond, body, (np.int32(0), np.float32(-np.inf), theta))
    return th * 1.0 + (i + 0 * best).astype(np.float32)


@needs_collectives
def test_seed_001_evolution_strategies_loop_runs_in_shard_map_with_no_transfers(session):
    n = _data_size()
    mesh = tessel.Mesh({"data": n})
    P = tessel.P
    theta = np.arange(2 * n, dtype=np.float32) / 10
    step = tessel.jit(tessel.shard_map(_es_step, mesh, P("data"), P("data")))
    x = tessel.device_put(theta, tessel.NamedSharding(mesh, P("data")))
    plan = step.lower(x)
    assert any(
        c["op"] == "all_gather" and "each time it runs" in c["reason"] for c in plan.collectives
    ), plan.collectives
    before = tessel.stats()
    with tessel.transfer_guard("disallow"):
        y = step(x)
        y.block_until_ready()
    after = tessel.stats()
    for k in ("bytes_device_to_host", "bytes_host_to_device", "bytes_device_to_device"):
        assert after[k] == before[k], (k, before[k], after[k])
    # numpy: the same loop over the four blocks at once.
    blocks, i, best = theta.reshape(n, 2).copy(), 0, -np.inf
    while best < 10.0 and i < 50:
        blocks = blocks * np.float32(1.5) + np.float32(0.25)
        best, i = blocks.sum(axis=1).max(), i + 1
    np.testing.assert_allclose(y.fetch(), (blocks + i).reshape(-1), rtol=1e-6)


@needs_collectives
def test_a_loop_condition_that_varies_over_an_axis_runs_per_shard_unless_an_iteration_communicates(session):
    mesh = tessel.Mesh({"data": _data_size()})
    P = tessel.P
    start = np.arange(8, dtype=np.float32) / 4

    def per_shard(theta):  # each device stops at its own iteration
        return lax.while_loop(lambda th: th.sum() < 10.0, lambda th: th * 2 + 1, theta)

    got = tessel.jit(tessel.shard_map(per_shard, mesh, P("data"), P("data")))(
        tessel.device_put(start, tessel.NamedSharding(mesh, P("data")))
    ).fetch()
    blocks = []
    for block in np.split(start, _data_size()):
        while block.sum() < 10.0:
            block = block * 2 + 1
        blocks.append(block)
    np.testing.assert_array_equal(got, np.concatenate(blocks))

    def bad(theta):  # an iteration meets the other devices in a psum
        return lax.while_loop(lambda th: th.sum() < 10.0, lambda th: th * 2 + tessel.psum(th, "data"), theta)

    x = tessel.device_put(np.ones(8, np.float32), tessel.NamedSharding(mesh, P("data")))
    with pytest.raises(tessel.InvalidArgumentError, match=r"varies over mesh axis 'data'.*uniform with a collective"):
        tessel.jit(tessel.shard_map(bad, mesh, P("data"), P("data")))(x)

    def fixed(theta):  # made uniform with a collective: fine
        return lax.while_loop(lambda th: tessel.psum(th.sum(), "data") < 100.0, lambda th: th * 2 + 1, theta)

    y = tessel.jit(tessel.shard_map(fixed, mesh, P("data"), P("data")))(x).fetch()
    ref = np.ones(8, np.float32)
    while ref.sum() < 100:
        ref = ref * 2 + 1
    np.testing.assert_array_equal(y, ref)


@needs_collectives
def test_loops_on_split_arrays_keep_their_carries_split(session):
    """Outside shard_map a carry keeps the layout it starts with: an
    elementwise body needs no collective, a predicate over a split value is
    made whole by one all_reduce per iteration (with its reason), and the
    result stays split."""
    n = _data_size()
    mesh = tessel.Mesh({"data": n})
    P = tessel.P
    x = tessel.device_put(np.arange(4 * n, dtype=np.float32), tessel.NamedSharding(mesh, P("data")))
    f = tessel.jit(lambda x: lax.fori_loop(0, 3, lambda i, v: v * 2 + i.astype(np.float32), x))
    np.testing.assert_array_equal(f(x).fetch(), ((np.arange(4 * n) * 2 + 0) * 2 + 1) * 2 + 2)
    assert f.lower(x).collectives == [], f.lower(x).collectives
    assert f(x).sharding == tessel.NamedSharding(mesh, P("data"))

    g = tessel.jit(lambda x: lax.while_loop(lambda v: v.sum() < 1000.0, lambda v: v * 2 + 1, x))
    plan = g.lower(x)
    reduces = [c for c in plan.collectives if c["op"] == "all_reduce"]
    assert len(reduces) == 1 and "each time it runs" in reduces[0]["reason"], plan.collectives
    ref = np.arange(4 * n, dtype=np.float32)
    while ref.sum() < 1000:
        ref = ref * 2 + 1
    y = g(x)
    np.testing.assert_array_equal(y.fetch(), ref)
    assert y.sharding == tessel.NamedSharding(mesh, P("data"))

    # scan over the rows of a matrix split by columns: each device scans its columns.
    xs = np.arange(3 * 2 * n, dtype=np.float32).reshape(3, 2 * n)
    h = tessel.jit(lambda xs: lax.scan(lambda c, r: (c + r, c * r), tnp.zeros((2 * n,), np.float32), xs))
    xa = tessel.device_put(xs, tessel.NamedSharding(mesh, P(None, "data")))
    carry, ys = h(xa)
    assert h.lower(xa).collectives == [], h.lower(xa).collectives
    c, want = np.zeros(2 * n, np.float32), []
    for r in xs:
        c, y_ = c + r, c * r
        want.append(y_)
    np.testing.assert_array_equal(carry.fetch(), c)
    np.testing.assert_array_equal(ys.fetch(), np.stack(want))


def test_a_fori_loop_index_is_weakly_typed_as_in_jax(session):
    """x * i keeps float32 for a float32 carry (the index from Python
    bounds is a weak int32), as jax.lax.fori_loop's."""
    jax = pytest.importorskip("jax")
    x = np.linspace(0.5, 2, 3).astype(np.float32)
    ours = tessel.jit(lambda x: lax.fori_loop(0, 4, lambda i, c: c * i + 1, x))(x).fetch()
    theirs = np.asarray(jax.jit(lambda x: jax.lax.fori_loop(0, 4, lambda i, c: c * i + 1, x))(x))
    assert ours.dtype == theirs.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
