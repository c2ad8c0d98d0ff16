"""The partitioned pieces of a traced function: sharding constraints,
shard_map with its collectives (psum, all_gather, ...), and custom kernels
with their replication rules."""

import numpy as np

from tessel import _dtypes, _region
from tessel import numpy as tnp
from tessel._sharding import NamedSharding, P
from tessel._trace import Builder, Tracer, current_builder, request_placement
from tessel._tree import flatten, unflatten
from tessel.v1 import ir_pb2


def with_sharding_constraint(x, sharding):
    """Inside a partitioned @tessel.jit: `x` takes `sharding` (a NamedSharding
    or a P on the function's mesh) from here on; the partitioner inserts what
    that needs, with the reason."""
    b = _builder(x, "with_sharding_constraint")
    spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
    request_placement(
        f"with_sharding_constraint({spec!r})", sharding.mesh if isinstance(sharding, NamedSharding) else None
    )

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

    def wrapped(*args):
        specs = in_specs if isinstance(in_specs, (list, tuple)) and not isinstance(in_specs, P) else (in_specs,)
        name = getattr(f, "__name__", "f")
        if len(specs) != len(args):
            raise ValueError(f"shard_map of {name}: {len(args)} arguments, {len(specs)} in_specs")
        if current_builder() is not None:  # numpy values and scalars join the trace, as in jax's shard_map
            args = tuple(a if isinstance(a, Tracer) else tnp.asarray_in_trace(a) for a in args)
        outer = _builder(args[0] if args else None, "shard_map")
        request_placement(f"shard_map of {name}", mesh)
        body = Builder(getattr(f, "__name__", "body"), root=outer)
        body._mesh = mesh
        with body:
            params = []
            for i, (a, spec) in enumerate(zip(args, specs)):
                shape = NamedSharding(mesh, spec).shard_shape(a.shape)
                params.append(body.parameter(i, shape, a.dtype, f"x{i}", a.weak))  # a Python scalar stays weak
            leaves, _, structure = flatten(f(*params))
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
                for a in () if d is None else (d,) if isinstance(d, str) else tuple(d):
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

            return outer.node(
                ir_pb2.MANUAL_REGION,
                list(args),
                global_shape(leaves[0], out_specs),
                leaves[0].dtype,
                False,
                attrs,
                with_type=True,
            )
        shapes = [global_shape(x, s) for x, s in zip(leaves, outs)]

        def attrs(n):
            common(n.manual_region)
            for s, x, shape in zip(outs, leaves, shapes):
                n.manual_region.out_specs.add().CopyFrom(s.proto())
                n.results.add().CopyFrom(_dtypes.tensor_type(shape, x.dtype))

        results = _region.control_node(
            outer,
            ir_pb2.MANUAL_REGION,
            list(args),
            attrs,
            [(tuple(shape), x.dtype, False) for x, shape in zip(leaves, shapes)],
        )
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


def axis_size(axis_name):
    """jax.lax.axis_size: how many devices the named mesh axes (one or a
    tuple) hold, inside shard_map."""
    b = current_builder()
    mesh = getattr(b, "_mesh", None) if b is not None else None
    if mesh is None:
        raise TypeError("axis_size works inside shard_map")
    return int(np.prod([mesh.shape[a] for a in _axes(axis_name)]))


def psum(x, axis_name):
    if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
        return x * axis_size(axis_name)  # jax's psum(1, axis): the axis size, known when tracing
    return _collective(ir_pb2.ALL_REDUCE, x, axis_name, x.shape, kind=ir_pb2.SUM)


def pmean(x, axis_name):
    """jax.lax.pmean: the group's mean (psum over the axis size)."""
    return tnp.divide(psum(x, axis_name), axis_size(axis_name))


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
