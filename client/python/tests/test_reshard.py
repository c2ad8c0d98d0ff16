"""device_put of an Array onto another placement (another mesh, another
sharding, one device, every device): the copy must hold the same values as
the numpy array it came from, and exactly the bytes each device lacked must
move between devices, counted device to device. The bytes each device
should receive are worked out here from the shardings with numpy masks,
independently of the coordinator's planner."""

import itertools

import numpy as np
import pytest

import tessel
from tessel import Mesh, NamedSharding, P, ReplicatedSharding, SingleDeviceSharding, errors
from tessel._context import session as current_session

from conftest import DEVICE_KIND

pytestmark = pytest.mark.skipif(DEVICE_KIND != "cpu", reason="resharding moves blocks of host-memory devices only")

SHAPE = (8, 12)
ALL = [0, 1, 2, 3]


def _held(where, shape):
    """device -> boolean mask of the global elements it holds."""
    if isinstance(where, SingleDeviceSharding):
        return {where.device: np.ones(shape, bool)}
    if isinstance(where, ReplicatedSharding):
        return {d: np.ones(shape, bool) for d in ALL}
    mesh, spec = where.mesh, tuple(where.spec) + (None,) * (len(shape) - len(tuple(where.spec)))
    out = {}
    for pos, dev in enumerate(mesh.devices):
        coords = dict(zip(mesh.axis_names, np.unravel_index(pos, mesh.axis_sizes)))
        mask = np.zeros(shape, bool)
        index = []
        for dim, axes in zip(shape, spec):
            axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
            parts, k = 1, 0
            for a in axes:
                k = k * mesh.shape[a] + int(coords[a])
                parts *= mesh.shape[a]
            size = dim // parts
            index.append(slice(k * size, (k + 1) * size))
        mask[tuple(index)] = True
        out[dev] = mask
    return out


def _expected_received(src, dst, shape, itemsize):
    have, want = _held(src, shape), _held(dst, shape)
    return {d: int((m & ~have.get(d, np.zeros(shape, bool))).sum()) * itemsize for d, m in want.items()}


def _received(s):
    return {t.device: t.device_to_device for t in s.stats().device_transfers}


PLACEMENTS = [
    NamedSharding(Mesh({"x": 2}, devices=[0, 1]), P("x")),
    NamedSharding(Mesh({"x": 2}, devices=[2, 3]), P("x")),
    NamedSharding(Mesh({"x": 2}, devices=[3, 1]), P(None, "x")),
    NamedSharding(Mesh({"data": 2, "model": 2}), P("data", "model")),
    NamedSharding(Mesh({"data": 2, "model": 2}, devices=[3, 2, 1, 0]), P("model", "data")),
    NamedSharding(Mesh({"data": 2, "model": 2}), P(None, ("model", "data"))),
    NamedSharding(Mesh({"data": 2, "model": 2}), P("data")),  # copies over `model`
    NamedSharding(Mesh({"x": 4}), P("x")),
    SingleDeviceSharding(2),
    ReplicatedSharding(),
]


@pytest.mark.parametrize("src,dst", [(a, b) for a, b in itertools.permutations(PLACEMENTS, 2)][::3])
def test_a_copy_holds_the_values_and_moves_only_what_each_device_lacked(session, src, dst):
    x = np.random.default_rng(7).standard_normal(SHAPE).astype(np.float32)
    a = tessel.device_put(x, src)
    before = _received(current_session())
    b = tessel.device_put(a, dst)
    got = b.fetch()
    np.testing.assert_array_equal(got, x)
    np.testing.assert_array_equal(a.fetch(), x)  # the source stays
    want = _expected_received(src, dst, SHAPE, 4)
    after = _received(current_session())
    for d, n in want.items():
        assert after.get(d, 0) - before.get(d, 0) == n, (d, src, dst)
    assert b.reshard_receipt["bytes_moved"] == sum(want.values())
    held = sum(int(m.sum()) for m in _held(dst, SHAPE).values()) * 4
    assert b.reshard_receipt["bytes_moved"] + b.reshard_receipt["bytes_copied"] == held
    assert b.sharding == dst


def test_an_array_of_one_mesh_feeds_a_jit_on_another_once_moved(session):
    mesh_a, mesh_b = Mesh({"x": 2}, devices=[0, 1]), Mesh({"x": 2}, devices=[2, 3])
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    on_a = tessel.device_put(x, NamedSharding(mesh_a, P("x")))
    f = tessel.jit(lambda v: v * 2 + 1)
    add = tessel.jit(lambda u, v: u + v)
    with pytest.raises(ValueError, match="incompatible placements"):
        add(on_a, tessel.device_put(x, NamedSharding(mesh_b, P("x"))))
    on_b = tessel.device_put(on_a, NamedSharding(mesh_b, P("x")))
    out = add(on_b, tessel.device_put(x, NamedSharding(mesh_b, P("x"))))
    assert out.sharding.mesh == mesh_b
    np.testing.assert_array_equal(out.fetch(), 2 * x)
    np.testing.assert_array_equal(f(on_b).fetch(), x * 2 + 1)


def test_a_copy_reads_the_result_of_the_step_queued_before_it(session):
    mesh_a, mesh_b = Mesh({"x": 2}, devices=[0, 1]), Mesh({"x": 2}, devices=[3, 2])
    x = np.random.default_rng(3).standard_normal((8, 6)).astype(np.float32)
    v = tessel.device_put(x, NamedSharding(mesh_a, P("x")))
    step = tessel.jit(lambda u: u * 2)
    copies = []
    for _ in range(5):
        v = step(v)  # not awaited: the copy is queued behind it on each device
        copies.append(tessel.device_put(v, NamedSharding(mesh_b, P(None, "x"))))
    for i, c in enumerate(copies):
        np.testing.assert_array_equal(c.fetch(), x * 2.0 ** (i + 1))


def test_copies_and_collectives_over_the_same_devices_keep_their_order_pipelined(session):
    # Devices 0 and 2 are on different workers: each copy's exchange and
    # each psum meet in the same group, and nothing is awaited until the end.
    mesh = Mesh({"x": 2}, devices=[0, 2])
    rows, cols = NamedSharding(mesh, P("x")), NamedSharding(mesh, P(None, "x"))
    psum = tessel.jit(tessel.shard_map(lambda b: tessel.psum(b * 2, "x"), mesh, in_specs=(P("x"),), out_specs=P("x")))
    inc = tessel.jit(lambda u: u + 1)
    x = np.random.default_rng(9).integers(-50, 50, (8, 6)).astype(np.float32)
    w = tessel.device_put(x, rows)
    v = w
    outs, copies = [], []
    for _ in range(8):
        v = tessel.device_put(tessel.device_put(v, cols), rows)  # there and back, worker to worker
        outs.append(psum(w))  # reads no copy: only the order of the group's rounds keeps it apart
        copies.append(v)
        outs.append(psum(v))
        v = inc(v)
        w = inc(w)
    for i in range(8):
        block = 2 * ((x[:4] + i) + (x[4:] + i))
        np.testing.assert_array_equal(outs[2 * i].fetch(), np.concatenate([block, block]))
        np.testing.assert_array_equal(outs[2 * i + 1].fetch(), np.concatenate([block, block]))
        np.testing.assert_array_equal(copies[i].fetch(), x + i)


def test_the_guard_judges_a_copy_as_an_explicit_device_to_device_transfer(session):
    x = tessel.device_put(np.ones((8, 4), np.float32), NamedSharding(Mesh({"x": 2}, devices=[0, 1]), P("x")))
    other = NamedSharding(Mesh({"x": 2}, devices=[2, 3]), P("x"))
    with tessel.transfer_guard(device_to_device="disallow_explicit"):
        with pytest.raises(errors.TesselError, match=r"explicit device->device transfer of array .* disallowed"):
            tessel.device_put(x, other)
    with tessel.transfer_guard("disallow"):  # implicit transfers only
        np.testing.assert_array_equal(tessel.device_put(x, other).fetch(), np.ones((8, 4), np.float32))


def test_a_copy_of_a_deleted_array_or_onto_a_bad_placement_is_a_clear_error(session):
    x = tessel.device_put(np.ones((8, 4), np.float32), NamedSharding(Mesh({"x": 2}), P("x")))
    with pytest.raises(errors.TesselError, match="does not split evenly"):
        tessel.device_put(x, NamedSharding(Mesh({"x": 3}, devices=[0, 1, 2]), P("x")))
    with pytest.raises(errors.TesselError, match="device 7"):
        tessel.device_put(x, 7)
    y = tessel.device_put(x, 3)
    x.delete()
    with pytest.raises(errors.TesselError, match="deleted"):
        tessel.device_put(tessel.Array(x._session, x.handle, x.shape, x.dtype, x._placement), 2)
    np.testing.assert_array_equal(y.fetch(), np.ones((8, 4), np.float32))
