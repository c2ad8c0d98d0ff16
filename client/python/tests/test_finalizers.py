"""Finalizers never block: an Array freed by the cyclic garbage collector while
its thread holds the SDK's locks is queued, not deleted in place; a pipelined
loop under collection at nearly every allocation keeps its memory figures;
SIGINT interrupts a pipelined loop, even when its handler runs inside a
finalizer, and the cluster keeps serving."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp


def _live(session):
    return tessel.stats(session)["live_arrays"]


def test_cycle_collected_under_the_session_locks_does_not_hang(session):
    holder = [tessel.device_put(np.arange(8, dtype=np.float32))]
    baseline = _live(session)
    finished = threading.Event()

    def under_locks():
        # Every lock the SDK holds while it allocates: a finalizer that took
        # any of them would wait on its own thread here.
        with session._lock, session._collect_lock:
            cycle = [holder.pop()]
            cycle.append(cycle)  # the Array is freed only by the cyclic collector
            del cycle
            gc.collect()
        finished.set()

    t = threading.Thread(target=under_locks, daemon=True)
    t.start()
    t.join(timeout=20)
    assert finished.is_set(), "a finalizer blocked on a lock its own thread held"
    # The dropped array is deleted by the next call that collects.
    assert _live(session) == baseline - 1


def test_pipelined_loop_under_constant_collection_keeps_memory(session):
    @tessel.jit(donate_argnums=0)
    def step(state, x):
        return state * 0.5 + tnp.tanh(x)

    x = tessel.device_put(np.linspace(-1, 1, 64, dtype=np.float32))
    states = [tessel.device_put(np.zeros(64, np.float32)) for _ in range(2)]
    step(tessel.device_put(np.zeros(64, np.float32)), x).fetch()  # compiled before the check
    errors = []

    def loop(i, n):
        try:
            s = states[i]
            for _ in range(n):
                s = step(s, x)
                junk = [tnp.abs(x)]
                junk.append(junk)  # an Array in a reference cycle, freed by the collector
            states[i] = s
        except BaseException as e:  # noqa: BLE001: reported by the main thread
            errors.append(e)

    old = gc.get_threshold()
    with tessel.assert_no_memory_growth():
        gc.set_threshold(1)
        try:
            threads = [threading.Thread(target=loop, args=(i, 1500), daemon=True) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=240)
            assert not any(t.is_alive() for t in threads), "the loop hung"
        finally:
            gc.set_threshold(*old)
        assert not errors, errors
        want = np.zeros(64, np.float32)
        tanh = np.tanh(np.linspace(-1, 1, 64, dtype=np.float32))
        for _ in range(1500):
            want = want * np.float32(0.5) + tanh
        for s in states:
            np.testing.assert_allclose(s.fetch(), want, rtol=1e-6, atol=1e-6)
        del s


_SIGINT_CHILD = textwrap.dedent("""
    import sys, numpy as np, tessel, tessel.numpy as tnp
    tessel.connect(sys.argv[1])

    @tessel.jit(donate_argnums=0)
    def step(s):
        return s * 0.5 + 1.0

    s = step(tessel.device_put(np.zeros(1 << 16, np.float32)))
    s.fetch()
    try:  # "looping" is said inside the loop: the signal can only land in it
        steps = 0
        while True:
            s = step(s)
            steps += 1
            if steps == 10:
                print("looping", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")


def test_sigint_interrupts_a_pipelined_loop(cluster, session):
    p = subprocess.Popen(
        [sys.executable, "-c", _SIGINT_CHILD, cluster.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert p.stdout.readline().strip() == "looping", p.stderr.read()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "interrupted" in out, err
    # The cluster keeps serving.
    a = tessel.device_put(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(a.fetch(), np.arange(4, dtype=np.float32))


@pytest.mark.parametrize("queued", [False, True], ids=["before-the-drop", "after-the-drop"])
def test_a_signal_whose_handler_ran_in_a_finalizer_is_delivered_again(session, queued):
    # Python prints an exception raised in a finalizer and forgets it: a
    # KeyboardInterrupt that surfaced in Array.__del__ would leave the loop
    # it was meant to stop running. Here the handler's exception is made to
    # surface in the drop, before or after it queued the handle.
    a = tessel.device_put(np.arange(8, dtype=np.float32))
    handle = a.handle
    real = session.drop
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(kwargs.get("again", False))
        if len(calls) == 1:
            if queued:
                real(*args, **kwargs)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    session.drop = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            del a
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the signal lands again here, once the finalizer is done
                pass
    finally:
        del session.drop
    assert calls == [False, True]
    assert [d[0] for d in session._dropped].count(handle) == 1
    session.collect(force=True)
    assert not session._dropped
