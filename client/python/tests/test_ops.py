"""Every op of tessel.numpy against numpy itself: each case is one function
written over a namespace `m`, traced with m=tessel.numpy and run on the
cluster, and called with m=numpy on the host as the reference. Results must
have numpy's shape and dtype and its values (exact for integers and bools,
within a few ulps for floats)."""

import ml_dtypes
import numpy as np
import pytest

import tessel
import tessel.numpy as tnp

FLOATS = ["float32", "float64", "float16"]
INTS = ["int32", "int64", "uint8"]
ALL = FLOATS + INTS + ["bool"]
RNG = np.random.default_rng(7)

# Relative tolerance per result dtype: the CPU backend computes f16 in f32 and
# rounds once; transcendental functions differ from numpy's by a few ulps.
RTOL = {"float16": 2e-3, "float32": 2e-6, "float64": 1e-13}


def sample(dtype, shape, low=-4, high=4, positive=False, nonzero=False):
    d = np.dtype(dtype)
    if d == np.bool_:
        return RNG.random(shape) < 0.5
    if d.kind == "u":
        low, high = max(low, 0), max(high, 1)
    if positive:
        low = max(low, 0)
    if d.kind in "iu":
        x = RNG.integers(low, high + 1, size=shape).astype(d)
        if nonzero:
            x[x == 0] = 1
        return x
    x = RNG.uniform(low, high, size=shape).astype(d)
    if positive:
        x = np.abs(x) + d.type(0.125)
    if nonzero:
        x[np.abs(x) < 0.25] = d.type(0.5)
    return x


def check(fn, *args, rtol=None, exact_dtype=True, atol=0.0):
    """Runs fn(tnp, *args) on the cluster and fn(np, *args) on the host."""
    want = fn(np, *args)
    got = tessel.jit(lambda *a: fn(tnp, *a))(*args)
    leaves_w = want if isinstance(want, tuple) else (want,)
    leaves_g = got if isinstance(got, tuple) else (got,)
    for w, g in zip(leaves_w, leaves_g):
        w = np.asarray(w)
        assert isinstance(g, tessel.Array)
        out = g.fetch()
        assert out.shape == w.shape, f"shape {out.shape} != numpy's {w.shape}"
        if exact_dtype:
            assert out.dtype == w.dtype, f"dtype {out.dtype} != numpy's {w.dtype}"
        if w.dtype.kind == "f":
            tol = rtol if rtol is not None else RTOL[out.dtype.name]
            np.testing.assert_allclose(out, w.astype(out.dtype), rtol=tol, atol=atol or tol)
        else:
            np.testing.assert_array_equal(out, w.astype(out.dtype))


@pytest.fixture(autouse=True)
def _session(cluster):
    tessel._context.set_default_session(cluster.session)
    yield


# ---------------------------------------------------------------- elementwise

ARITH = {
    "add": lambda m, x, y: m.add(x, y),
    "subtract": lambda m, x, y: x - y,
    "multiply": lambda m, x, y: x * y,
    "maximum": lambda m, x, y: m.maximum(x, y),
    "minimum": lambda m, x, y: m.minimum(x, y),
}


@pytest.mark.parametrize("dtype", FLOATS + INTS)
@pytest.mark.parametrize("op", sorted(ARITH))
def test_arithmetic(op, dtype):
    check(ARITH[op], sample(dtype, (3, 5)), sample(dtype, (3, 5)))


@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_true_divide(dtype):
    # Integers divide as float64, as numpy does.
    check(lambda m, x, y: x / y, sample(dtype, (4, 4)), sample(dtype, (4, 4), nonzero=True, low=1))


@pytest.mark.parametrize("dtype", FLOATS + ["int32", "int64"])
def test_floor_divide_and_remainder_follow_the_divisor_sign(dtype):
    x = sample(dtype, (6, 7), low=-20, high=20)
    y = sample(dtype, (6, 7), low=-5, high=5, nonzero=True)
    check(lambda m, a, b: (a // b, a % b), x, y, atol=1e-2 if dtype == "float16" else 0.0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_power(dtype):
    check(lambda m, x, y: x**y, sample(dtype, (8,), positive=True), sample(dtype, (8,), low=-2, high=2))


@pytest.mark.parametrize("dtype", INTS + ["bool"])
def test_bitwise(dtype):
    x, y = sample(dtype, (5, 3), high=100), sample(dtype, (5, 3), high=100)
    check(lambda m, a, b: (a & b, a | b, a ^ b, ~a), x, y)


COMPARE = {
    "lt": lambda m, x, y: x < y,
    "le": lambda m, x, y: x <= y,
    "gt": lambda m, x, y: x > y,
    "ge": lambda m, x, y: x >= y,
    "eq": lambda m, x, y: x == y,
    "ne": lambda m, x, y: m.not_equal(x, y),
}


@pytest.mark.parametrize("dtype", FLOATS + INTS)
@pytest.mark.parametrize("op", sorted(COMPARE))
def test_compare(op, dtype):
    x = sample(dtype, (4, 6), low=-2, high=2)
    y = x.copy()
    y[::2] = sample(dtype, (2, 6), low=-2, high=2)  # half equal, half random
    check(COMPARE[op], x, y)


UNARY = {
    "negative": (lambda m, x: -x, {}),
    "abs": (lambda m, x: m.abs(x), {}),
    "sign": (lambda m, x: m.sign(x), {}),
    "square": (lambda m, x: m.square(x), {}),
    "exp": (lambda m, x: m.exp(x), {"high": 3}),
    "log": (lambda m, x: m.log(x), {"positive": True}),
    "log1p": (lambda m, x: m.log1p(x), {"positive": True}),
    "tanh": (lambda m, x: m.tanh(x), {}),
    "sqrt": (lambda m, x: m.sqrt(x), {"positive": True}),
    "floor": (lambda m, x: m.floor(x), {}),
    "ceil": (lambda m, x: m.ceil(x), {}),
    "sin": (lambda m, x: m.sin(x), {}),
    "cos": (lambda m, x: m.cos(x), {}),
    "tan": (lambda m, x: m.tan(x), {"low": -1.2, "high": 1.2}),
    "arcsin": (lambda m, x: m.arcsin(x), {"low": -0.99, "high": 0.99}),
    "arccos": (lambda m, x: m.arccos(x), {"low": -0.99, "high": 0.99}),
    "arctan": (lambda m, x: m.arctan(x), {}),
    "sinh": (lambda m, x: m.sinh(x), {}),
    "cosh": (lambda m, x: m.cosh(x), {}),
    "arcsinh": (lambda m, x: m.arcsinh(x), {}),
    "arccosh": (lambda m, x: m.arccosh(x + 2), {"positive": True}),
    "arctanh": (lambda m, x: m.arctanh(x), {"low": -0.95, "high": 0.95}),
    "expm1": (lambda m, x: m.expm1(x), {"high": 3}),
    "log2": (lambda m, x: m.log2(x), {"positive": True}),
    "log10": (lambda m, x: m.log10(x), {"positive": True}),
    "arctan2": (lambda m, x: m.arctan2(x, 0.5 - x * x * 0.25), {}),
}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_float(op, dtype):
    fn, kw = UNARY[op]
    check(fn, sample(dtype, (17,), **kw))


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("op", ["negative", "abs", "sign", "square"])
def test_unary_int(op, dtype):
    check(UNARY[op][0], sample(dtype, (3, 3)))


@pytest.mark.parametrize("dtype", ["int32", "uint8"])
@pytest.mark.parametrize("op", ["exp", "sqrt", "tanh"])
def test_float_functions_of_integers_promote_like_numpy(op, dtype):
    fn, kw = UNARY[op]
    check(fn, sample(dtype, (9,), low=0, high=3))


@pytest.mark.parametrize("dtype", FLOATS)
def test_sigmoid_and_rsqrt(dtype):
    x = sample(dtype, (11,), positive=True)
    got = tessel.jit(lambda a: (tnp.sigmoid(a), tnp.rsqrt(a)))(x)
    ref = x.astype(np.float64)
    np.testing.assert_allclose(got[0].fetch(), 1 / (1 + np.exp(-ref)), rtol=RTOL[dtype] * 2)
    np.testing.assert_allclose(got[1].fetch(), 1 / np.sqrt(ref), rtol=RTOL[dtype] * 2)
    assert got[0].dtype == got[1].dtype == np.dtype(dtype)


@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_where_clip(dtype):
    x = sample(dtype, (5, 4))
    check(lambda m, a: (m.where(a > 1, a, a * 2), m.clip(a, 0, 2)), x)


# ---------------------------------------------------------------- broadcasting and promotion

SHAPES = [((3, 4), (4,)), ((3, 1), (1, 4)), ((2, 1, 5), (3, 1)), ((), (2, 3)), ((1,), (6,))]


@pytest.mark.parametrize("a_shape,b_shape", SHAPES)
def test_broadcasting(a_shape, b_shape):
    x, y = sample("float32", a_shape), sample("float32", b_shape)
    check(lambda m, a, b: (a + b, m.maximum(a, b) * a, m.where(a > b, a, b)), x, y)


PAIRS = [
    ("float32", "float64"),
    ("int32", "float32"),
    ("int32", "int64"),
    ("uint8", "int32"),
    ("uint8", "float16"),
    ("bool", "int32"),
    ("float16", "float32"),
    ("bool", "float64"),
]


@pytest.mark.parametrize("a,b", PAIRS)
def test_promotion(a, b):
    check(lambda m, x, y: x + y, sample(a, (4,), high=3), sample(b, (4,), high=3))


@pytest.mark.parametrize("dtype", FLOATS + ["int32", "int64", "uint8"])
def test_python_scalars_are_weakly_typed(dtype):
    # numpy 2 (NEP 50): a Python scalar takes the array's dtype.
    check(lambda m, x: (x * 2 + 1, 3 - x, m.maximum(x, 1)), sample(dtype, (6,), high=9))


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_float_scalar_with_int_array_promotes(dtype):
    check(lambda m, x: x * 0.5, sample(dtype, (5,)))


@pytest.mark.parametrize("src", ALL)
@pytest.mark.parametrize("dst", ["float32", "float64", "float16", "int32", "int64", "uint8", "bool"])
def test_astype(src, dst):
    x = sample(src, (7,), low=0, high=100) if dst == "uint8" else sample(src, (7,), low=-50, high=50)
    check(lambda m, a: a.astype(dst), x)


# ---------------------------------------------------------------- reductions

AXES = [None, 0, 1, -1, (0, 2)]


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("name", ["sum", "max", "min", "mean", "prod"])
def test_reductions_float(name, axis, keepdims):
    x = sample("float64", (3, 4, 5), low=-1, high=1)
    check(lambda m, a: getattr(m, name)(a, axis=axis, keepdims=keepdims), x)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "int64", "bool"])
@pytest.mark.parametrize("name", ["sum", "max", "min", "mean"])
def test_reductions_dtypes(name, dtype):
    x = sample(dtype, (6, 8), low=-3, high=3)
    check(lambda m, a: getattr(m, name)(a, axis=1), x, rtol=2e-2 if dtype == "float16" else None)


@pytest.mark.parametrize("dtype", ["bool", "int32", "float32"])
@pytest.mark.parametrize("name", ["any", "all"])
def test_any_all(name, dtype):
    x = sample(dtype, (5, 6), low=0, high=1)
    check(lambda m, a: (getattr(m, name)(a), getattr(m, name)(a, axis=0, keepdims=True)), x)


def test_sum_of_uint8_accumulates_in_uint64():
    # numpy sums unsigned integers in uint64 and signed ones (and bools) in int64.
    x = sample("uint8", (4, 64), high=255)
    got = tessel.jit(lambda a: (tnp.sum(a, axis=1), tnp.sum(a.astype(np.int8), axis=1)))(x)
    assert got[0].fetch().dtype == np.uint64 and got[1].fetch().dtype == np.int64
    np.testing.assert_array_equal(got[0].fetch(), x.sum(axis=1))
    np.testing.assert_array_equal(got[1].fetch(), x.astype(np.int8).sum(axis=1))


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argreduce(name, axis):
    x = sample("float32", (5, 7))
    check(lambda m, a: getattr(m, name)(a, axis=axis), x)


def test_methods_on_traced_values():
    x = sample("float32", (2, 3, 4))
    check(
        lambda m, a: (
            a.sum(axis=0),
            a.mean(),
            a.max(axis=(1, 2)),
            a.T,
            a.reshape(6, 4),
            a.transpose(2, 0, 1),
            a.argmax(axis=2),
        ),
        x,
    )


# ---------------------------------------------------------------- layout


def test_reshape_transpose_broadcast():
    x = sample("float32", (2, 3, 4))
    check(
        lambda m, a: (
            m.reshape(a, (4, -1)),
            m.transpose(a, (1, 0, 2)),
            m.transpose(a),
            m.broadcast_to(a[:, :1, :], (2, 3, 4)),
            m.expand_dims(a, 1),
        ),
        x,
    )


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concatenate_and_stack(axis):
    x, y = sample("float32", (2, 3)), sample("int32", (2, 3))
    check(lambda m, a, b: (m.concatenate([a, b, a], axis=axis), m.stack([a, a], axis=axis)), x, y)


@pytest.mark.parametrize("widths", [1, ((1, 2), (0, 3)), ((0, 0), (2, 2))])
def test_pad(widths):
    x = sample("int32", (3, 4))
    check(lambda m, a: (m.pad(a, widths), m.pad(a, widths, constant_values=7)), x)


@pytest.mark.parametrize(
    "index",
    [
        (slice(1, 3),),
        (slice(None), 2),
        (-1,),
        (slice(None, None, 2), slice(1, None, 3)),
        (Ellipsis, 1),
        (1, Ellipsis, slice(0, 2)),
        (slice(2, 1),),
    ],
)
def test_static_indexing(index):
    x = sample("float32", (4, 5, 6))
    check(lambda m, a: a[index], x)


def test_bad_index_is_a_clear_error():
    with pytest.raises(IndexError, match="out of bounds for axis 0 with size 4"):
        tessel.jit(lambda a: a[7])(np.zeros(4, np.float32))


# ---------------------------------------------------------------- dot


@pytest.mark.parametrize(
    "a_shape,b_shape",
    [
        ((3, 4), (4, 5)),
        ((4,), (4, 2)),
        ((3, 4), (4,)),
        ((4,), (4,)),
        ((2, 3, 4), (4, 5)),
        ((2, 3, 4), (2, 4, 5)),
        ((1, 3, 4), (6, 4, 2)),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matmul(a_shape, b_shape, dtype):
    check(lambda m, a, b: a @ b, sample(dtype, a_shape), sample(dtype, b_shape), rtol=1e-5)


def test_dot():
    check(
        lambda m, a, b, c: (m.dot(a, b), m.dot(c, 2.0)),
        sample("float64", (3, 4)),
        sample("float64", (4, 2)),
        sample("float64", (3,)),
    )


@pytest.mark.parametrize(
    "spec,shapes",
    [
        ("ij,jk->ik", [(3, 4), (4, 5)]),
        ("ij,kj->ik", [(3, 4), (5, 4)]),
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("ij->ji", [(3, 4)]),
        ("ij->", [(3, 4)]),
        ("ij->i", [(3, 4)]),
        ("i,i->", [(5,), (5,)]),
        ("i,j->ij", [(3,), (4,)]),
        ("bij,jk", [(2, 3, 4), (4, 5)]),
        ("ijk,ik->j", [(2, 3, 4), (2, 4)]),
        # ellipses, broadcast as numpy does, and three or more operands
        ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
        ("...ij,...jk", [(2, 1, 3, 4), (5, 4, 2)]),
        ("i...->...", [(3, 2, 4)]),
        ("...i,i", [(2, 3, 4), (4,)]),
        ("ij...,jk...->ik...", [(3, 4, 2), (4, 5, 2)]),
        ("ij,jk,kl->il", [(3, 4), (4, 5), (5, 2)]),
        ("ij,jk,kl", [(30, 4), (4, 50), (50, 2)]),
        ("i,ij,jk,k->", [(3,), (3, 4), (4, 5), (5,)]),
        ("bij,bjk,bkl->bli", [(2, 3, 4), (2, 4, 5), (2, 5, 3)]),
        ("a,b,c->abc", [(2,), (3,), (4,)]),
        ("...a,...a,...a->...", [(3, 2), (1, 2), (3, 2)]),
        # a letter repeated in one operand: its diagonal
        ("ii->i", [(4, 4)]),
        ("ii", [(4, 4)]),
        ("bii->bi", [(2, 3, 3)]),
        ("iji->j", [(3, 5, 3)]),
        ("iij,jk->ik", [(3, 3, 4), (4, 2)]),
        ("ii,ij->j", [(3, 3), (3, 2)]),
        ("iii->i", [(3, 3, 3)]),
        ("...ii->...i", [(2, 4, 4)]),
    ],
)
def test_einsum(spec, shapes):
    ops = [sample("float64", s) for s in shapes]
    check(lambda m, *a: m.einsum(spec, *a), *ops, rtol=1e-12)


def test_einsum_contracts_the_smallest_pair_first():
    """A chain whose middle pair is small: the plan multiplies (30x4)(4x50)
    only if it has to; greedy order takes (4x50)(50x2) first, so no
    intermediate of 30x50 exists."""
    a, b, c = sample("float64", (30, 4)), sample("float64", (4, 50)), sample("float64", (50, 2))
    f = tessel.jit(lambda a, b, c: tnp.einsum("ij,jk,kl->il", a, b, c))
    text = f.lower(a, b, c).as_text()
    assert "f64[30,50]" not in text and "f64[4,2]" in text, text
    np.testing.assert_allclose(f(a, b, c).fetch(), np.einsum("ij,jk,kl->il", a, b, c), rtol=1e-12)


def test_einsum_errors_name_the_subscripts():
    x = sample("float64", (3, 4))
    with pytest.raises(ValueError, match="'ij,jk': letter 'j' has sizes 4 and 3"):
        tessel.jit(lambda v: tnp.einsum("ij,jk", v, v))(x)
    with pytest.raises(
        ValueError, match="'ii->i': letter 'i' repeated in one operand over dimensions of sizes 3 and 4"
    ):
        tessel.jit(lambda v: tnp.einsum("ii->i", v))(x)
    with pytest.raises(ValueError, match="output letter 'z'"):
        tessel.jit(lambda v: tnp.einsum("ij->z", v))(x)


# ---------------------------------------------------------------- creation


def test_creation_ops_are_generated_on_the_device():
    check(
        lambda m, a: (
            m.zeros((3, 4)),
            m.ones(5, dtype=m.int32),
            m.full((2, 2), 7.5),
            m.zeros_like(a),
            m.ones_like(a, dtype=m.float16),
            m.arange(6),
            m.full((3,), True),
        ),
        sample("float32", (2, 3)),
    )


def test_int_division_by_zero_follows_xla():
    # numpy warns and gives 0; Tessel follows XLA's definition (x / 0 = -1, x % 0 = x).
    x, y = np.array([7, -7, 3], np.int32), np.array([0, 0, 1], np.int32)
    q = tessel.jit(lambda a, b: tnp.add(a, 0) // b)(x, y).fetch()
    assert q[2] == 3


# ---------------------------------------------------------------- eager ops on arrays


def test_ops_on_arrays_outside_a_trace_run_on_the_devices():
    x = sample("float32", (4, 3))
    last = len(tessel.devices()) - 1  # a device of the second worker
    a = tessel.device_put(x, last)
    b = (a * 2 + 1).sum(axis=0)
    assert isinstance(b, tessel.Array) and b.sharding == tessel.SingleDeviceSharding(last)
    np.testing.assert_allclose(b.fetch(), (x * 2 + 1).sum(axis=0), rtol=1e-6)
    np.testing.assert_allclose(tnp.exp(a).fetch(), np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(a[1:, 0].fetch(), x[1:, 0])
    np.testing.assert_allclose((a @ a.T).fetch(), x @ x.T, rtol=1e-5)


# ---------------------------------------------------------------- bfloat16 (ml_dtypes)

BF16 = ml_dtypes.bfloat16


def bf16_sample(shape, **kw):
    return sample("float32", shape, **kw).astype(BF16)


def check_bf16(fn, *args, rtol=1e-2):
    """bf16 results against numpy on ml_dtypes' bfloat16, which, like the
    CPU backend, computes each op in float32 and rounds to bf16."""
    want = fn(np, *args)
    got = tessel.jit(lambda *a: fn(tnp, *a))(*args).fetch()
    assert got.dtype == want.dtype == np.dtype(BF16), (got.dtype, want.dtype)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("op", ["add", "subtract", "multiply", "maximum"])
def test_bf16_arithmetic(op):
    check_bf16(lambda m, x, y: ARITH[op](m, x, y) * 2 + 1, bf16_sample((4, 8)), bf16_sample((8,)))


@pytest.mark.parametrize("op", ["exp", "tanh", "sqrt", "log", "abs", "floor"])
def test_bf16_unary(op):
    fn, kw = UNARY[op]
    check_bf16(fn, bf16_sample((33,), **kw))


def test_bf16_reductions_layout_and_casts():
    x = bf16_sample((6, 5))
    check_bf16(lambda m, a: m.sum(a, axis=0), x, rtol=3e-2)
    check_bf16(lambda m, a: m.max(a, axis=1), x)
    check_bf16(lambda m, a: m.concatenate([a.T, a.T], axis=1)[1:3], x)
    check_bf16(lambda m, a: m.where(a > 0, a, BF16(0.5)), x)
    f32 = sample("float32", (9,))
    check_bf16(lambda m, a: a.astype(BF16), f32, rtol=0)  # one rounding, as ml_dtypes does
    got = tessel.jit(lambda a: a.astype(tnp.float32) + tnp.ones(9, tnp.float16))(f32.astype(BF16)).fetch()
    assert got.dtype == np.float32


def test_bf16_promotes_like_jax():
    b, h = bf16_sample((3,)), sample("float16", (3,))
    assert tessel.jit(lambda x: x * 2.5)(b).dtype == np.dtype(BF16)  # a Python float keeps bf16
    assert tessel.jit(lambda x, y: x + y)(b, h).dtype == np.float32
    assert tessel.jit(lambda x, y: x + y)(b, sample("float32", (3,))).dtype == np.float32


def test_bf16_round_trips_through_put_and_fetch():
    x = bf16_sample((5, 7))
    np.testing.assert_array_equal(tessel.device_put(x, 1).fetch().view(np.uint16), x.view(np.uint16))
