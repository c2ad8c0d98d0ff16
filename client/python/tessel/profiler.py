"""tessel.profiler: a timeline of the whole cluster, as jax.profiler gives
one of a process.

    with tessel.profiler.trace("step.json.gz"):
        for _ in range(10):
            state = train_step(state, batch)

records, on every process at once and aligned to the coordinator's clock:
each device's steps (queued, started, finished, with their execution ids),
its kernels and fusions, its collectives (waiting for the peers apart from
moving the data), transfers with their bytes and path, memory in use as a
counter; the coordinator's compiles and dispatches; and this client's
tracing, compiling and dispatching. The file is Chrome/Perfetto trace-event
JSON (gzipped when the path ends in .gz): open it in https://ui.perfetto.dev
or chrome://tracing. Recording needs an admin token on a secured cluster
(Admin.StartTrace), and stops by itself after `duration_s` (at most ten
minutes), so a client that goes away leaves no tracing on.
"""

import contextlib
import gzip
import json
import os
import time

from tessel import _context, _profile, errors
from tessel._session import _rpc
from tessel.v1 import trace_pb2

_active = None  # the trace being recorded: (session, path, clock estimate)


def _clock_sample(t_sent, coordinator_ns, t_back):
    """(offset, error): the coordinator's clock minus this process's, within
    half the round trip."""
    half = max(0, t_back - t_sent) // 2
    return coordinator_ns - (t_sent + half), half


def start_trace(path, *, duration_s=600.0, max_events_per_process=0, session=None):
    """Starts recording a trace of the cluster, to be written to `path` by
    stop_trace(). A directory writes tessel-<time>.json.gz in it."""
    global _active
    if _active is not None:
        raise errors.FailedPreconditionError(f"tessel.profiler: a trace to {_active[1]} is being recorded already")
    session = session or _context.session()
    if os.path.isdir(path):
        path = os.path.join(path, time.strftime("tessel-%Y%m%d-%H%M%S.json.gz"))
    req = trace_pb2.StartTraceRequest(
        duration_ms=int(round(duration_s * 1000)), max_events_per_process=max_events_per_process
    )
    t0 = time.time_ns()
    resp = _rpc(session._admin.StartTrace, req)
    clock = _clock_sample(t0, resp.coordinator_unix_ns, time.time_ns())
    _profile.start()
    _active = (session, path, clock)


def stop_trace():
    """Stops the trace started by start_trace(), writes it, and returns its path."""
    global _active
    if _active is None:
        raise errors.FailedPreconditionError("tessel.profiler: no trace is being recorded (start_trace)")
    session, path, clock = _active
    _active = None
    client_events, dropped = _profile.stop()
    session.flush()
    t0 = time.time_ns()
    chunks = _rpc(lambda r: list(session._admin.StopTrace(r)), trace_pb2.StopTraceRequest())
    if chunks:
        later = _clock_sample(t0, chunks[0].coordinator_unix_ns, time.time_ns())
        clock = min(clock, later, key=lambda c: c[1])
    doc = json.loads(b"".join(c.json for c in chunks))
    _add_client(doc, client_events, dropped, clock)
    data = json.dumps(doc).encode()
    with (gzip.open if path.endswith(".gz") else open)(path, "wb") as f:
        f.write(data)
    return path


@contextlib.contextmanager
def trace(path, *, duration_s=600.0, max_events_per_process=0, session=None):
    """Records a trace of the cluster while the block runs; writes it to
    `path` when it ends (see start_trace)."""
    start_trace(path, duration_s=duration_s, max_events_per_process=max_events_per_process, session=session)
    try:
        yield
    finally:
        stop_trace()


def _add_client(doc, events, dropped, clock):
    """This process's events, as one more process of the trace."""
    offset, error = clock
    processes = doc["otherData"]["processes"]
    pid = 1 + max((p["pid"] for p in processes), default=0)
    name = f"client (pid {os.getpid()})"
    processes.append(
        {
            "name": name,
            "pid": pid,
            "events": len(events),
            "dropped": dropped,
            "clock_offset_ns": offset,
            "clock_error_ns": error,
        }
    )
    origin = doc["otherData"]["origin_unix_ns"]
    out = doc["traceEvents"]
    out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
    tids = {}
    for ev_name, category, track, thread, start_ns, duration_ns, args in events:
        tid = tids.get((track, thread))
        if tid is None:
            tid = tids[(track, thread)] = len(tids) + 1
            label = track if sum(t == track for t, _ in tids) == 1 else f"{track} #{tid}"
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
        out.append(
            {
                "name": ev_name,
                "cat": category,
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": (start_ns + offset - origin) / 1e3,
                "dur": duration_ns / 1e3,
                "args": {k: str(v) for k, v in args.items()},
            }
        )
