"""One local cluster (2 workers x 2 CPU devices, real daemons on loopback)
for the whole suite; tests that break a cluster start their own."""
import os
import pathlib

import pytest

import tessel

_BUILD_BIN = pathlib.Path(__file__).resolve().parents[3] / "build" / "bin"
if not os.environ.get("TESSEL_BIN_DIR") and (_BUILD_BIN / "tessel-worker").exists():
    os.environ["TESSEL_BIN_DIR"] = str(_BUILD_BIN)


@pytest.fixture(scope="session")
def cluster():
    with tessel.local_cluster(workers=2, devices_per_worker=2) as c:
        yield c


@pytest.fixture
def session(cluster):
    """The suite's cluster, with a fresh default session per test so
    counters and options start clean."""
    s = tessel.connect(cluster.address)
    yield s
    s.close()
    tessel._context.set_default_session(cluster.session)
