"""Direct transfers from Python: an array's blocks written and read straight
to and from the workers holding them, checked against the numpy array put;
what goes one way directly comes back the other through the coordinator's
relay, whose block routing is its own code. An unreachable worker is
reached through the coordinator."""

import numpy as np
import pytest

import tessel
from tessel import Mesh, NamedSharding, P
from tessel._sharding import to_placement

MESH = {"data": 2, "model": 2}


@pytest.fixture
def direct(cluster):
    """A session moving every array directly, however small."""
    s = tessel.connect(cluster.address, make_default=False, direct_min_bytes=0)
    yield s
    s.close()


@pytest.mark.parametrize(
    "shape,dtype,spec,blocks,writes",
    [
        ((1000, 37), np.float32, None, 1, 1),
        ((), np.int64, None, 1, 1),
        ((0, 5), np.uint8, None, 1, 1),
        ((8, 6), np.float32, P("data", None), 2, 2),
        ((8, 6), np.float32, P(None, "model"), 2, 4),
        ((6, 10), np.int32, P("data", "model"), 4, 4),
        ((4, 6, 8), np.float64, P(None, "model", "data"), 4, 4),
        ((512, 2048), np.float32, P("model", "data"), 4, 4),
    ],
)
def test_blocks_go_straight_to_and_from_their_workers(direct, shape, dtype, spec, blocks, writes):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 100).astype(dtype)
    where = to_placement(3 if spec is None else NamedSharding(Mesh(MESH), spec))
    before = tessel.stats(direct)

    h = direct.put(x, where)
    assert direct.last_transfer == tessel.TransferReceipt(True, writes, "")
    np.testing.assert_array_equal(direct.fetch(h, direct=False), x)
    assert direct.last_transfer == tessel.TransferReceipt(False, 0, "")

    h2 = direct.put(x, where, direct=False)
    mid = tessel.stats(direct)
    np.testing.assert_array_equal(direct.fetch(h2), x)
    assert direct.last_transfer == tessel.TransferReceipt(True, blocks, "")
    # The coordinator counts what it authorised: a fetch reads each block once.
    assert tessel.stats(direct)["bytes_device_to_host"] - mid["bytes_device_to_host"] == x.nbytes
    assert mid["bytes_host_to_device"] - before["bytes_host_to_device"] == 2 * direct.info(h).bytes_per_device * len(
        direct.info(h).devices
    )
    direct.delete([h, h2])


def test_a_directly_put_array_is_what_steps_read(cluster):
    s = tessel.connect(cluster.address, direct_min_bytes=0)
    try:
        x = np.random.default_rng(2).standard_normal((8, 6)).astype(np.float32)
        a = tessel.device_put(x, 2)
        assert s.last_transfer.direct
        np.testing.assert_allclose(
            np.asarray(tessel.jit(lambda v: tessel.numpy.sum(v, axis=1))(a)), x.sum(axis=1), rtol=1e-5
        )
    finally:
        s.close()
        tessel._context.set_default_session(cluster.session)


def test_small_arrays_go_through_the_coordinator_by_default(session):
    small, big = np.arange(16, dtype=np.float32), np.arange(1 << 18, dtype=np.float32)
    a = tessel.device_put(small)
    assert not session.last_transfer.direct
    np.testing.assert_array_equal(a.fetch(), small)
    assert not session.last_transfer.direct
    b = tessel.device_put(big)
    assert session.last_transfer.direct
    np.testing.assert_array_equal(b.fetch(), big)
    assert session.last_transfer.direct


def test_a_direct_put_is_judged_as_any_put(direct):
    x = np.ones((64, 64), np.float32)
    with pytest.raises(tessel.TransferGuardError):
        direct.put(x, to_placement(0), guard={"host_to_device": "disallow_explicit"})
    assert not direct.last_transfer.direct
    with pytest.raises(tessel.TesselError, match="device 99"):
        direct.put(x, to_placement(99))


def test_a_session_that_opts_out_is_relayed(cluster):
    s = tessel.connect(cluster.address, make_default=False, direct_transfers=False, direct_min_bytes=0)
    try:
        x = np.arange(48, dtype=np.int32).reshape(8, 6)
        h = s.put(x, to_placement(NamedSharding(Mesh(MESH), P("data", "model"))))
        assert s.last_transfer == tessel.TransferReceipt(False, 0, "")
        np.testing.assert_array_equal(s.fetch(h), x)
        assert s.last_transfer == tessel.TransferReceipt(False, 0, "")
    finally:
        s.close()


def test_an_unreachable_worker_is_reached_through_the_coordinator():
    with tessel.local_cluster(
        workers=2, worker_flags=["--client_address=127.0.0.1:1"], client={"direct_min_bytes": 0}
    ) as c:
        x = np.random.default_rng(3).standard_normal((300, 7)).astype(np.float32)
        a = tessel.device_put(x, NamedSharding(Mesh({"data": 2}), P("data", None)))
        r = c.session.last_transfer
        assert not r.direct and "127.0.0.1:1" in r.relayed_because and "UNAVAILABLE" in r.relayed_because, r
        # Not tried again for a while.
        np.testing.assert_array_equal(a.fetch(), x)
        assert "not retried" in c.session.last_transfer.relayed_because
