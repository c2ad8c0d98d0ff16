"""Remote arrays, jit (pytrees, caching, static arguments, plans), memory
stats, errors as exception classes, and the progress bar."""

import gc
import io
import pathlib
import re
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import _array

# ---------------------------------------------------------------- arrays


def test_device_put_and_array_properties(session):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = tessel.device_put(x, 3)
    assert (a.shape, a.dtype, a.ndim, a.size, a.nbytes) == ((3, 4), np.float32, 2, 12, 48)
    assert a.sharding == tessel.SingleDeviceSharding(3) and a.devices() == (3,)
    assert len(a) == 3 and not a.is_deleted()
    assert a.block_until_ready() is a
    np.testing.assert_array_equal(a.fetch(), x)
    np.testing.assert_array_equal(np.asarray(a), x)
    assert "tessel.Array([[ 0.,  1.,  2.,  3.]" in repr(a)
    r = tessel.device_put(x, tessel.ReplicatedSharding())
    assert r.devices() == (0, 1, 2, 3)
    d = tessel.devices()[1]
    assert tessel.device_put(x, d).devices() == (1,)
    assert tessel.device_put(a, 3) is a
    # Placed elsewhere: a copy, moved device to device (test_reshard.py has the rest).
    b = tessel.device_put(a, 0)
    assert b is not a and b.devices() == (0,) and a.devices() == (3,)
    assert b.reshard_receipt["bytes_moved"] == 48
    np.testing.assert_array_equal(b.fetch(), x)


def test_scalars_convert_like_numpy(session):
    s = tessel.device_put(np.float32(2.5))
    assert s.shape == () and float(s) == 2.5 and int(s) == 2 and bool(s)
    with pytest.raises(TypeError, match="only one-element arrays convert"):
        float(tessel.device_put(np.ones(3)))


def test_delete_and_is_deleted(session):
    a = tessel.device_put(np.ones(4, np.float32))
    a.delete()
    assert a.is_deleted()
    with pytest.raises(tessel.NotFoundError):
        a.fetch()


def test_steps_run_where_their_arguments_live(session):
    f = tessel.jit(lambda x: x * 2)
    assert f(tessel.device_put(np.ones(2), 2)).devices() == (2,)
    g = tessel.jit(lambda x: x * 2, device=1)
    y = g(np.ones(2))  # a host value goes to the step's device
    assert y.devices() == (1,)
    np.testing.assert_array_equal(y.fetch(), [2.0, 2.0])


def test_arrays_dropped_by_python_are_freed(session):
    f = tessel.jit(lambda x: x + 1)
    x = tessel.device_put(np.zeros(256, np.float32))
    with tessel.assert_no_memory_growth():
        for _ in range(300):
            y = f(x)
            del y
    assert tessel.memory_stats()["live_arrays"] == 1


def test_the_garbage_of_a_loop_never_holds_more_than_one_batch_per_device(session):  # restores the default session
    """A loop of 1 MiB states, not donated, drops one state per step:
    each rides with the next call, which deletes it first (docs/python.md),
    so the device's peak rises by at most the states in flight, not by the
    loop's 400 MiB. Nothing waits for Python's cyclic collector (off here):
    a step's outputs rebuilt into its result's structure are freed when
    dropped."""
    gc.collect()
    gc.disable()
    try:
        with tessel.local_cluster(workers=1, devices_per_worker=1):
            f = tessel.jit(lambda s: {"s": s * 0.5 + 1.0, "total": s.sum()})
            with pytest.warns(tessel.DonationWarning, match=r"argument 0 's' \(1.0 MiB\) was dropped after the call"):
                out = f(f(tessel.device_put(np.zeros(1 << 18, np.float32)))["s"])
                out["s"].block_until_ready()
                before = tessel.memory_stats()["devices"][0]["peak_bytes_in_use"]
                for _ in range(400):
                    out = f(out["s"])
            out["s"].block_until_ready()
            tessel._context.session().collect(force=True)
            stats = tessel.memory_stats()
            growth = stats["devices"][0]["peak_bytes_in_use"] - before
            assert growth <= 2 << 20, f"peak grew by {growth / 2**20:.1f} MiB"
            assert stats["live_arrays"] == 2, stats  # the last step's two outputs
            np.testing.assert_allclose(out["s"].fetch()[0], 2.0 * (1 - 0.5**402), rtol=1e-6)
    finally:
        gc.enable()


def test_a_forgotten_donation_is_a_warning_a_receipt_and_under_strict_donation_an_error(session):
    """A loop whose state is not donated (say a refactor moved
    donate_argnums) drops each old state right after the call: a
    DonationWarning names the argument, its size and the output it could
    have been donated into, once; the receipts list it, not donated, with
    why; strict donation refuses it. An argument used after the call
    (fetched), a donated one, a small one and eager ops say nothing."""
    step = tessel.jit(lambda state, x: (state * 0.5 + x, (state * x).sum()))
    state = tessel.device_put(np.zeros(1 << 18, np.float32))
    with pytest.warns(tessel.DonationWarning) as caught:
        for _ in range(4):
            state, loss = step(state, np.float32(1.0))
        session_collect = tessel._context.session().collect
        session_collect(force=True)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert re.search(
        r"jit of <lambda>: argument 0 'state' \(1.0 MiB\) was dropped after the call, not donated; "
        r"it could have been donated into output 0",
        str(caught[0].message),
    )
    receipts = step.donation_receipts()
    assert [(r["argument"], r["donated"], r["reused"], r["output"]) for r in receipts] == [(0, False, False, 0)]
    assert "not donated: output 0 has the type of 'state'" in receipts[0]["reason"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", tessel.DonationWarning)
        kept = step(state, np.float32(1.0))  # used after the call: nothing to say
        state.fetch()
        del state
        donated = tessel.jit(lambda state, x: (state * 0.5 + x, (state * x).sum()), donate_argnums=0)
        state = tessel.device_put(np.zeros(1 << 18, np.float32))
        for _ in range(3):
            state, loss = donated(state, np.float32(1.0))
        assert [r["donated"] for r in donated.donation_receipts()] == [True]
        small = tessel.jit(lambda s: s + 1)
        s = tessel.device_put(np.zeros(4, np.float32))
        for _ in range(3):
            s = small(s)
        y = tessel.device_put(np.zeros(1 << 18, np.float32))
        for _ in range(3):
            y = y + 1.0  # eager: no donation to offer
        session_collect(force=True)
    del kept
    with tessel.session_options(strict_donation=True):
        with pytest.raises(tessel.FailedPreconditionError, match=r"strict donation: jit of <lambda>: argument 0 's'"):
            for _ in range(3):
                s = small(s)
            session_collect(force=True)


def test_memory_stats(session):
    before = tessel.memory_stats()
    a = tessel.device_put(np.zeros(1 << 16, np.float32), 2)
    a.block_until_ready()
    now = tessel.memory_stats()
    assert now["live_arrays"] == before["live_arrays"] + 1
    assert now["live_bytes"] == before["live_bytes"] + (1 << 18)
    assert now["devices"][2]["bytes_in_use"] >= before["devices"][2]["bytes_in_use"] + (1 << 18)
    assert set(now["devices"]) == {0, 1, 2, 3}
    assert now["devices"][2]["peak_bytes_in_use"] >= now["devices"][2]["bytes_in_use"]


# ---------------------------------------------------------------- jit


def test_pytrees_in_and_out(session):
    @tessel.jit
    def f(params, xs):
        w, b = params["w"], params["b"]
        return {"y": [x @ w + b for x in xs], "n": None, "t": (w.sum(), b)}

    w, b = np.eye(3, dtype=np.float32), np.ones(3, np.float32)
    xs = [np.full((2, 3), i, np.float32) for i in range(2)]
    out = f({"w": w, "b": b}, xs)
    assert set(out) == {"y", "n", "t"} and out["n"] is None and isinstance(out["t"], tuple)
    for i, y in enumerate(out["y"]):
        np.testing.assert_array_equal(y.fetch(), xs[i] @ w + b)
    assert float(out["t"][0]) == 3.0


def test_compiles_once_per_signature_and_explains_a_miss(session):
    f = tessel.jit(lambda x, y: x * y)
    f(np.ones(4, np.float32), 2.0)
    f(np.zeros(4, np.float32), 3.0)  # same signature: a hit
    assert f.compiles == 1
    f(np.ones(5, np.float32), 2.0)
    assert f.compiles == 2 and f.last_miss == "argument x: float32[4] -> float32[5]"
    f(np.ones(4, np.int32), 2.0)
    assert f.last_miss == "argument x: float32[4] -> int32[4]"
    assert tessel.stats()["compiles"] == 3


def test_static_arguments(session):
    f = tessel.jit(lambda x, n: x * n if n > 1 else -x, static_argnums=1)
    np.testing.assert_array_equal(f(np.ones(2), 3).fetch(), [3.0, 3.0])
    np.testing.assert_array_equal(f(np.ones(2), 1).fetch(), [-1.0, -1.0])
    assert f.compiles == 2 and "static arguments" in f.last_miss


def test_donate_argnames(session):
    f = tessel.jit(lambda state, x: state + x, donate_argnames="state")
    s = tessel.device_put(np.zeros(8, np.float32))
    s2 = f(s, np.ones(8, np.float32))
    assert s.is_deleted() and f.donation_receipts()[0]["reused"]
    np.testing.assert_array_equal(s2.fetch(), np.ones(8))
    with pytest.raises(ValueError, match="has no argument 'nope'"):
        tessel.jit(lambda a: a, donate_argnames="nope")


def test_compile_shows_the_plan(session):
    c = tessel.compile(lambda x: tnp.exp(x) * 2 + 1, np.zeros((4, 4), np.float32))
    text = c.as_text()
    assert "fusion" in text and "exp" in text and "%x = parameter()" in text, text
    assert c.input_types == ["f32[4,4]"] and c.output_types == ["f32[4,4]"]
    assert c.estimated_bytes > 0


def test_tracing_errors_are_python_errors(session):
    with pytest.raises(TypeError, match="its value is not known while tracing"):
        tessel.jit(lambda x: x * 2 if x > 0 else x)(np.ones(2))
    with pytest.raises(ValueError, match="cannot reshape"):
        tessel.jit(lambda x: x.reshape(3, 3))(np.ones(4))
    with pytest.raises(TypeError, match="dtype complex128 is not supported"):
        tessel.jit(lambda x: x)(np.ones(2, np.complex128))


# ---------------------------------------------------------------- errors


def test_server_errors_are_exception_classes_with_its_message(session):
    with pytest.raises(tessel.InvalidArgumentError, match="device 99"):
        tessel.device_put(np.ones(2), 99).block_until_ready()
    with tessel.session_options(memory_quota_bytes=1024):
        with pytest.raises(tessel.OutOfMemoryError, match="quota"):
            tessel.device_put(np.ones(4096, np.float32))
    with pytest.raises(TypeError, match="unknown option 'nope'"):
        with tessel.session_options(nope=1):
            pass
    with pytest.raises(ValueError, match="transfer guard level 'never'"):
        with tessel.transfer_guard("never"):
            tessel.device_put(np.ones(2))
    for cls in (
        tessel.InvalidArgumentError,
        tessel.DonatedArrayError,
        tessel.TransferGuardError,
        tessel.OutOfMemoryError,
        tessel.WorkerLostError,
        tessel.RecompileError,
    ):
        assert issubclass(cls, tessel.TesselError)


def _sessions(address):
    import grpc
    from tessel.v1 import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return list(admin_pb2_grpc.AdminStub(ch).ListSessions(admin_pb2.ListSessionsRequest(), timeout=5).sessions)


def _device_bytes_in_use(address):
    import grpc
    from tessel.v1 import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        resp = admin_pb2_grpc.AdminStub(ch).GetCluster(admin_pb2.GetClusterRequest(with_memory=True), timeout=5)
    return sum(m.bytes_in_use for w in resp.workers for m in w.memory)


def test_a_killed_clients_session_expires_and_its_memory_is_freed():
    """A client SIGKILLed while holding 16 MiB: the session's lease (1 s
    here) runs out, the coordinator frees its arrays on the workers and
    forgets it, and Admin.ListSessions no longer shows it. A live client
    idle for several leases keeps its session (the SDK renews it)."""
    import subprocess
    import sys
    import textwrap

    with tessel.local_cluster(workers=1, devices_per_worker=1, coordinator_flags=["--session_lease_s=1"]) as c:
        kept = tessel.device_put(np.arange(4, dtype=np.float32))
        kept.block_until_ready()
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(f"""
            import sys, time, numpy as np, tessel
            s = tessel.connect({c.address!r})
            x = tessel.device_put(np.ones(1 << 22, np.float32))
            x.block_until_ready()
            print(s.id, flush=True)
            time.sleep(600)
            """),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            sid = holder.stdout.readline().strip()
            info = {s.session_id: s for s in _sessions(c.address)}
            assert sid in info, (sid, info)
            assert info[sid].arrays == 1 and info[sid].live_bytes == 16 << 20 and info[sid].lease_ms == 1000
            assert info[sid].client == "tessel-python"
            assert _device_bytes_in_use(c.address) >= 16 << 20
        finally:
            holder.kill()
            holder.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sid in {s.session_id for s in _sessions(c.address)}:
            time.sleep(0.1)
        assert sid not in {s.session_id for s in _sessions(c.address)}, "the killed client's session outlived its lease"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _device_bytes_in_use(c.address) >= 16 << 20:
            time.sleep(0.1)
        assert _device_bytes_in_use(c.address) < 16 << 20, "the expired session's 16 MiB is still held"
        time.sleep(3)  # three leases idle: this process's session is renewed in the background
        np.testing.assert_array_equal(kept.fetch(), np.arange(4, dtype=np.float32))
        assert c.session.id in {s.session_id for s in _sessions(c.address)}


def test_an_operator_closes_a_session_and_its_client_is_told_why():
    import grpc
    from tessel.v1 import admin_pb2, admin_pb2_grpc

    with tessel.local_cluster(workers=1, devices_per_worker=1) as c:
        x = tessel.device_put(np.ones(1024, np.float32))
        x.block_until_ready()
        mine = [s for s in _sessions(c.address) if s.session_id == c.session.id]
        assert len(mine) == 1 and mine[0].arrays == 1 and mine[0].live_bytes == 4096 and mine[0].lease_ms == 60000
        with grpc.insecure_channel(c.address) as ch:
            resp = admin_pb2_grpc.AdminStub(ch).CloseSession(
                admin_pb2.AdminCloseSessionRequest(session_id=c.session.id, reason="maintenance"), timeout=5
            )
        assert resp.arrays_freed == 1
        with pytest.raises(tessel.TesselError, match="was closed by an operator \\(Admin.CloseSession\\): maintenance"):
            x.fetch()
        with grpc.insecure_channel(c.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                admin_pb2_grpc.AdminStub(ch).CloseSession(
                    admin_pb2.AdminCloseSessionRequest(session_id="s-nope"), timeout=5
                )
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "s-nope" in e.value.details()


def test_out_of_device_memory_is_an_error_and_the_cluster_keeps_serving():
    with tessel.local_cluster(workers=1, devices_per_worker=1, worker_flags=["--device_memory_bytes=1048576"]) as c:
        f = tessel.jit(lambda x: tnp.concatenate([x, x, x, x]))
        x = tessel.device_put(np.ones(1 << 17, np.float32))  # 512 KiB of the 1 MiB
        with pytest.raises(tessel.OutOfMemoryError, match="device cpu:0 out of memory: allocating 2097152 bytes"):
            f(x).fetch()
        np.testing.assert_array_equal((x[:4] + 1).fetch(), [2, 2, 2, 2])
        assert c.session is not None


def test_a_lost_worker_fails_its_arrays_and_the_rest_keeps_serving():
    with tessel.local_cluster(workers=2, devices_per_worker=1, heartbeat_timeout_ms=500) as c:
        on_w1 = tessel.device_put(np.ones(4, np.float32), 1)
        on_w0 = tessel.device_put(np.ones(4, np.float32), 0)
        on_w1.block_until_ready()
        c.kill_worker(1)
        with pytest.raises(tessel.WorkerLostError, match="stopped heartbeating|unavailable|dead"):
            for _ in range(100):  # until the coordinator notices
                (on_w1 * 2).fetch()
        np.testing.assert_array_equal((on_w0 * 2).fetch(), [2, 2, 2, 2])
        deadline = time.monotonic() + 10  # the heartbeat timeout marks the worker dead
        while [d.id for d in tessel.devices()] != [0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [d.id for d in tessel.devices()] == [0]


# ---------------------------------------------------------------- clusters and progress


def test_local_cluster_stops_its_processes_also_on_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with tessel.local_cluster(workers=1) as c:
            pids = list(c._procs)
            raise RuntimeError("boom")
    assert all(p.poll() is not None for p in pids)
    with pytest.raises(RuntimeError, match="no Tessel session"):
        tessel.device_put(np.ones(1))


def test_connect_needs_an_address(monkeypatch):
    monkeypatch.delenv("TESSEL_COORDINATOR", raising=False)
    with pytest.raises(ValueError, match="TESSEL_COORDINATOR"):
        tessel.connect()
    with pytest.raises(tessel.WorkerLostError, match="no coordinator at 127.0.0.1:1"):
        tessel.connect("127.0.0.1:1", timeout=0.2)


def test_connecting_to_a_refused_port_fails_fast():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(tessel.WorkerLostError, match=f"no coordinator at 127.0.0.1:{port}"):
        tessel.connect(f"127.0.0.1:{port}", timeout=10)
    assert time.monotonic() - t0 < 1.0


def test_progress_bar_draws_on_a_terminal(session, monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(_array, "_PROGRESS_MIN_BYTES", 1 << 20)
    x = np.zeros(3 << 18, np.float32)  # 3 MiB: three chunks
    a = tessel.device_put(x)
    np.testing.assert_array_equal(a.fetch(), x)
    text = err.getvalue()
    assert "put float32[786432] [" in text and "fetch" in text and "3/3 MiB" in text, text


def test_the_readme_example_runs(capsys):
    readme = (pathlib.Path(__file__).resolve().parents[3] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "donate %state['w'] -> output 1" in out and "'reused': True" in out and " 2000" in out, out


def test_a_jitted_function_compiles_again_on_another_cluster(session):
    f = tessel.jit(lambda x: x * 3)
    np.testing.assert_array_equal(f(np.ones(2, np.float32)).fetch(), [3, 3])
    with tessel.local_cluster(workers=1):
        np.testing.assert_array_equal(f(np.ones(2, np.float32)).fetch(), [3, 3])
        np.testing.assert_array_equal((tessel.device_put(np.ones(2)) * 2).fetch(), [2, 2])
    tessel._context.set_default_session(session)
    np.testing.assert_array_equal(f(np.ones(2, np.float32)).fetch(), [3, 3])
    assert f.compiles == 2


def test_local_cluster_daemons_stop_when_the_program_is_killed(tmp_path):
    script = tmp_path / "victim.py"
    script.write_text(
        "import os, signal, tessel\n"
        "c = tessel.local_cluster(workers=2)\n"
        "print(' '.join(str(p.pid) for p in c._procs), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60).stdout
    pids = [int(p) for p in out.split()]
    assert len(pids) == 3, out
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        time.sleep(0.05)
    assert not alive, f"daemons still running after their parent was killed: {alive}"


def _running(pid):
    try:  # a zombie (state Z) has exited; init reaps it
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
