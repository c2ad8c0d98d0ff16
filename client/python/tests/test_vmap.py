"""tessel.vmap against a loop nobody here wrote the answer for: numpy applied
to each element and stacked (and jax.vmap on CPU for the composed cases),
under jit, eagerly, nested, with gradients, and on a sharded mesh."""

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from test_ops import sample


@pytest.fixture(autouse=True)
def _session(cluster):
    tessel._context.set_default_session(cluster.session)
    yield


def loop(fn, args, in_axes, out_axes=0):
    """numpy's fn on each element of the mapped arguments, stacked."""
    size = next(np.shape(a)[ax] for a, ax in zip(args, in_axes) if ax is not None)
    outs = [fn(np, *[a if ax is None else np.take(a, i, axis=ax) for a, ax in zip(args, in_axes)]) for i in range(size)]
    if isinstance(outs[0], tuple):
        return tuple(np.stack([o[k] for o in outs], axis=oa) for k, oa in enumerate(out_axes))
    return np.stack(outs, axis=out_axes)


def same(got, want, rtol=1e-6):
    got = got.fetch() if isinstance(got, tessel.Array) else np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    else:
        np.testing.assert_array_equal(got, want)


CASES = {
    # name: (fn(m, *elements), argument shapes, in_axes)
    "elementwise_with_unmapped": (lambda m, x, y: m.tanh(x) * y + 1, [(5, 3, 4), (3, 4)], (0, None)),
    "scalar_per_element": (lambda m, x, y: m.where(x > 0, x, y), [(6,), ()], (0, None)),
    "clamp_bounds": (lambda m, x, lo: m.clip(x, lo, 1.0), [(4, 7), (4,)], (0, 0)),
    "matmul_both": (lambda m, a, b: a @ b, [(3, 4, 5), (3, 5, 2)], (0, 0)),
    "matmul_lhs": (lambda m, a, b: a @ b, [(3, 4, 5), (5, 2)], (0, None)),
    "matmul_rhs": (lambda m, a, b: a @ b, [(4, 5), (5, 3, 2)], (None, 1)),
    "batched_matmul_rhs": (lambda m, a, b: m.einsum("bij,bjk->bik", a, b), [(2, 3, 4), (5, 2, 4, 2)], (None, 0)),
    "mapped_along_last": (lambda m, x: m.sum(x * x, axis=0), [(4, 3, 6)], (2,)),
    "reductions": (lambda m, x: (m.max(x, axis=1), m.argmin(x, axis=0), m.mean(x)), [(5, 3, 4)], (0,)),
    "layout": (lambda m, x: m.concatenate([x.T.reshape(-1), m.flip(x, 0)[1:, ::2].reshape(-1)]), [(3, 4, 5)], (0,)),
    "pad_and_broadcast": (lambda m, x: m.pad(x, ((1, 0), (2, 1))) + m.ones((1, 7)), [(2, 3, 4)], (0,)),
    "sort": (lambda m, x: m.sort(x, axis=-1), [(4, 3, 6)], (1,)),
    "take_static": (lambda m, x: m.take(x, np.array([2, 0, 2, 1]), axis=1), [(3, 4, 3)], (0,)),
    "take_mapped_indices": (lambda m, x, i: m.take(x, i, axis=0), [(5, 3), (4, 2)], (None, 0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap_matches_a_loop_under_jit_and_eagerly(name):
    fn, shapes, in_axes = CASES[name]
    args = [sample("float32", s) for s in shapes]
    if name == "take_mapped_indices":
        args[1] = np.array([[4, 0], [1, 1], [2, 3], [0, 4]], np.int64)
    want = loop(fn, args, in_axes, out_axes=(0, 0, 0) if name == "reductions" else 0)
    mapped = tessel.vmap(lambda *a: fn(tnp, *a), in_axes=in_axes)
    for got in (tessel.jit(mapped)(*args), mapped(*[tessel.device_put(a) for a in args])):
        for g, w in zip(got if isinstance(want, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            same(g, w, rtol=1e-5)


def test_gather_and_scatter_with_indices_mapped_with_the_operand():
    """Each element reads and writes its own row through its own indices
    (out of range: clamped reading, dropped writing, as JAX)."""
    x = sample("float32", (4, 6, 3))
    i = np.array([[5, 0, 9], [1, 1, 7], [2, 3, 4], [0, 6, 5]], np.int64)
    u = sample("float32", (4, 3, 3))
    got = tessel.jit(tessel.vmap(lambda a, j, v: (tnp.take(a, j, axis=0, mode="clip"), a.at[j].add(v))))(x, i, u)
    for k in range(4):
        same(got[0].fetch()[k], np.take(x[k], i[k], axis=0, mode="clip"))
        want = x[k].copy()
        for r, idx in enumerate(i[k]):
            if 0 <= idx < 6:
                want[idx] += u[k, r]
        same(got[1].fetch()[k], want)


def test_in_axes_and_out_axes_follow_jax():
    """in_axes as a prefix of the arguments (a dict), out_axes per result,
    out_axes=None for a result that does not depend on the batch."""
    x, w = sample("float64", (3, 5)), sample("float64", (5,))

    def f(p):
        return p["x"] * p["w"], tnp.sum(p["w"])

    got = tessel.jit(tessel.vmap(f, in_axes=({"x": 1, "w": None},), out_axes=(1, None)))({"x": x.T, "w": w})
    same(got[0], (x * w).T)
    same(got[1], np.sum(w))
    with pytest.raises(tessel.TesselError, match="depends on the batch"):
        tessel.jit(tessel.vmap(lambda a: a * 2, out_axes=None))(x)


def test_unmapped_results_are_broadcast_and_sizes_must_agree():
    x = sample("float32", (4, 2))
    got = tessel.jit(tessel.vmap(lambda a, b: b * 2, in_axes=(0, None)))(x, np.float32(3))
    same(got, np.full(4, 6, np.float32))
    with pytest.raises(
        ValueError, match=r"inconsistent sizes for the mapped axes: argument\[0\] has 4, argument\[1\] has 3"
    ):
        tessel.vmap(lambda a, b: a + b)(x, sample("float32", (3, 2)))
    with pytest.raises(ValueError, match="in_axes 2 for argument\\[0\\] of rank 2"):
        tessel.vmap(lambda a: a, in_axes=2)(x)


def test_nested_vmap_is_an_outer_product_of_loops():
    a, b = sample("float64", (3, 4)), sample("float64", (5, 4))
    f = tessel.vmap(tessel.vmap(lambda u, v: tnp.dot(u, v), in_axes=(None, 0)), in_axes=(0, None))
    same(tessel.jit(f)(a, b), a @ b.T, rtol=1e-12)


def test_per_example_gradients_match_jax():
    """vmap of grad (per-example gradients) and grad of vmap (the gradient
    of a batched loss), against jax on CPU."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    w, xs = sample("float64", (4, 3)), sample("float64", (6, 4))

    def loss(m):
        return lambda w, x: m.sum(m.tanh(x @ w) ** 2)

    per_example = tessel.jit(tessel.vmap(tessel.grad(loss(tnp)), in_axes=(None, 0)))(w, xs)
    same(per_example, np.asarray(jax.vmap(jax.grad(loss(jnp)), in_axes=(None, 0))(w, xs)), rtol=1e-10)
    batched = tessel.jit(tessel.grad(lambda w, x: tnp.sum(tessel.vmap(loss(tnp), in_axes=(None, 0))(w, x))))(w, xs)
    same(
        batched,
        np.asarray(jax.grad(lambda w, x: jnp.sum(jax.vmap(loss(jnp), in_axes=(None, 0))(w, x)))(w, xs)),
        rtol=1e-10,
    )


def test_vmap_over_a_sharded_batch():
    """The batch split over a mesh: each device maps its own elements."""
    from tessel import Mesh, NamedSharding, P

    x, w = sample("float32", (8, 4)), sample("float32", (4, 3))
    mesh = Mesh({"data": min(4, len(tessel.devices()))})  # 2 where the CUDA suite's cluster has 2
    xs = tessel.device_put(x, NamedSharding(mesh, P("data")))
    got = tessel.jit(tessel.vmap(lambda r, m: tnp.tanh(r @ m), in_axes=(0, None)))(xs, w)
    same(got, np.tanh(x @ w), rtol=1e-5)


def test_loops_and_conditionals_over_mapped_values_match_a_loop():
    """fori_loop, scan (a carry that starts unmapped and becomes mapped),
    while_loop with a condition that does not depend on the batch, cond on
    an unmapped and on a mapped predicate, switch on a mapped index."""
    lax = tessel.lax
    x, k = sample("float64", (4, 3)), sample("float64", (3,))

    def fori(a):
        return lax.fori_loop(0, 3, lambda i, c: c * 0.5 + tnp.sum(a), a)

    def fori_np(a):
        c = a
        for _ in range(3):
            c = c * 0.5 + np.sum(a)
        return c

    def scan(a):
        return lax.scan(lambda c, v: (c + v, c * v), 0.0, a)

    def scan_np(a):
        c, ys = 0.0, []
        for v in a:
            ys.append(c * v)
            c = c + v
        return np.float64(c), np.array(ys)

    def while_(a):
        return lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 2 + 1), (0, a))[1]

    def cond_unmapped(a, b):
        return lax.cond(tnp.sum(b) > 0, lambda u: u + 1, lambda u: u * 2, a)

    def cond_mapped(a):
        return lax.cond(tnp.sum(a) > 0, lambda u: u + 1, lambda u: u * 2, a)

    def switch(a, i):
        return lax.switch(i, [lambda u: u + 1, lambda u: u * 2, lambda u: -u], a)

    f = tessel.jit(
        lambda a, b, i: (
            tessel.vmap(fori)(a),
            tessel.vmap(scan)(a),
            tessel.vmap(while_)(a),
            tessel.vmap(cond_unmapped, in_axes=(0, None))(a, b),
            tessel.vmap(cond_mapped)(a),
            tessel.vmap(switch)(a, i),
        )
    )
    idx = np.array([0, 2, 1, 7], np.int32)  # out of range: the last branch, as the conditional
    got = f(x, k, idx)
    same(got[0], np.stack([fori_np(r) for r in x]), rtol=1e-12)
    same(got[1][0], np.stack([scan_np(r)[0] for r in x]), rtol=1e-12)
    same(got[1][1], np.stack([scan_np(r)[1] for r in x]), rtol=1e-12)
    w = x.copy()
    for _ in range(3):
        w = w * 2 + 1
    same(got[2], w, rtol=1e-12)
    same(got[3], x + 1 if np.sum(k) > 0 else x * 2)
    same(got[4], np.stack([r + 1 if np.sum(r) > 0 else r * 2 for r in x]))
    same(got[5], np.stack([[r + 1, r * 2, -r][min(j, 2)] for r, j in zip(x, idx)]))


def test_a_while_loop_whose_condition_depends_on_the_batch_names_the_node():
    x = sample("float32", (3, 4))
    f = tessel.vmap(lambda a: tessel.lax.while_loop(lambda c: tnp.sum(c) < 100, lambda c: c * 2 + 1, a))
    with pytest.raises(tessel.TesselError, match=r"\(while\) has a condition that depends on the batch"):
        tessel.jit(f)(x)
