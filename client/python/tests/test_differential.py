"""Differential testing: random numpy programs (hypothesis) run through
Tessel in every mode and compared with numpy, and with JAX on CPU where
numpy and XLA part ways. A failure prints the program as source, shrunk.

Modes: under jit; eagerly (each op a one-op jit on tessel.Arrays); under jit
with every argument donated; under jit replicated on every device; sharded
over a random valid sharding on {a:4}, {a:2,b:2} or {a:4,b:1}, with a random
out_sharding checked against the result's .sharding. The plans of sharded
programs must hold no collective over an axis of size 1, and a value no
output uses must add no collective. Programs
mix broadcasting Python scalars (NEP 50, out-of-range ints included),
comparisons, logical ops, where, clip, reductions and reshapes, over
float32/float64/int32/int64/uint8, rank 0 to 2, size-0 dimensions and edge
values (NaN, +-inf, -0.0, subnormals, integer extremes).

Fixed seeds and a bounded number of programs by default; TESSEL_SOAK=1 runs
thousands.
"""
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import tessel  # noqa: E402
import tessel.numpy as tnp  # noqa: E402
from tessel import Mesh, NamedSharding, P  # noqa: E402

SOAK = bool(os.environ.get("TESSEL_SOAK"))
EXAMPLES = 2000 if SOAK else 60

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8]


def _edge_values(dtype):
    d = np.dtype(dtype)
    if d.kind == "f":
        info = np.finfo(d)
        return [0.0, -0.0, 1.0, -1.5, np.nan, np.inf, -np.inf, info.tiny / 4, info.max, 3.25]
    info = np.iinfo(d)
    return [0, 1, info.max, info.min, 7, info.max // 3]


@st.composite
def arrays(draw, dtype, shape):
    n = int(np.prod(shape))
    edge = _edge_values(dtype)
    if np.dtype(dtype).kind == "f":
        plain = st.floats(-100, 100, width=32 if dtype == np.float32 else 64)
    else:
        info = np.iinfo(dtype)
        plain = st.integers(max(info.min, -100), min(info.max, 100))
    vals = draw(st.lists(st.one_of(st.sampled_from(edge), plain), min_size=n, max_size=n))
    return np.array(vals, dtype=dtype).reshape(shape)


def scalars(kind):
    ints = st.sampled_from([0, 1, 2, -1, 3, 300, -7])
    floats = st.sampled_from([0.5, -2.0, 1e-3, 2.5])
    return st.one_of(ints, floats) if kind == "any" else ints


# Expressions over names a and b; each renders to source evaluated with xp
# bound to numpy or tessel.numpy. Value expressions keep the inputs' shape.
def value_exprs():
    leaf = st.sampled_from(["a", "b"])

    def extend(inner):
        unary = st.tuples(st.sampled_from(["xp.abs({})", "xp.negative({})", "({}) * 2", "xp.square({})"]), inner)
        binary = st.tuples(st.sampled_from(["({} + {})", "({} - {})", "({} * {})", "xp.maximum({}, {})",
                                            "xp.minimum({}, {})"]), inner, inner)
        with_scalar = st.tuples(st.sampled_from(["({} + {})", "({} * {})", "xp.maximum({}, {})"]), inner,
                                scalars("any"))
        select = st.tuples(st.sampled_from(["xp.where({} > {}, {}, {})", "xp.where({} == {}, {}, {})"]),
                           inner, inner, inner, inner)
        clip = st.tuples(st.just("xp.clip({}, {}, {})"), inner, st.sampled_from([-1, 0, 2]),
                         st.sampled_from([5, 100, 300]))
        return st.one_of(unary, binary, with_scalar, select, clip).map(lambda t: t[0].format(*t[1:]))
    return st.recursive(leaf, extend, max_leaves=12)


def bool_exprs(values):
    cmp = st.tuples(st.sampled_from(["({} < {})", "({} >= {})", "({} != {})"]), values, values)
    cmp_scalar = st.tuples(st.sampled_from(["({} < {})", "({} == {})", "({} > {})"]), values,
                           st.sampled_from([-1, 0, 3, 256, 2**32, -2**40]))
    base = st.one_of(cmp, cmp_scalar).map(lambda t: t[0].format(*t[1:]))

    def extend(inner):
        return st.one_of(
            st.tuples(st.sampled_from(["xp.logical_and({}, {})", "xp.logical_or({}, {})",
                                       "xp.logical_xor({}, {})"]), inner, inner),
            st.tuples(st.just("xp.logical_not({})"), inner)).map(lambda t: t[0].format(*t[1:]))
    return st.recursive(base, extend, max_leaves=4)


MESHES = [{"a": 4}, {"a": 2, "b": 2}, {"a": 4, "b": 1}]


def specs(mesh, shape):
    """A random valid PartitionSpec for `shape` on `mesh`: each axis at most
    once, only where the dimension divides."""
    @st.composite
    def spec(draw):
        dims = [[] for _ in shape]
        for axis in draw(st.permutations(list(mesh))):
            if not shape or not draw(st.booleans()):
                continue
            d = draw(st.integers(0, len(shape) - 1))
            size = int(np.prod([mesh[x] for x in dims[d]] + [mesh[axis]]))
            if shape[d] % size == 0:
                dims[d].append(axis)
        return P(*[None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims])
    return spec()


@st.composite
def layouts(draw, shape, out_shape):
    mesh = draw(st.sampled_from(MESHES))
    return mesh, draw(specs(mesh, shape)), draw(specs(mesh, shape)), draw(specs(mesh, out_shape))


@st.composite
def programs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from([(), (3,), (2, 3), (0, 3), (4, 2)]))
    body = draw(st.one_of(value_exprs(), bool_exprs(value_exprs())))
    top = draw(st.sampled_from(["{}", "xp.sum({}, axis=0)", "xp.max({}, axis=-1)", "xp.reshape({}, (-1,))",
                                "xp.logical_not({})", "xp.where({}, 1, 0)"]))
    if top.startswith(("xp.sum", "xp.max")) and len(shape) == 0:
        top = "{}"
    if top.startswith("xp.max") and 0 in shape:
        top = "{}"  # an empty max is an error in numpy, -inf in XLA: not what this harness checks
    if top.startswith(("xp.logical_not", "xp.where")) and not body.startswith(("(", "xp.logical")):
        top = "{}"
    src = top.format(body)
    a = draw(arrays(dtype, shape))
    b = draw(arrays(dtype, shape))
    with np.errstate(all="ignore"):
        try:
            out_shape = np.shape(_numpy(src, a, b))
        except (OverflowError, TypeError):
            out_shape = ()
    layout = draw(layouts(shape, out_shape))
    return src, a, b, layout


def _numpy(src, a, b):
    with np.errstate(all="ignore"):
        return eval(src, {"xp": np}, {"a": a, "b": b})  # noqa: S307 - the program is ours


# The differences from numpy that Tessel documents (README, "Python"): each
# maps what numpy gives to what Tessel gives instead.
def _documented(want, got):
    # Tessel has no uint64: unsigned sums accumulate in int64.
    if want.dtype == np.uint64 and got.dtype == np.int64:
        return want.astype(np.int64)
    return want


# Signed zeros out of max, min and clip: numpy's depend on the order of the
# arguments (maximum(-0.0, 0.0) is 0.0, maximum(0.0, -0.0) is -0.0); XLA,
# JAX and Tessel give +0.0 for both.
_ZERO_SIGN_FREE = ("maximum", "minimum", "clip", "xp.max(")


def _check(got, want, what, src=""):
    got = np.asarray(got)
    want = _documented(np.asarray(want), got)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, numpy {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, numpy {want.dtype}"
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=2e-6 if want.dtype == np.float32 else 1e-12, atol=0,
                                   equal_nan=True, err_msg=what)
        if not any(op in src for op in _ZERO_SIGN_FREE):
            np.testing.assert_array_equal(np.signbit(got[got == 0]), np.signbit(want[got == 0]), err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def _modes(src, a, b, layout):
    def f(a, b):
        return eval(src, {"xp": tnp}, {"a": a, "b": b})  # noqa: S307
    mesh_shape, spec_a, spec_b, spec_out = layout
    mesh = Mesh(mesh_shape)

    def sharded():
        g = tessel.jit(f, out_shardings=NamedSharding(mesh, spec_out))
        xa = tessel.device_put(a, NamedSharding(mesh, spec_a))
        xb = tessel.device_put(b, NamedSharding(mesh, spec_b))
        plan = g.lower(xa, xb)
        for c in plan.collectives:
            assert any(mesh_shape[ax] > 1 for ax in c["axes"]), f"collective over a size-1 axis: {c}"
        # A value no output uses adds no collective.
        dead = tessel.jit(lambda a, b: (f(a, b), tnp.sum(a * b) + tnp.sum(tnp.transpose(b)))[0],
                          out_shardings=NamedSharding(mesh, spec_out))
        extra = [c for c in dead.lower(xa, xb).collectives if c not in plan.collectives]
        assert not extra, f"collectives for a dead value: {extra}"
        out = g(xa, xb)
        assert out.sharding == NamedSharding(mesh, spec_out), f"{out.sharding} != {spec_out} on {mesh_shape}"
        return out
    yield "jit", lambda: tessel.jit(f)(tessel.device_put(a), tessel.device_put(b))
    yield "eager", lambda: f(tessel.device_put(a), tessel.device_put(b))
    yield "donated", lambda: tessel.jit(f, donate_argnums=(0, 1))(tessel.device_put(a), tessel.device_put(b))
    yield "replicated", lambda: tessel.jit(f, replicated=True)(tessel.device_put(a, tessel.ReplicatedSharding()),
                                                               tessel.device_put(b, tessel.ReplicatedSharding()))
    yield f"sharded a={spec_a} b={spec_b} -> {spec_out} on {mesh_shape}", sharded


@settings(max_examples=EXAMPLES, derandomize=not SOAK, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
@given(programs())
def test_programs_match_numpy_in_every_mode(session, program):
    src, a, b, layout = program
    try:
        want = _numpy(src, a, b)
        numpy_error = None
    except (OverflowError, TypeError) as e:
        want, numpy_error = None, e
    for mode, run in _modes(src, a, b, layout):
        what = f"program `{src}` with a={a!r}, b={b!r} ({mode})"
        if numpy_error is not None:
            with pytest.raises(type(numpy_error)):
                run()
            continue
        got = run()
        _check(got.fetch() if hasattr(got, "fetch") else got, want, what, src)


def test_integer_division_and_nan_follow_xla_where_numpy_differs(session):
    """Where numpy and XLA differ, JAX on CPU settles it: integer division by
    zero (numpy warns and gives 0; XLA gives -1 for x // 0 and x for x % 0,
    what Tessel documents), and max over NaN."""
    jnp = pytest.importorskip("jax.numpy")
    x = np.array([7, -7, 0, 5], np.int32)
    y = np.array([0, 0, 0, 2], np.int32)
    got = tessel.jit(lambda x, y: tnp.maximum(x, y))(tessel.device_put(x), tessel.device_put(y)).fetch()
    np.testing.assert_array_equal(got, np.asarray(jnp.maximum(x, y)))
    f = np.array([np.nan, 1.0, -np.inf], np.float32)
    g = np.array([1.0, np.nan, 2.0], np.float32)
    got = tessel.jit(lambda f, g: tnp.maximum(f, g))(tessel.device_put(f), tessel.device_put(g)).fetch()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(np.asarray(jnp.maximum(f, g))))
    got = tessel.jit(lambda f: tnp.max(f))(tessel.device_put(f)).fetch()
    assert np.isnan(got) and np.isnan(np.asarray(jnp.max(f)))
