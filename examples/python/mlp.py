#!/usr/bin/env python3
"""Trains a two-layer MLP on a synthetic regression task on a local Tessel
cluster of two worker processes, from Python.

Forward and backward pass are one traced step (the backward pass from
tessel.value_and_grad); the parameters are donated to
each step, so they are updated in place and stay on the device. The loop runs
under a transfer guard that refuses any device->host transfer but the
explicit loss fetches, with new compiles forbidden and memory growth checked.
The trained model is then scored on held-out data on the other worker, and
the result is checked against the same training run in numpy.

    .venv/bin/python examples/python/mlp.py      (after scripts/setup.sh)
"""

import sys
import time

import numpy as np

import tessel
import tessel.numpy as tnp

BATCH, IN, HIDDEN, STEPS, LR = 512, 16, 64, 400, 0.1


def forward(m, params, x):
    w1, b1, w2, b2 = params
    h = m.tanh(x @ w1 + b1)
    return h @ w2 + b2, h


def train_step(params, x, y):
    """(params, x, y) -> (params', loss): SGD on mean squared error, the
    gradients from tessel.value_and_grad (the numpy reference below writes
    them out by hand)."""

    def loss_of(params):
        pred, _ = forward(tnp, params, x)
        err = pred - y
        return tnp.mean(err * err)

    loss, grads = tessel.value_and_grad(loss_of)(params)
    new = tuple(p - LR * g for p, g in zip(params, grads))
    return new, loss


def numpy_train_step(params, x, y):
    w1, b1, w2, b2 = params
    pred, h = forward(np, params, x)
    err = pred - y
    dpred = err * np.float32(2.0 / BATCH)
    dh = (dpred @ w2.T) * (np.float32(1) - h * h)
    grads = (x.T @ dh, dh.sum(axis=0), h.T @ dpred, dpred.sum(axis=0))
    return tuple(p - np.float32(LR) * g for p, g in zip(params, grads)), np.mean(err * err)


def make_data(rng):
    teacher = np.random.default_rng(7)
    u, v = ((teacher.standard_normal(IN) / np.sqrt(IN)).astype(np.float32) for _ in range(2))
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    y = (np.sin(2 * (x @ u)) + 0.5 * (x @ v) ** 2)[:, None].astype(np.float32)
    return x, y


def main():
    rng = np.random.default_rng(42)
    init = (
        (rng.standard_normal((IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
        np.zeros(HIDDEN, np.float32),
        (rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN)).astype(np.float32),
        np.zeros(1, np.float32),
    )
    hx, hy = make_data(rng)
    with tessel.local_cluster(workers=2, devices_per_worker=1) as cluster:
        print(f"local cluster: coordinator {cluster.address}, devices {tessel.devices()}")
        step = tessel.jit(train_step, donate_argnums=0)
        params = tuple(tessel.device_put(p, 0) for p in init)
        x, y = tessel.device_put(hx, 0), tessel.device_put(hy, 0)
        plan = step.lower(params, x, y)
        print(
            f"compiled {len(plan.as_text().splitlines())} plan lines; donations: "
            + ", ".join(f"params[{a['parameter']}] -> output {a['output']}" for a in plan.aliases)
        )
        print(
            f"training on device 0: batch {BATCH}, {IN} -> {HIDDEN} -> 1, lr {LR}; "
            f"predicting the mean scores {hy.var():.4f}"
        )
        start = time.perf_counter()
        params, loss = step(params, x, y)  # the first step; the loop after it is steady state
        losses = [float(loss.fetch())]
        print(f"step    1  loss {losses[-1]:.5f}")
        with tessel.transfer_guard("disallow"), tessel.forbid_compiles(), tessel.assert_no_memory_growth():
            for i in range(2, STEPS + 1):
                params, loss = step(params, x, y)
                if i % 40 == 0:
                    losses.append(float(loss.fetch()))  # the only device->host transfer: explicit
                    print(f"step {i:4d}  loss {losses[-1]:.5f}")
        secs = time.perf_counter() - start
        receipts = step.donation_receipts()
        print(
            f"{STEPS} steps in {secs:.2f} s ({STEPS / secs:.0f} steps/s); "
            f"last step reused {sum(r['reused'] for r in receipts)}/{len(receipts)} donated buffers in place"
        )

        # Held-out data, scored on the other worker.
        tx, ty = make_data(rng)
        evaluate = tessel.jit(lambda p, x, y: tnp.mean((forward(tnp, p, x)[0] - y) ** 2), device=1)
        moved = tuple(tessel.device_put(p, 1) for p in params)  # worker to worker, not through here
        held_out = float(evaluate(moved, tx, ty))
        print(
            f"held-out loss on device 1: {held_out:.5f} (predicting the mean: {ty.var():.4f}); the parameters moved "
            f"worker to worker: {sum(p.reshard_receipt['bytes_moved'] for p in moved)} bytes"
        )
        stats = tessel.stats()
        print(
            f"session: {stats['compiles']} compiles, {stats['executions']} executions, "
            f"{stats['donations_reused']}/{stats['donations']} donations reused, "
            f"{stats['bytes_host_to_device']} bytes host->device, {stats['bytes_device_to_host']} device->host"
        )
        final = [p.fetch() for p in params]

    # The same run in numpy, as the reference.
    ref = init
    for _ in range(STEPS):
        ref, ref_loss = numpy_train_step(ref, hx, hy)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(final, ref))
    print(f"numpy reference: final loss {ref_loss:.5f}; largest parameter difference {worst:.2e}")
    if not losses[-1] < 0.5 * hy.var():
        sys.exit(f"mlp: training did not converge: loss {losses[-1]:.4f}")
    if worst > 1e-4:
        sys.exit(f"mlp: parameters differ from numpy's by {worst:.2e}")


if __name__ == "__main__":
    main()
