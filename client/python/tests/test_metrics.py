"""The daemons' Prometheus endpoints, scraped over HTTP from real daemons:
every figure Admin also reports must agree with it (sessions, arrays,
executions, compiles, device memory), and the step figures must count the
steps this test ran."""

import json
import pathlib
import re
import urllib.request

import numpy as np
import pytest

import tessel
from tessel import _context

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? (\S+)$")


def scrape(port):
    """{(name, frozenset(labels)): value} from the text exposition format."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = frozenset(tuple(kv.split("=", 1)) for kv in re.findall(r'[a-z_]+="[^"]*"', m.group(3) or ""))
        labels = frozenset((k, v.strip('"')) for k, v in labels)
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def total(samples, name, **labels):
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def read_port(path):
    with open(path) as f:
        return int(f.read())


@pytest.fixture(scope="module")
def metered(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("metrics"))
    previous = _context.default_session_or_none()
    with tessel.LocalCluster(
        1,
        2,
        coordinator_flags=["--metrics_address=127.0.0.1:0", f"--metrics_port_file={d}/coordinator"],
        worker_flags=["--metrics_address=127.0.0.1:0", f"--metrics_port_file={d}/worker"],
    ) as c:
        yield c, read_port(f"{d}/coordinator"), read_port(f"{d}/worker")
    _context.set_default_session(previous)


def test_coordinator_metrics_match_admin(metered):
    cluster, cport, _ = metered
    _context.set_default_session(cluster.session)
    x = np.arange(1000, dtype=np.float32)
    a = tessel.device_put(x)
    f = tessel.jit(lambda v: v * 3 + 1)
    steps = 5
    for _ in range(steps):
        a = f(a)
    np.testing.assert_allclose(a.fetch(), ((((x * 3 + 1) * 3 + 1) * 3 + 1) * 3 + 1) * 3 + 1)
    before = scrape(cport)
    admin = cluster.session.cluster()
    after = scrape(cport)
    for name, field in (
        ("tessel_live_arrays", "live_arrays"),
        ("tessel_executions_total", "executions"),
        ("tessel_compiles_total", "compiles"),
        ("tessel_compile_cache_hits_total", "compile_cache_hits"),
    ):
        assert total(before, name) == total(after, name) == getattr(admin, field), name
    assert total(after, "tessel_sessions") == admin.sessions
    assert total(after, "tessel_sessions", tenant="default") == admin.sessions
    assert total(after, "tessel_workers", state="alive") == 1
    assert total(after, "tessel_compile_cache_bytes") == admin.compile_cache_bytes > 0
    # Every step sent ran on device 0 and was timed.
    assert total(after, "tessel_step_seconds_count", device="0") >= steps
    assert total(after, "tessel_step_errors_total") == 0
    assert total(after, "tessel_transfer_bytes_total", direction="host_to_device") >= x.nbytes
    assert total(after, "tessel_transfer_bytes_total", direction="device_to_host") >= x.nbytes


def test_worker_metrics_match_its_device_stats(metered):
    cluster, _, wport = metered
    _context.set_default_session(cluster.session)
    kept = tessel.device_put(np.ones(250_000, np.float32), 1)  # 1 MB on device 1
    assert kept.fetch().sum() == 250_000
    admin = cluster.session.cluster(with_memory=True)
    samples = scrape(wport)
    memory = {m.device: m for w in admin.workers for m in w.memory}
    for device in (0, 1):
        assert (
            total(samples, "tessel_worker_device_bytes_in_use", device=str(device)) == memory[device].bytes_in_use
        ), device
        assert total(samples, "tessel_worker_device_buffers", device=str(device)) == memory[device].num_buffers
    assert total(samples, "tessel_worker_device_bytes_in_use", device="1") >= 1_000_000
    assert total(samples, "tessel_worker_steps_total") >= 1
    assert total(samples, "tessel_worker_step_seconds_count") >= 1


def test_a_taken_metrics_port_stops_the_daemon_at_start(metered, tmp_path):
    import subprocess
    from tessel._cluster import find_binary

    _, cport, _ = metered
    p = subprocess.run(
        [find_binary("tessel-coordinator"), "--port=0", f"--metrics_address=127.0.0.1:{cport}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2
    assert f"cannot listen on 127.0.0.1:{cport}" in p.stdout + p.stderr


def test_the_grafana_dashboard_queries_only_metrics_the_daemons_export(metered):
    """deploy/grafana/tessel.json: every metric a panel's query names is one
    the coordinator or a worker exports (a histogram by its _bucket, _sum or
    _count series)."""
    cluster, cport, wport = metered
    _context.set_default_session(cluster.session)
    f = tessel.jit(lambda v: v + 1)
    f(tessel.device_put(np.ones(4, np.float32))).fetch()  # a step, so the histograms have series
    exported = {name for name, _ in scrape(cport)} | {name for name, _ in scrape(wport)}
    dashboard = json.loads((pathlib.Path(__file__).resolve().parents[3] / "deploy/grafana/tessel.json").read_text())
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            queried |= set(re.findall(r"\btessel_[a-z_]+", t["expr"]))
    assert queried, "the dashboard queries nothing"
    missing = sorted(q for q in queried if q not in exported)
    assert not missing, f"the dashboard queries metrics no daemon exports: {missing}"
    # And every metric the daemons export has a panel.
    bare = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported if n.startswith("tessel_")}
    shown = {re.sub(r"_(bucket|sum|count)$", "", q) for q in queried}
    assert not sorted(bare - shown), f"exported but on no panel: {sorted(bare - shown)}"
