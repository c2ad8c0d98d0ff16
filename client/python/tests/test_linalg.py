"""Linear algebra against numpy and JAX on CPU (jax from PyPI): the
factorizations of tessel.lax.linalg (cholesky, triangular_solve, lu,
eigh) and tessel.numpy.linalg (solve, inv, det, slogdet, norm, ...);
their gradients, forward mode and vmap; a batch split over devices; bad
input."""

import itertools

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import lax

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)
jnp, jlax = jax.numpy, jax.lax

RNG = np.random.default_rng(23)


def spd(*batch, n=5, dtype=np.float64):
    m = RNG.normal(size=batch + (n, n))
    return (m @ np.swapaxes(m, -1, -2) + n * np.eye(n)).astype(dtype)


def general(*batch, n=5):
    return RNG.normal(size=batch + (n, n)) + 3 * np.eye(n)


def test_cholesky_matches_numpy_in_f64_and_f32(cluster):
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        a = spd(3, dtype=dtype)
        got = tnp.linalg.cholesky(a).fetch()
        assert got.dtype == dtype
        np.testing.assert_allclose(got, np.linalg.cholesky(a), rtol=tol, atol=tol)
        up = tnp.linalg.cholesky(a, upper=True).fetch()
        np.testing.assert_allclose(up, np.swapaxes(np.linalg.cholesky(a), -1, -2), rtol=tol, atol=tol)


def test_cholesky_of_a_matrix_not_positive_definite_is_nan(cluster):
    a = np.diag([1.0, -2.0, 3.0])
    got, want = tnp.linalg.cholesky(a).fetch(), np.asarray(jnp.linalg.cholesky(a))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[np.tril_indices(3)]).all() and (got[np.triu_indices(3, 1)] == 0).all()


@pytest.mark.parametrize("left_side,lower,transpose_a,unit_diagonal", list(itertools.product([False, True], repeat=4)))
def test_triangular_solve_matches_jax(cluster, left_side, lower, transpose_a, unit_diagonal):
    a = general(2, n=4)
    b = RNG.normal(size=(2, 4, 3) if left_side else (2, 3, 4))
    kw = dict(left_side=left_side, lower=lower, transpose_a=transpose_a, unit_diagonal=unit_diagonal)
    got = lax.linalg.triangular_solve(a, b, **kw).fetch()
    want = np.asarray(jax.lax.linalg.triangular_solve(a, b, **kw))
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
    # Gradients in both operands, through a nonlinear use of x.
    w = RNG.normal(size=b.shape)
    ours = tessel.jit(tessel.grad(lambda a, b: tnp.sum(tnp.sin(lax.linalg.triangular_solve(a, b, **kw)) * w), (0, 1)))
    theirs = jax.grad(lambda a, b: jnp.sum(jnp.sin(jax.lax.linalg.triangular_solve(a, b, **kw)) * w), (0, 1))
    for g, h in zip(ours(a, b), theirs(a, b)):
        np.testing.assert_allclose(g.fetch(), np.asarray(h), rtol=1e-9, atol=1e-11)


def test_lu_matches_jax(cluster):
    a = RNG.normal(size=(3, 6, 6))
    lu, piv, perm = lax.linalg.lu(a)
    jlu, jpiv, jperm = jax.lax.linalg.lu(a)
    np.testing.assert_allclose(lu.fetch(), np.asarray(jlu), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(piv.fetch(), np.asarray(jpiv))
    np.testing.assert_array_equal(perm.fetch(), np.asarray(jperm))
    assert piv.dtype == np.int32 and perm.dtype == np.int32
    f, p = lu.fetch(), perm.fetch()
    lower = np.tril(f, -1) + np.eye(6)
    upper = np.triu(f)
    np.testing.assert_allclose(lower @ upper, np.take_along_axis(a, p[..., None], axis=-2), atol=1e-12)


def test_eigh_matches_numpy(cluster):
    a = spd(2, n=6)
    w, v = tnp.linalg.eigh(a)
    nw, nv = np.linalg.eigh(a)
    np.testing.assert_allclose(w.fetch(), nw, rtol=1e-12)
    # Eigenvectors are unique up to sign.
    np.testing.assert_allclose(np.abs(v.fetch()), np.abs(nv), atol=1e-10)
    vv = v.fetch()
    np.testing.assert_allclose(vv @ (nw[..., None] * np.swapaxes(vv, -1, -2)), a, atol=1e-10)
    np.testing.assert_allclose(tnp.linalg.eigvalsh(a).fetch(), np.linalg.eigvalsh(a), rtol=1e-12)
    # Only the named triangle is read without symmetrizing.
    m = RNG.normal(size=(4, 4))
    upper = lax.linalg.eigh(m, lower=False, symmetrize_input=False)[1].fetch()
    np.testing.assert_allclose(upper, np.linalg.eigvalsh(m, UPLO="U"), rtol=1e-12)


def test_solve_inv_det_slogdet_match_numpy(cluster):
    a = general(3, n=5)
    b = RNG.normal(size=(3, 5, 2))
    np.testing.assert_allclose(tnp.linalg.solve(a, b).fetch(), np.linalg.solve(a, b), rtol=1e-10)
    v = RNG.normal(size=5)
    np.testing.assert_allclose(tnp.linalg.solve(a[0], v).fetch(), np.linalg.solve(a[0], v), rtol=1e-10)
    np.testing.assert_allclose(tnp.linalg.inv(a).fetch(), np.linalg.inv(a), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(tnp.linalg.det(a).fetch(), np.linalg.det(a), rtol=1e-10)
    neg = a.copy()
    neg[:, [0, 1]] = neg[:, [1, 0]]  # a row swap flips the sign
    sign, logabs = tnp.linalg.slogdet(neg)
    nsign, nlog = np.linalg.slogdet(neg)
    np.testing.assert_array_equal(sign.fetch(), nsign)
    np.testing.assert_allclose(logabs.fetch(), nlog, rtol=1e-12)
    # Integers are computed in float64, as numpy does.
    ints = np.array([[2, 1], [1, 3]])
    np.testing.assert_allclose(tnp.linalg.det(ints).fetch(), np.linalg.det(ints), rtol=1e-12)


@pytest.mark.parametrize(
    "ord,axis",
    [
        (None, None),
        (2, None),
        (1, None),
        (np.inf, None),
        (-np.inf, None),
        (0, None),
        (3, None),
        ("fro", (0, 1)),
        ("nuc", (0, 1)),
        (1, (0, 1)),
        (-1, (0, 1)),
        (np.inf, (0, 1)),
        (-np.inf, (0, 1)),
        (2, (0, 1)),
        (-2, (0, 1)),
        (None, 1),
        (2, 0),
    ],
)
def test_norm_matches_numpy(cluster, ord, axis):
    x = RNG.normal(size=(4, 3)) if axis is not None else RNG.normal(size=7)
    x[0] = 0
    got = tnp.linalg.norm(x, ord=ord, axis=axis).fetch()
    np.testing.assert_allclose(got, np.linalg.norm(x, ord=ord, axis=axis), rtol=1e-10)
    kept = tnp.linalg.norm(x, ord=ord, axis=axis, keepdims=True).fetch()
    np.testing.assert_allclose(kept, np.linalg.norm(x, ord=ord, axis=axis, keepdims=True), rtol=1e-10)


def test_gradients_match_jax(cluster):
    a, b = general(2, n=4), RNG.normal(size=(2, 4, 3))
    s = spd(2, n=4)
    w = RNG.normal(size=(2, 4, 4))

    def both(fn, *args, argnums=0):
        ours = tessel.jit(tessel.grad(lambda *xs: fn(tnp, *xs), argnums))(*args)
        theirs = jax.grad(lambda *xs: fn(jnp, *xs), argnums)(*args)
        ours = ours if isinstance(ours, tuple) else (ours,)
        theirs = theirs if isinstance(theirs, tuple) else (theirs,)
        for g, h in zip(ours, theirs):
            np.testing.assert_allclose(g.fetch(), np.asarray(h), rtol=1e-8, atol=1e-10)

    both(lambda m, x: m.sum(m.sin(m.linalg.cholesky(x)) * w), s)
    both(lambda m, x, y: m.sum(m.sin(m.linalg.solve(x, y))), a, b, argnums=(0, 1))
    both(lambda m, x: m.sum(m.cos(m.linalg.inv(x))), a)
    both(lambda m, x: m.sum(m.linalg.det(x) ** 2), a)
    both(lambda m, x: m.sum(m.linalg.slogdet(x)[1]), a)
    both(lambda m, x: m.sum(m.linalg.eigvalsh(x) * m.arange(4.0)), s)
    # Eigenvectors are unique up to sign: differentiate something that is not.
    both(lambda m, x: m.sum(m.linalg.eigh(x)[1] ** 2 * w), s)
    both(lambda m, x: m.linalg.norm(x, ord=2, axis=(-2, -1)).sum(), a)


def test_forward_mode_matches_jax(cluster):
    s, ds = spd(n=4), RNG.normal(size=(4, 4))
    ds = ds + ds.T
    for ours_f, theirs_f in (
        (tnp.linalg.cholesky, jnp.linalg.cholesky),
        (tnp.linalg.eigvalsh, jnp.linalg.eigvalsh),
        (tnp.linalg.det, jnp.linalg.det),
        (tnp.linalg.inv, jnp.linalg.inv),
    ):
        got = tessel.jit(lambda x, t: tessel.jvp(ours_f, (x,), (t,)))(s, ds)
        want = jax.jvp(theirs_f, (s,), (ds,))
        for g, h in zip(got, want):
            np.testing.assert_allclose(g.fetch(), np.asarray(h), rtol=1e-9, atol=1e-11)


def test_vmap_matches_a_loop(cluster):
    a, b = general(3, n=4), RNG.normal(size=(4, 2))
    got = tessel.jit(tessel.vmap(lambda x: tnp.linalg.solve(x, b)))(a).fetch()
    np.testing.assert_allclose(got, np.stack([np.linalg.solve(x, b) for x in a]), rtol=1e-10)
    s = spd(3, n=4)
    got = tessel.jit(tessel.vmap(lax.linalg.cholesky))(s).fetch()
    np.testing.assert_allclose(got, np.linalg.cholesky(s), rtol=1e-12)
    t = tessel.jit(tessel.vmap(lambda x, y: lax.linalg.triangular_solve(x, y, left_side=True, lower=True), (0, None)))
    got = t(a, b).fetch()
    np.testing.assert_allclose(got, np.stack([np.linalg.solve(np.tril(x), b) for x in a]), rtol=1e-10)


def test_a_batch_split_factorizes_without_communication(cluster):
    """A batch of matrices split over devices: each device factors its own;
    a split matrix is gathered first, and the plan says why."""
    mesh = tessel.Mesh({"data": 2})
    s = spd(4, n=6)
    f = tessel.jit(lambda x: lax.linalg.cholesky(x, symmetrize_input=False))
    arg = tessel.device_put(s, tessel.NamedSharding(mesh, tessel.P("data")))
    out = f(arg)
    np.testing.assert_allclose(out.fetch(), np.linalg.cholesky(s), rtol=1e-12)
    assert f.lower(arg).collectives == []
    assert out.sharding.spec[0] == "data"
    rows = tessel.device_put(s, tessel.NamedSharding(mesh, tessel.P(None, "data")))
    np.testing.assert_allclose(f(rows).fetch(), np.linalg.cholesky(s), rtol=1e-12)
    gathers = f.lower(rows).collectives
    assert [c["op"] for c in gathers] == ["all_gather"], gathers
    assert "needed whole" in gathers[0]["reason"], gathers
    # A left-side solve's columns are independent: they stay split.
    a = general(n=6)
    b = RNG.normal(size=(6, 4))
    g = tessel.jit(lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True, lower=True))
    args = (
        tessel.device_put(a, tessel.NamedSharding(mesh, tessel.P())),
        tessel.device_put(b, tessel.NamedSharding(mesh, tessel.P(None, "data"))),
    )
    np.testing.assert_allclose(g(*args).fetch(), np.linalg.solve(np.tril(a), b), rtol=1e-10)
    assert g.lower(*args).collectives == []


def test_bad_input_names_the_operand_and_shapes(cluster):
    with pytest.raises(ValueError, match=r"square matrix .*\[2, 3\]"):
        tnp.linalg.cholesky(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"b needs 3 rows .*\[4, 1\]"):
        lax.linalg.triangular_solve(np.eye(3), np.ones((4, 1)), left_side=True)
    with pytest.raises(TypeError, match="int32"):
        lax.linalg.cholesky(np.eye(3, dtype=np.int32))
    with pytest.raises(TypeError, match="float16"):
        tnp.linalg.inv(np.eye(3, dtype=np.float16))
    with pytest.raises(ValueError, match=r"b needs 3 rows"):
        tnp.linalg.solve(np.eye(3), np.ones(4))


@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (4, 4), (2, 6, 4)])
def test_qr_and_svd_match_jax(cluster, shape):
    x = RNG.normal(size=shape)
    m, n = shape[-2:]
    q, r = tnp.linalg.qr(x)
    jq, jr = jnp.linalg.qr(x)
    np.testing.assert_allclose(q.fetch(), np.asarray(jq), atol=1e-10)
    np.testing.assert_allclose(r.fetch(), np.asarray(jr), atol=1e-10)
    u, s, vh = tnp.linalg.svd(x, full_matrices=False)
    ns = np.linalg.svd(x, compute_uv=False)
    np.testing.assert_allclose(s.fetch(), ns, rtol=1e-12)
    np.testing.assert_allclose(tnp.linalg.svdvals(x).fetch(), ns, rtol=1e-12)
    uu, vv = u.fetch(), vh.fetch()
    np.testing.assert_allclose((uu * s.fetch()[..., None, :]) @ vv, x, atol=1e-12)
    k = min(m, n)
    eye = np.broadcast_to(np.eye(k), shape[:-2] + (k, k))
    np.testing.assert_allclose(np.swapaxes(uu, -1, -2) @ uu, eye, atol=1e-12)
    np.testing.assert_allclose(vv @ np.swapaxes(vv, -1, -2), eye, atol=1e-12)
    # Gradients against JAX's, through functions of the factors that do not
    # depend on the singular vectors' signs.
    c = RNG.normal(size=k)
    w = RNG.normal(size=shape)

    def f_svd(lib, a):
        u, s, vh = lib.linalg.svd(a, full_matrices=False)
        return lib.sum(lib.sin((u * (s * c)[..., None, :]) @ vh) * w) + lib.sum(s**2 * c)

    def f_qr(lib, a):
        q, r = lib.linalg.qr(a)
        return lib.sum(lib.sin(q @ r) * w) + lib.sum(lib.abs(r) * 0.5) + lib.sum((q * q) @ c[: q.shape[-1]])

    fns = [f_svd] + ([f_qr] if m >= n else [])
    for f in fns:
        got = tessel.jit(tessel.grad(lambda a: f(tnp, a)))(x).fetch()
        want = np.asarray(jax.grad(lambda a: f(jnp, a))(x))
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10, err_msg=f.__name__)


def test_svd_forward_mode_and_vmap_match_jax(cluster):
    x, dx = RNG.normal(size=(5, 3)), RNG.normal(size=(5, 3))
    got = tessel.jit(lambda a, t: tessel.jvp(tnp.linalg.svdvals, (a,), (t,)))(x, dx)
    want = jax.jvp(lambda a: jnp.linalg.svd(a, compute_uv=False), (x,), (dx,))
    for g, h in zip(got, want):
        np.testing.assert_allclose(g.fetch(), np.asarray(h), rtol=1e-10)
    xs = RNG.normal(size=(3, 4, 6))
    got = tessel.jit(tessel.vmap(tnp.linalg.svdvals))(xs).fetch()
    np.testing.assert_allclose(got, np.linalg.svd(xs, compute_uv=False), rtol=1e-12)


def test_complete_factors_of_non_square_matrices_are_refused_by_name(cluster):
    with pytest.raises(NotImplementedError, match=r"full_matrices=True of a 5x3 matrix"):
        tnp.linalg.svd(np.ones((5, 3)))
    with pytest.raises(NotImplementedError, match=r"full_matrices=True of a 5x3 matrix"):
        tnp.linalg.qr(np.ones((5, 3)), mode="complete")
    with pytest.raises(Exception, match=r"wide matrix \(3x5"):
        tessel.jit(tessel.grad(lambda a: tnp.sum(tnp.linalg.qr(a)[1])))(np.ones((3, 5)))


def test_norms_of_empty_matrices_are_numpys(cluster):
    for shape in ((1, 0), (0, 3), (2, 0, 4)):
        x = np.zeros(shape)
        for ord in (None, "fro", 1, np.inf, 2, "nuc"):
            got = tnp.linalg.norm(x, ord=ord, axis=(-2, -1)).fetch()
            np.testing.assert_array_equal(got, np.linalg.norm(x, ord=ord, axis=(-2, -1)))


def test_signatures_are_jaxs():
    """Parameter names, kinds and defaults as jax.numpy.linalg's and
    jax.lax.linalg's (annotations aside)."""
    import inspect

    def params(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    for name in ("cholesky", "solve", "inv", "det", "slogdet", "eigh", "eigvalsh", "qr", "svd", "norm"):
        assert params(getattr(tnp.linalg, name)) == params(getattr(jnp.linalg, name)), name
    for name in ("cholesky", "triangular_solve", "lu", "eigh", "qr", "svd"):
        assert params(getattr(lax.linalg, name)) == params(getattr(jax.lax.linalg, name)), name
