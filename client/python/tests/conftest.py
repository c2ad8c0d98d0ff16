"""One local cluster (2 workers x 2 devices, real daemons on loopback) for
the whole suite; tests that break a cluster start their own.

TESSEL_DEVICE_KIND=cuda runs the suites against GPUs: each worker then
serves every GPU the CUDA runtime sees (two workers on a one-GPU host share
it, as two processes would)."""

import os
import pathlib

import pytest

import tessel

# JAX on CPU is an oracle; four host devices let its own shard_map stand
# beside Tessel's (set before anything imports jax).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

_BUILD_BIN = pathlib.Path(__file__).resolve().parents[3] / "build" / "bin"
if not os.environ.get("TESSEL_BIN_DIR") and (_BUILD_BIN / "tessel-worker").exists():
    os.environ["TESSEL_BIN_DIR"] = str(_BUILD_BIN)


DEVICE_KIND = os.environ.get("TESSEL_DEVICE_KIND", "cpu")
if DEVICE_KIND not in ("cpu", "cuda"):
    raise ValueError(f"TESSEL_DEVICE_KIND: expected cpu or cuda, got {DEVICE_KIND!r}")


def suite_cluster():
    """The suites' cluster shape on the device kind under test."""
    if DEVICE_KIND == "cpu":
        return tessel.local_cluster(workers=2, devices_per_worker=2)
    return tessel.local_cluster(workers=2, devices_per_worker=1, worker_flags=[f"--device_kind={DEVICE_KIND}"])


@pytest.fixture(scope="session")
def cluster():
    with suite_cluster() as c:
        yield c


def assert_every_buffer_owned(s, when):
    """Every buffer the cluster's workers hold belongs to a live array or an
    open put (Admin.Reconcile, over an admin session)."""
    r = s.reconcile()
    unowned = [(u.device, hex(u.handle), u.bytes) for u in r.unowned]
    assert not unowned, f"{when}: buffers no array owns (device, handle, bytes): {unowned}"


@pytest.fixture(autouse=True)
def _every_buffer_owned_after(request):
    """After each test on the suite's cluster: no byte on a device without an owner."""
    yield
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        if c.session is not None and not c.session.closed:
            assert_every_buffer_owned(c.session, f"after {request.node.name}")


@pytest.fixture
def session(cluster):
    """The suite's cluster, with a fresh default session per test so
    counters and options start clean."""
    s = tessel.connect(cluster.address)
    yield s
    s.close()
    tessel._context.set_default_session(cluster.session)
