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


def test_a_constant_in_a_partitioned_program_is_replicated_over_its_mesh(session):
    n = len(tessel.devices())
    mesh = tessel.Mesh({"data": n})
    c = np.random.default_rng(2).standard_normal((n * 256, 1024)).astype(np.float32)  # over 1 MiB
    x = np.ones_like(c)
    xs = tessel.device_put(x, tessel.NamedSharding(mesh, tessel.P("data")))
    before = tessel.stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = tessel.jit(lambda v: tnp.sum(v * c, axis=1))(xs)
    # Sums of 1024 products in any order: within f32's pairwise bound of numpy's f64 sum.
    terms = x.astype(np.float64) * c
    err = np.abs(y.fetch() - terms.sum(axis=1))
    assert np.all(err <= 2e-6 * np.abs(terms).sum(axis=1)), err.max()
    moved = tessel.stats()["bytes_host_to_device"] - before["bytes_host_to_device"]
    assert c.nbytes <= moved <= n * c.nbytes, moved  # once per worker at most once per device


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
