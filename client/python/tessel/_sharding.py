"""Meshes and shardings (as in jax.sharding), and the partitioned pieces of
a traced function: sharding constraints, shard_map with its collectives,
and custom kernels with their replication rules."""
import dataclasses

import numpy as np

from tessel import _dtypes
from tessel._trace import request_placement, Builder, Tracer, current_builder
from tessel.v1 import ir_pb2, session_pb2


def _is_device_array(x):
    if isinstance(x, np.ndarray):
        return True
    if isinstance(x, (list, tuple)) and x and not isinstance(x, dict):
        flat = np.asarray(x, dtype=object).reshape(-1)
        return all(isinstance(d, (int, np.integer, Device)) and not isinstance(d, bool) for d in flat)
    return False


class Mesh:
    """Named axes over the cluster's devices, row-major: Mesh({"data": 2,
    "model": 2}) or Mesh((("data", 2), ("model", 2)), devices=[0, 1, 2, 3]),
    or as jax.sharding.Mesh: Mesh(np.array([[0, 1], [2, 3]]), ("data",
    "model")), an array of device ids (or tessel.Devices) shaped like the
    mesh."""

    def __init__(self, axes, devices=None):
        if _is_device_array(axes):
            # jax.sharding.Mesh(devices, axis_names)
            grid = np.vectorize(lambda d: d.id if isinstance(d, Device) else d, otypes=[object])(
                np.asarray(axes, dtype=object))
            names = (devices,) if isinstance(devices, str) else tuple(devices or ())
            if len(names) != grid.ndim:
                raise ValueError(f"Mesh: a device array of shape {grid.shape} needs {grid.ndim} axis names, "
                                 f"got {names!r}")
            items = list(zip(names, grid.shape))
            devices = [int(d) for d in grid.reshape(-1)]
        elif isinstance(axes, dict):
            items = list(axes.items())
        else:
            try:
                items = [tuple(a) for a in axes]
            except TypeError:
                raise TypeError(f"Mesh: expected {{name: size}}, ((name, size), ...) or an array of devices "
                                f"with axis names, got {axes!r}") from None
        if any(len(a) != 2 for a in items):
            raise TypeError(f"Mesh: each axis is (name, size), got {items!r}")
        self.axis_names = tuple(str(n) for n, _ in items)
        self.axis_sizes = tuple(int(s) for _, s in items)
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"Mesh: axis names must differ, got {self.axis_names!r}")
        if any(s < 1 for s in self.axis_sizes):
            raise ValueError(f"Mesh: axis sizes must be at least 1, got {self.shape}")
        n = int(np.prod(self.axis_sizes))
        self.devices = tuple(int(d) for d in devices) if devices is not None else tuple(range(n))
        if len(self.devices) != n:
            raise ValueError(f"Mesh: axes {self.shape} hold {n} devices, got {len(self.devices)}: "
                             f"{list(self.devices)}")
        if len(set(self.devices)) != n:
            raise ValueError(f"Mesh: a device appears twice in {list(self.devices)}")

    @property
    def shape(self):
        return dict(zip(self.axis_names, self.axis_sizes))

    @property
    def size(self):
        return len(self.devices)

    def proto(self):
        return ir_pb2.Mesh(axis_names=self.axis_names, axis_sizes=self.axis_sizes, devices=self.devices)

    @classmethod
    def from_proto(cls, m):
        return cls(list(zip(m.axis_names, m.axis_sizes)), devices=list(m.devices))

    def _key(self):
        return (self.axis_names, self.axis_sizes, self.devices)

    def __eq__(self, other):
        return isinstance(other, Mesh) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return f"Mesh({self.shape}, devices={list(self.devices)})"


class P(tuple):
    """A PartitionSpec: per dimension, None, a mesh axis, or a tuple of axes
    (major first). `unreduced` names axes over which the value is an
    unreduced partial sum."""

    def __new__(cls, *dims, unreduced=()):
        self = super().__new__(cls, dims)
        self.unreduced = tuple(unreduced)
        return self

    def proto(self):
        s = ir_pb2.Sharding()
        for d in self:
            axes = () if d is None else (d,) if isinstance(d, str) else tuple(d)
            s.dims.add().axes.extend(axes)
        s.partial.extend(self.unreduced)
        return s

    @classmethod
    def from_proto(cls, s):
        dims = []
        for d in s.dims:
            dims.append(None if not d.axes else d.axes[0] if len(d.axes) == 1 else tuple(d.axes))
        return cls(*dims, unreduced=tuple(s.partial))

    def _canonical(self):
        """What the spec means: trailing Nones dropped, one-axis tuples as the axis."""
        dims = [d[0] if isinstance(d, tuple) and len(d) == 1 else d for d in self]
        while dims and dims[-1] is None:
            dims.pop()
        return (tuple(dims), tuple(sorted(self.unreduced)))

    def __eq__(self, other):
        # As jax.sharding.PartitionSpec: specs are equal as written, so P('a')
        # and P('a', None) differ though they lay an array out alike (that is
        # NamedSharding.is_equivalent_to). The hash is the meaning's, which
        # equal specs share.
        return isinstance(other, P) and tuple(self) == tuple(other) and \
            sorted(self.unreduced) == sorted(other.unreduced)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(self._canonical())

    def __repr__(self):
        inner = ", ".join(repr(d) for d in self)
        return f"P({inner}{', unreduced=' + repr(self.unreduced) if self.unreduced else ''})"


@dataclasses.dataclass(frozen=True)
class NamedSharding:
    """An array laid out over `mesh` as `spec` says."""
    mesh: Mesh
    spec: P

    def placement(self):
        return session_pb2.Placement(sharded=session_pb2.MeshSharding(mesh=self.mesh.proto(), sharding=self.spec.proto()))

    @classmethod
    def from_placement(cls, p):
        return cls(Mesh.from_proto(p.sharded.mesh), P.from_proto(p.sharded.sharding))

    def is_equivalent_to(self, other, ndim=None):
        """Whether `other` lays an array out the same way (as jax's): the same
        mesh, and specs that differ at most in trailing Nones."""
        return isinstance(other, NamedSharding) and self.mesh == other.mesh and \
            self.spec._canonical() == other.spec._canonical()

    def shard_shape(self, shape):
        out = list(shape)
        for i, d in enumerate(self.spec):
            axes = () if d is None else (d,) if isinstance(d, str) else tuple(d)
            for a in axes:
                out[i] //= self.mesh.shape[a]
        return tuple(out)


# ---------------------------------------------------------------- in traces


def with_sharding_constraint(x, sharding):
    """Inside a partitioned @tessel.jit: `x` takes `sharding` (a NamedSharding
    or a P on the function's mesh) from here on; the partitioner inserts what
    that needs, with the reason."""
    b = _builder(x, "with_sharding_constraint")
    spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
    request_placement(f"with_sharding_constraint({spec!r})",
                      sharding.mesh if isinstance(sharding, NamedSharding) else None)

    def attrs(n):
        n.sharding.sharding.CopyFrom(spec.proto())
    return b.node(ir_pb2.SHARDING_CONSTRAINT, [x], x.shape, x.dtype, False, attrs)


def _builder(x, what):
    b = current_builder()
    if b is None or not isinstance(x, Tracer):
        raise TypeError(f"{what} works on traced values, inside @tessel.jit")
    return b


def shard_map(f, mesh, in_specs, out_specs):
    """Per-shard semantics (as jax's shard_map): `f` runs on each device's
    blocks under `in_specs` and returns its block of the result under
    `out_specs`, calling collectives (psum, all_gather, ...) explicitly.
    `f` may return a pytree of arrays: `out_specs` is then one P for every
    leaf, or a sequence of one P per leaf. Partitioned tracing tracks the
    axes each value varies over: returning a value that varies over an axis
    `out_specs` replicates it over is an error, unless `out_specs` marks
    that axis unreduced."""
    from tessel._jit import flatten, unflatten

    def wrapped(*args):
        specs = in_specs if isinstance(in_specs, (list, tuple)) and not isinstance(in_specs, P) else (in_specs,)
        name = getattr(f, "__name__", "f")
        if len(specs) != len(args):
            raise ValueError(f"shard_map of {name}: {len(args)} arguments, {len(specs)} in_specs")
        outer = _builder(args[0], "shard_map")
        request_placement(f"shard_map of {name}", mesh)
        body = Builder(getattr(f, "__name__", "body"), root=outer)
        body._mesh = mesh
        with body:
            params = []
            for i, (a, spec) in enumerate(zip(args, specs)):
                shape = NamedSharding(mesh, spec).shard_shape(a.shape)
                params.append(body.parameter(i, shape, a.dtype, f"x{i}"))
            leaves, _, structure = flatten(f(*params))
            from tessel import numpy as tnp
            leaves = [x if isinstance(x, Tracer) else tnp.asarray_in_trace(x) for x in leaves]
            body.graph.outputs.extend(x._name for x in leaves)
        if isinstance(out_specs, P):
            outs = [out_specs] * len(leaves)
        else:
            outs = list(out_specs)
            if len(outs) != len(leaves):
                raise ValueError(f"shard_map of {name}: it returns {len(leaves)} arrays; {len(outs)} out_specs")

        def global_shape(leaf, spec):
            full = list(leaf.shape)
            for i, d in enumerate(spec):
                for a in (() if d is None else (d,) if isinstance(d, str) else tuple(d)):
                    full[i] *= mesh.shape[a]
            return full

        def common(m):
            m.body.CopyFrom(body.graph)
            for s in specs:
                m.in_specs.add().CopyFrom(s.proto())
        if len(leaves) == 1 and isinstance(out_specs, P) and structure == flatten(leaves[0])[2]:
            def attrs(n):
                common(n.manual_region)
                n.manual_region.out_spec.CopyFrom(out_specs.proto())
            return outer.node(ir_pb2.MANUAL_REGION, list(args), global_shape(leaves[0], out_specs), leaves[0].dtype,
                              False, attrs, with_type=True)
        shapes = [global_shape(x, s) for x, s in zip(leaves, outs)]

        def attrs(n):
            common(n.manual_region)
            for s, x, shape in zip(outs, leaves, shapes):
                n.manual_region.out_specs.add().CopyFrom(s.proto())
                n.results.add().CopyFrom(_dtypes.tensor_type(shape, x.dtype))
        from tessel import lax as _lax
        results = _lax._control_node(outer, ir_pb2.MANUAL_REGION, list(args), attrs,
                                     [(tuple(shape), x.dtype, False) for x, shape in zip(leaves, shapes)])
        return unflatten(structure, results)
    return wrapped


def _axes(axis_name):
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _collective(op, x, axis_name, shape, **fields):
    b = _builder(x, ir_pb2.Op.Name(op).lower())

    def attrs(n):
        n.collective.axes.extend(_axes(axis_name))
        for k, v in fields.items():
            if isinstance(v, (list, tuple)):
                getattr(n.collective, k).extend(v)
            else:
                setattr(n.collective, k, v)
    return b.node(op, [x], shape, x.dtype, False, attrs)


def _group_size(x, axis_name):
    mesh = getattr(x._builder, "_mesh", None)
    if mesh is None:
        raise TypeError("collectives are explicit only inside shard_map")
    return int(np.prod([mesh.shape[a] for a in _axes(axis_name)]))


def psum(x, axis_name):
    return _collective(ir_pb2.ALL_REDUCE, x, axis_name, x.shape, kind=ir_pb2.SUM)


def pmax(x, axis_name):
    return _collective(ir_pb2.ALL_REDUCE, x, axis_name, x.shape, kind=ir_pb2.REDUCE_MAX)


def pmin(x, axis_name):
    return _collective(ir_pb2.ALL_REDUCE, x, axis_name, x.shape, kind=ir_pb2.REDUCE_MIN)


def all_gather(x, axis_name, axis=0):
    """Concatenates the blocks of the group along `axis` (tiled)."""
    shape = list(x.shape)
    shape[axis] *= _group_size(x, axis_name)
    return _collective(ir_pb2.ALL_GATHER, x, axis_name, shape, dimension=axis)


def psum_scatter(x, axis_name, scatter_dimension=0):
    shape = list(x.shape)
    shape[scatter_dimension] //= _group_size(x, axis_name)
    return _collective(ir_pb2.REDUCE_SCATTER, x, axis_name, shape, dimension=scatter_dimension, kind=ir_pb2.SUM)


def all_to_all(x, axis_name, split_axis, concat_axis):
    k = _group_size(x, axis_name)
    shape = list(x.shape)
    shape[split_axis] //= k
    shape[concat_axis] *= k
    return _collective(ir_pb2.ALL_TO_ALL, x, axis_name, shape, dimension=split_axis, concat_dimension=concat_axis)


def ppermute(x, axis_name, perm):
    flat = [int(v) for pair in perm for v in pair]
    return _collective(ir_pb2.COLLECTIVE_PERMUTE, x, axis_name, x.shape, source_target_pairs=flat)


def axis_index(axis_name):
    b = current_builder()
    if b is None or getattr(b, "_mesh", None) is None:
        raise TypeError("axis_index works inside shard_map")

    def attrs(n):
        n.collective.axes.extend(_axes(axis_name))
    return b.node(ir_pb2.AXIS_INDEX, [], (), np.int32, False, attrs)


def custom_kernel(name, decomposition, cuda_source="", replication="union"):
    """An op carrying user code: `cuda_source` (entry point `name`) for the
    CUDA backend, and `decomposition`, a function of the operands in
    tessel.numpy ops, that runs everywhere else. `replication` says which mesh
    axes its result varies over, given its operands': "union", ("follow", i),
    an explicit collection of axis names, or None: nothing declared, so the
    result may vary over every axis (an out_spec that replicates it is
    trusted, and reverse mode sums its cotangents over those axes)."""
    def call(*args):
        b = _builder(args[0], f"custom kernel {name!r}")
        inner = Builder(name)
        with inner:
            params = [inner.parameter(i, a.shape, a.dtype, f"x{i}") for i, a in enumerate(args)]
            out = decomposition(*params)
            inner.graph.outputs.append(out._name)

        def attrs(n):
            k = n.custom_kernel
            k.name = name
            k.cuda_source = cuda_source
            k.decomposition.CopyFrom(inner.graph)
            if replication is None:
                k.replication.kind = ir_pb2.ReplicationRule.UNKNOWN
            elif replication == "union":
                k.replication.kind = ir_pb2.ReplicationRule.UNION
            elif isinstance(replication, tuple) and len(replication) == 2 and replication[0] == "follow":
                k.replication.kind = ir_pb2.ReplicationRule.FOLLOW
                k.replication.operand = int(replication[1])
            else:
                k.replication.kind = ir_pb2.ReplicationRule.EXPLICIT
                k.replication.axes.extend(sorted(replication))
        return b.node(ir_pb2.CUSTOM_KERNEL, list(args), out.shape, out.dtype, False, attrs)
    return call


# ---------------------------------------------------------------- placements

@dataclasses.dataclass(frozen=True)
class Device:
    """One device of the cluster, by global id."""
    id: int
    kind: str = "cpu"
    worker: str = ""
    local_index: int = 0

    def __repr__(self):
        return f"Device({self.id}, {self.kind}, worker {self.worker})"


@dataclasses.dataclass(frozen=True)
class SingleDeviceSharding:
    """The whole array on one device."""
    device: int

    def placement(self):
        return session_pb2.Placement(device=self.device)


@dataclasses.dataclass(frozen=True)
class ReplicatedSharding:
    """A full copy of the array on every live device."""

    def placement(self):
        return session_pb2.Placement(replicated=True)


def to_placement(where):
    """None (device 0), a device id, a Device, or a sharding -> Placement."""
    if where is None:
        return session_pb2.Placement(device=0)
    if isinstance(where, NamedSharding):
        return where.placement()
    if isinstance(where, (SingleDeviceSharding, ReplicatedSharding)):
        return where.placement()
    if isinstance(where, Device):
        return session_pb2.Placement(device=where.id)
    if isinstance(where, (int, np.integer)) and not isinstance(where, bool):
        return session_pb2.Placement(device=int(where))
    raise TypeError(f"placement: expected a device id, a tessel.Device, NamedSharding, SingleDeviceSharding or "
                    "ReplicatedSharding, "
                    f"got {type(where).__name__}")
