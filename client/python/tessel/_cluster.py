"""Connecting to a coordinator, and local clusters of real daemons.

`local_cluster()` starts `tessel-coordinator` and N `tessel-worker` processes
on 127.0.0.1 (ports chosen free), the same way the C++ LocalCluster does:
workers start one at a time and register in order, so worker i owns global
devices [i*D, (i+1)*D). The processes stop when the cluster is closed, when
the `with` block exits (also on an exception), at interpreter exit, and -
through the daemons' --parent_pid (PR_SET_PDEATHSIG) - when this process dies
without cleaning up. The kernel ties that to the thread that started them:
start a cluster from a thread that outlives it.

No Python code runs between fork and exec (no preexec_fn): grpcio's fork
handlers would run there and abort the child.
"""

import atexit
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import weakref

import grpc

from tessel import _context, errors
from tessel._channel import make_channel
from tessel._session import Session
from tessel.v1 import admin_pb2, admin_pb2_grpc


def connect(
    address=None,
    *,
    timeout=10.0,
    make_default=True,
    token=None,
    tls_ca=None,
    tls_cert=None,
    tls_key=None,
    tls_server_name=None,
    direct_transfers=True,
    direct_min_bytes=1 << 20,
):
    """Opens a session on the coordinator at `address` (default:
    $TESSEL_COORDINATOR). It becomes the default session unless told not to.

    A secured coordinator: `token` (default $TESSEL_TOKEN) is the client's
    bearer token; `tls_ca` (default $TESSEL_TLS_CA), a PEM file, turns TLS on
    and verifies the coordinator; `tls_cert`/`tls_key` present a client
    certificate; `tls_server_name` overrides the name checked against the
    coordinator's certificate. With `direct_transfers`, puts and fetches of
    arrays of `direct_min_bytes` or more move their blocks straight between
    this client and the workers holding them when the coordinator grants it,
    falling back to its relay when a worker cannot be reached."""
    address = address or os.environ.get("TESSEL_COORDINATOR")
    if not address:
        raise ValueError("tessel.connect: no address given and $TESSEL_COORDINATOR is not set")
    s = Session(
        address,
        timeout=timeout,
        token=token,
        tls_ca=tls_ca,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_server_name=tls_server_name,
        direct_transfers=direct_transfers,
        direct_min_bytes=direct_min_bytes,
    )
    if make_default:
        _context.set_default_session(s)
    return s


_connect = connect


def find_binary(name, bin_dir=None):
    """`name` in `bin_dir`, else in $TESSEL_BIN_DIR, else in the build of the
    source tree this SDK is imported from (build/bin, after
    scripts/setup.sh), else beside this Python (where the wheel installs the
    daemons), else on $PATH."""
    for d in (bin_dir, os.environ.get("TESSEL_BIN_DIR")):
        if d:
            path = os.path.join(d, name)
            if os.access(path, os.X_OK):
                return path
            raise FileNotFoundError(
                f"cannot execute {path!r}: build Tessel (scripts/setup.sh) or point "
                "TESSEL_BIN_DIR at the folder holding its binaries"
            )
    tree = pathlib.Path(__file__).resolve().parents[3] / "build" / "bin"
    for d in (str(tree), sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        path = os.path.join(d, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(
            f"{name} is neither beside {sys.executable} nor on $PATH: install the tessel wheel "
            "(pip install . from the Tessel tree), or set TESSEL_BIN_DIR to the folder holding "
            "the Tessel binaries (build/bin after scripts/setup.sh)"
        )
    return path


class LocalCluster:
    """A coordinator and `workers` workers with `devices_per_worker` CPU
    devices each, as real processes on loopback. Use as a context manager;
    `close()` is idempotent."""

    def __init__(
        self,
        workers=2,
        devices_per_worker=1,
        *,
        bin_dir=None,
        log_dir=None,
        connect=True,
        heartbeat_timeout_ms=2000,
        worker_flags=(),
        coordinator_flags=(),
        client=None,
    ):
        """`client`: keyword arguments of `tessel.connect` (token, tls_ca, ...)
        for this cluster's own calls, for a cluster started with security
        flags."""
        if workers < 1 or devices_per_worker < 1:
            raise ValueError(
                f"local_cluster: expected >= 1 workers and devices per worker, "
                f"got {workers} and {devices_per_worker}"
            )
        self._procs = []
        self.worker_pids = []
        self.session = None
        self._owns_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="tessel-local-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.client = dict(client or {})
        self._finalizer = weakref.finalize(self, _stop_all, self._procs, self.log_dir, self._owns_log_dir)
        atexit.register(self._finalizer)
        try:
            self._start(
                workers, devices_per_worker, bin_dir, heartbeat_timeout_ms, list(worker_flags), list(coordinator_flags)
            )
            if connect:
                self.session = _connect(self.address, **self.client)
        except BaseException:
            self.close()
            raise

    def _spawn(self, binary, args, log_name):
        log = open(os.path.join(self.log_dir, log_name + ".log"), "ab")
        try:
            # A session of their own: Ctrl-C reaches this process only, which
            # then stops the daemons in order.
            p = subprocess.Popen(
                [binary] + args + [f"--parent_pid={os.getpid()}"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            log.close()
        self._procs.append(p)
        return p

    def _start(self, workers, devices, bin_dir, heartbeat_timeout_ms, worker_flags, coordinator_flags):
        coordinator = find_binary("tessel-coordinator", bin_dir)
        worker = find_binary("tessel-worker", bin_dir)
        port_file = os.path.join(self.log_dir, "coordinator.port")
        if os.path.exists(port_file):
            os.remove(port_file)
        self._coordinator_args = [coordinator, f"--heartbeat_timeout_ms={heartbeat_timeout_ms}"] + coordinator_flags
        c = self._spawn(
            coordinator,
            ["--port=0", f"--port_file={port_file}"] + self._coordinator_args[1:],
            "coordinator",
        )
        port = _wait_for(lambda: _read_port(port_file), 15, c, "tessel-coordinator", self.log_dir)
        self.address = f"127.0.0.1:{port}"
        security = ("token", "tls_ca", "tls_cert", "tls_key", "tls_server_name")
        channel = make_channel(self.address, **{k: v for k, v in self.client.items() if k in security})
        admin = admin_pb2_grpc.AdminStub(channel)
        try:
            for i in range(workers):
                w = self._spawn(
                    worker, [f"--coordinator={self.address}", f"--devices={devices}"] + worker_flags, f"worker{i}"
                )
                self.worker_pids.append(w.pid)
                _wait_for(lambda: _alive_workers(admin) == i + 1 or None, 30, w, f"tessel-worker {i}", self.log_dir)
        finally:
            channel.close()

    def restart_coordinator(self):
        """Kills the coordinator (SIGKILL) and starts a new one on the same
        port; returns once every worker still running has registered with it.
        Its sessions, arrays and programs are gone: clients connect again
        (the workers drop what the old one placed)."""
        old = self._procs[0]
        old.send_signal(signal.SIGKILL)
        old.wait()
        port = self.address.rsplit(":", 1)[1]
        port_file = os.path.join(self.log_dir, "coordinator.port")
        if os.path.exists(port_file):
            os.remove(port_file)
        c = self._spawn(
            self._coordinator_args[0],
            [f"--port={port}", f"--port_file={port_file}"] + self._coordinator_args[1:],
            "coordinator",
        )
        self._procs.remove(c)
        self._procs[0] = c
        _wait_for(lambda: _read_port(port_file), 15, c, "tessel-coordinator", self.log_dir)
        running = sum(1 for p in self._procs[1:] if p.poll() is None)
        security = ("token", "tls_ca", "tls_cert", "tls_key", "tls_server_name")
        channel = make_channel(self.address, **{k: v for k, v in self.client.items() if k in security})
        try:
            admin = admin_pb2_grpc.AdminStub(channel)
            _wait_for(
                lambda: _alive_workers(admin) >= running or None, 30, c, "the workers' registration", self.log_dir
            )
        finally:
            channel.close()

    def kill_worker(self, i, sig=signal.SIGKILL):
        """Sends `sig` to worker `i` (to test what losing a worker does, or,
        with SIGSTOP and SIGCONT, what pausing one does) and returns once it
        has taken effect: a stop lands when the kernel next schedules one of
        the worker's threads, which on a loaded machine can be after the
        caller's next step has reached it."""
        p = self._procs[1 + i]
        p.send_signal(sig)
        if sig == signal.SIGKILL:
            p.wait()
        elif sig == signal.SIGSTOP:
            while True:
                _, status = os.waitpid(p.pid, os.WUNTRACED)
                if os.WIFSTOPPED(status):
                    return
                if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                    p.returncode = os.waitstatus_to_exitcode(status)
                    raise errors.TesselError(
                        f"tessel-worker {i} exited instead of stopping (rc {p.returncode})", "UNAVAILABLE"
                    )

    def close(self):
        if self.session is not None:
            if _context.default_session_or_none() is self.session:
                _context.set_default_session(None)
            self.session.close()
            self.session = None
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def local_cluster(workers=2, devices_per_worker=1, **kwargs):
    """Starts a local cluster and connects a default session to it:

    with tessel.local_cluster(workers=2, devices_per_worker=2) as cluster:
        ...
    """
    return LocalCluster(workers, devices_per_worker, **kwargs)


def _read_port(path):
    try:
        with open(path) as f:
            port = int(f.read().strip() or 0)
        return port or None
    except (OSError, ValueError):
        return None


def _alive_workers(admin):
    try:
        resp = admin.GetCluster(admin_pb2.GetClusterRequest(), timeout=2)
    except grpc.RpcError:
        return -1
    return sum(1 for w in resp.workers if w.alive)


def _wait_for(probe, seconds, proc, what, log_dir):
    deadline = time.monotonic() + seconds
    while True:
        v = probe()
        if v:
            return v
        if proc.poll() is not None:
            raise errors.TesselError(f"{what} exited at start-up (rc {proc.returncode}); logs in {log_dir}", "INTERNAL")
        if time.monotonic() > deadline:
            raise errors.TesselError(f"{what} did not start within {seconds} s; logs in {log_dir}", "DEADLINE_EXCEEDED")
        time.sleep(0.005)


def _stop_all(procs, log_dir, owns_log_dir):
    # The coordinator first: it closes its step streams, so workers stop at once.
    # A finalizer as well as close(): every wait is bounded (no lock, no wait
    # without a deadline in a finalizer).
    for p in procs:
        if p.poll() is None:
            p.terminate()
        try:
            p.wait(timeout=2)
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass  # reaped by the OS once this process exits
    procs.clear()
    if owns_log_dir and not os.environ.get("TESSEL_KEEP_LOGS"):
        shutil.rmtree(log_dir, ignore_errors=True)
