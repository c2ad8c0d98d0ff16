"""The client's part of a trace (tessel.profiler): while a trace records,
tracing a function, compiling it and dispatching its calls are spans on this
process's clock (Unix nanoseconds, as the daemons' events). Off, each point
costs one global read."""

import threading
import time

events = None  # a list of (name, category, track, thread, start_ns, duration_ns, args) while recording
_MAX_EVENTS = 1_000_000
dropped = 0


def start():
    global events, dropped
    events, dropped = [], 0


def stop():
    """Stops recording; returns the events and how many were dropped."""
    global events
    taken, events = events or [], None
    return taken, dropped


def begin():
    """A span's start: its time, or 0 when not recording."""
    return time.time_ns() if events is not None else 0


def end(start_ns, name, category, track, **args):
    """Records the span begun at `start_ns` (nothing when that was 0 or
    recording has stopped since)."""
    global dropped
    recording = events
    if not start_ns or recording is None:
        return
    if len(recording) >= _MAX_EVENTS:
        dropped += 1
        return
    now = time.time_ns()
    recording.append((name, category, track, threading.get_ident(), start_ns, now - start_ns, args))
