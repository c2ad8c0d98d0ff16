"""The coordinator's live dashboard (/dashboard on its metrics port), loaded
in headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium) against a local cluster of 2 workers x 2 devices while a sharded
loop runs: the page's figures must agree with `tessel stats` and
Admin.GetCluster, its profile button must record a trace of the cluster,
and on a cluster with tokens only an admin's token opens it. A screenshot
of the page is kept as a test artifact (build/test-artifacts/)."""

import base64
import json
import pathlib
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import Mesh, NamedSharding, P, _context
from tessel._cluster import find_binary
from tessel.v1 import admin_pb2

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = pathlib.Path(__file__).resolve().parents[3] / "build" / "test-artifacts"

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and chromium-driver (scripts/setup.sh)"
)


def read_port(path, deadline=10):
    end = time.time() + deadline
    while time.time() < end:
        try:
            return int(pathlib.Path(path).read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(0.05)
    raise TimeoutError(path)


def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1400"):
        options.add_argument(flag)
    return webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)


def http(url, method="GET", token=None, basic=None):
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        req.add_header("Authorization", "Bearer " + token)
    if basic:
        req.add_header("Authorization", "Basic " + base64.b64encode(basic.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    d = tmp_path_factory.mktemp("dashboard")
    previous = _context.default_session_or_none()
    with tessel.LocalCluster(
        2, 2, coordinator_flags=["--metrics_address=127.0.0.1:0", f"--metrics_port_file={d}/port"]
    ) as c:
        yield c, read_port(d / "port")
    _context.set_default_session(previous)


class Loop:
    """A data-parallel step over the 4 devices, run on a thread until stopped
    (its all_reduce crosses the two workers)."""

    def __init__(self, session):
        self.session, self.stop, self.steps, self.error = session, threading.Event(), 0, None
        mesh = Mesh({"data": 4})
        self.x = tessel.device_put(np.ones((64, 32), np.float32), NamedSharding(mesh, P("data")))
        self.w = tessel.device_put(np.full((32, 8), 0.01, np.float32), NamedSharding(mesh, P()))
        self.step = tessel.jit(lambda w, x: w - 0.01 * tessel.grad(lambda w: tnp.mean(tnp.tanh(x @ w)))(w))
        self.thread = threading.Thread(target=self.run)

    def run(self):
        try:
            _context.set_default_session(self.session)
            while not self.stop.is_set():
                self.w = self.step(self.w, self.x)
                self.w.fetch()
                self.steps += 1
        except Exception as e:  # noqa: BLE001 (reported by the test)
            self.error = e

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)
        assert self.error is None, self.error


def cell(driver, selector):
    return driver.find_element(By.CSS_SELECTOR, selector).text


def wait_for_poll(driver, seconds=20):
    """Until the page has rendered a poll after now."""
    before = cell(driver, "#updated")
    WebDriverWait(driver, seconds).until(
        lambda d: cell(d, "#updated") != before and cell(d, "#updated").startswith("updated")
    )


def test_the_dashboard_shows_what_tessel_stats_says_while_a_loop_runs(watched):
    cluster, port = watched
    _context.set_default_session(cluster.session)
    driver = browser()
    try:
        with Loop(cluster.session) as loop:
            driver.get(f"http://127.0.0.1:{port}/dashboard")
            wait_for_poll(driver)
            wait_for_poll(driver)  # two polls: rates and quantiles have a difference to show
            deadline = time.time() + 30
            while loop.steps < 5 and time.time() < deadline:
                time.sleep(0.1)
            wait_for_poll(driver)
            rates = [
                r.find_elements(By.TAG_NAME, "td")[2].text
                for r in driver.find_elements(By.CSS_SELECTOR, "#device-table tbody tr")
            ]
            assert len(rates) == 4 and all(float(r) > 0 for r in rates), rates
            p50 = [
                r.find_elements(By.TAG_NAME, "td")[3].text
                for r in driver.find_elements(By.CSS_SELECTOR, "#device-table tbody tr")
            ]
            assert all(float(p) > 0 for p in p50), p50
            rounds = driver.find_elements(By.CSS_SELECTOR, "#collectives tbody tr")
            assert len(rounds) == 2 and all(int(r.find_elements(By.TAG_NAME, "td")[1].text) > 0 for r in rounds)
            # The profile button: a trace of the next second, every process in it.
            driver.find_element(By.ID, "profile-seconds").clear()
            driver.find_element(By.ID, "profile-seconds").send_keys("1")
            driver.find_element(By.ID, "profile").click()
            WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.ID, "profile-download"))
            assert "from 3 processes" in cell(driver, "#profile-status")
            assert int(driver.find_element(By.ID, "profile-status").get_attribute("data-events")) > 0
        # The loop has stopped: the figures hold still, and the page's next
        # poll shows what `tessel stats` and GetCluster show.
        time.sleep(0.5)
        wait_for_poll(driver)
        stats = subprocess.run(
            [find_binary("tessel"), "stats", "--coordinator", cluster.address],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        m = re.search(
            r"(\d+) live devices, (\d+) sessions, (\d+) live arrays, (\d+) compiles \((\d+) cache hits\), (\d+) executions",
            stats,
        )
        assert m, stats
        devices, sessions, arrays, compiles, hits, executions = m.groups()
        assert cell(driver, "#devices") == devices == "4"
        # `tessel stats` counts its own session, open while it asks.
        assert int(cell(driver, "#sessions")) == int(sessions) - 1
        assert cell(driver, "#live-arrays") == arrays
        assert cell(driver, "#executions") == executions
        assert cell(driver, "#compiles") == f"{compiles} ({hits})"
        assert cell(driver, "#workers-alive") == "2 / 2"
        admin = cluster.session._admin.GetCluster(admin_pb2.GetClusterRequest(with_memory=True), timeout=10)
        in_use = {m.device: m.bytes_in_use for w in admin.workers for m in w.memory}
        for d, want in in_use.items():
            shown = driver.find_element(By.CSS_SELECTOR, f'#device-table tr[data-device="{d}"] td.memory')
            assert int(shown.get_attribute("data-bytes")) == want
        tenants = driver.find_elements(By.CSS_SELECTOR, "#tenants tbody tr")
        assert [t.get_attribute("data-tenant") for t in tenants] == ["default"]
        assert int(tenants[0].find_elements(By.TAG_NAME, "td")[1].text) == int(sessions) - 1
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    finally:
        driver.quit()


def test_the_dashboard_lists_a_failed_step_among_its_recent_errors(tmp_path):
    """Every program load fails in transit (--inject_faults=fail_load=1): the
    step is sent and fails on its worker; the page lists it, with its device,
    execution and the error its outputs carry."""
    previous = _context.default_session_or_none()
    driver = None
    try:
        with tessel.LocalCluster(
            1,
            1,
            coordinator_flags=[
                "--inject_faults=fail_load=1",
                "--metrics_address=127.0.0.1:0",
                f"--metrics_port_file={tmp_path}/port",
            ],
        ) as c:
            url = f"http://127.0.0.1:{read_port(tmp_path / 'port')}"
            _context.set_default_session(c.session)
            y = tessel.jit(lambda a: a * 2)(tessel.device_put(np.ones(3)))
            with pytest.raises(tessel.TesselError) as raised:
                y.fetch()
            errors = json.loads(http(url + "/dashboard/data")[1])["errors"]
            assert len(errors) == 1, errors
            e = errors[0]
            assert e["device"] == 0 and e["session"] == c.session.id and e["execution"] >= 1
            assert "injected" in e["message"] and e["message"].split(": ")[-1] in str(raised.value)
            driver = browser()
            driver.get(url + "/dashboard")
            WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#errors tbody tr"))
            cells = [td.text for td in driver.find_elements(By.CSS_SELECTOR, "#errors tbody tr td")]
            assert cells[1:4] == ["0", str(e["execution"]), c.session.id] and "injected" in cells[4], cells
    finally:
        if driver is not None:
            driver.quit()
        _context.set_default_session(previous)


@pytest.mark.parametrize(
    "query, status, message",
    [
        ("seconds=0", 400, "seconds must be 0.001 .. 60; got 'seconds=0'"),
        ("seconds=600", 400, "got 'seconds=600'"),
        ("seconds=soon", 400, "got 'seconds=soon'"),
        ("", 400, "got ''"),
    ],
)
def test_a_bad_profile_request_is_a_clear_error(watched, query, status, message):
    _, port = watched
    got, body = http(f"http://127.0.0.1:{port}/dashboard/profile?{query}", method="POST")
    assert got == status and message in body, body


def test_the_dashboard_answers_only_its_own_paths_and_methods(watched):
    _, port = watched
    assert http(f"http://127.0.0.1:{port}/dashboard/profile?seconds=1")[0] == 405
    assert http(f"http://127.0.0.1:{port}/dashboard/data", method="POST")[0] == 405
    status, body = http(f"http://127.0.0.1:{port}/metrics")
    assert status == 200 and "tessel_live_arrays" in body  # the scrape endpoint as before
    assert http(f"http://127.0.0.1:{port}/elsewhere")[0] == 404


def test_with_tokens_only_an_admin_opens_the_dashboard(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token alice\nops-token ops admin\n")
    previous = _context.default_session_or_none()
    try:
        with tessel.LocalCluster(
            1,
            1,
            coordinator_flags=[
                f"--auth_tokens_file={tokens}",
                "--metrics_address=127.0.0.1:0",
                f"--metrics_port_file={tmp_path}/port",
            ],
            client=dict(token="ops-token"),
        ):
            url = f"http://127.0.0.1:{read_port(tmp_path / 'port')}"
            for path in ("/dashboard", "/dashboard/data"):
                status, _ = http(url + path)
                assert status == 401
                status, body = http(url + path, token="alice-token")
                assert status == 403 and "tenant alice's token is not an admin token" in body
                assert http(url + path, token="wrong")[0] == 401
                assert http(url + path, token="ops-token")[0] == 200
                assert http(url + path, basic="anyone:ops-token")[0] == 200
            assert http(url + "/dashboard/profile?seconds=0.1", method="POST", token="alice-token")[0] == 403
            status, body = http(url + "/dashboard/profile?seconds=0.1", method="POST", basic="ops:ops-token")
            assert status == 200 and json.loads(body)["traceEvents"]
    finally:
        _context.set_default_session(previous)
