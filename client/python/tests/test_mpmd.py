"""MPMD in one program: jitted functions on sub-meshes (their in_shardings
and out_shardings name the mesh) called inside another jitted function
become mesh regions, each compiled for its own devices, with the values
between them moved worker to worker. Values are checked against numpy; where
each part ran is checked by the coordinator's per-device step counts and
the devices' memory."""

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import Mesh, NamedSharding, P, errors

from conftest import DEVICE_KIND

pytestmark = pytest.mark.skipif(DEVICE_KIND != "cpu", reason="values cross sub-meshes by resharding, host-memory only")

A = Mesh({"d": 2}, devices=[0, 1])
B = Mesh({"d": 2}, devices=[2, 3])
WA, RA = NamedSharding(A, P()), NamedSharding(A, P("d"))
WB, RB = NamedSharding(B, P()), NamedSharding(B, P("d"))

stage0 = tessel.jit(lambda x, w: tnp.tanh(x @ w), in_shardings=(RA, WA), out_shardings=RA)
stage1 = tessel.jit(lambda h, v: (h @ v).sum(axis=1), in_shardings=(RB, WB), out_shardings=RB)
apart = tessel.jit(lambda z: z * 2.0 + 1.0, in_shardings=RB, out_shardings=RB)


def _data():
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((8, 4)).astype(np.float32),
        rng.standard_normal((4, 6)).astype(np.float32),
        rng.standard_normal((6, 3)).astype(np.float32),
        np.arange(1 << 16, dtype=np.float32),
    )


def _steps_per_device(session):
    return {d.id: d.steps for w in session.cluster().workers for d in w.devices}


def test_regions_run_on_their_devices_and_values_move_between_them(session):
    @tessel.jit
    def step(x, w, v, z):
        return stage1(stage0(x, w), v), apart(z)

    x, w, v, z = _data()
    plan = step.lower(x, w, v, z)
    text = plan.as_text()
    assert "part 0 '<lambda>' on {d: 2} over devices 0,1" in text, text
    assert "part 2 '<lambda>' on {d: 2} over devices 2,3" in text, text
    # Only h crosses: f32[8,6] from devices 0,1 to 2,3, every byte of it.
    assert [t["bytes"] for t in plan.transfers] == [8 * 6 * 4], plan.transfers
    assert "result 0 of part 0" in plan.transfers[0]["reason"] and "devices 2,3" in plan.transfers[0]["reason"]
    a, b = step(x, w, v, z)
    assert a.sharding == RB and b.sharding == RB
    np.testing.assert_allclose(a.fetch(), (np.tanh(x @ w) @ v).sum(axis=1), rtol=1e-5)
    np.testing.assert_array_equal(b.fetch(), z * 2 + 1)
    assert step.compiles == 1
    step(x, w, v, z)
    assert step.compiles == 1


def test_an_unrelated_part_runs_only_on_its_subset(session):
    @tessel.jit
    def two(x, w, z):
        return stage0(x, w), apart(z)

    x, w, _, z = _data()
    xa, wa, zb = tessel.device_put(x, RA), tessel.device_put(w, WA), tessel.device_put(z, RB)
    for out in two(xa, wa, zb):  # compiled and loaded; every step of the warm-up done and counted
        out.block_until_ready()
    steps = _steps_per_device(session)
    mem = tessel.memory_stats()["devices"]
    h, big = two(xa, wa, zb)
    big.block_until_ready()
    h.block_until_ready()
    after = _steps_per_device(session)
    now = tessel.memory_stats()["devices"]
    # One step per device: stage0 on 0 and 1, apart on 2 and 3; no transfer.
    assert {d: after[d] - steps[d] for d in after} == {0: 1, 1: 1, 2: 1, 3: 1}
    half = z.nbytes // 2
    for d in (2, 3):
        assert now[d]["bytes_in_use"] - mem[d]["bytes_in_use"] >= half
    for d in (0, 1):
        assert now[d]["bytes_in_use"] - mem[d]["bytes_in_use"] < half  # a block of h, not of z


def test_an_argument_placed_elsewhere_moves_where_its_reader_takes_it(session):
    @tessel.jit
    def one(z):
        return apart(z)

    _, _, _, z = _data()
    on_a = tessel.device_put(z, RA)  # apart takes it on B
    np.testing.assert_array_equal(one(on_a).fetch(), z * 2 + 1)
    with tessel.transfer_guard(device_to_device="disallow"):
        with pytest.raises(errors.TesselError, match=r"implicit device->device transfer"):
            one(on_a).fetch()
    np.testing.assert_array_equal(one(tessel.device_put(z, RB)).fetch(), z * 2 + 1)


def test_mpmd_programs_refuse_what_they_cannot_do_clearly(session):
    x, w, v, _ = _data()
    with pytest.raises(errors.TesselError, match="stands outside every mesh region"):
        tessel.jit(lambda x, w: stage0(x, w) + 1.0)(x, w)
    unplaced = tessel.jit(lambda x: x * 2)  # names no devices: inlined, as JAX inlines a nested jit
    np.testing.assert_array_equal(tessel.jit(lambda x: unplaced(x) + 1)(x).fetch(), x * 2 + 1)
    with pytest.raises(errors.TesselError, match="donation is not available in MPMD programs"):
        tessel.jit(lambda x, w: stage0(x, w), donate_argnums=0)(x, w)
    inner_b = tessel.jit(lambda x: tessel.with_sharding_constraint(x * 2, RB), in_shardings=RA, out_shardings=RA)
    with pytest.raises(ValueError, match="incompatible placements"):
        tessel.jit(lambda x: inner_b(x))(x)


def test_mesh_names_a_region_and_replicates_what_it_reads(session):
    double_on_b = tessel.jit(lambda v: v * 2, mesh=B)
    x, _, _, _ = _data()
    out = tessel.jit(lambda x, w: double_on_b(stage0(x, w)))(x, _data()[1])
    np.testing.assert_allclose(out.fetch(), np.tanh(x @ _data()[1]) * 2, rtol=1e-6)
    assert set(out.sharding.mesh.devices) == {2, 3}
    # At the top level, mesh= is where the step runs.
    top = tessel.jit(lambda v: v + 1, mesh=B)(x)
    assert top.sharding.mesh == B
    np.testing.assert_array_equal(top.fetch(), x + 1)


def test_a_large_constant_inside_a_region_stays_in_its_program(session):
    table = np.arange(1 << 19, dtype=np.float32).reshape(512, 1024)  # 2 MiB: hoisted at the top level
    add_table = tessel.jit(lambda v: v + table, mesh=B)
    out = tessel.jit(lambda v: add_table(v))(np.ones((512, 1024), np.float32))
    np.testing.assert_array_equal(out.fetch(), table + 1)


def test_values_read_in_another_order_than_they_were_made_meet_their_readers(session):
    # p and q leave A in that order, in one group (A's devices send, B's
    # receive): each is sent as soon as it is made, and B, which reads q
    # first, must still receive p first, as A's senders send them.
    make = tessel.jit(lambda x, w: tnp.tanh(x @ w), in_shardings=(RA, WA), out_shardings=RA)

    @tessel.jit
    def step(x, w1, w2, v):
        p = make(x, w1)
        q = make(x, w2)
        return stage1(q, v), stage1(p, v)

    x, w1, v, _ = _data()
    w2 = (w1[::-1] * 0.5).copy()
    plan = step.lower(x, w1, w2, v)
    assert len(plan.transfers) == 2, plan.transfers
    for _ in range(3):  # the senders' lanes and groups are reused
        from_q, from_p = step(x, w1, w2, v)
        np.testing.assert_allclose(from_q.fetch(), (np.tanh(x @ w2) @ v).sum(axis=1), rtol=1e-5)
        np.testing.assert_allclose(from_p.fetch(), (np.tanh(x @ w1) @ v).sum(axis=1), rtol=1e-5)


# What an error may say it came from under injected faults (as tests/soak_test.cc).
FAULT_CAUSES = (
    "lost in transit",
    "started over in a new epoch",
    "did not reach this collective",
    "no word from",
    "stalled or went away mid-exchange",
    "did not arrive within",
    "Connection closed",
    "Connection reset",
    "Broken pipe",
    "out of step",
    "broke at an earlier collective",
    "cannot run its collectives",
    "connecting to workers",
    "gave up on this group",
    "must start over",
)


def test_a_pipeline_whose_steps_are_lost_or_late_is_right_or_fails_naming_the_cause(cluster):
    # GPipe-shaped and pure (every step gives the same values): forwards on
    # A, each activation sent to B as it is made (one-way), B's step, each
    # gradient sent back as it is made, then A's backwards. Steps are lost
    # in transit or reach the workers late (the coordinator's
    # --inject_faults); a sender whose receiver never comes, or a receiver
    # whose sender was lost, must fail its step naming why, never leave a
    # value READY and wrong, and later steps must run right again.
    fwd0 = tessel.jit(lambda w, x: tnp.tanh(x @ w), in_shardings=(WA, RA), out_shardings=RA)
    fb1 = tessel.jit(lambda v, h: ((h @ v) * 2.0, h * 0.5), in_shardings=(WB, RB), out_shardings=(RB, RB))
    bwd0 = tessel.jit(lambda h, g: h * g + 1.0, in_shardings=(RA, RA), out_shardings=RA)

    @tessel.jit
    def step(w, v, xs):
        hs = [fwd0(w, x) for x in xs]
        made = [fb1(v, h) for h in hs]
        return [o for o, _ in made] + [bwd0(h, g) for h, (_, g) in zip(hs, made)]

    rng = np.random.default_rng(3)
    w, v = rng.standard_normal((16, 32)).astype(np.float32), rng.standard_normal((32, 8)).astype(np.float32)
    xs = [rng.standard_normal((8, 16)).astype(np.float32) for _ in range(4)]
    hs = [np.tanh(x @ w) for x in xs]
    want = [(h @ v) * 2 for h in hs] + [h * (h * 0.5) + 1 for h in hs]
    faults = "drop_step=0.003,delay_step=0.05,max_delay_ms=3,seed=20261127"
    try:
        with tessel.local_cluster(
            workers=2,
            devices_per_worker=2,
            heartbeat_timeout_ms=20000,
            worker_flags=["--collective_timeout_s=2"],
            coordinator_flags=[f"--inject_faults={faults}"],
        ):
            right, failed = 0, []
            for _ in range(40):
                try:
                    got = [o.fetch() for o in step(w, v, xs)]
                except errors.TesselError as e:
                    assert any(c in str(e) for c in FAULT_CAUSES), f"a step failed for no injected cause: {e}"
                    failed.append(str(e))
                    continue
                for g, r in zip(got, want):
                    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)  # f32 sums of 32 products up to 26
                right += 1
            assert failed, "no injected fault reached a step: the test tested nothing"
            assert right >= 20, f"{right} of 40 steps right; failures: {failed[:3]}"
    finally:
        tessel._context.set_default_session(cluster.session)
