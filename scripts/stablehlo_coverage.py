#!/usr/bin/env python3
"""Writes docs/stablehlo.md: every op of jaxlib's StableHLO dialect, and
whether tessel.jax imports it, read from the importer itself (the ops its
Interpreter.op dispatches, its unary and binary tables, and the manual
regions' collectives); --check fails when the page differs from what the
importer reads now."""

import inspect
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client" / "python"))

from jaxlib.mlir.dialects import stablehlo  # noqa: E402

from tessel import _stablehlo, _stablehlo_manual  # noqa: E402

PAGE = ROOT / "docs" / "stablehlo.md"

# Why an op is not imported: the classes of StableHLO that Tessel's IR has
# no counterpart for yet, or that JAX does not emit.
WHY = {
    "complex": "complex numbers: Tessel has no complex dtype yet",
    "tokens": "tokens and host I/O (ordered effects): Tessel's programs have none",
    "dynamic": "dynamic shapes: Tessel's programs are shaped at compile",
    "quantized": "quantized types",
    "legacy": "a legacy or front-end-only form that JAX does not emit",
    "rng": "XLA's stateful generator (jax.lax.rng_uniform), whose numbers are each backend's own",
    "spmd": "a replica or async form that JAX's SPMD lowering does not emit",
}
CLASS = {
    "stablehlo.complex": "complex",
    "stablehlo.real": "complex",
    "stablehlo.imag": "complex",
    "stablehlo.fft": "complex",
    "stablehlo.after_all": "tokens",
    "stablehlo.create_token": "tokens",
    "stablehlo.infeed": "tokens",
    "stablehlo.outfeed": "tokens",
    "stablehlo.send": "tokens",
    "stablehlo.recv": "tokens",
    "stablehlo.dynamic_broadcast_in_dim": "dynamic",
    "stablehlo.dynamic_conv": "dynamic",
    "stablehlo.dynamic_gather": "dynamic",
    "stablehlo.dynamic_iota": "dynamic",
    "stablehlo.dynamic_pad": "dynamic",
    "stablehlo.real_dynamic_slice": "dynamic",
    "stablehlo.get_dimension_size": "dynamic",
    "stablehlo.set_dimension_size": "dynamic",
    "stablehlo.uniform_quantize": "quantized",
    "stablehlo.uniform_dequantize": "quantized",
    "stablehlo.rng": "rng",
    "stablehlo.replica_id": "spmd",
    "stablehlo.collective_broadcast": "spmd",
    "stablehlo.cross-replica-sum": "spmd",
    "stablehlo.async_start": "spmd",
    "stablehlo.async_done": "spmd",
}


def dialect_ops():
    ops = set()
    for n in dir(stablehlo):
        c = getattr(stablehlo, n)
        if isinstance(c, type) and isinstance(getattr(c, "OPERATION_NAME", None), str):
            ops.add(c.OPERATION_NAME)
    return sorted(ops)


def imported():
    src = "".join(
        inspect.getsource(f)
        for f in (_stablehlo.Interpreter.op, _stablehlo.Interpreter.region, _stablehlo_manual.collective)
    )
    names = set(re.findall(r'"((?:stablehlo|chlo|sdy|func)\.[a-z_]+)"', src))
    return names | set(_stablehlo._UNARY) | set(_stablehlo._BINARY)


def page():
    ops, have = dialect_ops(), imported()
    rows = []
    for op in ops:
        if op in have:
            rows.append(f"| `{op}` | imported | |")
        else:
            rows.append(f"| `{op}` | not yet | {WHY[CLASS.get(op, 'legacy')]} |")
    others = sorted(n for n in have if not n.startswith("stablehlo."))
    n_in = sum(op in have for op in ops)
    return "\n".join(
        [
            "# StableHLO in tessel.jax",
            "",
            "What `tessel.jax.jit` and `tessel.jax.load` import: every op of the",
            "StableHLO dialect in jaxlib's MLIR bindings, read from the importer",
            "(`client/python/tessel/_stablehlo.py`) by `scripts/stablehlo_coverage.py`,",
            "which writes this page and checks it in the test suite. An op that is",
            "not imported is an `InvalidArgumentError` naming it and where it stands",
            "in the module; the cluster keeps serving.",
            "",
            f"{n_in} of {len(ops)} ops are imported. Beside them the importer reads",
            ", ".join(f"`{n}`" for n in others) + ".",
            "`stablehlo.custom_call` is imported for the sharding targets",
            "(`Sharding`, `SPMDFullToShardShape`, `SPMDShardToFullShape`) and",
            "JAX's LAPACK calls on CPU; any other target is an error naming it.",
            "",
            "| op | status | why not |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )


def main():
    text = page()
    if "--check" in sys.argv[1:]:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} differs from what the importer reads: run {__file__}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
