#!/usr/bin/env python3
"""Pipeline-parallel training of a three-layer MLP over two sub-meshes of a
local cluster (GPipe schedule), as one jitted MPMD program, from Python.

Stage 0 (the first layer) lives on devices {0, 1} of worker 0, stage 1 (the
other two layers and the loss) on devices {2, 3} of worker 1; within a stage each
microbatch is split over the stage's two devices. Each stage function is a
jit on its sub-mesh (its in_shardings and out_shardings name the mesh);
called inside the jitted training step, each call becomes a mesh region of
one MPMD program. The coordinator compiles every region for its devices and
moves each value a region reads from another stage worker to worker, as its
plan lists. A step runs the microbatches through stage 0's forward, stage
1's forward and backward, then stage 0's backward; the gradients of the
microbatches are averaged and each stage updates its own weights where they
live. Each device runs its queue in order, so stage 0's forward of
microbatch m+1 runs while stage 1 works on microbatch m.

The run prints the plan's sends and receives, and checks the result against
the same training on the whole batch in numpy.

    .venv/bin/python examples/python/pipeline.py      (after scripts/setup.sh)
"""

import sys
import time

import numpy as np

import tessel
import tessel.numpy as tnp
from tessel import Mesh, NamedSharding, P

BATCH, IN, HIDDEN, HIDDEN2, MICRO, STEPS, LR = 512, 16, 64, 32, 4, 60, 0.1
STAGE0 = Mesh({"d": 2}, devices=[0, 1])
STAGE1 = Mesh({"d": 2}, devices=[2, 3])


def layer0(w1, b1, x):
    return tnp.tanh(x @ w1 + b1)


def loss1(w2, b2, w3, b3, h, y):
    err = tnp.tanh(h @ w2 + b2) @ w3 + b3 - y
    return tnp.mean(err * err)


def forward_backward1(w2, b2, w3, b3, h, y):
    """Stage 1 on one microbatch: its loss, the gradients of its weights
    and that of the activation it was given."""
    loss, grads = tessel.value_and_grad(loss1, argnums=(0, 1, 2, 3, 4))(w2, b2, w3, b3, h, y)
    return (loss,) + tuple(grads)


def backward0(w1, b1, x, gh):
    _, pullback = tessel.vjp(lambda w, b: layer0(w, b, x), w1, b1)
    return pullback(gh)


def sgd(w, *grads):
    """One SGD update with the mean of the microbatches' gradients."""
    total = grads[0]
    for g in grads[1:]:
        total = total + g
    return w - LR * total / len(grads)


class Pipeline:
    """The stage functions as jits on their sub-meshes (each microbatch
    split over a stage's devices along axis 'd'), and the training step."""

    def __init__(self, stage0, stage1):
        self.whole0, self.rows0 = NamedSharding(stage0, P()), NamedSharding(stage0, P("d"))
        self.whole1, self.rows1 = NamedSharding(stage1, P()), NamedSharding(stage1, P("d"))
        w0, r0, w1, r1 = self.whole0, self.rows0, self.whole1, self.rows1
        self.forward0 = tessel.jit(layer0, in_shardings=(w0, w0, r0), out_shardings=r0)
        self.forward_backward1 = tessel.jit(
            forward_backward1, in_shardings=(w1, w1, w1, w1, r1, r1), out_shardings=(w1, w1, w1, w1, w1, r1)
        )
        self.backward0 = tessel.jit(backward0, in_shardings=(w0, w0, r0, r0), out_shardings=(w0, w0))
        self.sgd0 = tessel.jit(sgd, in_shardings=w0, out_shardings=w0)
        self.sgd1 = tessel.jit(sgd, in_shardings=w1, out_shardings=w1)
        self.mean1 = tessel.jit(lambda *losses: sum(losses) / len(losses), in_shardings=w1, out_shardings=w1)
        self.train_step = tessel.jit(self._step)

    def _step(self, params, xs, ys):
        """GPipe over the microbatches `xs`, `ys`: (params', mean loss)."""
        w1, b1, *rest = params
        losses, g1, gh = [], [], []
        for x, y in zip(xs, ys):
            h = self.forward0(w1, b1, x)  # stage 0
            loss, *grads, g = self.forward_backward1(*rest, h, y)  # stage 1: h is sent to it
            losses.append(loss)
            g1.append(grads)
            gh.append(g)
        g0 = [self.backward0(w1, b1, x, g) for x, g in zip(xs, gh)]  # stage 0: each g is sent back
        new = (self.sgd0(w1, *(g[0] for g in g0)), self.sgd0(b1, *(g[1] for g in g0)))
        new += tuple(self.sgd1(p, *(g[k] for g in g1)) for k, p in enumerate(rest))
        return new, self.mean1(*losses)

    def place(self, params, xs, ys):
        """Weights on their stage (whole), microbatches split over it."""
        w1, b1, *rest = params
        return (
            (tessel.device_put(w1, self.whole0), tessel.device_put(b1, self.whole0))
            + tuple(tessel.device_put(p, self.whole1) for p in rest),
            tuple(tessel.device_put(x, self.rows0) for x in xs),
            tuple(tessel.device_put(y, self.rows1) for y in ys),
        )


def numpy_step(params, x, y):
    w1, b1, w2, b2, w3, b3 = params
    h1 = np.tanh(x @ w1 + b1)
    h2 = np.tanh(h1 @ w2 + b2)
    err = h2 @ w3 + b3 - y
    dpred = err * np.float32(2.0 / err.size)
    dh2 = (dpred @ w3.T) * (np.float32(1) - h2 * h2)
    dh1 = (dh2 @ w2.T) * (np.float32(1) - h1 * h1)
    grads = (x.T @ dh1, dh1.sum(axis=0), h1.T @ dh2, dh2.sum(axis=0), h2.T @ dpred, dpred.sum(axis=0))
    return tuple(p - np.float32(LR) * g for p, g in zip(params, grads)), float(np.mean(err * err))


def make_data(rng):
    u = (np.random.default_rng(7).standard_normal(IN) / np.sqrt(IN)).astype(np.float32)
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    y = np.sin(2 * (x @ u))[:, None].astype(np.float32)
    return x, y


def main():
    rng = np.random.default_rng(42)
    init = (
        (rng.standard_normal((IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
        np.zeros(HIDDEN, np.float32),
        (rng.standard_normal((HIDDEN, HIDDEN2)) / np.sqrt(HIDDEN)).astype(np.float32),
        np.zeros(HIDDEN2, np.float32),
        (rng.standard_normal((HIDDEN2, 1)) / np.sqrt(HIDDEN2)).astype(np.float32),
        np.zeros(1, np.float32),
    )
    hx, hy = make_data(rng)
    mb = BATCH // MICRO
    with tessel.local_cluster(workers=2, devices_per_worker=2) as cluster:
        print(f"local cluster: coordinator {cluster.address}, devices {tessel.devices()}")
        print(
            f"stage 0: {STAGE0}; stage 1: {STAGE1}; {MICRO} microbatches of {mb} rows, split over each stage's "
            f"2 devices"
        )
        pipe = Pipeline(STAGE0, STAGE1)
        train_step = pipe.train_step
        params, xs, ys = pipe.place(
            init, [hx[i * mb : (i + 1) * mb] for i in range(MICRO)], [hy[i * mb : (i + 1) * mb] for i in range(MICRO)]
        )
        plan = train_step.lower(params, xs, ys)
        parts = [line for line in plan.as_text().splitlines() if line.startswith("part ")]
        print(f"one jitted step, {len(parts)} mesh regions; its sends and receives, worker to worker:")
        for t in plan.transfers:
            print(f"  {t['bytes']:6d} bytes: {t['reason']}")
        params, loss = train_step(params, xs, ys)
        first = float(loss.fetch())
        print(f"step    1  loss {first:.5f}")
        start = time.perf_counter()
        with tessel.forbid_compiles():
            for i in range(2, STEPS + 1):
                params, loss = train_step(params, xs, ys)
                if i % 20 == 0:
                    print(f"step {i:4d}  loss {float(loss.fetch()):.5f}")
        final = [p.fetch() for p in params]
        secs = time.perf_counter() - start
        last = float(loss.fetch())
        stats = tessel.stats()
        print(
            f"{STEPS - 1} steps in {secs:.2f} s; session: {stats['compiles']} compiles, {stats['executions']} "
            f"executions, {stats['bytes_device_to_device']} bytes device->device"
        )

    ref = init
    for _ in range(STEPS):
        ref, ref_loss = numpy_step(ref, hx, hy)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(final, ref))
    print(
        f"numpy on the whole batch: loss before the last step {ref_loss:.5f}, pipeline {last:.5f}; "
        f"largest parameter difference {worst:.2e}"
    )
    if not last < 0.5 * first:
        sys.exit(f"pipeline: training did not converge: loss {first:.4f} -> {last:.4f}")
    if worst > 1e-4 or abs(last - ref_loss) > 1e-4:
        sys.exit(f"pipeline: differs from numpy's run by {worst:.2e} (loss {last:.5f} vs {ref_loss:.5f})")


if __name__ == "__main__":
    main()
