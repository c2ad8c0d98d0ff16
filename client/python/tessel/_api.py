"""Devices and placements, device_put, the plan of a compile, and the
contracts as Python: memory stats, no memory growth, no new compiles."""

import contextlib
import gc
import threading

import numpy as np

from tessel import _context, _dtypes, errors
from tessel._array import Array, progress_bar
from tessel._compiled import type_text
from tessel._jit import Jitted
from tessel._sharding import Device, NamedSharding, to_placement
from tessel._session import _rpc
from tessel.v1 import session_pb2

# ---------------------------------------------------------------- placements


def devices(session=None):
    """The cluster's live devices, in global id order (any tenant's token
    may ask: what each holds for other tenants is not said)."""
    s = session or _context.session()
    return [Device(d.id, d.kind, d.worker_id, d.local_index) for d in s.list_devices().devices]


def device_put(x, device=None):
    """Explicit transfer of `x` to `device` (a device id, a tessel.Device, a
    NamedSharding over any mesh, SingleDeviceSharding or ReplicatedSharding;
    default device 0).

    A numpy array or Python scalar goes host->device. An Array already
    placed there is returned as it is; one placed elsewhere is copied there
    device to device: each new block is cut from the blocks it overlaps and
    sent worker to worker, never through the client (the copy's
    `reshard_receipt` says what moved). Both are explicit transfers to the
    transfer guard."""
    s = _context.session()
    placement = to_placement(device)
    if isinstance(x, Array):
        if x._placement == placement:
            return x
        handle, receipt = s.reshard(x.handle, placement, guard=_context.guard())
        out = Array(s, handle, x.shape, x.dtype, placement)
        out.reshard_receipt = {
            "execution": receipt.execution_id,
            "bytes_moved": receipt.bytes_moved,
            "bytes_copied": receipt.bytes_copied,
            "pieces": list(receipt.pieces),
        }
        return out
    a = np.asarray(x)
    handle = s.put(
        a,
        placement,
        implicit=False,
        guard=_context.guard(),
        progress=progress_bar(f"put {_dtypes.type_string(a.shape, a.dtype)}"),
    )
    return Array(s, handle, a.shape, a.dtype, placement)


def placement_text(p):
    kind = p.WhichOneof("kind")
    if kind == "sharded":
        return repr(NamedSharding.from_placement(p))
    return "every device (replicated)" if kind == "replicated" else f"device {p.device}"


# ---------------------------------------------------------------- plans


def compile(fn, *args, **kwargs):
    """Compiles `fn` (a function or a tessel.jit) for these arguments (arrays,
    numpy arrays, or anything with .shape and .dtype) and returns the plan."""
    j = fn if isinstance(fn, Jitted) else Jitted(fn)
    return j.lower(*args, **kwargs)


# ---------------------------------------------------------------- stats


def stats(session=None):
    """The session's counters (compiles, cache hits, executions, bytes moved
    per direction, donations reused) as a dict."""
    s = session or _context.session()
    r = s.stats()
    return {
        "live_arrays": r.live_arrays,
        "live_bytes": r.live_bytes,
        "compiles": r.session_compiles,
        "cache_hits": r.session_cache_hits,
        "cache_misses": r.compile_cache_misses,
        "executions": r.executions,
        "bytes_host_to_device": r.bytes_host_to_device,
        "bytes_device_to_host": r.bytes_device_to_host,
        "bytes_device_to_device": r.bytes_device_to_device,
        "donations": r.donations,
        "donations_reused": r.donations_reused,
    }


def _device_stats(m):
    return {
        "bytes_in_use": m.bytes_in_use,
        "peak_bytes_in_use": m.peak_bytes_in_use,
        "num_buffers": m.num_buffers,
        "bytes_cached": m.bytes_cached,
        "bytes_limit": m.bytes_limit,
        "largest_free_block": m.largest_free_block,
    }


def memory_stats(session=None):
    """Memory now: the session's live arrays and bytes, and per device (by
    global id) bytes in use, peak, buffers, cached bytes, limit. With a
    tenant's token (not an admin's) a device's figures are the tenant's own
    arrays there, its limit the tenant's quota."""
    s = session or _context.session()
    r = s.stats()
    return {
        "live_arrays": r.live_arrays,
        "live_bytes": r.live_bytes,
        "devices": {m.device: _device_stats(m) for m in r.devices},
    }


def _settled_stats(s):
    """Stats once every step the session queued has run and every array the
    program dropped has been deleted."""
    gc.collect()
    s.collect(force=True)
    r = s.stats(with_arrays=True)
    pending = [a.handle for a in r.arrays if a.state == session_pb2.PENDING]
    if pending:
        s.await_(pending, raise_errors=False)
        r = s.stats(with_arrays=True)
    return r


@contextlib.contextmanager
def assert_no_memory_growth(session=None):
    """Fails (FailedPreconditionError) if the block leaves more live arrays,
    live bytes, or device bytes/buffers than it found, naming what grew and
    which execution made each new array. Device figures are the whole
    device's (other sessions' allocations count too), or with a tenant's
    token the tenant's own."""
    s = session or _context.session()
    before = _settled_stats(s)
    yield
    now = _settled_stats(s)
    grew = []
    if now.live_arrays > before.live_arrays or now.live_bytes > before.live_bytes:
        had = {a.handle for a in before.arrays}
        fresh = [a for a in now.arrays if a.handle not in had]
        names = ", ".join(
            f"{a.handle:#x} {type_text(a.type)} ({a.bytes} bytes, made by {a.producer or '?'}"
            f"{f' in execution {a.producer_execution}' if a.producer_execution else ''})"
            for a in fresh[:8]
        )
        grew.append(
            f"session: {before.live_arrays} live arrays ({before.live_bytes} bytes) -> {now.live_arrays} "
            f"({now.live_bytes} bytes); new: {names}{', ...' if len(fresh) > 8 else ''}"
        )
    old = {m.device: m for m in before.devices}
    for m in now.devices:
        b = old.get(m.device)
        if b is not None and (m.bytes_in_use > b.bytes_in_use or m.num_buffers > b.num_buffers):
            grew.append(
                f"device {m.device}: {b.bytes_in_use} bytes in {b.num_buffers} buffers -> "
                f"{m.bytes_in_use} bytes in {m.num_buffers} buffers"
            )
    if grew:
        raise errors.FailedPreconditionError("memory grew: " + "; ".join(grew), "FAILED_PRECONDITION")


# ---------------------------------------------------------------- options


@contextlib.contextmanager
def session_options(session=None, **changes):
    """Sets session options for the block and restores them after:
    forbid_compiles, strict_donation (bools), memory_quota_bytes (int)."""
    s = session or _context.session()
    old = session_pb2.SessionOptions()
    old.CopyFrom(s.options)
    new = session_pb2.SessionOptions()
    new.CopyFrom(old)
    for k, v in changes.items():
        if k not in ("forbid_compiles", "strict_donation", "memory_quota_bytes"):
            raise TypeError(
                f"session_options: unknown option {k!r}; expected forbid_compiles, strict_donation "
                "or memory_quota_bytes"
            )
        setattr(new, k, v)
    s.set_options(new)
    try:
        yield
    finally:
        if not s.closed:
            s.set_options(old)


def forbid_compiles(session=None):
    """Inside the block a cache miss is a RecompileError saying what changed,
    never a silent compile."""
    return session_options(session, forbid_compiles=True)


_EVENT_KINDS = {
    session_pb2.ClusterEvent.WORKER_JOINED: "worker_joined",
    session_pb2.ClusterEvent.WORKER_DRAINING: "worker_draining",
    session_pb2.ClusterEvent.WORKER_LOST: "worker_lost",
}


def cluster_events(session=None):
    """What happened to the cluster's workers since this session last asked
    (the first call: every event the coordinator keeps, its last 1,024), in
    order. Each a dict: seq, kind ("worker_joined", "worker_draining" —
    told to stop, it serves until `deadline` — or "worker_lost": its arrays
    are gone), worker, address, devices (global ids), time and deadline
    (Unix seconds), message. A training loop polls it (or registers
    on_cluster_event) to save a checkpoint before a draining worker stops."""
    s = session or _context.session()
    after = getattr(s, "_events_seen", 0)
    r = _rpc(s._stub.ClusterEvents, session_pb2.ClusterEventsRequest(session_id=s.id, after=after))
    out = []
    for e in r.events:
        out.append(
            {
                "seq": e.seq,
                "kind": _EVENT_KINDS.get(e.kind, "unknown"),
                "worker": e.worker_id,
                "address": e.address,
                "devices": list(e.devices),
                "time": e.unix_ms / 1e3,
                "deadline": e.deadline_unix_ms / 1e3 if e.deadline_unix_ms else None,
                "message": e.message,
            }
        )
        s._events_seen = max(getattr(s, "_events_seen", 0), e.seq)
    return out


def on_cluster_event(callback, interval=0.5, session=None):
    """Calls `callback(event)` (a cluster_events dict) on a thread of its own
    for each event from now on, polling every `interval` seconds. Returns a
    function that stops it."""
    s = session or _context.session()
    cluster_events(s)  # what happened before: not news
    stop = threading.Event()

    def poll():
        while not stop.wait(interval) and not s.closed:
            try:
                events = cluster_events(s)
            except errors.TesselError:
                continue
            for e in events:
                callback(e)

    threading.Thread(target=poll, name="tessel-cluster-events", daemon=True).start()
    return stop.set
