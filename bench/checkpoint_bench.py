#!/usr/bin/env python3
"""Checkpoints beside their baselines, in one run, as ratios.

ckpt_save_1gib  tessel.checkpoints.save(..., wait=True) of a 1 GiB f32 array
               split over 2 workers (512 MiB each, written by each worker,
               synced) vs the same bytes written by two dd processes at once
               (512 MiB each, bs=64M, conv=fsync) to the same filesystem;
               GB/s, best of 4 rounds, alternated (each side first in turn).
               Goal >= 0.8x.
ckpt_restore_1gib  tessel.checkpoints.restore of that checkpoint onto the
               same layout (each worker reading its chunk, checking its
               CRC32C), until the arrays are ready, vs two dd processes
               reading the same chunk files at once (bs=64M, to /dev/null);
               GB/s, best of 4 alternated rounds, the page cache dropped
               before each where this process may. Goal >= 0.8x.
ckpt_step_during_save  ms per step of an MLP SGD loop (f32, 2048 -> 8192 ->
               2048 weights of 256 MiB with their biases, batch 16, tanh,
               the weights donated, one device) while async saves of its
               state run back to back, vs the same loop without; median of
               3 alternated rounds of 12 steps. Goal <= 1.15x.

  .venv/bin/python bench/checkpoint_bench.py [--json] [--only=NAME]      (after scripts/setup.sh)
"""

import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import tessel
import tessel.numpy as tnp
from tessel import Mesh, NamedSharding, P
from tessel import checkpoints as ckpt
from report import report

GIB = 1 << 30


def drop_caches():
    """Empties the page cache when this process may (root, a writable
    /proc/sys/vm/drop_caches); else leaves it."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def parallel(commands):
    """Seconds for `commands` run at once, each to its end."""
    start = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"{' '.join(procs[0].args)} failed")
    return time.perf_counter() - start


def save_and_restore(root):
    """(save GB/s, dd write GB/s, restore GB/s, dd read GB/s)."""
    with tessel.local_cluster(workers=2, devices_per_worker=1) as c:
        mesh = Mesh([("x", 2)])
        sharding = NamedSharding(mesh, P("x"))
        x = tessel.device_put(np.arange(GIB // 4, dtype=np.float32).reshape(2, -1), sharding)
        ours, dd, back, dd_read = [], [], [], []
        dropped = False
        for r in range(4):
            path = root / f"c{r}"
            files = [path / "x" / "c" / str(i) / "0" for i in range(2)]
            outs = [root / f"dd{r}.{i}" for i in range(2)]

            def ours_write():
                os.sync()
                t = time.perf_counter()
                ckpt.save(path, {"x": x}, wait=True)
                ours.append(GIB / (time.perf_counter() - t))
                assert all(f.stat().st_size == GIB // 2 + 4 for f in files)

            def dd_write():
                os.sync()
                cmds = [["dd", "if=/dev/zero", f"of={o}", "bs=64M", "count=8", "conv=fsync"] for o in outs]
                dd.append(GIB / parallel(cmds))

            def ours_read():
                nonlocal dropped
                dropped = drop_caches()
                t = time.perf_counter()
                y = ckpt.restore(path, target={"x": x})
                c.session.await_([y["x"].handle])
                back.append(GIB / (time.perf_counter() - t))

            def dd_read_():
                drop_caches()
                dd_read.append(GIB / parallel([["dd", f"if={f}", "of=/dev/null", "bs=64M"] for f in files]))

            # Alternated: the disk's own writeback after one side's syncs
            # slows whichever writes next.
            for f in (ours_write, dd_write) if r % 2 == 0 else (dd_write, ours_write):
                f()
            for f in (ours_read, dd_read_) if r % 2 == 0 else (dd_read_, ours_read):
                f()
            shutil.rmtree(path)
            for o in outs:
                o.unlink()
        print(f"page cache dropped before reads: {dropped}", file=sys.stderr)
        return max(ours) / 1e9, max(dd) / 1e9, max(back) / 1e9, max(dd_read) / 1e9


def mlp_step(w1, b1, w2, b2, x):
    h = tnp.tanh(x @ w1 + b1)
    y = h @ w2 + b2
    err = y - x  # an autoencoder's squared error, its gradient by hand
    gy = err * (2.0 / err.size)
    gh = (gy @ w2.T) * (1.0 - h * h)
    lr = 1e-3
    return (
        w1 - lr * (x.T @ gh),
        b1 - lr * gh.sum(axis=0),
        w2 - lr * (h.T @ gy),
        b2 - lr * gy.sum(axis=0),
    )


def step_during_save(root):
    """(ms per step with saves running, ms per step without)."""
    with tessel.local_cluster(workers=1, devices_per_worker=1) as c:
        rng = np.random.default_rng(0)
        d, h, batch = 2048, 8192, 16
        state = [
            tessel.device_put((rng.standard_normal((d, h)) * 0.01).astype(np.float32)),
            tessel.device_put(np.zeros(h, np.float32)),
            tessel.device_put((rng.standard_normal((h, d)) * 0.01).astype(np.float32)),
            tessel.device_put(np.zeros(d, np.float32)),
        ]
        x = tessel.device_put(rng.standard_normal((batch, d)).astype(np.float32))
        step = tessel.jit(mlp_step, donate_argnums=(0, 1, 2, 3))
        state = list(step(*state, x))
        c.session.await_([a.handle for a in state])

        def run(steps, saving):
            nonlocal state
            pending, n, written = None, 0, []
            t = time.perf_counter()
            for _ in range(steps):
                if saving and (pending is None or pending.done()):
                    if pending is not None:
                        written.append(pending.wait())
                    n += 1
                    pending = ckpt.save(root / f"s{n}", {"state": state})
                state = list(step(*state, x))
                c.session.await_([a.handle for a in state])
            ms = (time.perf_counter() - t) * 1e3 / steps
            if pending is not None:
                written.append(pending.wait())
            for path in written:
                shutil.rmtree(path)
            return ms, n

        with_save, without = [], []
        for _ in range(3):
            ms, saves = run(12, True)
            with_save.append(ms)
            without.append(run(12, False)[0])
        print(f"saves during the last round: {saves}", file=sys.stderr)
        return statistics.median(with_save), statistics.median(without)


def main():
    if not os.environ.get("TESSEL_BIN_DIR"):
        os.environ["TESSEL_BIN_DIR"] = str(pathlib.Path(__file__).resolve().parents[1] / "build" / "bin")
    only = next((a[len("--only=") :] for a in sys.argv if a.startswith("--only=")), "")
    root = pathlib.Path(tempfile.mkdtemp(prefix="tessel-ckpt-bench-", dir=os.environ.get("TESSEL_BENCH_DIR")))
    rows = []
    try:
        if not only or only in "ckpt_save_1gib ckpt_restore_1gib":
            save, dd_write, restore, dd_read = save_and_restore(root)
            rows.append(("ckpt_save_1gib", "GB/s", save, dd_write, ">= 0.8x", save / dd_write >= 0.8))
            rows.append(("ckpt_restore_1gib", "GB/s", restore, dd_read, ">= 0.8x", restore / dd_read >= 0.8))
        if not only or only in "ckpt_step_during_save":
            ours, base = step_during_save(root)
            rows.append(("ckpt_step_during_save", "ms", ours, base, "<= 1.15x", ours / base <= 1.15))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(rows)


if __name__ == "__main__":
    main()
