"""tessel.jax: functions written against jax run on the cluster unchanged,
their StableHLO read through jaxlib's MLIR bindings; each result against
the same function under jax.jit on CPU."""

import pathlib
import subprocess
import sys
import typing

import ml_dtypes
import numpy as np
import pytest

import tessel

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy
tjax = pytest.importorskip("tessel.jax")

RNG = np.random.default_rng(23)


def check(fun, *args, rtol=1e-12, **jit_kwargs):
    ours = tjax.jit(fun, **jit_kwargs)(*args)
    theirs = jax.jit(fun, **jit_kwargs)(*args)
    ours_leaves, ours_tree = jax.tree_util.tree_flatten(ours)
    theirs_leaves, theirs_tree = jax.tree_util.tree_flatten(theirs)
    assert ours_tree == theirs_tree
    for o, t in zip(ours_leaves, theirs_leaves):
        assert isinstance(o, tessel.Array)
        o = o.fetch()
        assert o.dtype == np.asarray(t).dtype and o.shape == np.asarray(t).shape
        np.testing.assert_allclose(o, np.asarray(t), rtol=rtol, atol=1e-12)
    return ours


def classifier_step(model, tx, optax):
    """A Flax classifier's training step with Optax optimizer `tx`: integer
    labels, softmax cross-entropy; (params, opt, x, y) -> (params, opt, loss)."""

    def step(params, opt, x, y):
        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

        value, g = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, value

    return step


def test_jax_numpy_and_nn_functions(cluster):
    x, w = RNG.normal(size=(4, 3)), RNG.normal(size=(3, 5))

    def f(x, w):
        y = jnp.tanh(x @ w + 1.0)
        return {
            "softmax": jax.nn.softmax(y, axis=-1),
            "gelu": jax.nn.gelu(y),
            "logsumexp": jax.nn.logsumexp(y, axis=0),
            "max": jnp.max(y),
            "stats": (y.mean(axis=1), y.var(), jnp.argmax(y, axis=1)),
            "where": jnp.where(y > 0, y, 0.1 * y),
            "slices": (y[1:3, ::2], y.T, jnp.concatenate([y, y], axis=0), jnp.pad(y, ((1, 0), (0, 2)))),
            "ints": (jnp.arange(5) * 3 // 2, jnp.arange(6).reshape(2, 3) % 4, (y > 0).astype(jnp.int32).sum()),
        }

    check(f, x, w)


class State(typing.NamedTuple):
    w: object
    b: object
    step: object


def test_a_training_step_with_value_and_grad_donation_and_a_named_tuple(cluster):
    x, t = RNG.normal(size=(16, 4)), RNG.normal(size=(16, 2))
    state = State(RNG.normal(size=(4, 2)), np.zeros(2), np.int32(0))

    def loss(w, b, x, t):
        return jnp.mean((jnp.tanh(x @ w + b) - t) ** 2)

    def step(state, x, t):
        value, (gw, gb) = jax.value_and_grad(loss, argnums=(0, 1))(state.w, state.b, x, t)
        return State(state.w - 0.1 * gw, state.b - 0.1 * gb, state.step + 1), value

    ours = check(step, state, x, t)
    assert type(ours[0]) is State
    # donated: the state's arrays go into the next step's
    run = tjax.jit(step, donate_argnums=0)
    s = State(*[tessel.device_put(np.asarray(v)) for v in state])
    for _ in range(3):
        s, value = run(s, x, t)
    theirs = state
    for _ in range(3):
        theirs, j_value = jax.jit(step)(theirs, x, t)
    np.testing.assert_allclose(s.w.fetch(), np.asarray(theirs.w), rtol=1e-12)
    assert int(s.step.fetch()) == 3


def test_loops_and_conditionals(cluster):
    x = RNG.normal(size=(5,))

    def f(x, n):
        def body(i, c):
            return c * 0.9 + jnp.sin(c) * i

        y = jax.lax.fori_loop(0, n, body, x)
        z, ys = jax.lax.scan(lambda c, v: (c + v, c * v), 0.0, y)
        w = jax.lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 1, c[1] * 1.01), (0, z))
        k = jax.lax.cond(z > 0, lambda: y * 2, lambda: y - 1)
        return y, ys, w, k, jax.lax.switch(2, [lambda v: v, lambda v: -v, lambda v: v * v], y)

    check(f, x, 4, static_argnums=1)
    check(f, -x, 7, static_argnums=1)


def test_a_convolution_and_a_pooling_window(cluster):
    x, k = RNG.normal(size=(2, 8, 8, 3)), RNG.normal(size=(3, 3, 3, 4))

    def f(x, k):
        y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    check(f, x, k)


def test_jax_linalg_runs_through_the_lapack_calls_jax_lowers(cluster):
    """On the CPU jax lowers jnp.linalg to LAPACK calls (custom_calls with
    column-major layouts); each runs as the IR's factorization. Factors
    unique only up to sign are compared through what they reconstruct."""
    a, t = RNG.normal(size=(5, 5)) + 2 * np.eye(5), RNG.normal(size=(6, 4))
    spd, b = a @ a.T + 5 * np.eye(5), RNG.normal(size=(5, 2))

    def f(a, spd, b, t):
        w, v = jnp.linalg.eigh(spd)
        u, s, vh = jnp.linalg.svd(t, full_matrices=False)
        q, r = jnp.linalg.qr(t)
        return {
            "solve": jnp.linalg.solve(a, b),
            "inv": jnp.linalg.inv(a),
            "det": (jnp.linalg.det(a), jnp.linalg.slogdet(a)),
            "cholesky": jnp.linalg.cholesky(spd),
            "triangular": jax.scipy.linalg.solve_triangular(a, b, lower=True, trans="T"),
            "eigh": (w, (v * w) @ v.T),
            "svd": (s, (u * s) @ vh, jnp.linalg.norm(t, 2)),
            "qr": (jnp.abs(r), q @ r),
        }

    check(f, a, spd, b, t, rtol=1e-9)
    # JAX differentiates; the cluster runs the LAPACK calls of the gradient.
    check(jax.grad(lambda a, spd: jnp.linalg.slogdet(a)[1] + jnp.sum(jnp.linalg.cholesky(spd))), a, spd, rtol=1e-9)


def test_sorts_with_a_comparator_on_the_keys(cluster):
    x = np.array([[3.0, np.nan, -1.0, 3.0, 0.5], [2.0, 2.0, -0.0, 7.0, 1.0]])
    y = RNG.normal(size=(2, 5))

    def f(x, y):
        return (
            jnp.argsort(x, axis=1),
            jnp.sort(x, axis=0),
            jnp.argsort(x, axis=1, descending=True),
            jax.lax.sort_key_val(x, y, dimension=1),
        )

    check(f, x, y)


def test_max_pool_gradients_run_through_select_and_scatter(cluster):
    """JAX's gradient of a max (or min) pool is select_and_scatter; ties go
    to the window's first maximum, as XLA's."""
    import flax.linen as fnn

    x = RNG.normal(size=(2, 7, 6, 3))
    ties = np.round(RNG.normal(size=(2, 7, 6, 3)))  # many equal maxima
    w = RNG.normal(size=(2, 4, 3, 3))

    def loss(x):
        same = fnn.max_pool(x, (3, 2), strides=(2, 2), padding="SAME")
        valid = -fnn.max_pool(-x, (2, 2), strides=(1, 2))  # a min pool
        return jnp.sum(same * w) + jnp.sum(valid**2)

    for arg in (x, ties):
        check(jax.grad(loss), arg)


def _float_edges(d):
    info = ml_dtypes.finfo(d)
    v = [0.0, -0.0, np.inf, -np.inf, np.nan, float(info.smallest_subnormal), float(info.tiny), float(info.max)]
    v += [-float(info.max), 1.0, -1.5, 65504.0, 65520.0, 3.0e38, 1e-8, 6.1e-5, 1 + 2.0**-8, 1 + 3 * 2.0**-9]
    return np.concatenate([np.array(v).astype(d), RNG.normal(size=64).astype(d) * d.type(100)])


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_bits_reading_ops_run_through_bitcasts_as_jax_computes_them(cluster, dtype):
    """jnp.signbit, copysign and nextafter, jax.lax.bitcast_convert_type
    and reduce_precision (to bf16's, f16's and a smaller format), as JAX
    lowers them (bitcast_convert, shifts, reduce_precision), bit for bit
    against jax.jit."""
    d = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = _float_edges(d)
    y = np.roll(x, 3)
    u = f"u{d.itemsize}"

    def f(x, y):
        out = {
            "signbit": jnp.signbit(x),
            "copysign": jnp.copysign(x, y),
            "nextafter": jnp.nextafter(x, y),
            "bits": jax.lax.bitcast_convert_type(x, jnp.dtype(u)),
            "bytes": jax.lax.bitcast_convert_type(x, jnp.uint8),
            "rp_small": jax.lax.reduce_precision(x, 3, 2),
        }
        if d.itemsize >= 4:
            out["rp_bf16"] = jax.lax.reduce_precision(x, 8, 7)
            out["rp_f16"] = jax.lax.reduce_precision(x, 5, 10)
        return out

    ours = tjax.jit(f)(x, y)
    theirs = jax.jit(f)(x, y)
    for k in theirs:
        o, t = ours[k].fetch(), np.asarray(theirs[k])
        assert o.dtype == t.dtype and o.shape == t.shape, k
        if o.dtype == d:
            nan = np.isnan(t.astype(np.float64))
            np.testing.assert_array_equal(np.isnan(o.astype(np.float64)), nan, err_msg=k)
            o, t = o[~nan].view(u), t[~nan].view(u)
        np.testing.assert_array_equal(o, t, err_msg=k)


def test_an_op_without_a_counterpart_is_an_error_naming_it(cluster):
    with pytest.raises(tessel.InvalidArgumentError, match="element type complex<f64> has no Tessel dtype"):
        tjax.jit(lambda x: jnp.fft.fft(x).real)(np.ones(8))


def test_a_signature_lowers_once_and_the_contracts_hold(cluster):
    """The second call of a signature lowers and compiles nothing
    (forbid_compiles passes); a host value inside is a counted transfer."""
    step = tjax.jit(lambda w, x: jnp.tanh(x @ w).sum(axis=0))
    w, x = tessel.device_put(RNG.normal(size=(3, 2))), tessel.device_put(RNG.normal(size=(4, 3)))
    first = step(w, x).fetch()
    with tessel.forbid_compiles():
        again = step(w, x).fetch()
    np.testing.assert_array_equal(first, again)
    with tessel.transfer_guard("disallow"):
        step(w, x)  # device arrays in, a device array out: no transfer


def test_gathers_and_scatters_as_jax_indexing_lowers_them(cluster):
    """Indexing with arrays, take_along_axis (a gather with batching
    dimensions), an embedding lookup, and .at[] updates with repeated and
    out-of-range indices (a gather clamps them, a scatter drops them)."""
    x = RNG.normal(size=(5, 4))
    table = RNG.normal(size=(10, 3))
    idx = np.array([4, 0, 4, 9, -7], np.int32)  # repeated, and out of range both ways
    labels = np.array([3, 0, 1, 1, 2], np.int32)
    ids = np.array([[1, 2], [9, 0]], np.int32)

    def f(x, table, idx, labels, ids):
        logp = jax.nn.log_softmax(x, axis=-1)
        return {
            "rows": x[idx[:3]],
            "clamped": jnp.take(x, idx, axis=0, mode="clip"),
            "xent": -jnp.take_along_axis(logp, labels[:, None], axis=1).mean(),
            "embed": table[ids],
            "add": x.at[idx].add(1.0),
            "set": x.at[idx[:2]].set(-1.0),
            "max": x.at[:, labels[:3]].max(0.5),
            "cols": x[:, labels],
        }

    check(f, x, table, idx, labels, ids)


def test_gathers_and_scatters_of_windows(cluster):
    """Dimension numbers beyond points: windows along indexed dims (slice
    updates, dynamic slices under vmap, LU's row swaps), windows at the
    origin of dims nothing indexes, a window that does not fit (a gather
    clamps its start, a scatter drops it whole), and a scatter that
    indexes no dimension at all."""
    x = RNG.normal(size=(5, 6, 7))
    starts = np.array([0, 1, 4, 5, -2], np.int64)

    def f(x, starts):
        return {
            "slice_set": x.at[1:4].set(1.0),
            "slice_add": x.at[1:3, 2:5].add(x[:2, :3]),
            "strided_mul": x.at[2:, ::2].multiply(2.0),
            "vmap_slice": jax.vmap(lambda r, k: jax.lax.dynamic_slice(r, (k, 0), (2, 3)))(x, starts),
            "vmap_update": jax.vmap(lambda r, k: jax.lax.dynamic_update_slice(r, jnp.ones((2, 3)), (k, 1)))(x, starts),
            "mixed": x.at[jnp.array([0, 4, 2]), 1:3, jnp.array([1, 1, 6])].max(0.5),
            "whole": x[:1, 0, 0].at[0:1].set(x[1, 1, :1]),
            "slogdet": jnp.linalg.slogdet(x[:, :5, :5])[1],
        }

    check(f, x, starts, rtol=1e-10)


def test_the_gradient_of_a_cross_entropy_runs_through_gather_and_scatter(cluster):
    x, w = RNG.normal(size=(6, 4)), RNG.normal(size=(4, 5))
    labels = np.array([0, 4, 2, 2, 1, 3], np.int32)

    def loss(w, x, labels):
        logp = jax.nn.log_softmax(x @ w, axis=-1)
        return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()

    check(jax.grad(loss), w, x, labels)


def test_a_flax_model_trained_with_optax_runs_unchanged(cluster):
    """A Flax linen MLP (Dense, relu, LayerNorm) and an Optax AdamW step
    with integer-label cross-entropy: three steps, losses and every
    parameter and optimizer leaf against jax.jit's."""
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(16)(x))
            x = nn.LayerNorm()(x)
            return nn.Dense(3)(x)

    model, tx = MLP(), optax.adamw(1e-2)
    x, y = RNG.normal(size=(8, 5)), np.array([0, 1, 2, 0, 1, 2, 0, 1], np.int32)
    params = model.init(jax.random.PRNGKey(0), x)
    opt = tx.init(params)

    step = classifier_step(model, tx, optax)

    ours, theirs = (params, opt), (params, opt)
    run = tjax.jit(step, donate_argnums=(0, 1))
    for _ in range(3):
        *ours, ours_loss = run(*ours, x, y)
        *theirs, theirs_loss = jax.jit(step)(*theirs, x, y)
        # Flax keeps float32 parameters, and Adam divides by the root of
        # small second moments: sums in another order differ in the last
        # bits, and the next step shows it.
        np.testing.assert_allclose(ours_loss.fetch(), np.asarray(theirs_loss), rtol=1e-5)
    ours_leaves, ours_tree = jax.tree_util.tree_flatten(ours)
    theirs_leaves, theirs_tree = jax.tree_util.tree_flatten(theirs)
    assert ours_tree == theirs_tree
    for o, t in zip(ours_leaves, theirs_leaves):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=1e-5, atol=1e-7)


def test_an_exported_program_runs_from_its_file_without_its_source(cluster, tmp_path):
    """jax.export's serialized program, loaded from a file: the same
    results as JAX calling it, in the exported output structure; arguments
    of another shape are refused naming the leaf."""
    pytest.importorskip("flatbuffers")
    from jax import export

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return {"w": w - 0.1 * g, "loss": loss}

    w, x = RNG.normal(size=(4, 2)), RNG.normal(size=(8, 4))
    exported = export.export(jax.jit(step))(w, x)
    path = tmp_path / "step.jax"
    path.write_bytes(exported.serialize())
    run = tjax.load(str(path))
    ours = run(tessel.device_put(w), x)
    theirs = exported.call(w, x)
    assert sorted(ours) == ["loss", "w"]
    for k in ours:
        np.testing.assert_allclose(ours[k].fetch(), np.asarray(theirs[k]), rtol=1e-12)
    with pytest.raises(TypeError, match=r"argument leaf 1 is float64\[8, 3\]; it was exported for float64\[8, 4\]"):
        run(w, np.ones((8, 3)))


def test_an_exported_program_donates_what_it_was_exported_donating(cluster):
    """An Exported of a jax.jit with donate_argnums keeps the donation
    (tf.aliasing_output on @main's parameter): loaded, that argument's
    buffer is reused and the array is gone; an argument the function never
    reads (dropped from the module by JAX) is skipped, not shifted onto
    the next parameter."""
    pytest.importorskip("flatbuffers")
    from jax import export

    def step(state, unused, x):
        return state + x, jnp.sum(x)

    avals = [jax.ShapeDtypeStruct((4,), jnp.float64)] * 3
    exported = export.export(jax.jit(step, donate_argnums=0))(*avals)
    assert list(exported.module_kept_var_idx) == [0, 2]
    run = tjax.load(exported.serialize())
    s, x = tessel.device_put(np.arange(4.0)), np.full(4, 2.0)
    new, total = run(s, np.zeros(4), x)
    np.testing.assert_array_equal(new.fetch(), np.arange(4.0) + 2)
    assert float(total.fetch()) == 8.0
    receipts = run.donation_receipts()
    assert [r["reused"] for r in receipts] == [True] and receipts[0]["output"] == 0, receipts
    assert s.is_deleted()
    # Exported without donation: nothing is donated unless asked for.
    plain = tjax.load(export.export(jax.jit(step))(*avals).serialize())
    s = tessel.device_put(np.arange(4.0))
    plain(s, np.zeros(4), x)
    receipts = plain.donation_receipts()
    assert not s.is_deleted() and [(r["donated"], r["output"]) for r in receipts] == [(False, 0)], receipts
    asked = tjax.load(export.export(jax.jit(step))(*avals).serialize(), donate_argnums=0)
    asked(s, np.zeros(4), x)
    assert s.is_deleted()


def test_donate_argnames_donates_by_name_however_the_argument_is_passed(cluster):
    """jax.jit's donate_argnames: the named argument is donated whether it
    is passed by keyword or by position (and donate_argnums by keyword),
    each leaf of it; a name that is no parameter is an error naming it."""

    def step(params, x):
        return jax.tree_util.tree_map(lambda p: p - 0.5 * x, params)

    def fresh():
        return {"a": tessel.device_put(np.ones(3)), "b": tessel.device_put(np.full(3, 2.0))}

    for jitted, call in [
        (tjax.jit(step, donate_argnames="params"), lambda f, p: f(params=p, x=np.ones(3))),
        (tjax.jit(step, donate_argnames="params"), lambda f, p: f(p, np.ones(3))),
        (tjax.jit(step, donate_argnums=0), lambda f, p: f(params=p, x=np.ones(3))),
    ]:
        p = fresh()
        out = call(jitted, p)
        np.testing.assert_array_equal(out["a"].fetch(), np.full(3, 0.5))
        np.testing.assert_array_equal(out["b"].fetch(), np.full(3, 1.5))
        assert p["a"].is_deleted() and p["b"].is_deleted()
        assert all(r["reused"] for r in jitted.donation_receipts())
    p = fresh()
    tjax.jit(step, donate_argnames="x")(p, np.ones(3))
    assert not p["a"].is_deleted()
    with pytest.raises(ValueError, match="donate_argnames names 'state', which is not a parameter"):
        tjax.jit(step, donate_argnames="state")


def test_jax_random_inside_the_function_draws_jaxs_numbers(cluster):
    """Threefry's unsigned shifts, the bits of a uniform decoded as a float
    (bitcast_convert), and erf_inv for normals (Giles' polynomial, as XLA
    evaluates it for float32; refined by Newton steps for float64): the
    same draws as JAX's from the same key."""

    def f(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return {
            "normal64": jax.random.normal(k1, (6,)),
            "normal32": jax.random.normal(k1, (6,), dtype=jnp.float32),
            "uniform": jax.random.uniform(k2, (2, 3), minval=-1.0, maxval=3.0),
            "bernoulli": jax.random.bernoulli(k3, 0.3, (8,)),
            "randint": jax.random.randint(k3, (5,), 0, 10),
            "dropout": jnp.where(jax.random.bernoulli(k2, 0.9, (4,)), jnp.arange(4.0) / 0.9, 0.0),
        }

    key = np.asarray(jax.random.PRNGKey(7))
    ours = tjax.jit(f)(key)
    theirs = jax.jit(f)(key)
    for name in theirs:
        rtol = 2e-6 if np.asarray(theirs[name]).dtype == np.float32 else 1e-12
        np.testing.assert_allclose(ours[name].fetch(), np.asarray(theirs[name]), rtol=rtol, err_msg=name)


def test_in_and_out_shardings_as_pytree_prefixes(cluster):
    """A dict of parameters sharded leaf by leaf (the JAX idiom for model
    parallelism), a batch sharded by rows, and the output laid out as
    asked: Tessel's partitioner plans the program around them."""
    mesh = tessel.Mesh({"data": 2})
    P, S = tessel.P, tessel.NamedSharding
    params = {"w": RNG.normal(size=(4, 6)), "b": RNG.normal(size=(6,))}
    x = RNG.normal(size=(8, 4))

    def f(params, x):
        return jnp.tanh(x @ params["w"] + params["b"])

    run = tjax.jit(
        f,
        in_shardings=({"w": S(mesh, P(None, "data")), "b": S(mesh, P("data"))}, S(mesh, P("data"))),
        out_shardings=S(mesh, P("data", None)),
    )
    out = run(params, x)
    np.testing.assert_allclose(out.fetch(), np.asarray(jax.jit(f)(params, x)), rtol=1e-12)
    assert out.sharding.spec == P("data", None)
    with pytest.raises(ValueError, match="in_shardings does not match the structure it shards"):
        tjax.jit(f, in_shardings=({"w": None, "c": None}, None))(params, x)


def test_jax_meshes_and_sharding_constraints_map_onto_the_tessel_mesh(cluster):
    """A training step written for a JAX 2x2 mesh (data x model), with
    JAX's NamedSharding and PartitionSpec: in_shardings in JAX's terms, a
    with_sharding_constraint on JAX's mesh and one with a bare
    PartitionSpec. On the cluster they name the Tessel mesh of the same
    axes: the loss and gradients equal JAX's run on four host devices, and
    the constrained activations come back laid out as constrained."""
    JS, JP = jax.sharding.NamedSharding, jax.sharding.PartitionSpec
    jmesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = {"w1": RNG.normal(size=(4, 8)), "w2": RNG.normal(size=(8, 3))}
    x, y = RNG.normal(size=(8, 4)), RNG.normal(size=(8, 3))

    def step(params, x, y):
        def loss(params):
            h = jax.lax.with_sharding_constraint(jnp.tanh(x @ params["w1"]), JS(jmesh, JP("data", "model")))
            out = jax.lax.with_sharding_constraint(h @ params["w2"], JP("data"))
            return jnp.mean((out - y) ** 2), h

        (value, h), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, grads, h

    shardings = ({"w1": JS(jmesh, JP(None, "model")), "w2": JS(jmesh, JP("model"))}, JS(jmesh, JP("data")), None)
    with jax.set_mesh(jmesh):  # the bare PartitionSpec's mesh, for JAX's own run
        theirs = jax.jit(step, in_shardings=shardings)(params, x, y)
    tmesh = tessel.Mesh({"data": 2, "model": 2})
    ours = tjax.jit(step, in_shardings=shardings)(
        params, x, tessel.device_put(y, tessel.NamedSharding(tmesh, tessel.P()))
    )
    for o, t in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=1e-12, atol=1e-12)
    assert ours[2].sharding == tessel.NamedSharding(tmesh, tessel.P("data", "model"))
    # A constraint on a JAX mesh of other axes than the arguments' is an error naming both.
    other = jax.make_mesh((4,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match="incompatible placements.*batch"):
        tjax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, JS(other, JP("batch"))))(
            tessel.device_put(x, tessel.NamedSharding(tmesh, tessel.P("data")))
        )


def test_shard_map_and_its_collectives_run_as_a_tessel_manual_region(cluster):
    """jax.shard_map (sdy.manual_computation) becomes a Tessel shard_map on
    the mesh of the same axes, and its collectives, whose groups StableHLO
    names by device ids, Tessel's over the axes those groups span: psum,
    pmax over two axes, all_gather (over one axis, and over two in the
    order other than the mesh's), ppermute, psum_scatter, all_to_all and
    axis_index. A gradient through a shard_map (JAX's transposed body) runs
    too. A shard_map manual over some of the mesh's axes is an error naming
    them."""
    JP = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def body(x, w):
        s = jax.lax.psum(x @ w, "model")
        g = jax.lax.all_gather(s, "data", axis=0, tiled=True)
        g2 = jax.lax.all_gather(s, ("model", "data"), axis=1, tiled=True)
        p = jax.lax.ppermute(s, "data", [(0, 1), (1, 0)])
        m = jax.lax.pmax(s, ("data", "model"))
        rs = jax.lax.psum_scatter(x, "model", scatter_dimension=0, tiled=True)
        a = jax.lax.all_to_all(x, "data", 0, 1, tiled=True)
        return s + p + m, g, g2, rs * jax.lax.axis_index("model"), a

    specs = (JP("data"), JP("data"), JP("data", "model"), JP("data", "model"), JP("data", "model"))
    f = jax.shard_map(body, mesh=mesh, in_specs=(JP("data", "model"), JP("model", None)), out_specs=specs)
    x, w = RNG.normal(size=(8, 4)), RNG.normal(size=(4, 6))
    check(f, x, w)

    def loss(w, x):
        local = lambda x, w: jax.lax.psum(jnp.sum(jnp.tanh(x @ w) ** 2), ("data", "model"))  # noqa: E731
        return jax.shard_map(local, mesh=mesh, in_specs=(JP("data", "model"), JP("model", None)), out_specs=JP())(x, w)

    check(jax.value_and_grad(loss), w, x, rtol=1e-10)
    partial = jax.shard_map(
        lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=JP("data"), out_specs=JP(), axis_names={"data"}
    )
    with pytest.raises(tessel.errors.InvalidArgumentError, match=r"manual over \['data'\] of the mesh's axes"):
        tjax.jit(partial)(x)


def test_a_flax_model_trains_on_a_2x2_mesh_given_in_jaxs_own_shardings(cluster):
    """The Flax MLP and Optax AdamW step as a JAX user shards them: a 2x2
    mesh (data x model) built with jax.make_mesh, the batch split over
    data, the Dense kernels over model (in_shardings as JAX NamedShardings,
    a pytree prefix of the parameters), and the hidden activation
    constrained inside the module. Three steps with donation; losses and
    every leaf against jax.jit's run of the same shardings on four host
    devices, and the parameters come back laid out as asked."""
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    JS, JP = jax.sharding.NamedSharding, jax.sharding.PartitionSpec
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jax.lax.with_sharding_constraint(nn.relu(nn.Dense(16)(x)), JS(mesh, JP("data", "model")))
            return nn.Dense(3)(nn.LayerNorm()(h))

    model, tx = MLP(), optax.adamw(1e-2)
    x, y = RNG.normal(size=(8, 5)), np.array([0, 1, 2, 0, 1, 2, 0, 1], np.int32)
    params = model.init(jax.random.PRNGKey(0), x)
    opt = tx.init(params)

    def layout(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        if "Dense_0" in names and names[-1] == "kernel":
            return JS(mesh, JP(None, "model"))
        if "Dense_1" in names and names[-1] == "kernel":
            return JS(mesh, JP("model", None))
        return JS(mesh, JP())

    param_shardings = jax.tree_util.tree_map_with_path(layout, params)
    shardings = (param_shardings, None, JS(mesh, JP("data")), JS(mesh, JP("data")))

    step = classifier_step(model, tx, optax)

    run = tjax.jit(step, in_shardings=shardings, out_shardings=(param_shardings, None, None), donate_argnums=(0, 1))
    theirs_run = jax.jit(step, in_shardings=shardings, out_shardings=(param_shardings, None, None))
    ours, theirs = (params, opt), (params, opt)
    for _ in range(3):
        *ours, ours_loss = run(*ours, x, y)
        *theirs, theirs_loss = theirs_run(*theirs, x, y)
        np.testing.assert_allclose(ours_loss.fetch(), np.asarray(theirs_loss), rtol=1e-5)
    for o, t in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=1e-5, atol=1e-7)
    kernel = ours[0]["params"]["Dense_0"]["kernel"]
    assert kernel.sharding == tessel.NamedSharding(tessel.Mesh({"data": 2, "model": 2}), tessel.P(None, "model"))


def test_a_cross_entropy_over_a_split_batch_gathers_where_the_rows_lie(cluster):
    """JAX lowers take_along_axis (and the cross-entropy built on it) to a
    gather with batching dims, and its gradient to a scatter with them:
    each is one Tessel GATHER or SCATTER with batch dims, so with the batch
    split over data neither moves a byte; only the mean's sum is a
    collective. Values and gradients against jax.jit's."""
    optax = pytest.importorskip("optax")
    mesh = tessel.Mesh({"data": 4})
    logits = RNG.normal(size=(8, 16, 32)).astype(np.float32)
    labels = RNG.integers(0, 32, size=(8, 16)).astype(np.int32)

    def loss(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    split = tessel.NamedSharding(mesh, tessel.P("data"))
    run = tjax.jit(jax.value_and_grad(loss))
    args = (tessel.device_put(logits, split), tessel.device_put(labels, split))
    assert [(c["op"], c["axes"]) for c in run.lower(*args).collectives] == [("all_reduce", ("data",))]
    value, grad = run(*args)
    want_value, want_grad = jax.jit(jax.value_and_grad(loss))(logits, labels)
    np.testing.assert_allclose(value.fetch(), np.asarray(want_value), rtol=1e-6)
    np.testing.assert_allclose(grad.fetch(), np.asarray(want_grad), rtol=1e-5, atol=1e-8)


def test_a_composite_runs_its_decomposition(cluster):
    """jax.lax.composite lowers to stablehlo.composite naming a function:
    Tessel has no kernel by that name, so the decomposition runs."""
    x = RNG.normal(size=(4, 5))
    check(jax.lax.composite(lambda v, scale=3.0: jnp.tanh(v) * scale + v, name="tessel.test.scaled_tanh"), x)


@pytest.mark.parametrize("left_side", [True, False])
@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_linalg_exported_for_a_platform_without_lapack_calls_runs_as_stablehlo(
    cluster, tmp_path, left_side, lower, transpose_a
):
    """Exported for TPU, jax.lax.linalg's cholesky and triangular_solve are
    stablehlo.cholesky and stablehlo.triangular_solve (not LAPACK calls):
    the file runs on the cluster, against JAX's CPU run of the same
    function."""

    def f(a, b):
        eye = jnp.eye(4, dtype=a.dtype)
        chol = jax.lax.linalg.cholesky(a @ a.T + 4 * eye)
        tri = (jnp.tril(a) if lower else jnp.triu(a)) + 4 * eye
        x = jax.lax.linalg.triangular_solve(tri, b, left_side=left_side, lower=lower, transpose_a=transpose_a)
        return chol, x

    a, b = RNG.normal(size=(4, 4)).astype(np.float32), RNG.normal(size=(4, 4)).astype(np.float32)
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(a, b)
    text = exported.mlir_module()
    assert "stablehlo.cholesky" in text and "stablehlo.triangular_solve" in text
    path = tmp_path / "linalg.bin"
    path.write_bytes(exported.serialize())
    ours = tjax.load(str(path))(a, b)
    for o, t in zip(ours, jax.jit(f)(a, b)):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=2e-5, atol=2e-6)


# StableHLO that JAX itself no longer emits (older exports, other front
# ends): the legacy broadcast and dot, `if`, and the upper Cholesky factor.
_LEGACY_MODULE = """
func.func @main(%x: tensor<3x4xf64>, %w: tensor<4x2xf64>, %p: tensor<i1>, %s: tensor<3x3xf64>)
    -> (tensor<2x3x4xf64>, tensor<3x2xf64>, tensor<3x4xf64>, tensor<3x3xf64>) {
  %b = "stablehlo.broadcast"(%x) <{broadcast_sizes = array<i64: 2>}> : (tensor<3x4xf64>) -> tensor<2x3x4xf64>
  %d = "stablehlo.dot"(%x, %w) : (tensor<3x4xf64>, tensor<4x2xf64>) -> tensor<3x2xf64>
  %c = "stablehlo.if"(%p) ({
    %t = stablehlo.multiply %x, %x : tensor<3x4xf64>
    stablehlo.return %t : tensor<3x4xf64>
  }, {
    %f = stablehlo.negate %x : tensor<3x4xf64>
    stablehlo.return %f : tensor<3x4xf64>
  }) : (tensor<i1>) -> tensor<3x4xf64>
  %u = stablehlo.cholesky %s, lower = false : tensor<3x3xf64>
  return %b, %d, %c, %u : tensor<2x3x4xf64>, tensor<3x2xf64>, tensor<3x4xf64>, tensor<3x3xf64>
}
"""


def test_legacy_stablehlo_forms_run_against_numpy(cluster):
    from jax._src.interpreters import mlir as jax_mlir
    from jaxlib.mlir import ir

    context = jax_mlir.make_ir_context()
    with context:
        module = ir.Module.parse(_LEGACY_MODULE)
    run, n = tjax._program(module, "legacy", (), context)
    assert n == 4
    x, w = RNG.normal(size=(3, 4)), RNG.normal(size=(4, 2))
    m = RNG.normal(size=(3, 3))
    s = m @ m.T + 3 * np.eye(3)
    for p in (True, False):
        b, d, c, u = (o.fetch() for o in run(x, w, np.array(p), s))
        np.testing.assert_array_equal(b, np.broadcast_to(x, (2, 3, 4)))
        np.testing.assert_allclose(d, x @ w, rtol=1e-13)
        np.testing.assert_array_equal(c, x * x if p else -x)
        # The upper factor: U^T U = s, U upper triangular (numpy's lower factor, transposed).
        np.testing.assert_allclose(np.triu(u), np.linalg.cholesky(s).T, rtol=1e-12, atol=1e-13)


def test_the_coverage_page_is_what_the_importer_reads(cluster):
    """docs/stablehlo.md lists every op of jaxlib's StableHLO dialect with
    the importer's status for it, as scripts/stablehlo_coverage.py reads
    the importer now; an op it lists as not yet imported is refused by name."""
    root = pathlib.Path(__file__).resolve().parents[3]
    r = subprocess.run(
        [sys.executable, str(root / "scripts" / "stablehlo_coverage.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    page = (root / "docs" / "stablehlo.md").read_text()
    assert "| `stablehlo.rng` | not yet |" in page and "| `stablehlo.rng_bit_generator` | imported |" in page
    with pytest.raises(tessel.InvalidArgumentError, match=r"stablehlo\.rng .*no Tessel counterpart"):
        tjax.jit(lambda lo: jax.lax.rng_uniform(lo, lo + 1.0, (4,)))(np.float32(0))
    tessel.device_put(np.ones(2)).fetch()  # the cluster keeps serving


@pytest.mark.parametrize("algorithm", ["RNG_DEFAULT", "RNG_THREE_FRY", "RNG_PHILOX"])
def test_rng_bit_generator_draws_xlas_bits(cluster, algorithm):
    """stablehlo.rng_bit_generator, bit for bit as XLA's CPU backend (and so
    jax.jit) draws them: every unsigned width, odd and multi-dimensional
    shapes, uint64[2] and uint32[4] states, a counter about to wrap, and
    the new state."""
    alg = getattr(jax.lax.RandomAlgorithm, algorithm)
    keys = [np.array([2**64 - 1, 2**64 - 3], np.uint64), np.array([5, 6, 7, 8], np.uint32)]
    for dtype in (jnp.uint8, jnp.uint16, jnp.uint32, jnp.uint64):
        for shape in ((), (5,), (7, 9), (2, 3, 5)):
            for key in keys:
                f = lambda k, shape=shape, dtype=dtype: jax.lax.rng_bit_generator(k, shape, dtype=dtype, algorithm=alg)
                ours, theirs = tjax.jit(f)(key), jax.jit(f)(key)
                for o, t in zip(ours, theirs):
                    np.testing.assert_array_equal(o.fetch(), np.asarray(t), err_msg=f"{dtype} {shape} {key}")
                    assert o.dtype == np.asarray(t).dtype


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_jax_random_over_rbg_keys_draws_jaxs_numbers(cluster, impl):
    """jax.random with the rbg key implementations (built on
    rng_bit_generator): keys made, split and drawn from inside the
    function, as jax.jit draws them."""

    def draw(seed):
        k1, k2 = jax.random.split(jax.random.key(seed, impl=impl))
        return jax.random.normal(k1, (4, 33)), jax.random.uniform(k2, (17,)), jax.random.randint(k2, (6,), 0, 100)

    seed = np.uint32(7)
    (normal, uniform, ints), (j_normal, j_uniform, j_ints) = tjax.jit(draw)(seed), jax.jit(draw)(seed)
    np.testing.assert_array_equal(uniform.fetch(), np.asarray(j_uniform))  # the bits, scaled: exact
    np.testing.assert_array_equal(ints.fetch(), np.asarray(j_ints))
    # erf_inv of the same uniforms, within a few ulps of XLA's polynomial.
    np.testing.assert_allclose(normal.fetch(), np.asarray(j_normal), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_prng_keys_pass_as_arguments(cluster, impl):
    """A jax.random.key argument goes in as its key data (what JAX's module
    takes in its place); a key the function returns comes back as its key
    data, a uint32 tessel.Array that the next call takes as that key type
    again. Three steps of a loop that splits its key, against jax.jit's
    with typed keys throughout."""

    def step(key, x):
        key, sub = jax.random.split(key)
        return key, x + jax.random.uniform(sub, x.shape, dtype=jnp.float32)

    x = np.zeros(5, np.float32)
    ours, theirs = (jax.random.key(3, impl=impl), x), (jax.random.key(3, impl=impl), x)
    run = tjax.jit(step)
    for _ in range(3):
        ours = run(*ours)
        theirs = jax.jit(step)(*theirs)
    np.testing.assert_array_equal(ours[1].fetch(), np.asarray(theirs[1]))
    np.testing.assert_array_equal(ours[0].fetch(), np.asarray(jax.random.key_data(theirs[0])))
