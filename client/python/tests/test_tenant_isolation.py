"""Tenants isolated, tried as an attacker would: a secured cluster (TLS, a
tokens file with tenants alice and bob and an admin, a join token) where bob
tries, with real gRPC calls, to run alice's executable, to learn from the
compile cache what alice compiled, to evict alice's executables, to read
alice's activity from his statistics, and to leave buffers on a device that
no array owns. Each attack must be refused or harmless; after each test,
every buffer the workers hold belongs to a live array (Admin.Reconcile)."""

import contextlib
import os
import re
import subprocess
import time

import grpc
import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import _context, _dtypes, errors
from tessel._cluster import find_binary
from tessel._channel import make_channel
from tessel.v1 import session_pb2, worker_pb2, worker_pb2_grpc

from conftest import assert_every_buffer_owned
from test_security import pki, tls_flags  # noqa: F401  (pki is a fixture)

MiB = 1 << 20
TOKENS = (
    "alice-token alice compile_cache_quota=4MiB\n"
    "bob-token   bob   compile_cache_quota=4MiB\n"
    "carol-token carol\n"
    "ops-token   ops   admin\n"
)


@pytest.fixture(scope="module")
def tenants(pki, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("tenants")
    tokens = d / "tokens"
    tokens.write_text(TOKENS)
    previous = _context.default_session_or_none()
    with tessel.LocalCluster(
        2,
        2,
        coordinator_flags=tls_flags(pki)
        + [
            f"--auth_tokens_file={tokens}",
            f"--join_token_file={pki['join']}",
            "--auth_reload_s=1",
            "--session_lease_s=3",
            "--reconcile_interval_s=0",
        ],
        worker_flags=tls_flags(pki) + [f"--join_token_file={pki['join']}"],
        client=dict(token="ops-token", tls_ca=pki["ca"]),
    ) as c:
        c.tokens_file = tokens
        yield c
    _context.set_default_session(previous)


@pytest.fixture
def connect(tenants, pki):  # noqa: F811
    """Opens sessions by token; checks, after the test, that every buffer
    has an owner."""
    opened = []

    def open_session(token):
        s = tessel.connect(tenants.address, token=token, tls_ca=pki["ca"], make_default=False)
        opened.append(s)
        return s

    yield open_session
    for s in opened:
        s.close()
    assert_every_buffer_owned(tenants.session, "after the test")


@contextlib.contextmanager
def as_session(s):
    previous = _context.default_session_or_none()
    _context.set_default_session(s)
    try:
        yield s
    finally:
        _context.set_default_session(previous)


def raw_execute(s, executable_id, arguments):
    out = s.new_handle()
    return s._stub.Execute(
        session_pb2.ExecuteRequest(
            session_id=s.id, executable_id=executable_id, arguments=arguments, outputs=[out], wait=True
        ),
        timeout=10,
    )


def rpc_error(call, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kwargs)
    return e.value.code(), e.value.details()


def test_a_tenant_cannot_run_another_tenants_executable(connect):
    alice, bob = connect("alice-token"), connect("bob-token")
    secret = np.array([7.0, 1.0, 4.0, 2.0], np.float32)

    def reveal(x):
        return x + secret

    with as_session(alice):
        exe = tessel.compile(tessel.jit(reveal), np.zeros(4, np.float32)).executable_id
        x = tessel.device_put(np.ones(4, np.float32))
        np.testing.assert_array_equal(tessel.jit(reveal)(x).fetch(), 1 + secret)  # alice's own runs
    with as_session(bob):
        mine = tessel.device_put(np.zeros(4, np.float32))
    code, theirs = rpc_error(raw_execute, bob, exe, [mine.handle])
    never = "0123456789abcdef0123456789abcdef"
    code_never, unknown = rpc_error(raw_execute, bob, never, [mine.handle])
    assert code == code_never == grpc.StatusCode.NOT_FOUND
    # Nothing tells bob the executable exists: the answer is the one for an id never compiled.
    assert theirs.replace(exe, "ID") == unknown.replace(never, "ID"), (theirs, unknown)
    assert "never compiled here" in theirs


def test_the_compile_cache_says_nothing_of_another_tenants_graphs(connect):
    alice, bob = connect("alice-token"), connect("bob-token")

    def train_step(x):
        return tnp.tanh(x) * 2

    with as_session(alice):
        theirs = tessel.compile(tessel.jit(train_step), np.zeros((4, 3), np.float32))
    with as_session(bob):
        other_shape = tessel.compile(tessel.jit(train_step), np.zeros((5, 3), np.float32))
        same = tessel.compile(tessel.jit(train_step), np.zeros((4, 3), np.float32))
    assert not other_shape.cache_hit
    assert "was compiled before (0 executables of this tenant" in other_shape.cache_miss_reason
    assert "f32[4,3]" not in other_shape.cache_miss_reason and theirs.executable_id not in other_shape.cache_miss_reason
    # Alice's exact graph is a miss for bob, with an id of bob's own: a guess confirms nothing.
    assert not same.cache_hit
    assert same.executable_id != theirs.executable_id


def big_constant_graph(i, nbytes=MiB):
    # A literal shipped in the program: one that varies (a fill would go as one value).
    table = np.arange(nbytes // 4, dtype=np.float32) + float(i)

    def flood(x):
        return x + tnp.mean(tnp.asarray(table))

    return tessel.jit(flood)


def test_a_cache_flood_by_one_tenant_evicts_only_its_own_entries(connect, tenants):
    alice, bob = connect("alice-token"), connect("bob-token")
    with as_session(alice):
        kept = tessel.jit(lambda x: x * 3)
        x = tessel.device_put(np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(kept(x).fetch(), np.arange(4) * 3)
        compiled = tessel.stats()["compiles"]
    evictions = tenants.session.cluster().compile_cache_evictions
    held = {m.device: m.bytes_in_use for m in tenants.session.stats().devices}
    with as_session(bob):
        y = tessel.device_put(np.zeros(4, np.float32))
        for i in range(40):
            big_constant_graph(i)(y).fetch()
    assert tenants.session.cluster().compile_cache_evictions > evictions + 30  # bob's own, past his 4 MiB
    # The workers dropped the evicted programs: 40 MiB of constants loaded,
    # no more than bob's share of the cache still held on the devices.
    grew = sum(m.bytes_in_use - held[m.device] for m in tenants.session.stats().devices)
    assert grew <= 4 * MiB, grew
    with as_session(alice):
        np.testing.assert_array_equal(kept(x).fetch(), np.arange(4) * 3)
        assert tessel.stats()["compiles"] == compiled  # never evicted: nothing compiled again


def test_an_evicted_executable_is_compiled_again_when_called(connect):
    alice = connect("alice-token")
    with as_session(alice):
        small = tessel.jit(lambda x: x - 1)
        x = tessel.device_put(np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(small(x).fetch(), np.arange(4) - 1)
        before = tessel.stats()["compiles"]
        for i in range(10):  # past alice's 4 MiB: the small program loses its place
            big_constant_graph(100 + i, MiB // 4)(x).fetch()
        np.testing.assert_array_equal(small(x).fetch(), np.arange(4) - 1)
        after = tessel.stats()["compiles"]
        assert after == before + 11, (before, after)  # the ten, and the small one again
        for i in range(10):
            big_constant_graph(200 + i, MiB // 4)(x).fetch()
        with tessel.forbid_compiles():
            with pytest.raises(errors.TesselError, match="forbids new compiles.*was evicted from the compile cache"):
                small(x).fetch()


def test_statistics_show_only_the_callers_tenant(connect, tenants, pki):  # noqa: F811
    alice, bob = connect("alice-token"), connect("bob-token")
    with as_session(bob):
        mine = tessel.device_put(np.zeros((256, 256), np.float32), 1)  # 256 KiB on device 1
        before = tessel.memory_stats()
        compiles = tessel.stats()["compiles"]
        devices = tessel.devices()  # a tenant's token may list them
    assert [d.id for d in devices] == [0, 1, 2, 3]
    assert before["devices"][1]["bytes_in_use"] == mine.nbytes and before["devices"][1]["num_buffers"] == 1
    assert before["devices"][0]["bytes_in_use"] == 0
    with as_session(alice):
        theirs = tessel.device_put(np.ones((512, 512), np.float32), 0)  # alice's 1 MiB on device 0
        tessel.jit(lambda v: v * 5)(theirs).fetch()
    with as_session(bob):
        after = tessel.memory_stats()
        assert tessel.stats()["compiles"] == compiles  # alice's compile is not his
    assert after["devices"] == before["devices"]
    r = bob.stats()
    assert r.tenant_view and not tenants.session.stats().tenant_view  # the admin sees the devices' own figures
    # The CLI's status with a tenant's token: the devices and what the tenant holds.
    env = dict(os.environ, TESSEL_TOKEN="bob-token", TESSEL_TLS_CA=pki["ca"], TESSEL_COORDINATOR=tenants.address)
    out = subprocess.run([find_binary("tessel"), "status"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "4 live devices (a tenant's view" in out.stdout
    assert re.search(r"^1 +cpu .* 256\.0 KiB +1$", out.stdout, re.M), out.stdout


def abandoned_direct_put(s, nbytes, device):
    """Takes a PutDirect grant for `nbytes` on `device` and abandons it:
    the stream ends without the client saying it wrote anything. Returns
    the grant's blocks (worker address and ticket)."""
    header = session_pb2.PutRequest.Header(
        session_id=s.id,
        handle=s.new_handle(),
        type=_dtypes.tensor_type((nbytes // 4,), np.float32),
        placement=session_pb2.Placement(device=device),
    )
    sent = [session_pb2.PutDirectRequest(header=header)]
    call = s._stub.PutDirect(iter(sent), timeout=10)
    plan = next(call)
    assert not plan.relay and plan.blocks
    with pytest.raises(grpc.RpcError) as e:  # the stream ends: the put is abandoned
        next(call)
    assert e.value.code() == grpc.StatusCode.ABORTED
    return list(plan.blocks)


def write_by_ticket(block, pki, nbytes):  # noqa: F811
    # A client certificate of the cluster's, as clients that write directly hold.
    ch = make_channel(block.address, token="", tls_ca=pki["ca"], tls_cert=pki["cert"], tls_key=pki["key"])
    try:
        header = worker_pb2.PutShardRequest.Header(
            buffer=block.buffer, type=block.type, devices=block.devices, ticket=block.ticket
        )
        msgs = [worker_pb2.PutShardRequest(header=header), worker_pb2.PutShardRequest(data=b"\0" * min(nbytes, MiB))]
        return worker_pb2_grpc.WorkerStub(ch).PutShard(iter(msgs), timeout=10)
    finally:
        ch.close()


def test_abandoned_tickets_cannot_leave_buffers_without_an_owner(connect, tenants, pki):  # noqa: F811
    alice, bob = connect("alice-token"), connect("bob-token")
    grants = [abandoned_direct_put(bob, 20 * MiB, 0) for _ in range(14)]
    # Then more arrays made and freed than a worker ever remembered retiring (16,384).
    with as_session(bob):
        many = tessel.jit(lambda v: tuple(v + i for i in range(1024)))
        v = tessel.device_put(np.zeros(2, np.float32), 0)
        for _ in range(17):
            outs = many(v)
            bob.delete([o.handle for o in outs])
            for o in outs:
                o._deleted = "deleted"  # deleted above, in one call
    for blocks in grants:  # still inside their minute, the tickets write nothing
        code, why = rpc_error(write_by_ticket, blocks[0], pki, 20 * MiB)
        assert code == grpc.StatusCode.FAILED_PRECONDITION, why
        assert "no open write" in why
    r = tenants.session.reconcile()
    assert r.buffers_checked > 0 and not r.unowned
    held = {m.device: m for m in tenants.session.stats().devices}
    assert held[0].bytes_in_use < 20 * MiB, held[0]
    with as_session(alice):  # the device has room for alice
        big = tessel.device_put(np.ones(4 * MiB, np.float32), 0)
        assert big.fetch()[-1] == 1


def test_revocation_mid_put_frees_the_reservation(connect, tenants, pki):  # noqa: F811
    carol = connect("carol-token")
    blocks = None
    header = session_pb2.PutRequest.Header(
        session_id=carol.id,
        handle=carol.new_handle(),
        type=_dtypes.tensor_type((MiB,), np.float32),
        placement=session_pb2.Placement(device=2),
    )
    pending = [session_pb2.PutDirectRequest(header=header)]

    def requests():
        yield pending[0]
        while not done:
            time.sleep(0.05)

    done = False
    call = carol._stub.PutDirect(requests(), timeout=60)
    blocks = list(next(call).blocks)
    try:
        # The operator revokes carol's token; her session's lease then runs out.
        tenants.tokens_file.write_text(TOKENS.replace("carol-token carol\n", ""))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not any(s.tenant == "carol" for s in tenants.session.list_sessions().sessions):
                break
            time.sleep(0.2)
        else:
            pytest.fail("carol's session outlived her revoked token's lease")
        code, why = rpc_error(write_by_ticket, blocks[0], pki, 4 * MiB)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no open write" in why, why
    finally:
        done = True
        tenants.tokens_file.write_text(TOKENS)
        with contextlib.suppress(grpc.RpcError, StopIteration):
            next(call)
    assert not tenants.session.reconcile().unowned
