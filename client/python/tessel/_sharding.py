"""Meshes, partition specs and shardings (as in jax.sharding), and the
placements they name: plain types, with no tracing (that is _shard_map's)."""

import dataclasses

import numpy as np

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
                np.asarray(axes, dtype=object)
            )
            names = (devices,) if isinstance(devices, str) else tuple(devices or ())
            if len(names) != grid.ndim:
                raise ValueError(
                    f"Mesh: a device array of shape {grid.shape} needs {grid.ndim} axis names, " f"got {names!r}"
                )
            items = list(zip(names, grid.shape))
            devices = [int(d) for d in grid.reshape(-1)]
        elif isinstance(axes, dict):
            items = list(axes.items())
        else:
            try:
                items = [tuple(a) for a in axes]
            except TypeError:
                raise TypeError(
                    f"Mesh: expected {{name: size}}, ((name, size), ...) or an array of devices "
                    f"with axis names, got {axes!r}"
                ) from None
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
            raise ValueError(
                f"Mesh: axes {self.shape} hold {n} devices, got {len(self.devices)}: " f"{list(self.devices)}"
            )
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
        return (
            isinstance(other, P) and tuple(self) == tuple(other) and sorted(self.unreduced) == sorted(other.unreduced)
        )

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
        return session_pb2.Placement(
            sharded=session_pb2.MeshSharding(mesh=self.mesh.proto(), sharding=self.spec.proto())
        )

    @classmethod
    def from_placement(cls, p):
        return cls(Mesh.from_proto(p.sharded.mesh), P.from_proto(p.sharded.sharding))

    def is_equivalent_to(self, other, ndim=None):
        """Whether `other` lays an array out the same way (as jax's): the same
        mesh, and specs that differ at most in trailing Nones."""
        return (
            isinstance(other, NamedSharding)
            and self.mesh == other.mesh
            and self.spec._canonical() == other.spec._canonical()
        )

    def shard_shape(self, shape):
        out = list(shape)
        for i, d in enumerate(self.spec):
            axes = () if d is None else (d,) if isinstance(d, str) else tuple(d)
            for a in axes:
                out[i] //= self.mesh.shape[a]
        return tuple(out)


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
    raise TypeError(
        f"placement: expected a device id, a tessel.Device, NamedSharding, SingleDeviceSharding or "
        "ReplicatedSharding, "
        f"got {type(where).__name__}"
    )
