#!/usr/bin/env python3
"""Trains a Flax transformer language model with Optax on a 2x2 mesh of a
local Tessel cluster, written as a JAX user writes it.

The model, the loss and the AdamW step are plain Flax, Optax and JAX. The
layouts are JAX's own: a mesh from jax.make_mesh (data x model), the batch
split over data, the attention and MLP weights over model as
NamedShardings, and the activations constrained with
jax.lax.with_sharding_constraint. tessel.jax.jit runs the step on the
cluster: JAX lowers it, Tessel partitions it over the Tessel mesh of the same
axes. The loop runs under transfer_guard("disallow") and forbid_compiles():
the only device->host transfers are the explicit loss fetches. The plan's
collectives are printed with their reasons, and the donation receipts of the
last step; the losses are checked against jax.jit's run of the same step
on four host devices.

    .venv/bin/python examples/jax/train_lm.py      (after scripts/setup.sh)
"""

import os
import sys

# JAX's own run, the reference, needs four host devices (set before jax loads).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import tessel  # noqa: E402
import tessel.jax  # noqa: E402

VOCAB, SEQ, BATCH, D_MODEL, HEADS, LAYERS, STEPS = 32, 16, 8, 64, 4, 2, 60
JS, P = jax.sharding.NamedSharding, jax.sharding.PartitionSpec
MESH = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def constrain(x, *spec):
    return jax.lax.with_sharding_constraint(x, JS(MESH, P(*spec)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attention")(nn.LayerNorm()(x), mask=mask)
        x = constrain(x + h, "data")
        h = nn.gelu(nn.Dense(4 * D_MODEL, name="up")(nn.LayerNorm()(x)))
        h = constrain(h, "data", None, "model")  # the MLP's hidden units split over model
        return constrain(x + nn.Dense(D_MODEL, name="down")(h), "data")


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D_MODEL)(tokens) + self.param("position", nn.initializers.normal(0.02), (SEQ, D_MODEL))
        for i in range(LAYERS):
            x = Block(name=f"block{i}")(x)
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm()(x))


MODEL, OPTIMIZER = LM(), optax.adamw(3e-3)


def train_step(params, opt, tokens):
    def loss(params):
        logits = MODEL.apply(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt = OPTIMIZER.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, value


def layout(path, leaf):
    """Megatron's split over model: attention's heads, the MLP's hidden
    units; the rest replicated."""
    names = {str(getattr(k, "key", "")) for k in path}
    if "kernel" in names:
        if names & {"query", "key", "value"}:
            return JS(MESH, P(None, "model", None))  # (d_model, heads, head_dim)
        if "out" in names:
            return JS(MESH, P("model", None, None))  # (heads, head_dim, d_model)
        if "up" in names:
            return JS(MESH, P(None, "model"))
        if "down" in names:
            return JS(MESH, P("model", None))
    return JS(MESH, P())


def batches(rng):
    """Sequences that count up from a random start, modulo VOCAB: the next
    token is a function of the last, which a model learns quickly."""
    while True:
        start = rng.integers(0, VOCAB, size=(BATCH, 1))
        yield ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)


def main():
    rng = np.random.default_rng(0)
    data = batches(rng)
    first = next(data)
    params = MODEL.init(jax.random.PRNGKey(0), first[:, :-1])
    opt = OPTIMIZER.init(params)
    # Adam's moments have the parameters' paths, so the same rule lays them out.
    param_shardings, opt_shardings = (jax.tree_util.tree_map_with_path(layout, t) for t in (params, opt))
    in_shardings = (param_shardings, opt_shardings, JS(MESH, P("data")))
    out_shardings = (param_shardings, opt_shardings, None)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    tokens = [first] + [next(data) for _ in range(STEPS - 1)]

    # The reference: jax.jit on four host devices, the same shardings.
    reference = jax.jit(train_step, in_shardings=in_shardings, out_shardings=out_shardings)
    theirs, their_losses = (params, opt), []
    for t in tokens:
        *theirs, value = reference(*theirs, t)
        their_losses.append(float(value))

    with tessel.local_cluster(workers=2, devices_per_worker=2) as cluster:
        print(f"local cluster: coordinator {cluster.address}, devices {tessel.devices()}")
        step = tessel.jax.jit(train_step, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=(0, 1))
        plan = step.lower(params, opt, tokens[0])
        print(f"a {LAYERS}-layer transformer LM, {n_params:,} parameters, on mesh {{data: 2, model: 2}}; the plan:")
        for c in plan.collectives[:8]:
            print(f"  {c['op']} over {c['axes']}, {c['bytes_per_device']} bytes per device: {c['reason'][:100]}")
        print(f"  ... {len(plan.collectives)} collectives in all")
        batch_sharding = tessel.NamedSharding(tessel.Mesh({"data": 2, "model": 2}), tessel.P("data"))
        ours, losses = (params, opt), []
        *ours, value = step(*ours, tokens[0])  # the first call lowers, converts and compiles
        losses.append(float(value.fetch()))
        with tessel.transfer_guard("disallow"), tessel.forbid_compiles():
            for i, t in enumerate(tokens[1:], start=2):
                batch = tessel.device_put(t, batch_sharding)  # explicit: the guard allows it
                *ours, value = step(*ours, batch)
                losses.append(float(value.fetch()))  # the only device->host transfer: explicit
                if i % 10 == 0:
                    print(f"step {i:3d}  loss {losses[-1]:.4f}  (jax.jit: {their_losses[i - 1]:.4f})")
        receipts = step.donation_receipts()
        print(
            f"the last step reused {sum(r['reused'] for r in receipts)} of {len(receipts)} donated buffers in place; "
            f"{tessel.stats()['compiles']} compiles in the session"
        )
    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, their_losses))
    print(f"losses against jax.jit's: largest relative difference {worst:.1e}")
    if worst > 1e-3:
        sys.exit(f"train_lm: losses differ from jax.jit's by {worst:.1e} (relative)")
    if not losses[-1] < 0.5 * losses[0]:
        sys.exit(f"train_lm: the loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
