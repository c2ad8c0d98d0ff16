"""tessel.profiler and `tessel profile`: a trace of a sharded training loop
over 2 workers and 4 devices, recorded by every process at once and read
back as Chrome/Perfetto trace-event JSON. The checks are on the file as a
viewer reads it: its schema, spans that nest on every track, each
collective on every device of its group under one id, and the clock
alignment (a step starts on its device after the coordinator dispatched it).
The loop's values are checked against numpy, so the trace is of a real run."""

import collections
import gzip
import json
import subprocess
import time

import grpc
import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from conftest import DEVICE_KIND
from tessel import Mesh, NamedSharding, P, errors
from tessel._cluster import find_binary
from tessel.v1 import admin_pb2, trace_pb2, worker_pb2_grpc

# Trace-event JSON writes microseconds with three decimals.
ROUNDING_US = 0.002


def load(path):
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
        return json.loads(f.read())


def check_schema(doc):
    """The trace-event format's fields, as Perfetto and chrome://tracing read them."""
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    for e in doc["traceEvents"]:
        assert e["ph"] in ("M", "X", "C", "i"), e
        assert isinstance(e["pid"], int) and isinstance(e["name"], str), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index"), e
            continue
        assert isinstance(e["ts"], (int, float)) and isinstance(e["cat"], str), e
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["dur"] >= 0, e
            assert all(isinstance(v, str) for v in e["args"].values()), e
        if e["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values()), e


def names(doc):
    """(pid -> process name, (pid, tid) -> track name)."""
    procs, tracks = {}, {}
    for e in doc["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        if e["ph"] == "M" and e["name"] == "thread_name":
            tracks[(e["pid"], e["tid"])] = e["args"]["name"]
    return procs, tracks


def spans(doc):
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def assert_nested(doc):
    """On each track, two spans are disjoint or one holds the other."""
    by_track = collections.defaultdict(list)
    for e in spans(doc):
        by_track[(e["pid"], e["tid"])].append(e)
    for track, evs in by_track.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - ROUNDING_US:
                stack.pop()
            if stack:
                top = stack[-1]
                assert e["ts"] + e["dur"] <= top["ts"] + top["dur"] + ROUNDING_US, (
                    f"track {track}: {e['name']} [{e['ts']}, +{e['dur']}] overlaps "
                    f"{top['name']} [{top['ts']}, +{top['dur']}] without nesting in it"
                )
            stack.append(e)


def train(steps):
    """A data-parallel MLP step over the 4 devices: its gradients are one
    all_reduce. Returns the final parameters and numpy's."""
    mesh = Mesh({"data": 4})
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((32, 8)), rng.standard_normal((32, 1))
    w1, w2 = rng.standard_normal((8, 16)) / 3, rng.standard_normal((16, 1)) / 4

    def loss(params, x, y):
        w1, w2 = params
        return tnp.mean((tnp.tanh(x @ w1) @ w2 - y) ** 2)

    @tessel.jit
    def step(params, x, y):
        _, g = tessel.value_and_grad(loss)(params, x, y)
        return tuple(p - 0.1 * d for p, d in zip(params, g))

    params = tuple(tessel.device_put(p, NamedSharding(mesh, P())) for p in (w1, w2))
    data = [tessel.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y)]
    for _ in range(steps):
        params = step(params, *data)
    got = [p.fetch() for p in params]
    for _ in range(steps):
        h = np.tanh(x @ w1)
        d_out = 2 * (h @ w2 - y) / len(x)
        g1, g2 = x.T @ ((d_out @ w2.T) * (1 - h * h)), h.T @ d_out
        w1, w2 = w1 - 0.1 * g1, w2 - 0.1 * g2
    return got, [w1, w2]


def test_a_trace_of_a_sharded_training_loop_covers_every_process(session, tmp_path):
    path = tmp_path / "loop.json.gz"
    with tessel.profiler.trace(str(path)):
        got, want = train(steps=4)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)

    doc = load(path)
    check_schema(doc)
    procs, tracks = names(doc)
    kinds = sorted(p.split(" ")[0] for p in procs.values())
    assert kinds == ["client", "coordinator", "worker", "worker"], procs
    meta = {p["name"]: p for p in doc["otherData"]["processes"]}
    for name, p in meta.items():
        assert p["dropped"] == 0, p
        if name.startswith("worker"):
            # Estimated over the heartbeats: within half a loopback round trip.
            assert 0 <= p["clock_error_ns"] < 50_000_000, p
    assert_nested(doc)

    evs = spans(doc)
    by_cat = collections.Counter(e["cat"] for e in evs)
    for cat in ("step", "kernel", "collective", "transfer", "compile", "dispatch", "trace"):
        assert by_cat[cat] > 0, (cat, by_cat)
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert {k for e in counters for k in e["args"]} == {f"device {d}" for d in range(4)}

    # Each device ran each of the loop's 4 steps.
    device_tracks = {k: v for k, v in tracks.items() if v.startswith("device ")}
    assert sorted(device_tracks.values()) == [f"device {d}" for d in range(4)]
    steps = [e for e in evs if e["cat"] == "step"]
    runs = collections.defaultdict(set)
    for e in steps:
        runs[e["args"]["execution"]].add(device_tracks[(e["pid"], e["tid"])])
    full = [ex for ex, devs in runs.items() if devs == set(device_tracks.values())]
    assert len(full) >= 4, runs

    # Each collective appears on every device of its group, under one id.
    groups = collections.defaultdict(list)
    for e in evs:
        if e["cat"] == "collective" and "id" in e["args"]:
            groups[(e["args"]["group"], e["args"]["id"])].append(e)
    assert len(groups) >= 4, groups.keys()
    for (group, cid), members in groups.items():
        peers = members[0]["args"]["peers"].split(",")
        on = sorted(device_tracks[(e["pid"], e["tid"])] for e in members)
        assert on == sorted(f"device {p}" for p in peers), (group, cid, on)
        assert len({e["name"] for e in members}) == 1 and len({e["args"]["bytes"] for e in members}) == 1
    # A round's phases, inside the collective of the rank that ran it.
    phases = {e["name"] for e in evs if e["cat"] == "collective" and "id" not in e["args"]}
    assert "move data" in phases and "wait for peers" in phases, phases

    # The clock alignment: a step starts on its device after the
    # coordinator began dispatching it (within the worker's error bound).
    coordinator = next(pid for pid, n in procs.items() if n == "coordinator")
    dispatched = {e["args"]["execution"]: e for e in evs if e["pid"] == coordinator and "execution" in e["args"]}
    error_us = {
        next(pid for pid, n in procs.items() if n == p["name"]): p["clock_error_ns"] / 1e3
        for p in doc["otherData"]["processes"]
        if p["name"].startswith("worker")
    }
    checked = 0
    for e in steps:
        d = dispatched.get(e["args"]["execution"])
        if d is None:
            continue
        assert e["ts"] >= d["ts"] - error_us[e["pid"]] - ROUNDING_US, (e, d)
        checked += 1
    assert checked >= 16


def test_tracing_off_records_nothing_and_a_forgotten_trace_stops_by_itself(session):
    admin = session._admin
    # Nothing was started: nothing to stop.
    with pytest.raises(grpc.RpcError) as e:
        list(admin.StopTrace(trace_pb2.StopTraceRequest()))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no trace was started" in e.value.details()
    # A client that starts a trace and goes away: the trace ends at its duration.
    admin.StartTrace(trace_pb2.StartTraceRequest(duration_ms=300))
    with pytest.raises(grpc.RpcError) as e:
        admin.StartTrace(trace_pb2.StartTraceRequest(duration_ms=300))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "being recorded already" in e.value.details()
    f = tessel.jit(lambda a: a * 2 + 1)
    x = tessel.device_put(np.arange(4.0))
    f(x).fetch()
    time.sleep(0.5)
    after = time.time_ns()
    for _ in range(5):
        f(x).fetch()
    doc = json.loads(b"".join(c.json for c in admin.StopTrace(trace_pb2.StopTraceRequest())))
    check_schema(doc)
    origin = doc["otherData"]["origin_unix_ns"]
    late = [e for e in spans(doc) if origin + e["ts"] * 1e3 > after]
    assert not late, late[:3]
    assert any(e["cat"] == "step" for e in spans(doc))


@pytest.mark.parametrize(
    "request_, message",
    [
        (dict(duration_ms=0), "duration_ms must be 1 .. 600000"),
        (dict(duration_ms=3_600_000), "duration_ms must be 1 .. 600000 (10 minutes); got 3600000"),
        (dict(duration_ms=1000, max_events_per_process=-1), "max_events_per_process must be 1 .. 250000"),
        (dict(duration_ms=1000, max_events_per_process=10**9), "got 1000000000"),
    ],
)
def test_a_bad_trace_request_is_a_clear_error(session, request_, message):
    with pytest.raises(grpc.RpcError) as e:
        session._admin.StartTrace(trace_pb2.StartTraceRequest(**request_))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def test_the_profiler_api_refuses_out_of_order_calls(session, tmp_path):
    with pytest.raises(errors.FailedPreconditionError, match="no trace is being recorded"):
        tessel.profiler.stop_trace()
    tessel.profiler.start_trace(str(tmp_path), duration_s=30)
    try:
        with pytest.raises(errors.FailedPreconditionError, match="being recorded already"):
            tessel.profiler.start_trace(str(tmp_path / "other.json"))
        tessel.jit(lambda a: a + 1)(tessel.device_put(np.ones(3))).fetch()
    finally:
        written = tessel.profiler.stop_trace()
    assert written.startswith(str(tmp_path)) and written.endswith(".json.gz")
    check_schema(load(written))


def test_the_cli_records_a_profile_and_refuses_bad_durations(cluster, tmp_path):
    cli = find_binary("tessel")
    out = tmp_path / "cli.json.gz"
    env = {"TESSEL_COORDINATOR": cluster.address, "PATH": "/usr/bin:/bin"}
    bad = subprocess.run([cli, "profile", "--duration", "0"], env=env, capture_output=True, text=True)
    assert bad.returncode == 1 and "duration_ms must be 1 .. 600000" in bad.stderr, bad.stderr
    bad = subprocess.run([cli, "profile", "--duration", "soon"], env=env, capture_output=True, text=True)
    assert bad.returncode == 1 and "expected a duration such as 10s" in bad.stderr, bad.stderr
    proc = subprocess.Popen([cli, "profile", "--duration", "1.5s", "--out", str(out)], env=env, text=True)
    time.sleep(0.3)
    f = tessel.jit(lambda a: tnp.sin(a) * 3)
    x = tessel.device_put(np.linspace(0, 1, 64))
    for _ in range(5):
        np.testing.assert_allclose(f(x).fetch(), np.sin(np.linspace(0, 1, 64)) * 3, rtol=1e-12)
    assert proc.wait(timeout=60) == 0
    doc = load(out)
    check_schema(doc)
    assert_nested(doc)
    assert any(e["cat"] == "step" for e in spans(doc))


def test_only_an_admin_token_records_a_trace(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token alice\nops-token ops admin\n")
    previous = tessel._context.default_session_or_none()
    try:
        with tessel.LocalCluster(
            1, 1, coordinator_flags=[f"--auth_tokens_file={tokens}"], client=dict(token="ops-token")
        ) as c:
            alice = tessel.connect(c.address, token="alice-token", make_default=False)
            with pytest.raises(errors.TesselError, match="alice's token is not an admin token"):
                tessel.profiler.start_trace(str(tmp_path / "t.json"), session=alice)
            with pytest.raises(grpc.RpcError) as e:
                list(alice._admin.StopTrace(trace_pb2.StopTraceRequest()))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            cli = subprocess.run(
                [find_binary("tessel"), "profile", "--duration", "100ms", "--token", "alice-token"],
                env={"TESSEL_COORDINATOR": c.address, "PATH": "/usr/bin:/bin"},
                capture_output=True,
                text=True,
            )
            assert cli.returncode == 1 and "PERMISSION_DENIED" in cli.stderr, cli.stderr
            alice.close()
            # The admin's trace works on the same cluster.
            with tessel.profiler.trace(str(tmp_path / "ops.json")):
                tessel.jit(lambda a: a - 1)(tessel.device_put(np.ones(2))).fetch()
            check_schema(load(tmp_path / "ops.json"))
    finally:
        tessel._context.set_default_session(previous)


def test_a_worker_records_only_for_its_coordinator(cluster):
    """Worker.Trace, as every worker call, needs the secret only the
    coordinator holds: a stranger can neither start a worker's recorder nor
    read what it recorded."""
    w = cluster.session._admin.GetCluster(admin_pb2.GetClusterRequest(), timeout=10).workers[0]
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(w.address))
    for request in (trace_pb2.TraceRequest(start=True, capacity=10, duration_ms=1000), trace_pb2.TraceRequest()):
        with pytest.raises(grpc.RpcError) as e:
            stub.Trace(request, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_an_argument_moved_between_workers_is_a_transfer_with_its_bytes(session, tmp_path):
    a = tessel.device_put(np.arange(4.0), tessel.devices()[0])
    b = tessel.device_put(np.ones(4), tessel.devices()[2])  # on the other worker
    with tessel.profiler.trace(str(tmp_path / "move.json")):
        got = tessel.jit(lambda x, y: x + y)(a, b).fetch()
    np.testing.assert_array_equal(got, np.arange(4.0) + 1)
    doc = load(tmp_path / "move.json")
    procs, tracks = names(doc)
    moves = [e for e in spans(doc) if e["cat"] == "transfer" and e["name"] == "move"]
    assert len(moves) == 1 and procs[moves[0]["pid"]] == "coordinator", moves
    assert moves[0]["args"]["bytes"] == "32" and {moves[0]["args"]["from_device"], moves[0]["args"]["to_device"]} == {
        "0",
        "2",
    }
    # The move's put lands on the worker of the device it goes to.
    puts = [e for e in spans(doc) if e["cat"] == "transfer" and e["name"] == "put" and e["args"]["bytes"] == "32"]
    assert puts and all(tracks[(e["pid"], e["tid"])] == "transfers" for e in puts)


@pytest.mark.skipif(DEVICE_KIND != "cpu", reason="values cross sub-meshes by resharding, host-memory only")
def test_an_mpmd_programs_move_is_a_send_and_a_receive_on_the_workers_transfers(session, tmp_path):
    """h crosses from the region on devices 0,1 (the first worker) to the
    one on devices 2,3 (the second): each sender's block is a `send` on its
    worker's transfers track, each receiver's a `receive`, with its bytes
    and peers; every byte of the plan's move is sent once and received
    once."""
    a_mesh, b_mesh = tessel.Mesh({"d": 2}, devices=[0, 1]), tessel.Mesh({"d": 2}, devices=[2, 3])
    ra, rb = tessel.NamedSharding(a_mesh, tessel.P("d")), tessel.NamedSharding(b_mesh, tessel.P("d"))
    wa, wb = tessel.NamedSharding(a_mesh, tessel.P()), tessel.NamedSharding(b_mesh, tessel.P())
    stage0 = tessel.jit(lambda x, w: tnp.tanh(x @ w), in_shardings=(ra, wa), out_shardings=ra)
    stage1 = tessel.jit(lambda h, v: (h @ v).sum(axis=1), in_shardings=(rb, wb), out_shardings=rb)
    step = tessel.jit(lambda x, w, v: stage1(stage0(x, w), v))
    rng = np.random.default_rng(0)
    x, w, v = (rng.standard_normal(s).astype(np.float32) for s in ((8, 4), (4, 6), (6, 3)))
    plan = step.lower(x, w, v)
    assert [t["bytes"] for t in plan.transfers] == [8 * 6 * 4], plan.transfers
    step(x, w, v).fetch()  # compiled, and its arguments placed, before the trace
    with tessel.profiler.trace(str(tmp_path / "mpmd.json")):
        got = step(x, w, v).fetch()
    np.testing.assert_allclose(got, (np.tanh(x @ w) @ v).sum(axis=1), rtol=1e-5)
    doc = load(tmp_path / "mpmd.json")
    check_schema(doc)
    assert_nested(doc)
    procs, tracks = names(doc)
    moved = [e for e in spans(doc) if e["cat"] == "transfer" and e["name"].split()[0] in ("send", "receive")]
    assert all(
        tracks[(e["pid"], e["tid"])].startswith("transfers") and procs[e["pid"]].startswith("worker") for e in moved
    ), [(procs[e["pid"]], tracks[(e["pid"], e["tid"])]) for e in moved]
    sends = sorted((e["name"].split()[-1], e["args"]["peers"]) for e in moved if e["name"].startswith("send"))
    receives = sorted((e["name"].split()[-1], e["args"]["peers"]) for e in moved if e["name"].startswith("receive"))
    assert [d for d, _ in sends] == ["0", "1"] and [d for d, _ in receives] == ["2", "3"], (sends, receives)
    assert all({"2", "3"} <= set(p.split(",")) for _, p in sends), sends
    assert all({"0", "1"} <= set(p.split(",")) for _, p in receives), receives
    assert sum(int(e["args"]["bytes sent"]) for e in moved) == 8 * 6 * 4
    assert sum(int(e["args"]["bytes received"]) for e in moved) == 8 * 6 * 4


def test_each_allocation_and_free_is_an_event_that_moves_the_memory_counter(session, tmp_path):
    """A 4 MiB put is an `alloc` of 4 MiB on its device's track and its
    delete a `free` of as much; the device's memory counter steps up and
    down by exactly that at each, and every event says the bytes in use
    after it, as the counter does."""
    device = tessel.devices()[1]
    with tessel.profiler.trace(str(tmp_path / "memory.json")):
        a = tessel.device_put(np.zeros(1 << 20, np.float32), device)
        a.block_until_ready()
        a.delete()
        tessel.stats()  # after the delete: the free has run when this answers
    doc = load(tmp_path / "memory.json")
    check_schema(doc)
    _, tracks = names(doc)
    events = [e for e in doc["traceEvents"] if e.get("cat") == "memory" and e["ph"] in ("i", "C")]
    mine = [e for e in events if tracks.get((e["pid"], e["tid"]), "").startswith(f"device {device.id}")]
    big = [e for e in mine if e["ph"] == "i" and e["args"]["bytes"] == str(4 << 20)]
    assert [e["name"] for e in big] == ["alloc", "free"], big
    alloc, free = big
    assert int(alloc["args"]["in use"]) - int(free["args"]["in use"]) == 4 << 20
    assert alloc["ts"] <= free["ts"]
    # The device's counter, right after each event, agrees to the byte.
    counter = [e for e in events if e["ph"] == "C" and (e["pid"], e["tid"]) == (alloc["pid"], alloc["tid"])]
    for e in big:
        after = min((c for c in counter if c["ts"] >= e["ts"]), key=lambda c: c["ts"])
        assert after["args"] == {f"device {device.id}": int(e["args"]["in use"])}, (e, after)
