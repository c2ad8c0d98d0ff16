"""The jit's fast path: a call whose arguments match the last signature
skips the cache key and the request message. Its results must be those of
the full path, and anything it cannot vouch for must go the full way."""

import numpy as np
import pytest

import tessel
from tessel import _dispatcher, _jit
from tessel.v1 import session_pb2


@pytest.fixture
def full_path_calls(monkeypatch):
    """Counts the calls that take the full path (look up the compile cache)."""
    calls = []
    original = _jit.Jitted._compiled

    def counted(self, args):
        calls.append(self.fn.__name__)
        return original(self, args)

    monkeypatch.setattr(_jit.Jitted, "_compiled", counted)
    return calls


def test_a_step_loop_takes_the_fast_path_and_matches_numpy(session, full_path_calls):
    def scale(s):
        return s * 0.5 + 1.0

    def shift(s):
        return s - 0.25

    f1 = tessel.jit(scale, donate_argnums=0)
    f2 = tessel.jit(shift, donate_argnums=0)
    x0 = np.linspace(-3, 3, 16, dtype=np.float32)
    state = f2(f1(tessel.device_put(x0)))
    assert full_path_calls == ["scale", "shift"]
    expected = (x0 * np.float32(0.5) + np.float32(1.0)) - np.float32(0.25)
    with tessel.transfer_guard("disallow"), tessel.forbid_compiles():
        for _ in range(300):
            state = f2(f1(state))
            expected = (expected * np.float32(0.5) + np.float32(1.0)) - np.float32(0.25)
    # The first call under the new guard went the full way; the rest did not.
    assert full_path_calls == ["scale", "shift"] * 2, "the loop's calls took the full path"
    np.testing.assert_array_equal(state.fetch(), expected)
    # Donation still happens, and is reported, on the fast path.
    assert f1.donation_receipts()[0]["reused"] and f2.donation_receipts()[0]["reused"]
    assert f1.compiles == f2.compiles == 1


def test_pytrees_of_arrays_and_many_outputs_take_the_fast_path(session, full_path_calls):
    @tessel.jit
    def f(params, xs):
        return {"y": [x * params["w"] + params["b"] for x in xs], "n": None, "s": params["w"].sum()}

    rng = np.random.default_rng(0)
    w, b = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    xs = [rng.standard_normal(5).astype(np.float32) for _ in range(20)]  # a request over 127 bytes
    params = {"w": tessel.device_put(w), "b": tessel.device_put(b)}
    dxs = [tessel.device_put(x) for x in xs]
    outs = [f(params, dxs) for _ in range(3)]
    assert full_path_calls == ["f"]
    handles = set()
    for out in outs:
        assert out["n"] is None and len(out["y"]) == 20
        for x, y in zip(xs, out["y"]):
            np.testing.assert_array_equal(y.fetch(), x * w + b)
            handles.add(y.handle)
        np.testing.assert_allclose(float(out["s"]), w.sum(), rtol=1e-6)
    assert len(handles) == 60  # every output its own array
    # Another structure goes the full way, and is right.
    out = f(params, dxs[:2])
    assert full_path_calls == ["f", "f"] and f.compiles == 2
    np.testing.assert_array_equal(out["y"][1].fetch(), xs[1] * w + b)


def test_what_the_fast_path_cannot_vouch_for_goes_the_full_way(session, full_path_calls):
    f = tessel.jit(lambda s: s + 1.0, donate_argnums=0)
    a = tessel.device_put(np.zeros(4, np.float32))
    b = f(a)
    # A donated argument: the full path names what became of it.
    with pytest.raises(tessel.TesselError, match="donated"):
        f(a)
    # Another shape and dtype: traced again, right.
    c = f(tessel.device_put(np.zeros(6, np.float32)))
    d = f(tessel.device_put(np.zeros(4, np.int32)))
    assert f.compiles == 3
    np.testing.assert_array_equal(c.fetch(), np.ones(6))
    np.testing.assert_array_equal(d.fetch(), np.ones(4, np.int32))
    # Keywords bind as the full path binds them.
    np.testing.assert_array_equal(f(s=f(b)).fetch(), np.full(4, 3.0))
    # A host value as an argument is a transfer the full path counts.
    before = tessel.stats()["bytes_host_to_device"]
    np.testing.assert_array_equal(f(np.zeros(4, np.float32)).fetch(), np.ones(4))
    assert tessel.stats()["bytes_host_to_device"] - before == 16


def test_a_new_transfer_guard_reaches_the_next_call(session):
    f = tessel.jit(lambda x, y: x + y)
    x = tessel.device_put(np.ones(4, np.float32), device=0)
    y = tessel.device_put(np.ones(4, np.float32), device=1)  # read on device 0: a device->device move
    np.testing.assert_array_equal(f(x, y).fetch(), np.full(4, 2.0))
    np.testing.assert_array_equal(f(x, y).fetch(), np.full(4, 2.0))
    with tessel.transfer_guard(device_to_device="disallow"):
        with pytest.raises(tessel.TransferGuardError, match="device->device"):
            f(x, y).fetch()
    np.testing.assert_array_equal(f(x, y).fetch(), np.full(4, 2.0))


def test_each_session_gets_its_own_calls(cluster, session):
    f = tessel.jit(lambda x: x * 3)
    a = f(tessel.device_put(np.ones(2, np.float32)))
    other = tessel.connect(cluster.address)  # now the default session
    try:
        b = f(tessel.device_put(np.full(2, 2, np.float32)))
        assert b._session is other and f.compiles == 2
        np.testing.assert_array_equal(b.fetch(), [6, 6])
        tessel._context.set_default_session(session)
        c = f(a)
        assert c._session is session
        np.testing.assert_array_equal(c.fetch(), [9, 9])
    finally:
        other.close()
        tessel._context.set_default_session(session)


def test_handles_and_their_encodings_agree_with_protobuf():
    import random

    batch = list(_dispatcher.handle_batch(random.Random(7), n=512))
    assert len({h for h, _ in batch}) == 512
    for h, enc in batch:
        assert 0 < h < 1 << 63
        # protobuf's own encoding of the handle as ExecuteRequest.outputs (packed: tag, length, varint)
        wire = session_pb2.ExecuteRequest(outputs=[h]).SerializeToString()
        assert wire == b"\x22" + bytes((len(enc),)) + enc
        assert _dispatcher.varint(h) == enc
    for v in (0, 1, 127, 128, 300, (1 << 64) - 1):
        assert session_pb2.ExecuteRequest(arguments=[v]).SerializeToString()[2:] == _dispatcher.varint(v)
