#!/usr/bin/env python3
"""Pipeline-parallel training of a two-layer MLP over two sub-meshes of a
local cluster (GPipe schedule), from Python.

Stage 0 (the first layer) lives on devices {0, 1} of worker 0, stage 1 (the
second layer and the loss) on devices {2, 3} of worker 1; within a stage each
microbatch is split over the stage's two devices. Each step runs the
microbatches through stage 0's forward, sends each activation to stage 1
(device_put: worker to worker), runs stage 1's forward and backward there,
sends each activation gradient back, and runs stage 0's backward; the
gradients of the microbatches are averaged and each stage updates its own
weights where they live. Nothing waits on the client: each device runs its
queue in order, so stage 0's forward of microbatch m+1 runs while stage 1
works on microbatch m.

The run prints the plan of one step (each send and receive with its bytes)
and checks the result against the same training on the whole batch in numpy.

    .venv/bin/python examples/python/pipeline.py      (after scripts/setup.sh)
"""
import os
import pathlib
import sys
import time

import numpy as np

import tessel
import tessel.numpy as tnp
from tessel import Mesh, NamedSharding, P

BATCH, IN, HIDDEN, MICRO, STEPS, LR = 512, 16, 64, 4, 60, 0.1
STAGE0 = Mesh({"d": 2}, devices=[0, 1])
STAGE1 = Mesh({"d": 2}, devices=[2, 3])


def layer0(w1, b1, x):
    return tnp.tanh(x @ w1 + b1)


def loss1(w2, b2, h, y):
    err = h @ w2 + b2 - y
    return tnp.mean(err * err)


@tessel.jit
def forward0(w1, b1, x):
    return layer0(w1, b1, x)


@tessel.jit
def forward_backward1(w2, b2, h, y):
    """Stage 1 on one microbatch: its loss and the gradients of its weights
    and of the activation it was given."""
    loss, (gw2, gb2, gh) = tessel.value_and_grad(loss1, argnums=(0, 1, 2))(w2, b2, h, y)
    return loss, gw2, gb2, gh


@tessel.jit
def backward0(w1, b1, x, gh):
    _, pullback = tessel.vjp(lambda w, b: layer0(w, b, x), w1, b1)
    return pullback(gh)


@tessel.jit
def sgd(w, *grads):
    """One SGD update with the mean of the microbatches' gradients."""
    total = grads[0]
    for g in grads[1:]:
        total = total + g
    return w - LR * total / len(grads)


def pipeline_step(params, xs, ys):
    """GPipe: forwards through both stages microbatch by microbatch, then the
    backwards of stage 0. Returns (params', mean loss, the receipts of the
    step's sends)."""
    w1, b1, w2, b2 = params
    rows1, rows0 = NamedSharding(STAGE1, P("d")), NamedSharding(STAGE0, P("d"))
    losses, g1, gh, sends = [], [], [], []
    for x, y in zip(xs, ys):
        h = tessel.device_put(forward0(w1, b1, x), rows1)  # stage 0 -> stage 1
        loss, gw2, gb2, g = forward_backward1(w2, b2, h, y)
        losses.append(loss)
        g1.append((gw2, gb2))
        gh.append(g)
        sends.append(("activation", h.reshard_receipt))
    g0 = []
    for x, g in zip(xs, gh):
        back = tessel.device_put(g, rows0)  # stage 1 -> stage 0
        sends.append(("activation gradient", back.reshard_receipt))
        g0.append(backward0(w1, b1, x, back))
    new = (sgd(w1, *(g[0] for g in g0)), sgd(b1, *(g[1] for g in g0)),
           sgd(w2, *(g[0] for g in g1)), sgd(b2, *(g[1] for g in g1)))
    return new, losses, sends


def numpy_step(params, x, y):
    w1, b1, w2, b2 = params
    h = np.tanh(x @ w1 + b1)
    err = h @ w2 + b2 - y
    dpred = err * np.float32(2.0 / err.size)
    dh = (dpred @ w2.T) * (np.float32(1) - h * h)
    grads = (x.T @ dh, dh.sum(axis=0), h.T @ dpred, dpred.sum(axis=0))
    return tuple(p - np.float32(LR) * g for p, g in zip(params, grads)), float(np.mean(err * err))


def make_data(rng):
    u = (np.random.default_rng(7).standard_normal(IN) / np.sqrt(IN)).astype(np.float32)
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    y = np.sin(2 * (x @ u))[:, None].astype(np.float32)
    return x, y


def main():
    rng = np.random.default_rng(42)
    init = ((rng.standard_normal((IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32), np.zeros(HIDDEN, np.float32),
            (rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN)).astype(np.float32), np.zeros(1, np.float32))
    hx, hy = make_data(rng)
    mb = BATCH // MICRO
    with tessel.local_cluster(workers=2, devices_per_worker=2) as cluster:
        print(f"local cluster: coordinator {cluster.address}, devices {tessel.devices()}")
        print(f"stage 0: {STAGE0}; stage 1: {STAGE1}; {MICRO} microbatches of {mb} rows, split over each stage's "
              f"2 devices")
        rep0, rep1 = NamedSharding(STAGE0, P()), NamedSharding(STAGE1, P())
        params = (tessel.device_put(init[0], rep0), tessel.device_put(init[1], rep0),
                  tessel.device_put(init[2], rep1), tessel.device_put(init[3], rep1))
        xs = [tessel.device_put(hx[i * mb:(i + 1) * mb], NamedSharding(STAGE0, P("d"))) for i in range(MICRO)]
        ys = [tessel.device_put(hy[i * mb:(i + 1) * mb], NamedSharding(STAGE1, P("d"))) for i in range(MICRO)]
        params, losses, sends = pipeline_step(params, xs, ys)
        print("plan of one step: sends between the stages, worker to worker")
        for what, r in sends[:1] + sends[MICRO:MICRO + 1]:
            print(f"  {what} ({r['bytes_moved']} bytes):")
            for p in r["pieces"]:
                print(f"    {p}")
        print(f"  ... {len(sends)} sends per step, {sum(r['bytes_moved'] for _, r in sends)} bytes in all")
        first = float(np.mean([float(l.fetch()) for l in losses]))
        print(f"step    1  loss {first:.5f}")
        start = time.perf_counter()
        for i in range(2, STEPS + 1):
            params, losses, _ = pipeline_step(params, xs, ys)
            if i % 20 == 0:
                print(f"step {i:4d}  loss {float(np.mean([float(l.fetch()) for l in losses])):.5f}")
        final = [p.fetch() for p in params]
        secs = time.perf_counter() - start
        last = float(np.mean([float(l.fetch()) for l in losses]))
        stats = tessel.stats()
        print(f"{STEPS - 1} steps in {secs:.2f} s; session: {stats['executions']} executions, "
              f"{stats['bytes_device_to_device']} bytes device->device, "
              f"{stats['bytes_device_to_host']} device->host (the printed losses and the final weights)")

    ref = init
    for _ in range(STEPS):
        ref, ref_loss = numpy_step(ref, hx, hy)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(final, ref))
    print(f"numpy on the whole batch: loss before the last step {ref_loss:.5f}, pipeline {last:.5f}; "
          f"largest parameter difference {worst:.2e}")
    if not last < 0.5 * first:
        sys.exit(f"pipeline: training did not converge: loss {first:.4f} -> {last:.4f}")
    if worst > 1e-4 or abs(last - ref_loss) > 1e-4:
        sys.exit(f"pipeline: differs from numpy's run by {worst:.2e} (loss {last:.5f} vs {ref_loss:.5f})")


if __name__ == "__main__":
    if not os.environ.get("TESSEL_BIN_DIR"):
        build = pathlib.Path(__file__).resolve().parents[2] / "build" / "bin"
        if (build / "tessel-worker").exists():
            os.environ["TESSEL_BIN_DIR"] = str(build)
    main()
