"""Sharded execution on a real 2-worker cluster (2 CPU devices each): every
mesh shape over the 4 devices, random shardings for each op's operands and
result, compared with the same function run whole on one device and with
numpy. Collectives run across the two worker processes through Gloo."""

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import Mesh, NamedSharding, P

MESHES = {"1x4": (1, 4), "2x2": (2, 2), "4x1": (4, 1)}


def mesh_of(shape):
    return Mesh({"data": shape[0], "model": shape[1]})


def random_spec(rng, mesh, shape):
    """A random valid PartitionSpec for `shape`: each axis used at most once,
    only where it divides the dimension."""
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    rng.shuffle(axes)
    dims = [[] for _ in shape]
    for a in axes:
        if rng.random() < 0.3:
            continue
        d = int(rng.integers(len(shape))) if shape else None
        if d is None:
            continue
        size = int(np.prod([mesh.shape[x] for x in dims[d]] + [mesh.shape[a]]))
        if shape[d] % size == 0:
            dims[d].append(a)
    return P(*[None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims])


# name -> (function of the arguments, argument shapes)
OPS = {
    "add": (lambda a, b: a + b, [(8, 4), (8, 4)]),
    "mul_tanh": (lambda a, b: tnp.tanh(a * b) - a, [(8, 4), (8, 4)]),
    "where": (lambda a, b: tnp.where(a > b, a, b * 2), [(4, 8), (4, 8)]),
    "matmul": (lambda a, b: a @ b, [(8, 4), (4, 8)]),
    "batched_matmul": (lambda a, b: tnp.einsum("bij,bjk->bik", a, b), [(4, 4, 8), (4, 8, 4)]),
    "sum_rows": (lambda a: tnp.sum(a, axis=0), [(8, 4)]),
    "sum_all": (lambda a: tnp.sum(a), [(8, 4)]),
    "max_cols": (lambda a: tnp.max(a, axis=1), [(8, 4)]),
    "mean_keepdims": (lambda a: tnp.mean(a, axis=1, keepdims=True), [(4, 8)]),
    "argmax": (lambda a: tnp.argmax(a, axis=1), [(8, 4)]),
    "transpose": (lambda a: a.T + 1, [(8, 4)]),
    "reshape_merge": (lambda a: tnp.reshape(a, (32,)) * 2, [(8, 4)]),
    "reshape_split": (lambda a: tnp.reshape(a, (4, 2, 4)), [(8, 4)]),
    "slice": (lambda a: a[2:6, :] - 1, [(8, 4)]),
    "concatenate": (lambda a, b: tnp.concatenate([a, b], axis=1), [(8, 4), (8, 4)]),
    "pad": (lambda a: tnp.pad(a, ((1, 3), (0, 0))), [(4, 8)]),
    "broadcast": (lambda a, b: tnp.expand_dims(a, 1) + tnp.expand_dims(b, 0), [(4, 8), (4, 8)]),
    "iota_fill": (
        lambda a: a + tnp.arange(32, dtype=tnp.float32).reshape(8, 4) + tnp.ones((8, 4), tnp.float32),
        [(8, 4)],
    ),
    "mlp_layer": (lambda x, w, b: tnp.tanh(x @ w + b), [(8, 4), (4, 8), (8,)]),
}


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("op", OPS)
def test_partitioned_result_equals_the_whole_one(session, mesh_name, op):
    fn, shapes = OPS[op]
    mesh = mesh_of(MESHES[mesh_name])
    rng = np.random.default_rng(abs(hash((mesh_name, op))) % (1 << 32))
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    whole = tessel.jit(fn)(*[tessel.device_put(a) for a in args]).fetch()
    for trial in range(3):
        specs = [random_spec(rng, mesh, s) for s in shapes]
        out_spec = random_spec(rng, mesh, whole.shape) if trial > 0 else None
        placed = [tessel.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        f = tessel.jit(fn, out_shardings=None if out_spec is None else NamedSharding(mesh, out_spec))
        got = f(*placed)
        assert isinstance(got.sharding, NamedSharding)
        if out_spec is not None:
            assert got.sharding.spec == out_spec
        np.testing.assert_allclose(
            got.fetch(),
            whole,
            rtol=2e-5,
            atol=2e-5,
            err_msg=f"{op} on {mesh_name}: {specs} -> {out_spec}\n{f.lower(*placed).as_text()}",
        )


@pytest.mark.parametrize(
    "spec", [P("data", None), P(None, "model"), P(("data", "model")), P("model", "data"), P(None, ("model", "data"))]
)
def test_put_sends_each_device_its_block_and_fetch_reassembles(session, spec):
    mesh = mesh_of((2, 2))
    x = np.arange(8 * 12, dtype=np.int32).reshape(8, 12)
    before = tessel.stats()
    a = tessel.device_put(x, NamedSharding(mesh, spec))
    np.testing.assert_array_equal(a.fetch(), x)
    info = a._info()
    block = NamedSharding(mesh, spec).shard_shape(x.shape)
    assert list(info.device_bytes) == [int(np.prod(block)) * 4] * 4
    copies = 4 // int(
        np.prod(
            [
                NamedSharding(mesh, spec).mesh.shape[ax]
                for d in spec
                if d is not None
                for ax in ((d,) if isinstance(d, str) else d)
            ]
        )
    )
    moved = tessel.stats()["bytes_host_to_device"] - before["bytes_host_to_device"]
    assert moved == x.nbytes * copies  # each device got exactly its block


def test_sharded_zeros_allocate_a_quarter_on_each_device_and_move_nothing(session):
    """Seed 001: zeros(f32[500000000]) over 4 devices is made on each device
    for its own block: 500 MB per device, 0 bytes moved."""
    mesh = Mesh({"x": 4})
    n = 500_000_000

    def zeros():
        return tnp.zeros((n,), tnp.float32)

    f = tessel.jit(zeros, out_shardings=NamedSharding(mesh, P("x")))
    plan = f.lower()
    assert plan.collectives == [] and "literal" not in plan.as_text(), plan.as_text()
    before_mem = tessel.memory_stats()["devices"]
    before = tessel.stats()
    z = f()
    z.block_until_ready()
    after = tessel.stats()
    for k in ("bytes_host_to_device", "bytes_device_to_host", "bytes_device_to_device"):
        assert after[k] == before[k], k
    grown = {d: m["bytes_in_use"] - before_mem[d]["bytes_in_use"] for d, m in tessel.memory_stats()["devices"].items()}
    # A quarter each (the allocator rounds to 2 MiB pages), never the whole 2 GB.
    assert all(n <= g < n + (4 << 20) for g in grown.values()), grown
    assert list(z._info().device_bytes) == [n] * 4
    z.delete()


def test_collectives_in_a_manual_region_match_numpy(session):
    mesh = mesh_of((2, 2))
    x = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)

    def body(b):
        s = tessel.psum(b, "model")  # sum of the two column blocks
        g = tessel.all_gather(s, "data", axis=0)  # whole rows
        i = tessel.axis_index("model").astype(tnp.float32)
        return g * 0 + tnp.sum(g) + i * 0

    def f(a):
        return tessel.shard_map(body, mesh, P("data", "model"), P(None, None))(a)

    with pytest.raises(tessel.InvalidArgumentError, match="varies over mesh axis 'model'.*axis_index"):
        tessel.jit(f)(tessel.device_put(x, NamedSharding(mesh, P("data", "model"))))

    def body2(b):
        s = tessel.psum(b, "model")
        return tessel.all_gather(s, "data", axis=0)

    def f2(a):
        return tessel.shard_map(body2, mesh, P("data", "model"), P(None, None))(a)

    xs = tessel.device_put(x, NamedSharding(mesh, P("data", "model")))
    out = tessel.jit(f2)(xs).fetch()
    np.testing.assert_array_equal(out, x[:, :4] + x[:, 4:])

    def region(body, out_spec):
        return tessel.jit(lambda a: tessel.shard_map(body, mesh, P("data", "model"), out_spec)(a))(xs).fetch()

    # Block (d, m) of x: rows d*4.., columns m*4..
    shifted = region(lambda b: tessel.ppermute(b, "data", [(0, 1), (1, 0)]), P("data", "model"))
    np.testing.assert_array_equal(shifted, np.concatenate([x[4:], x[:4]]))
    scattered = region(lambda b: tessel.psum_scatter(b, "model", scatter_dimension=1), P("data", "model"))
    np.testing.assert_array_equal(scattered, x[:, :4] + x[:, 4:])
    moved = region(lambda b: tessel.all_to_all(b, "model", split_axis=0, concat_axis=1), P(("data", "model"), None))
    np.testing.assert_array_equal(moved, x)  # the same value, split by rows only
    index = region(
        lambda b: b * 0 + (tessel.axis_index("data") * 2 + tessel.axis_index("model")).astype(tnp.float32),
        P("data", "model"),
    )
    np.testing.assert_array_equal(index, np.kron(np.arange(4, dtype=np.float32).reshape(2, 2), np.ones((4, 4))))


COPY_SOURCE = (
    'extern "C" __global__ void copy(const float* a, float* b, long n) '
    "{ long i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) b[i] = a[i]; }"
)


def _seed_002(session, bwd_rule, bwd_unreduced, scale):
    """The forward's copy kernel follows its input; the backward's has `bwd_rule`."""
    mesh = mesh_of((2, 2))
    copy = tessel.custom_kernel("copy", lambda a: a + 0, cuda_source=COPY_SOURCE, replication=("follow", 0))
    copy_bwd = tessel.custom_kernel("copy", lambda a: a + 0, cuda_source=COPY_SOURCE, replication=bwd_rule)

    def fwd(x):
        return copy(x)

    def bwd(g):
        return copy_bwd(g) * scale

    def grad_step(inputs):
        y = tessel.shard_map(fwd, mesh, P("data", None), P("data", None))(inputs)
        loss = tnp.sum(y)
        ones = tnp.ones(inputs.shape, inputs.dtype)
        dx = tessel.shard_map(bwd, mesh, P("data", None), P("data", None, unreduced=bwd_unreduced))(ones)
        return loss, dx

    x = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    xs = tessel.device_put(x, NamedSharding(mesh, P("data", None)))
    f = tessel.jit(grad_step, out_shardings=(None, NamedSharding(mesh, P("data", None))))
    plan = f.lower(xs)
    loss, dx = f(xs)
    np.testing.assert_allclose(float(loss.fetch()), x.sum(), rtol=1e-4)
    np.testing.assert_array_equal(dx.fetch(), np.ones_like(x))
    return [c for c in plan.collectives if c["op"] == "all_reduce"], plan


def test_seed_002_replication_rule_keeps_the_gradient_free_of_all_reduce(session):
    reduces, plan = _seed_002(session, ("follow", 0), (), 1.0)
    # One all_reduce completes the scalar loss (output 0); the gradient needs none.
    assert len(reduces) == 1 and "output 0" in reduces[0]["reason"], plan.as_text()


def test_seed_002_kernel_varying_over_model_costs_exactly_one_all_reduce_with_its_reason(session):
    reduces, plan = _seed_002(session, {"data", "model"}, ("model",), 0.5)
    grad = [c for c in reduces if "output 1" in c["reason"]]
    assert len(grad) == 1 and grad[0]["axes"] == ("model",), plan.as_text()
    assert "partial result over model" in grad[0]["reason"]


def test_seed_002_kernel_varying_over_model_without_unreduced_is_an_error_naming_it(session):
    with pytest.raises(tessel.InvalidArgumentError, match="varies over mesh axis 'model'.*custom kernel 'copy'"):
        _seed_002(session, {"data", "model"}, (), 0.5)


def test_bad_shardings_are_clear_errors_and_leave_nothing_behind(session):
    mesh = mesh_of((2, 2))
    x = np.zeros((6, 4), np.float32)
    live = tessel.stats()["live_arrays"]
    for spec, msg in [
        (P("rows"), "unknown mesh axis 'rows'"),
        (P("data", "data"), "'data' is used twice"),
        (P(None, None, "model"), "names 3 dimensions but the value has rank 2"),
        (P(("data", "model")), "does not split evenly"),
    ]:
        with pytest.raises(tessel.InvalidArgumentError, match=msg):
            tessel.device_put(x, NamedSharding(mesh, spec))
    with pytest.raises(tessel.InvalidArgumentError, match="device 4 does not exist; the cluster has 4 devices"):
        tessel.device_put(x, NamedSharding(Mesh({"data": 2, "model": 4}), P()))
    assert tessel.stats()["live_arrays"] == live

    with pytest.raises(tessel.InvalidArgumentError, match="explicit only inside"):
        tessel.jit(lambda a: tessel.psum(a, "data"), in_shardings=NamedSharding(mesh, P()))(x)

    xs = tessel.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("data")))
    f = tessel.jit(lambda a: a + 1, in_shardings=NamedSharding(mesh, P(None, "model")))
    with pytest.raises(
        tessel.InvalidArgumentError, match="laid out P\\('data', None\\).*takes it P\\(None, 'model'\\)"
    ):
        f(xs).fetch()  # calls are pipelined: the error travels on the result
    # The daemons keep serving.
    np.testing.assert_array_equal(tessel.jit(lambda a: a * 2)(xs).fetch(), np.zeros((8, 4), np.float32))


def test_fetching_an_unreduced_result_is_refused(session):
    mesh = mesh_of((2, 2))
    a = tessel.device_put(np.ones((4, 8), np.float32), NamedSharding(mesh, P(None, "model")))
    f = tessel.jit(lambda x: tnp.sum(x, axis=1), out_shardings=NamedSharding(mesh, P(unreduced=("model",))))
    s = f(a)
    assert s.sharding.spec == P(unreduced=("model",))
    with pytest.raises(tessel.FailedPreconditionError, match="unreduced partial result"):
        s.fetch()
    g = tessel.jit(lambda x: x * 1, out_shardings=NamedSharding(mesh, P()))
    np.testing.assert_array_equal(g(s).fetch(), np.full(4, 8, np.float32))


def test_take_along_axis_over_a_split_batch_moves_nothing(session):
    """take_along_axis is one gather whose batch dimensions are the
    others: with the rows split over data, each device picks from its own
    rows, forward and backward, and the loss's sum is the only collective
    (it used to all_gather the indices and reduce the picks)."""
    mesh = Mesh({"data": 4})
    rng = np.random.default_rng(11)
    x = rng.standard_normal((8, 16, 6)).astype(np.float32)
    i = rng.integers(0, 16, size=(8, 3, 6))
    xs, ids = (tessel.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, i))

    def loss(x, i):
        return tnp.sum(tnp.take_along_axis(x, i, axis=1) ** 2)

    step = tessel.jit(tessel.value_and_grad(loss))
    plan = step.lower(xs, ids)
    assert [(c["op"], c["axes"]) for c in plan.collectives] == [("all_reduce", ("data",))], plan.as_text()
    value, grad = step(xs, ids)
    picked = np.take_along_axis(x, i, axis=1)
    want = np.zeros_like(x)
    np.add.at(want, (np.arange(8)[:, None, None], i, np.arange(6)[None, None, :]), 2 * picked)
    np.testing.assert_allclose(value.fetch(), (picked.astype(np.float64) ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(grad.fetch(), want, rtol=1e-6)
    assert grad.sharding.spec == P("data", None, None)


def test_a_data_parallel_gradient_crosses_the_mesh_in_one_all_reduce(session):
    """Each parameter's gradient of a data-parallel step is a partial sum
    over data; the plan combines them (and the loss's) into one all_reduce
    of their operands concatenated, sliced back apart after. The gradients
    equal numpy's."""
    mesh = Mesh({"data": 4})
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((16, 8)), rng.standard_normal((16, 1))
    w1, b1, w2, b2 = rng.standard_normal((8, 32)) / 3, np.zeros(32), rng.standard_normal((32, 1)) / 6, np.zeros(1)

    def loss(params, x, y):
        w1, b1, w2, b2 = params
        h = tnp.tanh(x @ w1 + b1)
        return tnp.mean((h @ w2 + b2 - y) ** 2)

    step = tessel.jit(tessel.value_and_grad(loss))
    params = tuple(tessel.device_put(p, NamedSharding(mesh, P())) for p in (w1, b1, w2, b2))
    data = [tessel.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y)]
    plan = step.lower(params, *data)
    reduces = [c for c in plan.collectives if c["op"] == "all_reduce"]
    assert len(reduces) == 1 and "one all_reduce for 5 values" in reduces[0]["reason"], plan.as_text()
    value, grads = step(params, *data)
    h = np.tanh(x @ w1 + b1)
    err = h @ w2 + b2 - y
    d_out = 2 * err / len(x)
    dh = (d_out @ w2.T) * (1 - h * h)
    want = (x.T @ dh, dh.sum(0), h.T @ d_out, d_out.sum(0))
    np.testing.assert_allclose(value.fetch(), np.mean(err**2), rtol=1e-10)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.fetch(), w, rtol=1e-9, atol=1e-12)


def test_in_and_out_shardings_are_pytree_prefixes_as_jax_takes_them(session):
    """One NamedSharding per parameter leaf (the JAX idiom for model
    parallelism), None for "as the argument is", and out_shardings as a
    dict over a dict result: each honoured, and the result equals numpy's.
    A prefix that does not fit, such as a flat per-leaf list, is an error
    naming where it stops fitting."""
    mesh = Mesh([("data", 2), ("model", 2)])
    rng = np.random.default_rng(3)
    params = {"w": rng.normal(size=(4, 8)).astype(np.float32), "b": rng.normal(size=8).astype(np.float32)}
    x = rng.normal(size=(6, 4)).astype(np.float32)

    def layer(p, x):
        return {"y": tnp.tanh(x @ p["w"] + p["b"]), "norm": (p["w"] * p["w"]).sum()}

    by_leaf = {"w": NamedSharding(mesh, P(None, "model")), "b": NamedSharding(mesh, P("model"))}
    f = tessel.jit(
        layer,
        in_shardings=(by_leaf, NamedSharding(mesh, P("data"))),
        out_shardings={"y": NamedSharding(mesh, P("data", "model")), "norm": None},
    )
    out = f(params, x)
    np.testing.assert_allclose(out["y"].fetch(), np.tanh(x @ params["w"] + params["b"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["norm"].fetch(), (params["w"] ** 2).sum(), rtol=1e-5)
    assert out["y"].sharding.spec == P("data", "model")
    # The parameters went in laid out as asked, leaf by leaf (b, w, x).
    placed = [P.from_proto(s) for s in f.lower(params, x)._r.parameter_shardings]
    assert placed == [P("model"), P(None, "model"), P("data", None)], placed
    w = tessel.device_put(params["w"], NamedSharding(mesh, P(None, "model")))
    out = f({"w": w, "b": params["b"]}, x)  # already laid out as asked: accepted as it is
    np.testing.assert_allclose(out["y"].fetch(), np.tanh(x @ params["w"] + params["b"]), rtol=1e-5, atol=1e-6)
    # Leaves the prefix leaves out (None) keep their own layout.
    g = tessel.jit(layer, in_shardings=({"w": None, "b": None}, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(g(params, x)["y"].fetch(), np.tanh(x @ params["w"] + params["b"]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"in_shardings: at the top a tuple of 3 entries for 2 children"):
        tessel.jit(layer, in_shardings=(by_leaf["b"], by_leaf["w"], NamedSharding(mesh, P("data"))))(params, x)
    with pytest.raises(ValueError, match=r"in_shardings: at \[0\]: expected a dict with keys \['b', 'w'\], got list"):
        tessel.jit(layer, in_shardings=([by_leaf["b"], by_leaf["w"]], None))(params, x)
    with pytest.raises(ValueError, match=r"out_shardings: at \['y'\] the tree has one leaf, but got a tuple"):
        tessel.jit(layer, out_shardings={"y": (by_leaf["w"], by_leaf["w"]), "norm": None})(params, x)
