#!/usr/bin/env python3
"""The MLP training step on one GPU: Tessel's CUDA backend beside JAX on the
same GPU, as a ratio of step times (goal <= 1.2x).

  mlp_step_bf16  a two-layer MLP (8192 x 4096 -> 4096 -> 4096, relu, mean
                 squared error) in bf16 with f32 accumulation: the forward
                 pass, the backward pass written out by hand (the same
                 function runs under both, with xp = tessel.numpy or
                 jax.numpy), and an SGD update of the donated weights. 30
                 steps issued back to back, timed until the last loss is on
                 the host.

Needs a GPU, jax with its CUDA plugin, and Tessel's binaries:

    TESSEL_BIN_DIR=build/bin python3 bench/gpu_mlp_bench.py [--json]
"""

import json
import sys
import time

import ml_dtypes
import numpy as np

import tessel
import tessel.numpy as tnp

BATCH, D_IN, HIDDEN, D_OUT = 8192, 4096, 4096, 4096
STEPS = 30
LR = 1e-3
BF16 = ml_dtypes.bfloat16


def step(xp, w1, w2, x, t):
    pre = x @ w1
    h = xp.maximum(pre, 0)
    y = h @ w2
    err = y - t
    loss = xp.mean(xp.square(err.astype(np.float32)))
    dy = err * np.array(2.0 / err.size, BF16)
    dw2 = h.T @ dy
    dh = xp.where(pre > 0, dy @ w2.T, np.array(0, BF16))
    dw1 = x.T @ dh
    return w1 - dw1 * np.array(LR, BF16), w2 - dw2 * np.array(LR, BF16), loss


def data():
    rng = np.random.default_rng(0)
    return [
        (rng.standard_normal(s) * scale).astype(BF16)
        for s, scale in (
            ((D_IN, HIDDEN), D_IN**-0.5),
            ((HIDDEN, D_OUT), HIDDEN**-0.5),
            ((BATCH, D_IN), 1.0),
            ((BATCH, D_OUT), 1.0),
        )
    ]


def run_tessel(arrays):
    with tessel.local_cluster(workers=1, devices_per_worker=1, worker_flags=["--device_kind=cuda"]):
        f = tessel.jit(lambda w1, w2, x, t: step(tnp, w1, w2, x, t), donate_argnums=(0, 1))
        w1, w2, x, t = (tessel.device_put(a) for a in arrays)
        w1, w2, loss = f(w1, w2, x, t)  # compile, load, warm up
        first = float(loss.fetch())
        start = time.perf_counter()
        for _ in range(STEPS):
            w1, w2, loss = f(w1, w2, x, t)
        last = float(loss.fetch())
        return (time.perf_counter() - start) / STEPS, first, last


def run_jax(arrays):
    import jax
    import jax.numpy as jnp

    gpu = jax.devices("gpu")[0]
    f = jax.jit(lambda w1, w2, x, t: step(jnp, w1, w2, x, t), donate_argnums=(0, 1))
    w1, w2, x, t = (jax.device_put(a, gpu) for a in arrays)
    w1, w2, loss = f(w1, w2, x, t)
    first = float(loss)
    start = time.perf_counter()
    for _ in range(STEPS):
        w1, w2, loss = f(w1, w2, x, t)
    last = float(loss)
    return (time.perf_counter() - start) / STEPS, first, last


def main():
    arrays = data()
    t_tessel, first_t, last_t = run_tessel(arrays)
    t_jax, first_j, last_j = run_jax(arrays)
    # Same start, same steps: the losses agree to bf16's precision.
    agree = abs(first_t - first_j) <= 2e-2 * abs(first_j) and abs(last_t - last_j) <= 2e-2 * abs(last_j)
    ratio = t_tessel / t_jax
    row = {
        "value": t_tessel * 1e3,
        "baseline": t_jax * 1e3,
        "ratio": round(ratio, 3),
        "goal": "<=1.20",
        "unit": "ms/step",
        "met": ratio <= 1.2 and agree,
        "losses": {"tessel": [first_t, last_t], "jax": [first_j, last_j]},
    }
    if "--json" in sys.argv:
        print(json.dumps({"mlp_step_bf16": row}, indent=2))
    else:
        print(f"{'benchmark':18} {'tessel':>12} {'baseline':>12} {'unit':8} {'ratio':>7} {'goal':>8}  what")
        print(
            f"{'mlp_step_bf16':18} {row['value']:12.2f} {row['baseline']:12.2f} {'ms/step':8} {ratio:7.2f} "
            f"{'<=1.20':>8}{' ' if row['met'] else '!'} 2-layer bf16 MLP train step vs jax.jit on the same GPU; "
            f"loss {first_t:.4f}->{last_t:.4f} (jax {first_j:.4f}->{last_j:.4f})"
        )
    if not agree:
        print("gpu_mlp_bench: Tessel's losses differ from JAX's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
