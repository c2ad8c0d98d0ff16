#!/usr/bin/env python3
"""Sharded execution beside its baselines, in one run, as ratios.

  all_reduce_{1,16,256}mib  psum of an f32 block per device, in a manual region
                 over a mesh of 2 devices on 2 worker processes, through
                 Tessel (dispatch, Gloo ring across the workers, completion);
                 bus bandwidth vs Gloo's ring allreduce called directly by 2
                 processes on the same sizes (tessel-gloo-bench). Goal >= 0.9x.
  sharded_sum    tanh(x) * 2 + 1 summed over 2^26 f32, x split over the mesh:
                 1 worker (1 device) vs 2 workers (1 device each); the sum
                 finishes with one all_reduce of 4 bytes.

    TESSEL_BIN_DIR=build/bin python3 bench/sharding_bench.py
Timings are medians of repeated runs; machines drift, so compare the ratios.
"""
import os
import pathlib
import re
import subprocess
import time

import numpy as np

import tessel
import tessel.numpy as tnp
from tessel import Mesh, NamedSharding, P

SIZES = [1 << 20, 16 << 20, 256 << 20]


def bin_dir():
    d = os.environ.get("TESSEL_BIN_DIR") or str(pathlib.Path(__file__).resolve().parents[1] / "build" / "bin")
    return pathlib.Path(d)


def median_time(fn, iters):
    fn()  # warm: compile, first-touch of buffers, group rendezvous
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def tessel_all_reduce(nbytes, iters):
    mesh = Mesh({"x": 2})
    n = nbytes // 4
    state = [tessel.device_put(np.ones(2 * n, np.float32), NamedSharding(mesh, P("x")))]
    # Donated, as a hot loop would be: the result reuses the argument's buffer.
    step = tessel.jit(lambda a: tessel.shard_map(lambda b: tessel.psum(b, "x") * 0.5, mesh, P("x"), P("x"))(a),
                      donate_argnums=0)
    assert len(step.lower(state[0]).collectives) == 1

    def once():
        state[0] = step(state[0])
        state[0].block_until_ready()
    return median_time(once, iters)


def gloo_all_reduce(iters):
    out = subprocess.run([str(bin_dir() / "tessel-gloo-bench"), f"--iters={iters}"] + [str(s) for s in SIZES],
                         check=True, capture_output=True, text=True).stdout
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"bytes=(\d+) seconds=([\d.]+)", out)}


def sharded_sum(workers, iters):
    n = 1 << 26
    with tessel.local_cluster(workers=workers, devices_per_worker=1):
        mesh = Mesh({"x": workers})
        x = tessel.device_put(np.full(n, 0.5, np.float32), NamedSharding(mesh, P("x")))
        f = tessel.jit(lambda a: tnp.sum(tnp.tanh(a) * 2 + 1))
        got = float(f(x).fetch())
        return median_time(lambda: f(x).block_until_ready(), iters), got


def main():
    gloo = gloo_all_reduce(10)
    print(f"{'benchmark':<22} {'tessel':>14} {'baseline':>14} {'ratio':>7}")
    with tessel.local_cluster(workers=2, devices_per_worker=1):
        for nbytes in SIZES:
            t = tessel_all_reduce(nbytes, 10 if nbytes < (64 << 20) else 5)
            g = gloo[nbytes]
            # Bus bandwidth of a 2-rank allreduce: 2(n-1)/n * bytes / time = bytes / time.
            print(f"all_reduce_{nbytes >> 20}mib{'':<8} {nbytes / t / 1e9:>9.3f} GB/s {nbytes / g / 1e9:>9.3f} GB/s "
                  f"{g / t:>6.2f}x")
    one, sum_one = sharded_sum(1, 10)
    two, sum_two = sharded_sum(2, 10)
    print(f"{'sharded_sum_2^26':<22} {two * 1e3:>10.2f} ms {one * 1e3:>10.2f} ms {one / two:>6.2f}x"
          f"  (2 workers vs 1: speed-up; sums {sum_two:.6g} / {sum_one:.6g}, numpy f64 "
          f"{(1 << 26) * (np.tanh(0.5) * 2 + 1):.6g})")


if __name__ == "__main__":
    main()
