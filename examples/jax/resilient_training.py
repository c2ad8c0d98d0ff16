#!/usr/bin/env python3
"""Trains a small GPT-style language model (Flax, Optax AdamW, through
tessel.jax) with a CheckpointManager, and survives the loss of a worker.

The batch is split over a data-parallel mesh of every live device. Every
5 steps the manager saves the parameters and the optimizer state (async:
the workers write their own blocks while training goes on). When a step
fails because a worker died, the loop rebuilds its mesh from the devices
left, restores the latest checkpoint onto it and goes on from there. The
data of step i depends only on i, so the losses equal an uninterrupted
run's: jax.jit's, on the host, is the reference.

    .venv/bin/python examples/jax/resilient_training.py [--kill-worker-at=STEP]
                                                        [--restart-coordinator-at=STEP]

With --kill-worker-at, the second worker is killed (SIGKILL) just before
that step; with --restart-coordinator-at, the coordinator is (and a new one
started on its port, which the workers join again): the loop connects
again and goes on from the latest checkpoint the same way.
"""

import os
import sys
import tempfile
import time

# The meshes are JAX's, over as many host devices as the cluster has (set
# before jax loads); JAX's device i is the cluster's device i.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import tessel  # noqa: E402
import tessel.jax  # noqa: E402
from tessel import checkpoints  # noqa: E402

VOCAB, SEQ, BATCH, D_MODEL, HEADS, STEPS, SAVE_EVERY = 32, 16, 8, 32, 2, 30, 5
JS, P = jax.sharding.NamedSharding, jax.sharding.PartitionSpec


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D_MODEL)(tokens) + self.param("position", nn.initializers.normal(0.02), (SEQ, D_MODEL))
        mask = nn.make_causal_mask(jnp.ones(tokens.shape, jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attention")(nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dense(D_MODEL, name="down")(nn.gelu(nn.Dense(4 * D_MODEL, name="up")(nn.LayerNorm()(x))))
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm()(x))


MODEL, OPTIMIZER = LM(), optax.adamw(3e-3)


def train_step(params, opt, tokens):
    def loss(params):
        logits = MODEL.apply(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt = OPTIMIZER.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, value


def batch(step):
    """Step `step`'s sequences (counting up from a random start, modulo
    VOCAB): a function of the step alone, so a resumed run sees the same."""
    start = np.random.default_rng(step).integers(0, VOCAB, size=(BATCH, 1))
    return ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)


def data_mesh():
    """A data-parallel mesh of the live devices (as many as divide the
    batch); JAX's device i is the cluster's device i."""
    live = sorted(d.id for d in tessel.devices())
    n = max(k for k in (1, 2, 4, 8) if k <= len(live) and BATCH % k == 0)
    return jax.sharding.Mesh(np.array([jax.devices()[i] for i in live[:n]]), ("data",))


def reference_losses(params, opt):
    step = jax.jit(train_step)
    out = []
    for i in range(STEPS):
        params, opt, value = step(params, opt, batch(i))
        out.append(float(value))
    return out


def flag(name):
    return next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith(f"--{name}=")), None)


def session_alive():
    try:
        tessel.devices()
        return True
    except tessel.TesselError:
        return False


def main():
    kill_at, restart_at = flag("kill-worker-at"), flag("restart-coordinator-at")
    params = MODEL.init(jax.random.PRNGKey(0), batch(0)[:, :-1])
    opt = OPTIMIZER.init(params)
    theirs = reference_losses(params, opt)
    losses, resumed = [None] * STEPS, []
    with tessel.local_cluster(workers=2, devices_per_worker=2, heartbeat_timeout_ms=1000) as cluster:
        directory = tempfile.mkdtemp(prefix="resilient-")
        manager = checkpoints.CheckpointManager(directory, save_interval_steps=SAVE_EVERY)
        done = set()
        state, i = (params, opt), 0
        while i < STEPS:
            mesh = data_mesh()
            replicated, split = JS(mesh, P()), JS(mesh, P("data"))
            ids = [d.id for d in mesh.devices.flat]
            batch_sharding = tessel.NamedSharding(tessel.Mesh([("data", len(ids))], devices=ids), tessel.P("data"))
            step = tessel.jax.jit(
                train_step,
                in_shardings=(replicated, replicated, split),
                out_shardings=(replicated, replicated, None),
                donate_argnums=(0, 1),
            )
            if state is None:  # after a failure: the latest checkpoint, on the mesh left
                i = manager.latest_step() or 0
                target = jax.tree_util.tree_map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), (params, opt)
                )
                state = manager.restore(i, target={"params": target[0], "opt": target[1]}) if i else (params, opt)
                state = (state["params"], state["opt"]) if i else state
                resumed.append((i, mesh.devices.size))
                print(f"resumed from step {i} on {mesh.devices.size} devices")
            try:
                while i < STEPS:
                    if i == kill_at and "kill" not in done:
                        done.add("kill")
                        print(f"step {i}: killing worker 1 (SIGKILL)")
                        cluster.kill_worker(1)
                    if i == restart_at and "restart" not in done:
                        done.add("restart")
                        print(f"step {i}: restarting the coordinator (SIGKILL, then a new one)")
                        cluster.restart_coordinator()
                    p, o, value = step(*state, tessel.device_put(batch(i), batch_sharding))
                    state = (p, o)
                    losses[i] = float(value.fetch())
                    i += 1
                    manager.save(i, {"params": p, "opt": o})
            except tessel.TesselError as e:
                print(f"step {i} failed: {str(e)[:160]}")
                try:
                    manager.wait_until_finished()  # a save cut short: the one before stays the latest
                except tessel.TesselError as lost:
                    print(f"  the save in flight failed too: {str(lost)[:120]}")
                if session_alive():
                    deadline = time.monotonic() + 30
                    while len(tessel.devices()) == mesh.devices.size and time.monotonic() < deadline:
                        time.sleep(0.2)  # the coordinator marks the worker dead
                else:  # a new coordinator: a new session, and a manager of it
                    print("  the coordinator is a new one: connecting again")
                    tessel.connect(cluster.address)
                    manager = checkpoints.CheckpointManager(directory, save_interval_steps=SAVE_EVERY)
                state = None
        manager.wait_until_finished()
        print(f"checkpoints kept: steps {manager.all_steps()}")
        manager.close()
    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, theirs))
    print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; against an uninterrupted jax.jit run: largest relative difference {worst:.1e}"
    )
    if len(resumed) != (kill_at is not None) + (restart_at is not None):
        sys.exit(f"resilient_training: resumed {len(resumed)} times; expected one per fault")
    if worst > 1e-4:
        sys.exit(f"resilient_training: losses differ from the uninterrupted run's by {worst:.1e}")


if __name__ == "__main__":
    main()
