"""The daemons and the CLI as an operator meets them: health by service name
(a worker without its coordinator is NOT_SERVING, and says so once), each
daemon's --help and --version, and the CLI refusing flags it does not know.
Real processes on loopback; health is asked through `tessel health` (the
gRPC health service's Check)."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import types

import pytest

from tessel._cluster import find_binary


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(address, service=""):
    p = subprocess.run(
        [find_binary("tessel"), "health", "--address", address, "--service", service, "--timeout", "2"],
        capture_output=True,
        text=True,
    )
    return p.returncode, (p.stdout + p.stderr).strip()


def wait_for(address, service, rc, seconds=15):
    deadline = time.monotonic() + seconds
    while True:
        got = health(address, service)
        if got[0] == rc or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def start_coordinator(port, tmp_path, log):
    port_file = tmp_path / f"port-{time.monotonic_ns()}"
    p = subprocess.Popen(
        [
            find_binary("tessel-coordinator"),
            f"--port={port}",
            f"--port_file={port_file}",
            "--heartbeat_timeout_ms=1000",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    for _ in range(100):
        if port_file.exists():
            return p
        time.sleep(0.05)
    p.kill()
    raise AssertionError("the coordinator did not start")


@contextlib.contextmanager
def coordinator_and_worker(tmp_path):
    """A coordinator and one worker on free ports; `restart()` SIGKILLs the
    coordinator and starts another on the same port. Both stop at exit."""
    cport, wport = free_port(), free_port()
    worker_log = tmp_path / "worker.log"
    with open(tmp_path / "coordinator.log", "ab") as clog, open(worker_log, "wb") as wlog:
        procs = [start_coordinator(cport, tmp_path, clog)]
        procs.append(
            subprocess.Popen(
                [find_binary("tessel-worker"), f"--coordinator=127.0.0.1:{cport}", f"--port={wport}"],
                stdout=wlog,
                stderr=subprocess.STDOUT,
            )
        )

        def kill_coordinator():
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait()

        def start_again():
            procs[0] = start_coordinator(cport, tmp_path, clog)

        try:
            yield types.SimpleNamespace(
                coordinator=f"127.0.0.1:{cport}",
                worker=f"127.0.0.1:{wport}",
                worker_log=worker_log,
                kill_coordinator=kill_coordinator,
                start_again=start_again,
            )
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_a_worker_without_its_coordinator_is_not_serving_and_says_so_once(tmp_path):
    with coordinator_and_worker(tmp_path) as c:
        address = c.worker
        assert wait_for(address, "tessel.v1.Worker", 0) == (0, f"{address} (service 'tessel.v1.Worker'): SERVING")
        assert wait_for(c.coordinator, "tessel.v1.Session", 0)[0] == 0

        c.kill_coordinator()
        rc, out = wait_for(address, "tessel.v1.Worker", 1)
        assert (rc, out) == (1, f"{address} (service 'tessel.v1.Worker'): NOT_SERVING")
        assert health(address)[0] == 0  # the process itself still answers
        time.sleep(2)  # several heartbeats fail meanwhile
        log = c.worker_log.read_text()
        assert log.count("lost the coordinator at") == 1, log
        assert "heartbeat to" not in log, log  # each failure at debug level, not a warning

        c.start_again()
        assert wait_for(address, "tessel.v1.Worker", 0)[0] == 0
        assert "answers again" in c.worker_log.read_text()


@pytest.mark.parametrize(
    "daemon, own_flags",
    [
        (
            "tessel-coordinator",
            [
                "--session_lease_s",
                "--port_file",
                "--heartbeat_timeout_ms",
                "--auth_reload_s",
                "--tls_cert",
                "--metrics_address",
                "--metrics_auth_file",
            ],
        ),
        (
            "tessel-worker",
            [
                "--coordinator",
                "--devices",
                "--device_memory_bytes",
                "--tls_cert",
                "--metrics_address",
                "--metrics_auth_file",
            ],
        ),
    ],
)
def test_each_daemon_lists_its_own_flags(daemon, own_flags):
    p = subprocess.run([find_binary(daemon), "--help"], capture_output=True, text=True)
    text = p.stdout + p.stderr
    assert "No flags matched" not in text
    for flag in own_flags:
        assert flag in text, f"{daemon} --help lacks {flag}"
    v = subprocess.run([find_binary(daemon), "--version"], capture_output=True, text=True)
    assert v.returncode == 0 and v.stdout.strip() == "Tessel 0.1.0", v.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["run", "g.textproto", "--devcie", "3"],
            "tessel run: unknown flag --devcie; 'run' takes --coordinator, "
            "--device, --fetch, --input, --mesh, --out-shard, --replicated, --shard",
        ),
        (["stats", "--json"], "tessel stats: unknown flag --json; 'stats' takes --coordinator"),
        (["compile"], "tessel compile: expected one graph file, got 0"),
        (["health", "extra"], "tessel health: expected no operand, got 1: extra"),
    ],
)
def test_the_cli_refuses_what_it_does_not_know(argv, message):
    env = dict(os.environ, TESSEL_COORDINATOR="127.0.0.1:1")
    p = subprocess.run([find_binary("tessel"), *argv], capture_output=True, text=True, env=env)
    assert p.returncode == 2
    assert message in p.stderr, p.stderr


def test_a_restarted_coordinator_is_named_and_its_predecessors_arrays_are_freed(tmp_path):
    import numpy as np
    import tessel

    with coordinator_and_worker(tmp_path) as c:
        assert wait_for(c.worker, "tessel.v1.Worker", 0)[0] == 0
        tessel.connect(c.coordinator)
        x = tessel.device_put(np.arange(1024, dtype=np.float32))
        x.block_until_ready()
        double = tessel.jit(lambda v: v * 2)  # loads a program on the worker
        y = double(x)
        np.testing.assert_array_equal(y.fetch(), np.arange(1024) * 2)
        y.delete()
        tessel.memory_stats()  # once the worker has freed it
        first = re.search(r"registered with \S+ as (\S+)", c.worker_log.read_text()).group(1)

        c.kill_coordinator()
        c.start_again()
        deadline = time.monotonic() + 15
        while "registered again as" not in c.worker_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert wait_for(c.worker, "tessel.v1.Worker", 0)[0] == 0
        log = c.worker_log.read_text()
        again = re.search(r"registered again as (\S+)", log).group(1)
        assert again != first and again.split(".")[0] == "w0", (first, again)  # a new id, never the old one
        assert "dropped the old one's 1 arrays (4096 bytes) and 1 programs" in log, log

        # The old session's next call says what happened, instead of a bare transport error.
        with pytest.raises(
            tessel.WorkerLostError,
            match=r"the coordinator restarted at \S+Z; session '\S+' was "
            r"opened under its previous incarnation \w+, and its "
            r"arrays were lost",
        ):
            x.fetch()
        # The new coordinator serves: a new session computes.
        fresh = tessel.connect(c.coordinator)  # the default session from here
        y = tessel.device_put(np.ones(3, np.float32))
        np.testing.assert_array_equal(y.fetch(), np.ones(3, np.float32))
        # The program the old coordinator loaded is loaded again for the new one.
        np.testing.assert_array_equal(
            double(tessel.device_put(np.arange(1024, dtype=np.float32))).fetch(), np.arange(1024) * 2
        )
        fresh.close()


def test_status_as_json_is_the_admin_api(cluster):
    import json

    p = subprocess.run(
        [find_binary("tessel"), "status", "--json", "--coordinator", cluster.address], capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    status = json.loads(p.stdout)
    workers = status["workers"]
    assert len(workers) == 2 and all(w["alive"] for w in workers), workers
    devices = [d["id"] for w in workers for d in w["devices"]]
    assert sorted(devices) == [0, 1, 2, 3], workers
    # The table's figures, from the same call.
    table = subprocess.run(
        [find_binary("tessel"), "status", "--coordinator", cluster.address], capture_output=True, text=True
    ).stdout
    assert f"{len(devices)} live devices" in table
    for w in workers:
        assert w["workerId"] in table and w["address"] in table


def test_json_logs_with_debug_say_what_ran(tmp_path):
    """--log_format=json writes one JSON object per line; --log_level=debug
    adds each execution (coordinator) and each step (worker). A line that
    speaks of an execution carries its id as a field, the same on both."""
    import json

    import numpy as np

    import tessel
    from tessel import _context

    previous = _context.default_session_or_none()
    flags = ["--log_format=json", "--log_level=debug"]
    with tessel.LocalCluster(1, 1, log_dir=str(tmp_path), coordinator_flags=flags, worker_flags=flags) as c:
        _context.set_default_session(c.session)
        x = np.arange(8, dtype=np.float32)
        np.testing.assert_array_equal(tessel.jit(lambda v: v + 1)(tessel.device_put(x)).fetch(), x + 1)
    _context.set_default_session(previous)
    for name, wanted in (("coordinator", "execution 1 of"), ("worker0", "step 0 (execution 1")):
        records = [json.loads(line) for line in (tmp_path / f"{name}.log").read_text().splitlines()]
        fields = {"time", "level", "logger", "thread", "message"}
        assert all(set(r) - {"execution"} == fields for r in records), records[:3]
        assert any(r["level"] == "debug" and wanted in r["message"] for r in records), (name, records)
        for r in records:
            m = re.search(r"(?<![\w])execution (\d+)", r["message"])
            assert r.get("execution") == (int(m.group(1)) if m else None), r
        assert any(r.get("execution") == 1 for r in records), (name, records)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", records[0]["time"])


def test_unknown_log_format_is_refused():
    p = subprocess.run(
        [find_binary("tessel-coordinator"), "--log_format=xml"], capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 2 and "--log_format: expected text or json, got 'xml'" in p.stderr


def test_a_restarted_worker_replaces_its_old_self_at_once(tmp_path):
    """Same --worker_id, new process: the coordinator marks the old
    incarnation dead when the new one registers (not a heartbeat timeout
    later), its arrays are lost naming the restart, and the new one serves."""
    import numpy as np

    import tessel
    from tessel import _context, errors

    previous = _context.default_session_or_none()
    with tessel.LocalCluster(
        1, 1, log_dir=str(tmp_path), heartbeat_timeout_ms=60_000, worker_flags=["--worker_id=node-a"]
    ) as c:
        _context.set_default_session(c.session)
        old = c.session.cluster().workers[0]
        assert old.name == "node-a" and len(old.incarnation) == 16
        kept = tessel.device_put(np.arange(4, dtype=np.float32))
        c.kill_worker(0)
        again = subprocess.Popen(
            [
                find_binary("tessel-worker"),
                f"--coordinator={c.address}",
                "--worker_id=node-a",
                f"--parent_pid={os.getpid()}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                workers = c.session.cluster().workers
                if any(w.alive and w.incarnation != old.incarnation for w in workers):
                    break
                time.sleep(0.05)
            by_id = {w.worker_id: w for w in c.session.cluster().workers}
            assert not by_id[old.worker_id].alive
            new = [w for w in by_id.values() if w.alive]
            assert len(new) == 1 and new[0].name == "node-a" and new[0].incarnation != old.incarnation
            with pytest.raises(errors.TesselError, match="restarted \\(node-a registered again"):
                kept.fetch()
            x = np.arange(6, dtype=np.float32)
            devices = [d.id for d in new[0].devices]
            got = tessel.jit(lambda v: v * 2)(tessel.device_put(x, devices[0])).fetch()
            np.testing.assert_array_equal(got, x * 2)
        finally:
            again.terminate()
            again.wait(10)
    _context.set_default_session(previous)


def test_admin_cordons_and_drains_a_worker_and_counts_steps_per_device():
    import numpy as np

    import tessel
    from tessel import _context, errors
    from tessel.v1 import admin_pb2

    previous = _context.default_session_or_none()
    with tessel.LocalCluster(2, 1) as c:
        _context.set_default_session(c.session)
        admin = c.session._admin
        x = np.arange(16, dtype=np.float32)
        a = tessel.device_put(x, 0)
        f = tessel.jit(lambda v: v + 1)
        for _ in range(5):
            a = f(a)
        np.testing.assert_array_equal(a.fetch(), x + 5)
        dev0 = c.session.cluster().workers[0].devices[0]
        assert dev0.steps >= 5 and dev0.queue_depth == 0 and dev0.step_errors == 0 and dev0.mean_step_ms > 0

        held = tessel.device_put(x, 1)
        w1 = c.session.cluster().workers[1]
        admin.CordonWorker(admin_pb2.CordonWorkerRequest(worker_id=w1.worker_id), timeout=10)
        assert c.session.cluster().workers[1].cordoned
        with pytest.raises(errors.TesselError, match="cordoned") as e:
            tessel.device_put(x, 1)
        assert e.value.code == "FAILED_PRECONDITION"
        np.testing.assert_array_equal(held.fetch(), x)  # what it holds stays readable
        drained = admin.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id=w1.worker_id, timeout_ms=5000), timeout=10)
        assert drained.idle and drained.arrays == 1 and drained.bytes == x.nbytes
        assert list(drained.sessions) == [c.session.id]
        admin.CordonWorker(admin_pb2.CordonWorkerRequest(worker_id=w1.worker_id, uncordon=True), timeout=10)
        np.testing.assert_array_equal(tessel.device_put(x, 1).fetch(), x)
        with pytest.raises(Exception, match="no worker 'w9'"):
            admin.CordonWorker(admin_pb2.CordonWorkerRequest(worker_id="w9"), timeout=10)
    _context.set_default_session(previous)


def test_tessel_top_shows_each_devices_rate_queue_and_memory():
    import numpy as np

    import tessel
    from tessel import _context

    previous = _context.default_session_or_none()
    with tessel.LocalCluster(1, 2) as c:
        _context.set_default_session(c.session)
        a = tessel.device_put(np.ones(1000, np.float32), 1)
        f = tessel.jit(lambda v: v * 1.0001)
        for _ in range(20):
            a = f(a)
        a.fetch()
        p = subprocess.run(
            [find_binary("tessel"), "top", "--coordinator", c.address, "--interval", "0.2", "--iterations", "2"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert p.returncode == 0, p.stderr
        lines = p.stdout.splitlines()
        header = [i for i, line in enumerate(lines) if line.startswith("device")]
        assert len(header) == 2  # two looks
        rows = {int(l.split()[0]): l.split() for l in lines[header[1] + 1 :]}
        assert set(rows) == {0, 1}
        assert rows[1][2] == "alive" and rows[1][3] == "0.0"  # idle now: no steps between the looks
        assert int(rows[1][5]) == 0  # no errors
        bad = subprocess.run(
            [find_binary("tessel"), "top", "--coordinator", c.address, "--interval", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert bad.returncode != 0 and "--interval: expected a positive number" in bad.stderr
    _context.set_default_session(previous)


def _process_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_worker_paused_by_kill_worker_is_stopped_when_the_call_returns(tmp_path):
    # A test that pauses a worker and then runs a step must not find the
    # worker still running that step: the stop has landed when the call returns.
    import tessel

    with tessel.LocalCluster(2, 1, log_dir=str(tmp_path), connect=False) as c:
        for _ in range(20):
            c.kill_worker(1, signal.SIGSTOP)
            assert _process_state(c.worker_pids[1]) == "T"
            c.kill_worker(1, signal.SIGCONT)
            assert _process_state(c.worker_pids[1]) != "T"
        assert _process_state(c.worker_pids[0]) != "T"
