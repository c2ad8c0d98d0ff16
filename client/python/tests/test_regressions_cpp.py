"""Silent wrong results (and crashes) whose fix is in the daemons, not the
SDK: each test failed against daemons built before its fix. A test marked
xfail(strict=True) waits for its fix; when the fix lands it passes, the
strict marker turns that into a failure, and the marker comes off."""

import numpy as np

import tessel
import tessel.numpy as tnp
from tessel import Mesh, NamedSharding, P


def test_a_donated_argument_that_is_also_returned_is_not_overwritten(session):
    """Issue 15 #1: an output that aliases a donated parameter (itself or a
    view) is never the target of an in-place write."""
    f = tessel.jit(lambda x: (x + 1, x), donate_argnums=0)
    y, x2 = f(tessel.device_put(np.arange(3, dtype=np.float32)))
    np.testing.assert_array_equal(y.fetch(), [1, 2, 3])
    np.testing.assert_array_equal(x2.fetch(), [0, 1, 2])
    g = tessel.jit(lambda x: (x.reshape(3, 1), x * 10), donate_argnums=0)
    v, t = g(tessel.device_put(np.arange(3, dtype=np.float32)))
    np.testing.assert_array_equal(v.fetch(), [[0], [1], [2]])
    np.testing.assert_array_equal(t.fetch(), [0, 10, 20])
    h = tessel.jit(lambda s: {"w": s["w"] - 1, "w_prev": s["w"]}, donate_argnums=0)
    out = h({"w": tessel.device_put(np.arange(3, dtype=np.float32))})
    np.testing.assert_array_equal(out["w"].fetch(), [-1, 0, 1])
    np.testing.assert_array_equal(out["w_prev"].fetch(), [0, 1, 2])


def test_float_sums_are_as_accurate_as_numpys(session):
    """Issue 15 #5: a sequential float32 sum of 1e6 x 0.1 is off by 1e-2;
    numpy's pairwise sum and JAX's give 100000."""
    x = np.full(1_000_000, np.float32(0.1))
    s, m = tessel.jit(lambda x: (tnp.sum(x), tnp.mean(x)))(tessel.device_put(x))
    exact = float(np.sum(x.astype(np.float64)))
    for got, want, true in ((s.fetch(), np.sum(x), exact), (m.fetch(), np.mean(x), exact / x.size)):
        # No worse than numpy's error, or two ulps.
        assert abs(float(got) - true) <= max(abs(float(want) - true), 2 * np.finfo(np.float32).eps * true), got


def test_no_collective_is_planned_for_a_dead_value(session):
    """Issue 15 #10c: `unused = x @ x; return x + 1` planned an all_gather and
    an all_to_all for `unused`."""
    mesh = Mesh({"a": 2, "b": 2})
    x = tessel.device_put(np.ones((4, 4), np.float32), NamedSharding(mesh, P("a", "b")))

    def f(x):
        unused = x @ x  # noqa: F841
        return x + 1

    assert tessel.jit(f).lower(x).collectives == []


def test_no_collective_is_planned_over_an_axis_of_size_1(session):
    """Issue 15 #10d: gathering a dimension split over an axis of size 1
    planned an all_gather of 0 bytes."""
    mesh = Mesh({"a": 4, "b": 1})
    for spec in (P(None, "b"), P("b")):
        x = tessel.device_put(np.ones((4, 4), np.float32), NamedSharding(mesh, spec))
        plan = tessel.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P())).lower(x)
        assert plan.collectives == [], spec


def test_donation_does_not_depend_on_the_order_of_outputs(session):
    """Issue 15 #11: (w * 2.0, sum(w)) could not reuse w, (sum(w), w * 2.0)
    could: readers of a parameter must run before its in-place writer."""
    for f in (lambda w: (w * 2.0, tnp.sum(w)), lambda w: (tnp.sum(w), w * 2.0)):
        j = tessel.jit(f, donate_argnums=0)
        outs = j(tessel.device_put(np.arange(4, dtype=np.float32)))
        receipts = j.donation_receipts()
        assert receipts[0]["reused"], receipts[0]["reason"]
        got = sorted(float(np.sum(o.fetch())) for o in outs)
        assert got == [6.0, 12.0]


def test_a_size0_arange_met_by_a_broadcast_scalar_does_not_kill_the_worker():
    """Found by the differential harness: `np.array(3) + tnp.arange(0)` (or
    `arange(0) != np.uint8(0)`) kills the worker with SIGFPE. Its own
    cluster, since the failure takes the worker down."""
    with tessel.local_cluster(workers=1, devices_per_worker=1):
        got = tessel.jit(lambda: (np.array(3) + tnp.arange(0), tnp.arange(0) != np.uint8(0)))()
        assert got[0].fetch().shape == (0,) and got[1].fetch().shape == (0,)
        # The worker is still there for the next step.
        np.testing.assert_array_equal(tessel.jit(lambda: tnp.arange(3) + 1)().fetch(), [1, 2, 3])


def test_a_partial_sum_is_completed_before_it_meets_a_product(session):
    """Found by the differential soak (seed 380073276): a sum over a split
    dimension stayed a per-device partial sum through a matmul (and a
    multiply) and was all-reduced after. Where the other operand holds an
    infinity, a device whose part is 0 makes 0 * inf = NaN, where the
    complete sum gives an infinity."""
    mesh = Mesh({"a": 4})
    a = np.zeros((4, 4, 4), np.float32)
    a[3, 3, :3] = 0.1
    x = tessel.device_put(a, NamedSharding(mesh, P("a", None, None)))
    inf = np.float32(np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        want_dot = np.sum(a, axis=0) @ (1 / np.sign(a))
        want_mul = np.sum(a, axis=0) * inf
    got_dot = tessel.jit(lambda v: tnp.sum(v, axis=0) @ (1 / tnp.sign(v)))(x).fetch()
    got_mul = tessel.jit(lambda v: tnp.sum(v, axis=0) * inf)(x).fetch()
    np.testing.assert_array_equal(got_dot, want_dot)
    np.testing.assert_array_equal(got_mul, want_mul)


def test_a_partial_sum_is_completed_before_it_is_converted(session):
    """Parts of 70000 and -10000 sum to 60000, which float16 holds; converted
    on each device first, the first part is already inf."""
    mesh = Mesh({"a": 2}, devices=[0, 1])
    a = np.array([[70000.0], [-10000.0]], np.float32)
    x = tessel.device_put(a, NamedSharding(mesh, P("a", None)))
    got = tessel.jit(lambda v: tnp.sum(v, axis=0).astype(np.float16))(x).fetch()
    np.testing.assert_array_equal(got, np.sum(a, axis=0).astype(np.float16))
