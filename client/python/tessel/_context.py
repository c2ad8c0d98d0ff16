"""Per-thread state: the current session and the transfer guard in force."""

import contextlib
import threading

_local = threading.local()
_default = {"session": None}


def session():
    s = getattr(_local, "session", None) or _default["session"]
    if s is None or s.closed:
        raise RuntimeError("no Tessel session: call tessel.connect(address) or use tessel.local_cluster()")
    return s


def current_session():
    """session() without the checks: None when there is none."""
    return getattr(_local, "session", None) or _default["session"]


def default_session_or_none():
    return _default["session"]


def set_default_session(s):
    _default["session"] = s


def guard():
    return dict(getattr(_local, "guard", {}) or {})


def guard_object():
    """The guard in force as set (not copied): a new object whenever a
    transfer_guard block starts or ends, so its identity says whether the
    guard may have changed."""
    return getattr(_local, "guard", None)


@contextlib.contextmanager
def transfer_guard(level=None, *, host_to_device=None, device_to_host=None, device_to_device=None):
    """Sets the transfer guard for the calls made inside, per direction.
    `level` sets all three; the keywords set one each."""
    new = guard()
    for direction, value in (
        ("host_to_device", host_to_device or level),
        ("device_to_host", device_to_host or level),
        ("device_to_device", device_to_device or level),
    ):
        if value is not None:
            new[direction] = value
    old = getattr(_local, "guard", None)
    _local.guard = new
    try:
        yield
    finally:
        _local.guard = old


def remat_hook():
    """The innermost checkpointed function being traced on this thread (its
    recorder, tessel._remat), or None."""
    stack = getattr(_local, "remat", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def remat_scope(hook):
    stack = getattr(_local, "remat", None)
    if stack is None:
        stack = _local.remat = []
    stack.append(hook)
    try:
        yield
    finally:
        stack.pop()
