"""@tessel.jit: trace once per signature, compile, execute pipelined."""

import functools
import inspect
import warnings
import weakref

import numpy as np

from tessel import _context, _dtypes, _profile, errors
from tessel import _region
from tessel import numpy as tnp
from tessel._array import Array
from tessel._compiled import Compiled
from tessel._dispatcher import varint
from tessel._session import guard_proto
from tessel._sharding import NamedSharding, P, to_placement
from tessel._trace import current_builder, placement_requests, Builder, Tracer
from tessel._tree import LEAF, flatten, structure_of, unflatten
from tessel.tree_util import prefix_per_leaf
from tessel.v1 import ir_pb2, session_pb2

_DTYPE_NAMES = {}  # np.dtype -> its name (numpy computes the name on every read)


def _leaf_signature(x):
    """(shape, dtype name, weakly typed) of an argument leaf: an Array, a
    numpy array or scalar, anything with .shape and .dtype, or a Python
    scalar (weakly typed, like jax's)."""
    if type(x) is Array:  # the hot path of a step loop: shape is a tuple of ints already
        name = _DTYPE_NAMES.get(x.dtype)
        if name is None:
            name = _DTYPE_NAMES.setdefault(x.dtype, x.dtype.name)
        return (x.shape, name, False)
    if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
        return ((), np.result_type(x).name, True)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return (tuple(int(d) for d in x.shape), np.dtype(x.dtype).name, False)
    a = np.asarray(x)
    return (a.shape, a.dtype.name, False)


def _is_spec(s):
    """A leaf of in_shardings or out_shardings: a sharding, a spec, or None."""
    return s is None or isinstance(s, (NamedSharding, P))


def _spec_of(s):
    """The spec of a leaf of in_shardings: replicated (P()) for None."""
    return s.spec if isinstance(s, NamedSharding) else s if isinstance(s, P) else P()


def _meshes(what, shardings):
    """(what, mesh) for each NamedSharding in a pytree of shardings."""
    return [(what, s.mesh) for s in flatten(shardings, is_leaf=_is_spec)[0] if isinstance(s, NamedSharding)]


# A forgotten donation of less is not worth a warning (strict donation
# refuses any): the buffer a call could have reused.
_FORGOTTEN_DONATION_BYTES = 1 << 20


class DonationWarning(UserWarning):
    """An argument dropped right after a call it could have been donated to."""


def _describe(sig):
    shape, dtype, weak = sig
    return _dtypes.type_string(shape, dtype) + (" (weak)" if weak else "")


class Jitted:
    def __init__(
        self,
        fn,
        donate_argnums=(),
        donate_argnames=(),
        static_argnums=(),
        device=None,
        replicated=False,
        in_shardings=None,
        out_shardings=None,
        mesh=None,
    ):
        self.fn = fn
        self._mesh = mesh
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        functools.update_wrapper(self, fn)
        params = [
            n for n, p in inspect.signature(fn).parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        donate = set(donate_argnums if isinstance(donate_argnums, (tuple, list)) else (donate_argnums,))
        for name in donate_argnames if isinstance(donate_argnames, (tuple, list)) else (donate_argnames,):
            if name not in params:
                raise ValueError(f"donate_argnames: {fn.__name__} has no argument {name!r}")
            donate.add(params.index(name))
        self._params = params
        self._donate = donate
        self._static = set(static_argnums if isinstance(static_argnums, (tuple, list)) else (static_argnums,))
        # Where the steps run: as asked, else where the first array argument lives, else device 0.
        self._placement = None
        if replicated:
            self._placement = session_pb2.Placement(replicated=True)
        elif device is not None:
            self._placement = to_placement(device)
        # Per session (executables live in a coordinator): signature ->
        # (compile response, output structure, output types).
        self._cache = weakref.WeakKeyDictionary()
        self._last_seq = None
        self._fast = None  # _FastCall: the last signature called with arrays only
        self.compiles = 0
        self._eager = False  # a one-op jit of an eager call: nothing to donate
        self._last_could = []  # the last call's (could-donate, handle) of arguments not donated
        self._warned = set()  # argument leaves a forgotten donation was reported for

    def _bind(self, args, kwargs):
        if kwargs:
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
            args = tuple(bound.args) + tuple(bound.kwargs.values())
        return args

    def _key(self, args):
        dyn, statics = [], []
        for i, a in enumerate(args):
            (statics if i in self._static else dyn).append((i, a))
        leaves, paths, structures = [], [], []
        donated_leaves = []
        self._leaf_args = []
        for i, a in dyn:
            ls, ps, st = flatten(a, self._params[i] if i < len(self._params) else f"arg{i}")
            donated_leaves += [i in self._donate] * len(ls)
            self._leaf_args += [i] * len(ls)
            leaves += ls
            paths += ps
            structures.append((i, st))
        self._arg_structure = ("tuple", tuple(st for _, st in structures))
        sig = tuple(_leaf_signature(x) for x in leaves)
        layouts = tuple(
            x.sharding if isinstance(x, Array) and x._placement.WhichOneof("kind") == "sharded" else None
            for x in leaves
        )
        key = (tuple(structures), sig, tuple(donated_leaves), tuple((i, repr(a)) for i, a in statics), layouts)
        return key, leaves, paths, donated_leaves

    def _layout(self, leaves):
        """The mesh and each parameter's spec, when this call is partitioned:
        from in_shardings/out_shardings, else from sharded array arguments."""
        wants = [("mesh=", self._mesh)] if self._mesh is not None else []
        wants += _meshes("in_shardings", self._in_shardings) + _meshes("out_shardings", self._out_shardings)
        wants += [
            (
                f"argument {arg} '{self._params[arg] if arg < len(self._params) else f'arg{arg}'}' "
                f"({x.sharding.spec!r})",
                x.sharding.mesh,
            )
            for x, arg in zip(leaves, self._leaf_args)
            if isinstance(x, Array) and x._placement.WhichOneof("kind") == "sharded"
        ]
        wants += list(getattr(self, "_requests", ()))
        mesh = self._one_mesh(wants)
        if mesh is None:
            return None, None
        specs = []
        for x, s in zip(leaves, self._in_per_leaf()):
            if s is None and isinstance(x, Array) and x._placement.WhichOneof("kind") == "sharded":
                s = x.sharding
            specs.append(_spec_of(s))
        return mesh, specs

    def _in_per_leaf(self):
        """in_shardings, one per argument leaf: a sharding for everything, or
        a pytree prefix of the (non-static) arguments, as JAX takes it."""
        name = getattr(self.fn, "__name__", "f")
        return prefix_per_leaf(self._in_shardings, self._arg_structure, _is_spec, f"jit of {name}: in_shardings")

    def _one_mesh(self, wants):
        """The one mesh every placement request names, or None when none
        names one; an error naming two that disagree, and one for an
        explicit device=/replicated= beside a mesh (as JAX's "incompatible
        devices"): a request is honoured or refused, never ignored."""
        name = getattr(self.fn, "__name__", "f")
        first = next(((what, m) for what, m in wants if m is not None), None)
        for what, m in wants:
            if m is not None and m != first[1]:
                raise ValueError(
                    f"jit of {name}: incompatible placements: {first[0]} is on {first[1]!r}, "
                    f"but {what} is on {m!r}; one jitted computation runs on one mesh"
                )
        if first is None:
            bare = next((what for what, m in wants if m is None), None)
            if bare is not None:
                raise ValueError(
                    f"jit of {name}: {bare} names no mesh, and the computation is not partitioned "
                    "(no sharded argument, in_shardings or out_shardings); give a NamedSharding"
                )
            return None
        if self._placement is not None:
            asked = (
                "replicated=True"
                if self._placement.WhichOneof("kind") == "replicated"
                else f"device={self._placement.device}"
            )
            raise ValueError(
                f"jit of {name}: incompatible placements: jit({asked}) asks for "
                f"{'every device' if asked.startswith('replicated') else f'device {self._placement.device}'}"
                f", but {first[0]} is on {first[1]!r}; drop {asked.split('=')[0]}= or "
                "device_put the array where the step should run"
            )
        return first[1]

    def _out_specs(self, structure):
        """out_shardings, one spec per output leaf of `structure`: a
        sharding for everything, or a pytree prefix of the results (one
        result in a 1-tuple too)."""
        outs = self._out_shardings
        if structure is LEAF and isinstance(outs, (list, tuple)) and not isinstance(outs, P) and len(outs) == 1:
            outs = outs[0]
        name = getattr(self.fn, "__name__", "f")
        specs = []
        for s in prefix_per_leaf(outs, structure, _is_spec, f"jit of {name}: out_shardings"):
            if s is None:
                specs.append(ir_pb2.Sharding(unspecified=True))
            else:
                specs.append((s.spec if isinstance(s, NamedSharding) else s).proto())
        return specs

    def explain_miss(self, cache, key, paths):
        """What changed since the nearest signature this function was compiled for."""
        if not cache:
            return "first call"
        best = None
        for old in cache:
            if old[0] != key[0]:
                continue
            diffs = [
                f"argument {p}: {_describe(b)} -> {_describe(a)}" for p, a, b in zip(paths, key[1], old[1]) if a != b
            ]
            if old[2] != key[2]:
                diffs.append("donated arguments changed")
            if old[3] != key[3]:
                diffs.append(f"static arguments {dict(old[3])} -> {dict(key[3])}")
            if best is None or len(diffs) < len(best):
                best = diffs
        if best is None:
            return "the structure of the arguments (pytree) changed"
        return "; ".join(best) or "the same argument shapes, dtypes, donations and statics"

    def _trace(self, args, leaves, paths, donated_leaves):
        t0 = _profile.begin()
        builder = Builder(self.fn.__name__)
        builder.hoist, builder.hoist_base = [], len(leaves)
        with builder, placement_requests() as requests:
            tracers = []
            for i, (x, p) in enumerate(zip(leaves, paths)):
                shape, dtype, weak = _leaf_signature(x)
                tracers.append(builder.parameter(i, shape, dtype, p, weak))
            it = iter(tracers)
            rebuilt = []
            for i, a in enumerate(args):
                if i in self._static:
                    rebuilt.append(a)
                else:
                    ls, _, st = flatten(a)
                    rebuilt.append(unflatten(st, [next(it) for _ in ls]))
            out = self.fn(*rebuilt)
            outs, _, out_structure = flatten(out)
            out_tracers = []
            for o in outs:
                if not isinstance(o, Tracer):
                    o = tnp.asarray_in_trace(o)
                out_tracers.append(o)
            builder.graph.outputs.extend(o._name for o in out_tracers)
        self._requests = requests
        # Snapshots: a constant is what it was when traced, as in the program.
        hoisted = [np.array(a, copy=True) for a, _ in builder.hoist]
        _profile.end(t0, f"trace {self.fn.__name__}", "trace", "trace", nodes=len(builder.graph.nodes))
        return builder.graph, out_structure, out_tracers, hoisted

    def lower(self, *args, **kwargs):
        """Compiles for these arguments (values, or anything with .shape and
        .dtype) and returns the plan: tessel.Compiled."""
        return Compiled(self._compiled(self._bind(args, kwargs))[0][0], _context.session())

    def _compiled(self, args):
        key, leaves, paths, donated_leaves = self._key(args)
        session = _context.session()
        cache = self._cache.setdefault(session, {})
        entry = cache.get(key)
        if entry is None:
            why = self.explain_miss(cache, key, paths)
            graph, structure, out_tracers, hoisted = self._trace(args, leaves, paths, donated_leaves)
            donated = [i for i, d in enumerate(donated_leaves) if d]
            mpmd = any(n.op == ir_pb2.MESH_REGION for n in graph.nodes)
            # An MPMD program's regions name their own meshes; arguments go where they are read.
            mesh, specs = (None, None) if mpmd else self._layout(leaves)
            if hoisted:
                _warn_hoisted(self.fn.__name__, hoisted)
            try:
                if mesh is None:
                    exe = session.compile(graph, donated)
                else:
                    # A hidden constant is laid out as its first reader wants it:
                    # put in blocks where that reader is split.
                    unspecified = ir_pb2.Sharding(unspecified=True)
                    exe = session.compile(
                        graph,
                        donated,
                        mesh=mesh.proto(),
                        in_shardings=[s.proto() for s in specs] + [unspecified] * len(hoisted),
                        out_shardings=self._out_specs(structure),
                    )
            except errors.RecompileError as e:
                raise errors.RecompileError(f"{self.fn.__name__}: {why}. {e}", e.code) from None
            self.compiles += 1
            self.last_miss = why
            placements = [None] * len(out_tracers)
            if exe.HasField("mesh"):
                # An output reports the sharding out_shardings asked for, as
                # written (as jax's do); else the one the coordinator chose.
                asked = self._out_specs(structure)
                placements = [
                    session_pb2.Placement(
                        sharded=session_pb2.MeshSharding(mesh=exe.mesh, sharding=s if a.unspecified else a)
                    )
                    for s, a in zip(exe.output_shardings, asked)
                ]
                in_placements = [
                    session_pb2.Placement(sharded=session_pb2.MeshSharding(mesh=exe.mesh, sharding=s))
                    for s in exe.parameter_shardings
                ]
            elif mpmd:
                placements = list(exe.output_placements)
                in_placements = list(exe.parameter_placements)
            else:
                in_placements = None
            entry = (
                exe,
                structure,
                [(t.shape, t.dtype, p) for t, p in zip(out_tracers, placements)],
                in_placements,
                _Hoisted(hoisted, exe),
                self._could_donate(exe, leaves, paths, donated_leaves, out_tracers),
            )
            cache[key] = entry
        return entry, leaves, donated_leaves

    def _could_donate(self, exe, leaves, paths, donated_leaves, out_tracers):
        """Per argument leaf: None, or (this jit, leaf, path, output) where the
        leaf is not donated but an output no donation takes has its type
        (and layout): if the caller drops the argument after the call
        (Array.__del__), its buffer could have been that output's."""
        if self._eager:
            return (None,) * len(leaves)
        taken = {a.output for a in exe.aliases}
        params, outs = list(exe.parameter_shardings), list(exe.output_shardings)
        could = []
        for i, (x, path, donated) in enumerate(zip(leaves, paths, donated_leaves)):
            c = None
            if not donated:
                for j, o in enumerate(out_tracers):
                    same = tuple(o.shape) == tuple(np.shape(x)) and np.dtype(o.dtype) == np.dtype(_leaf_signature(x)[1])
                    if same and j not in taken and (not params or params[i] == outs[j]):
                        c = (self, i, path, j)
                        taken.add(j)
                        break
            could.append(c)
        return tuple(could)

    def forgotten_donation(self, leaf, path, output, nbytes, strict):
        """An argument leaf dropped after its last use, a call of this jit,
        that could have been donated into `output`: a warning (once per
        leaf, from 1 MiB), or under strict donation an error."""
        name = getattr(self.fn, "__name__", "f")
        what = (
            f"jit of {name}: argument {leaf} '{path}' ({nbytes / (1 << 20):.1f} MiB) was dropped after the call, "
            f"not donated; it could have been donated into output {output} (same type), saving a buffer per call: "
            "donate it (donate_argnums= or donate_argnames=)"
        )
        if strict:
            raise errors.FailedPreconditionError(f"strict donation: {what}", "FAILED_PRECONDITION")
        if nbytes >= _FORGOTTEN_DONATION_BYTES and leaf not in self._warned:
            self._warned.add(leaf)
            warnings.warn(what, DonationWarning, stacklevel=4)

    def _region(self, args):
        """Called on traced values inside another jitted function: this
        function becomes a mesh region of the caller's MPMD program, run on
        the devices of the mesh its in_shardings/out_shardings name; with no
        mesh named, it is inlined into the caller."""
        name = getattr(self.fn, "__name__", "f")
        leaves, paths, structures = [], [], []
        self._leaf_args = []
        for i, a in enumerate(args):
            if i in self._static:
                raise TypeError(f"jit of {name} inside a traced function: static arguments are not available there")
            ls, ps, st = flatten(a, self._params[i] if i < len(self._params) else f"arg{i}")
            leaves += ls
            paths += ps
            structures.append(st)
            self._leaf_args += [i] * len(ls)
        self._arg_structure = ("tuple", tuple(structures))
        wants = [("mesh=", self._mesh)] if self._mesh is not None else []
        wants += _meshes("in_shardings", self._in_shardings) + _meshes("out_shardings", self._out_shardings)
        mesh = self._one_mesh(wants)
        if mesh is None:
            # A jit that names no devices is inlined into its caller, as JAX
            # inlines a nested jit: it runs where the caller runs.
            return self.fn(*args)
        specs = [_spec_of(s) for s in self._in_per_leaf()]
        outer = current_builder()
        operands = [x if isinstance(x, Tracer) else tnp.asarray_in_trace(x) for x in leaves]
        body = Builder(name, root=outer)
        # Constants the body captures stay inside its program: a hidden
        # argument of the caller would stand outside every region.
        hoist, body.root.hoist = body.root.hoist, None
        with body, placement_requests() as inner:
            params = [body.parameter(i, x.shape, x.dtype, p) for i, (x, p) in enumerate(zip(operands, paths))]
            it = iter(params)
            rebuilt = [unflatten(st, [next(it) for _ in flatten(a)[0]]) for st, a in zip(structures, args)]
            outs, _, out_structure = flatten(self.fn(*rebuilt))
            outs = [o if isinstance(o, Tracer) else tnp.asarray_in_trace(o) for o in outs]
            body.graph.outputs.extend(o._name for o in outs)
        body.root.hoist = hoist
        for what, m in inner:
            if m is not None and m != mesh:
                raise ValueError(
                    f"jit of {name}: incompatible placements: it runs on {mesh!r}, but {what} inside " f"it is on {m!r}"
                )
        out_specs = self._out_specs(out_structure)

        def attrs(n):
            r = n.mesh_region
            r.body.CopyFrom(body.graph)
            r.mesh.CopyFrom(mesh.proto())
            for sp in specs:
                r.in_shardings.add().CopyFrom(sp.proto())
            for sp, o in zip(out_specs, outs):
                r.out_shardings.add().CopyFrom(sp)
                n.results.add().CopyFrom(_dtypes.tensor_type(o.shape, o.dtype))

        results = _region.control_node(
            outer, ir_pb2.MESH_REGION, operands, attrs, [(tuple(o.shape), o.dtype, False) for o in outs]
        )
        return unflatten(out_structure, results)

    def __call__(self, *args, **kwargs):
        fast = self._fast
        if fast is not None and not kwargs:
            outs = fast(self, args)
            if outs is not None:
                return outs
        args = self._bind(args, kwargs)
        if current_builder() is not None and any(isinstance(x, Tracer) for x in flatten(args)[0]):
            return self._region(args)
        (exe, structure, out_types, in_placements, hoisted, could), leaves, donated_leaves = self._compiled(args)
        session = _context.session()
        guard = _context.guard()
        placement = self._placement or next((x._placement for x in leaves if isinstance(x, Array)), _DEFAULT_PLACEMENT)
        req = session_pb2.ExecuteRequest(
            executable_id=exe.executable_id, placement=placement, transfer_guard=guard_proto(guard)
        )
        donated_arrays = []
        implicit = []  # (handle, bytes) put for host arguments: dropped once the call is queued
        stale = False  # an argument this process knows was donated or deleted
        self._last_could = [(c, x.handle) for c, x in zip(could, leaves) if c is not None and isinstance(x, Array)]
        for i, (x, donate) in enumerate(zip(leaves, donated_leaves)):
            if isinstance(x, Array):
                stale = stale or x._deleted is not None
                x._could_donate = could[i]
                req.arguments.append(x.handle)
                if donate:
                    donated_arrays.append(x)
            else:
                # A host value passed as an argument: an implicit host->device transfer.
                host = np.asarray(x, dtype=_leaf_signature(x)[1])
                h = session.put(host, in_placements[i] if in_placements else placement, implicit=True, guard=guard)
                req.arguments.append(h)
                if not donate:
                    implicit.append((h, host.nbytes))
        req.arguments.extend(hoisted.handles(session, placement))
        outs = []
        for shape, dtype, out_placement in out_types:
            h = session.new_handle()
            req.outputs.append(h)
            outs.append(Array(session, h, shape, dtype, out_placement or placement))
        self._last_seq = session.execute(req, want_reply=True, forget=self._last_seq)
        for h, nbytes in implicit:  # a later batch deletes them, after this call in the stream
            session.drop(h, nbytes)
        if stale:
            # Raise here, with the coordinator's account of what became of
            # the array, rather than later on the outputs.
            seq, self._last_seq = self._last_seq, None
            session.reply(seq)
        for a in donated_arrays:
            a._mark_donated()
        if not kwargs and not implicit and not hoisted.arrays and in_placements is None:
            self._fast = _FastCall.build(self, args, session, exe, structure, out_types, placement, could)
        return unflatten(structure, outs)

    def donation_receipts(self):
        """For the last call: per donated argument, whether its buffer was
        reused and for which output (waits for the coordinator's reply);
        then each argument not donated that an output of its type could have
        reused ("donated": False, with why)."""
        if self._last_seq is None:
            return []
        resp = _context.session().reply(self._last_seq)
        self._last_seq = None
        receipts = [
            {
                "argument": r.argument,
                "handle": r.handle,
                "reused": r.reused,
                "output": r.output,
                "reason": r.reason,
                "donated": True,
            }
            for r in resp.donations
        ]
        for (_, leaf, path, output), handle in self._last_could:
            why = f"not donated: output {output} has the type of '{path}', so donating it would reuse its buffer"
            receipts.append(
                {"argument": leaf, "handle": handle, "reused": False, "output": output, "reason": why, "donated": False}
            )
        return receipts


_DEFAULT_PLACEMENT = session_pb2.Placement(device=0)


class _FastCall:
    """A jitted function's last signature, when every argument leaf was a
    tessel.Array off any mesh: a later call with the same pytrees of arrays
    of the same shapes, dtypes and placements (the same placement objects,
    as a step loop passes along), in the same session under the same
    transfer guard, skips the cache key, the trace lookup and the request
    message. The request's bytes are built once; each call appends its
    handles and queues them. Anything else (another argument, a donated or
    deleted one, keywords, another session or guard) returns None, and the
    full path runs and says what is wrong."""

    __slots__ = (
        "session",
        "guard",
        "structures",
        "sig",
        "placements",
        "template",
        "outs",
        "structure",
        "donated",
        "flat",
        "single",
        "could",
        "any_could",
    )

    @staticmethod
    def build(jit, args, session, exe, structure, out_types, placement, could):
        if jit._static:
            return None
        leaves, structures, donated = [], [], []
        for i, a in enumerate(args):
            n = len(leaves)
            structures.append(structure_of(a, leaves))
            donated += [k for k in range(n, len(leaves)) if i in jit._donate]
        if not all(type(x) is Array and x._placement.WhichOneof("kind") != "sharded" for x in leaves):
            return None
        f = _FastCall()
        f.session = session
        f.guard = _context.guard_object()
        f.structures = tuple(structures)
        f.flat = all(st is LEAF for st in structures)  # every argument an array: nothing to flatten
        f.sig = tuple((x.shape, x.dtype) for x in leaves)
        f.placements = tuple(x._placement for x in leaves)
        f.template = session_pb2.ExecuteRequest(
            session_id=session.id,
            executable_id=exe.executable_id,
            placement=placement,
            transfer_guard=guard_proto(_context.guard()),
        ).SerializeToString()
        f.outs = [(tuple(shape), np.dtype(dtype), p or placement) for shape, dtype, p in out_types]
        f.structure = structure
        f.single = structure == LEAF
        f.donated = tuple(donated)
        f.could = could
        f.any_could = any(c is not None for c in could)
        return f

    def __call__(self, jit, args):
        session = self.session
        if (
            _context.current_session() is not session
            or _context.guard_object() is not self.guard
            or session.closed
            or len(args) != len(self.structures)
        ):
            return None
        if self.flat:
            leaves = args
        else:
            leaves = []
            if tuple(structure_of(a, leaves) for a in args) != self.structures:
                return None
        encoded = []
        for a, (shape, dtype), p, could in zip(leaves, self.sig, self.placements, self.could):
            if (
                type(a) is not Array
                or a._deleted is not None
                or a._placement is not p
                or a.shape != shape
                or a.dtype != dtype
            ):
                return None
            e = a._henc
            if e is None:
                e = a._henc = varint(a.handle)
            encoded.append(e)
            a._could_donate = could
        outs, out_encoded = [], []
        for shape, dtype, placement in self.outs:
            h, e = session.take_handle()
            outs.append(Array.made(session, h, e, shape, dtype, placement))
            out_encoded.append(e)
        a, o = b"".join(encoded), b"".join(out_encoded)
        request = b"".join((self.template, b"\x1a", varint(len(a)), a, b"\x22", varint(len(o)), o))
        jit._last_seq = session.execute(request, want_reply=True, forget=jit._last_seq)
        jit._last_could = [(c, x.handle) for c, x in zip(self.could, leaves) if c is not None] if self.any_could else ()
        for k in self.donated:
            leaves[k]._deleted = "donated"
        return outs[0] if self.single else unflatten(self.structure, outs)


def _warn_hoisted(name, arrays):
    what = ", ".join(f"{_dtypes.type_string(a.shape, a.dtype)} ({a.nbytes / (1 << 20):.1f} MiB)" for a in arrays)
    warnings.warn(
        f"jit of {name}: {len(arrays)} captured constant(s) too large to ship inside the program ({what}) "
        "become hidden arguments, put once per placement (counted as host->device bytes); pass them as "
        "arguments to choose where they live",
        stacklevel=4,
    )


class _Hoisted:
    """A compiled function's large captured constants: put where its steps
    run, once per placement (a mesh-partitioned program: each in the layout
    the partitioner chose for it, its first reader's), and passed after the
    declared arguments."""

    def __init__(self, arrays, exe):
        self.arrays = arrays
        self._mesh_placements = None
        if arrays and exe.HasField("mesh"):
            first = len(exe.parameter_shardings) - len(arrays)
            self._mesh_placements = [
                session_pb2.Placement(sharded=session_pb2.MeshSharding(mesh=exe.mesh, sharding=s))
                for s in exe.parameter_shardings[first:]
            ]
        self._put = {}  # serialized placement -> [Array]

    def handles(self, session, placement):
        if not self.arrays:
            return []
        placements = self._mesh_placements or [placement] * len(self.arrays)
        key = placements[0].SerializeToString(deterministic=True)
        if key not in self._put:
            self._put[key] = [
                Array(session, session.put(a, p), a.shape, a.dtype, p) for a, p in zip(self.arrays, placements)
            ]
        return [x.handle for x in self._put[key]]


def jit(
    fn=None,
    *,
    donate_argnums=(),
    donate_argnames=(),
    static_argnums=(),
    device=None,
    replicated=False,
    in_shardings=None,
    out_shardings=None,
    mesh=None,
):
    """Traces `fn` over numpy-like ops once per signature and runs it on the
    devices. Arguments may be tessel.Arrays or host values (numpy arrays,
    scalars: an implicit host->device transfer). Results are tessel.Arrays.

    Partitioned over a mesh when an argument is a sharded Array or the
    shardings name a NamedSharding: `in_shardings` (one for all, or a
    pytree prefix of the non-static arguments, as JAX's: a dict of one per
    parameter leaf, None for an argument's own layout; default: each sharded
    argument's own layout, else replicated) and `out_shardings` (one for
    all, or a pytree prefix of the results; default: what propagation
    gives, completed). A prefix that does not fit is an error naming where. `mesh` runs it on that mesh (arguments
    with no sharding given are replicated over it).

    Called inside another jitted function, a function placed on a mesh
    (`mesh`, or shardings naming one) is a mesh region of the caller's MPMD
    program: it runs on that mesh's devices only, and the values it reads
    from other devices are moved there worker to worker."""
    if fn is None:
        return functools.partial(
            jit,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            static_argnums=static_argnums,
            device=device,
            replicated=replicated,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            mesh=mesh,
        )
    return Jitted(
        fn, donate_argnums, donate_argnames, static_argnums, device, replicated, in_shardings, out_shardings, mesh
    )


_eager = {}


class _Slot:
    """Where an array argument stood in an eager op's arguments."""

    __slots__ = ("k",)

    def __init__(self, k):
        self.k = k

    def __repr__(self):
        return f"<array {self.k}>"


def _hoist(a, arrays, keep_numpy=False):
    """`a` with every tessel.Array in it (also inside nested tuples and
    lists) replaced by a _Slot, the arrays appended to `arrays`; numpy
    arrays too unless `keep_numpy` (an index, static by value)."""
    if isinstance(a, Array) or (isinstance(a, np.ndarray) and not keep_numpy):
        arrays.append(a)
        return _Slot(len(arrays) - 1)
    if type(a) in (tuple, list):
        return type(a)(_hoist(x, arrays, keep_numpy) for x in a)
    return a


def _fill(a, values):
    if isinstance(a, _Slot):
        return values[a.k]
    if type(a) in (tuple, list):
        return type(a)(_fill(x, values) for x in a)
    return a


def _key(a):
    """A cache key for a static argument: repr, except numpy arrays, whose
    repr abbreviates: those by dtype, shape and bytes."""
    if isinstance(a, np.ndarray):
        return ("ndarray", a.dtype.str, a.shape, a.tobytes())
    if type(a) in (tuple, list):
        return (type(a).__name__,) + tuple(_key(x) for x in a)
    return repr(a)


def eager_call(fn, args, kwargs):
    """An op called outside a trace: compiled as a one-op jit over its array
    arguments, wherever they stand (in a tuple, a keyword). Numpy arrays in
    an index argument (fn._static_arrays) stay static, as under jit, keyed
    by value; everything else static is keyed by repr."""
    arrays = []
    keep = getattr(fn, "_static_arrays", ())
    static_args = tuple(_hoist(a, arrays, i in keep) for i, a in enumerate(args))
    static_kwargs = {k: _hoist(v, arrays) for k, v in kwargs.items()}
    # Keyed by the function itself: every binary, unary and comparison op is
    # a closure of one factory, so they share a __qualname__.
    key = (fn, _key(static_args), tuple(sorted((k, _key(v)) for k, v in static_kwargs.items())))
    j = _eager.get(key)
    if j is None:

        def op(*values):
            return fn(*_fill(static_args, values), **{k: _fill(v, values) for k, v in static_kwargs.items()})

        op.__name__ = fn.__name__
        j = _eager[key] = Jitted(op)
        j._eager = True
    return j(*arrays)


tnp.register_eager(eager_call)
