"""Large constants captured by a jitted function: they compile and run
whatever their size, travel once per placement through the chunked put
stream (counted as host->device bytes), and the user is told at compile.
Results are checked against numpy."""

import warnings

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from conftest import DEVICE_KIND


def _compile_warnings(call):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = call()
    return out, [str(w.message) for w in seen if "captured constant" in str(w.message)]


def test_a_64_mib_captured_constant_compiles_runs_and_is_put_once(session):
    n = 4096
    c = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)  # 64 MiB: over gRPC's message limit
    f = tessel.jit(lambda x: x * c + 1.0)
    x = np.full((n, n), 2.0, np.float32)
    xa = tessel.device_put(x)
    before = tessel.stats()
    y, said = _compile_warnings(lambda: f(xa))
    np.testing.assert_array_equal(y.fetch(), x * c + 1.0)
    assert len(said) == 1 and "float32[4096,4096] (64.0 MiB)" in said[0], said
    mid = tessel.stats()
    assert mid["bytes_host_to_device"] - before["bytes_host_to_device"] == c.nbytes
    # Later calls reuse the constant where it is: nothing more moves.
    for _ in range(3):
        y = f(xa)
    np.testing.assert_array_equal(y.fetch(), x * c + 1.0)
    after = tessel.stats()
    assert after["bytes_host_to_device"] == mid["bytes_host_to_device"]
    assert f.compiles == 1


def test_a_constant_is_what_it_was_when_traced(session):
    c = np.arange(1 << 19, dtype=np.float32)  # 2 MiB
    f = tessel.jit(lambda x: x + c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = f(np.float32(1)).fetch()
    c[:] = -1  # numpy semantics of a traced constant: later writes do not reach the program
    np.testing.assert_array_equal(f(np.float32(1)).fetch(), first)
    np.testing.assert_array_equal(first, np.arange(1 << 19, dtype=np.float32) + 1)


def test_constants_in_a_loop_body_and_the_same_array_twice(session):
    c = np.linspace(-1, 1, 1 << 19).astype(np.float32)
    lax = tessel.lax

    def f(x):
        body = lambda i, v: v * 0.5 + c  # noqa: E731  (captured inside the loop's function)
        return lax.fori_loop(0, 3, body, x) + c

    got, said = _compile_warnings(lambda: tessel.jit(f)(np.zeros(c.shape, np.float32)).fetch())
    want = np.zeros(c.shape, np.float32)
    for _ in range(3):
        want = want * np.float32(0.5) + c
    np.testing.assert_allclose(got, want + c, rtol=1e-6)
    assert len(said) == 1 and "1 captured constant" in said[0], said  # one array, one argument


def _mesh_2d():
    n = len(tessel.devices())
    return tessel.Mesh({"data": 2, "model": n // 2} if n % 2 == 0 else {"data": n})


def test_a_constant_in_a_partitioned_program_is_put_in_the_blocks_its_reader_takes(session):
    mesh = _mesh_2d()
    spec = tessel.P(*mesh.axis_names)
    c = np.random.default_rng(2).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    x = np.random.default_rng(3).standard_normal(c.shape).astype(np.float32)
    xs = tessel.device_put(x, tessel.NamedSharding(mesh, spec))
    f = tessel.jit(lambda v: tnp.sum(v * c, axis=1) + tnp.sum(c, axis=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = f.lower(xs).as_text()
        before = tessel.stats()
        y = f(xs)
    # The constant takes x's layout, as the product that reads it first does.
    axes = ", ".join(f"'{a}'" for a in mesh.axis_names) + ("," if len(mesh.axis_names) == 1 else "")
    assert f"parameter 1 'constant0' f32[512,1024] P({axes})" in plan, plan
    # Sums of 1024 terms in any order: within f32's pairwise bound of numpy's f64 sums.
    terms = x.astype(np.float64) * c
    want = terms.sum(axis=1) + c.astype(np.float64).sum(axis=1)
    err = np.abs(y.fetch() - want)
    assert np.all(err <= 4e-6 * (np.abs(terms).sum(axis=1) + np.abs(c).sum(axis=1))), err.max()
    moved = tessel.stats()["bytes_host_to_device"] - before["bytes_host_to_device"]
    assert moved == c.nbytes, moved  # each block put once: no device holds another's


def test_seed_001_on_a_2x2_mesh_peaks_at_a_block_of_each_value():
    """Seed 001 over P('data', 'model'): an arange reshaped and added, and a
    captured numpy constant multiplied, each peak at the blocks of the
    values the program holds, never a whole constant, in a cluster of its
    own (the peak counts from the worker's start)."""
    if DEVICE_KIND != "cpu":
        pytest.skip("four devices on two workers: the CPU suite's layout")
    n = 2048
    block = n * n * 4 // 4
    x = np.random.default_rng(4).standard_normal((n, n)).astype(np.float32)
    c = np.random.default_rng(5).standard_normal((n, n)).astype(np.float32)
    previous = tessel._context.default_session_or_none()
    try:
        with tessel.local_cluster(workers=2, devices_per_worker=2):
            mesh = tessel.Mesh({"data": 2, "model": 2})
            xs = tessel.device_put(x, tessel.NamedSharding(mesh, tessel.P("data", "model")))

            def peaks():
                return [d["peak_bytes_in_use"] for d in tessel.memory_stats()["devices"].values()]

            y = tessel.jit(lambda v: v + tnp.arange(n * n, dtype=np.int32).reshape(n, n).astype(np.float32))(xs)
            np.testing.assert_array_equal(
                y.fetch(), x + np.arange(n * n, dtype=np.int32).reshape(n, n).astype(np.float32)
            )
            # x's block and the result's: the iota's blocks are made inside the sum's loop.
            assert all(p <= 2 * block + (64 << 10) for p in peaks()), (peaks(), block)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                z = tessel.jit(lambda v: v * c)(xs)
            np.testing.assert_array_equal(z.fetch(), x * c)
            # x, y, the constant's block and z's: the constant is put in x's layout.
            assert all(p <= 4 * block + (64 << 10) for p in peaks()), (peaks(), block)
    finally:
        tessel._context.set_default_session(previous)


def test_small_constants_stay_in_the_program(session):
    c = np.arange(16, dtype=np.float32)
    f = tessel.jit(lambda x: x + c)
    _, said = _compile_warnings(lambda: f(np.float32(0)))
    assert said == []
    assert "literal" in f.lower(np.float32(0)).as_text()


# Constants made whole and then cut, reshaped, transposed or broadcast
# (seed 001's variants), against numpy: the same expression over `xp`.
N = 256
_I32 = np.int32
LAYOUT_VARIANTS = {
    "zeros_plus_reshaped_arange": lambda xp, x: x
    + xp.zeros((N, N), np.float32)
    + xp.arange(N * N, dtype=_I32).reshape(N, N).astype(np.float32),
    "sliced_zeros": lambda xp, x: xp.zeros((16 * N * N,), np.float32)[: N * N].reshape(N, N) + x,
    "strided_arange_slice": lambda xp, x: xp.arange(4 * N * N, dtype=_I32)[3::4].reshape(N, N).astype(np.float32) - x,
    "transposed_arange": lambda xp, x: xp.arange(N * N, dtype=_I32).reshape(N, N).T.astype(np.float32) * x,
    "broadcast_row": lambda xp, x: xp.broadcast_to(xp.arange(N, dtype=np.float32)[None, :], (N, N)) + x,
    "reshape_of_an_inner_iota": lambda xp, x: xp.broadcast_to(xp.arange(N, dtype=_I32)[None, :], (N, N))
    .reshape(N * N)[::3][: N * (N // 4)]
    .reshape(N // 4, N)
    .astype(np.float32)
    .sum(axis=0)
    + x[0],
    "three_d_round_trip": lambda xp, x: xp.arange(N * N, dtype=_I32)
    .reshape(N // 8, 8, N)
    .transpose(1, 0, 2)
    .reshape(N, N)
    .astype(np.float32)
    + x,
    "mask_of_an_iota": lambda xp, x: xp.where(xp.arange(N * N, dtype=_I32).reshape(N, N) % 3 == 0, x, 0.5),
}


@pytest.mark.parametrize("name", sorted(LAYOUT_VARIANTS))
@pytest.mark.parametrize("sharded", [False, True])
def test_constants_through_layout_ops_match_numpy_and_stay_generated(session, name, sharded):
    if sharded and DEVICE_KIND != "cpu":
        pytest.skip("the CUDA suite's workers share their GPUs, and NCCL needs one GPU per device")
    f = LAYOUT_VARIANTS[name]
    x = (np.random.default_rng(3).standard_normal((N, N)) * 4).round().astype(np.float32)
    want = f(np, x)
    if sharded:
        n = len(tessel.devices())
        mesh = tessel.Mesh({"data": n})
        xa = tessel.device_put(x, tessel.NamedSharding(mesh, tessel.P("data")))
    else:
        xa = tessel.device_put(x)
    jitted = tessel.jit(lambda v: f(tnp, v))
    got = jitted(xa).fetch()
    np.testing.assert_array_equal(got, want)
    # Nothing the size of a whole constant is made: no value above x's size
    # (the constants here have N*N to 16*N*N elements).
    plan = jitted.lower(xa)
    assert plan.estimated_bytes <= 8 * x.nbytes, (plan.estimated_bytes, plan.as_text())
    assert "literal" not in plan.as_text()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
