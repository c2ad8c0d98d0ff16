"""jax.shard_map as JAX lowers it: `sdy.manual_computation` becomes a
Tessel shard_map over the Tessel mesh of the module's `sdy.mesh`, and the
collectives in its body, whose groups StableHLO gives as device ids, become
Tessel's collectives over the mesh axes those groups span.

A group's devices vary along some mesh axes and agree on the others; its
order (which block an all_gather puts first) is row-major over those axes
in some order, as jax.lax's collectives list them. Groups that are no set
of mesh axes' groups are an error naming them."""

import itertools

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import sdy

from tessel import _shard_map
from tessel import numpy as tnp
from tessel._trace import Tracer


def _dense(attr):
    a = ir.DenseIntElementsAttr(attr)
    return np.asarray(a).reshape(ir.RankedTensorType(a.type).shape)


class Manual:
    """The manual computation being read: its mesh, and each device's
    coordinates on it."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.sizes = tuple(mesh.axis_sizes)
        self.coords = {d: np.unravel_index(i, self.sizes) for i, d in enumerate(mesh.devices)}

    def _position(self, device, axes):
        c = self.coords[device]
        return int(np.ravel_multi_index([c[k] for k in axes], [self.sizes[k] for k in axes])) if axes else 0

    def _rest(self, device, axes):
        c = self.coords[device]
        return tuple(c[k] for k in range(len(self.sizes)) if k not in axes)

    def axes_of_groups(self, groups, what):
        """The mesh axes (in the order that lists each group's devices) whose
        groups `groups` are."""
        groups = [[int(d) for d in g] for g in groups]
        if any(d not in self.coords for g in groups for d in g):
            raise NotImplementedError(f"{what}: replica groups {groups} name devices outside the mesh")
        first = np.array([self.coords[d] for d in groups[0]])
        varying = [k for k in range(len(self.sizes)) if len(set(first[:, k])) > 1]
        for order in itertools.permutations(varying):
            n = int(np.prod([self.sizes[k] for k in order]))
            if all(
                len(g) == n
                and [self._position(d, order) for d in g] == list(range(n))
                and len({self._rest(d, order) for d in g}) == 1
                for g in groups
            ) and sum(len(g) for g in groups) == len(self.coords):
                return tuple(self.mesh.axis_names[k] for k in order)
        raise NotImplementedError(f"{what}: replica groups {groups} are not the groups of any mesh axes")

    def permutation(self, pairs, what):
        """A collective_permute's (source, target) device pairs as mesh axes
        and one permutation of positions along them, the same in every group."""
        pairs = [(int(s), int(t)) for s, t in pairs]
        varying = sorted(
            {k for s, t in pairs for k in range(len(self.sizes)) if self.coords[s][k] != self.coords[t][k]}
        )
        perms = {}
        for s, t in pairs:
            perms.setdefault(self._rest(s, varying), set()).add(
                (self._position(s, varying), self._position(t, varying))
            )
        if len({frozenset(p) for p in perms.values()}) > 1:
            raise NotImplementedError(f"{what}: source-target pairs {pairs} differ from group to group")
        perm = sorted(next(iter(perms.values()))) if perms else []
        return tuple(self.mesh.axis_names[k] for k in varying), perm

    def partition_id(self):
        """The device's position on the mesh (row-major over every axis): what
        JAX's partition_id is for a mesh of devices in order."""
        if list(self.mesh.devices) != list(range(len(self.mesh.devices))):
            raise NotImplementedError(f"partition_id on a mesh of devices out of order ({list(self.mesh.devices)})")
        return tnp.astype(_shard_map.axis_index(tuple(self.mesh.axis_names)), np.uint32)


_ALL_REDUCE = {"add": _shard_map.psum, "max": _shard_map.pmax, "min": _shard_map.pmin}


def collective(interpreter, manual, name, op, args):
    """A collective inside a manual computation, or None if `name` is none."""
    a = op.attributes
    where = f"StableHLO {name}"
    if name == "stablehlo.partition_id":
        return [manual.partition_id()]
    if name == "stablehlo.collective_permute":
        axes, perm = manual.permutation(_dense(a["source_target_pairs"]), where)
        return [_shard_map.ppermute(args[0], axes, perm) if axes else args[0]]
    if name not in ("stablehlo.all_reduce", "stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_to_all"):
        return None
    axes = manual.axes_of_groups(_dense(a["replica_groups"]), where)
    if not axes:
        return list(args)  # a group of one device: each operand is its own result
    if name == "stablehlo.all_gather":
        dim = ir.IntegerAttr(a["all_gather_dim"]).value
        return [_shard_map.all_gather(x, axes, axis=dim) for x in args]
    if name == "stablehlo.all_to_all":
        split, concat = ir.IntegerAttr(a["split_dimension"]).value, ir.IntegerAttr(a["concat_dimension"]).value
        return [_shard_map.all_to_all(x, axes, split, concat) for x in args]
    kind = interpreter._body_reducer(op.regions[0], name)
    if name == "stablehlo.reduce_scatter":
        if kind != "add":
            raise NotImplementedError(f"a reduce_scatter combining with {kind}")
        dim = ir.IntegerAttr(a["scatter_dimension"]).value
        return [_shard_map.psum_scatter(args[0], axes, scatter_dimension=dim)]
    reduce = _ALL_REDUCE.get(kind)
    if reduce is None:
        raise NotImplementedError(f"an all_reduce combining with {kind}")
    return [reduce(x, axes) for x in args]


def manual_computation(interpreter, op, args, env, where):
    """sdy.manual_computation: a Tessel shard_map of its body."""
    a = op.attributes
    ins = [interpreter.named_sharding(s) for s in sdy.TensorShardingPerValueAttr(a["in_shardings"]).shardings]
    outs = [interpreter.named_sharding(s) for s in sdy.TensorShardingPerValueAttr(a["out_shardings"]).shardings]
    mesh = (ins + outs)[0].mesh
    manual_axes = [str(x) for x in sdy.ManualAxesAttr(a["manual_axes"])]
    if sorted(manual_axes) != sorted(mesh.axis_names):
        raise NotImplementedError(
            f"a shard_map manual over {manual_axes} of the mesh's axes {list(mesh.axis_names)} "
            "(Tessel's shard_map is manual over every axis)"
        )

    def body(*blocks):
        interpreter.manual.append(Manual(mesh))
        try:
            return list(interpreter.region(op.regions[0], list(blocks), f"{where} shard_map body", env))
        finally:
            interpreter.manual.pop()

    args = [x if isinstance(x, Tracer) else tnp.asarray_in_trace(x) for x in args]  # a constant too
    return list(_shard_map.shard_map(body, mesh, [s.spec for s in ins], [s.spec for s in outs])(*args))
