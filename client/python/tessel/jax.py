"""tessel.jax: JAX programs on a Tessel cluster, unchanged.

    step = tessel.jax.jit(train_step, donate_argnums=0)   # train_step written with jax
    state, loss = step(state, batch)                       # tessel.Arrays in, tessel.Arrays out

JAX lowers the function on abstract values (ShapeDtypeStructs of the
arguments: JAX allocates nothing), and the StableHLO module it gives is read
through jaxlib's MLIR bindings and emitted into a Tessel trace
(tessel._stablehlo). The coordinator then compiles and partitions it as any
Tessel program, so every contract holds: receipts for donations, the
transfer guard, forbid_compiles, memory assertions. Arguments and results
are any pytree jax.tree_util accepts; results come back in the function's
own structure. Each new signature (shapes, dtypes, structure, static
values) lowers once; later calls reuse the compiled program.
"""

import contextlib
import os

import jax
import numpy as np
from jax import export as jax_export
from jax._src.interpreters import mlir as jax_mlir
from jaxlib.mlir import ir

from tessel import _stablehlo
from tessel import numpy as tnp
from tessel._jit import jit as _tessel_jit
from tessel._sharding import Mesh, NamedSharding, P

__all__ = ["jit", "load"]


def _abstract(x):
    """A leaf as JAX lowers it: a ShapeDtypeStruct of its shape and dtype;
    a Python scalar stays weakly typed, as JAX keeps it."""
    if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
        return jax.ShapeDtypeStruct((), jax.numpy.asarray(x).dtype, weak_type=True)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype))
    a = np.asarray(x)
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def _key(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return ("a", x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)))
    return ("s", repr(x))


def _per_leaf(prefix, tree, what):
    """A sharding per leaf of `tree` from `prefix`: one sharding (or None)
    for everything, or a pytree prefix of `tree` with shardings (or None,
    "as the argument is") at its leaves, as JAX takes them."""
    if prefix is None or isinstance(prefix, (NamedSharding, P)):
        return [prefix] * len(jax.tree_util.tree_leaves(tree))
    is_sharding = lambda s: s is None or isinstance(s, (NamedSharding, P))  # noqa: E731
    try:
        groups = jax.tree_util.tree_map(
            lambda s, sub: [s] * len(jax.tree_util.tree_leaves(sub)), prefix, tree, is_leaf=is_sharding
        )
    except ValueError as e:
        raise ValueError(f"{what} does not match the structure it shards: {e}") from None
    return [s for group in jax.tree_util.tree_leaves(groups, is_leaf=lambda g: isinstance(g, list)) for s in group]


def _from_jax(s):
    """A sharding given in JAX's terms as Tessel's: a jax NamedSharding over
    a mesh of JAX's devices becomes a NamedSharding over the Tessel mesh of
    the same axis names and sizes (JAX's device i as the cluster's device
    i); a jax PartitionSpec becomes a P. Tessel's own pass through."""
    if isinstance(s, jax.sharding.PartitionSpec):
        return P(*s)
    if isinstance(s, jax.sharding.NamedSharding):
        mesh = s.mesh
        devices = getattr(mesh, "devices", None)
        ids = [int(d.id) for d in np.asarray(devices).reshape(-1)] if devices is not None else None
        return NamedSharding(Mesh(list(zip(mesh.axis_names, mesh.axis_sizes)), devices=ids), P(*s.spec))
    return s


def _shardings_from_jax(tree):
    if tree is None:
        return None
    is_sharding = lambda s: isinstance(  # noqa: E731
        s, (NamedSharding, P, jax.sharding.NamedSharding, jax.sharding.PartitionSpec)
    )
    return jax.tree_util.tree_map(_from_jax, tree, is_leaf=is_sharding)


def _mesh_of(leaves, shardings):
    """The Tessel mesh the call runs on, from its arguments' or its
    in_shardings' NamedShardings (the first found), or None."""
    for x in list(leaves) + list(shardings or ()):
        s = x if isinstance(x, NamedSharding) else getattr(x, "sharding", None)
        if isinstance(s, NamedSharding):
            return s.mesh
    return None


def _abstract_mesh(mesh):
    """A JAX AbstractMesh of a Tessel mesh's names and sizes: lowering under
    it, a bare PartitionSpec (with_sharding_constraint(x, P("data"))) names
    the mesh the arguments live on, as under jax.set_mesh."""
    if mesh is None:
        return contextlib.nullcontext()
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names), axis_types=auto)
    )


def _program(module, name, donated, context=None, in_shardings=None, out_shardings=None):
    """A Tessel jit running StableHLO `module`'s @main over its flat
    parameters, and their number."""
    interpreter = _stablehlo.Interpreter(module, context)
    wants = [_stablehlo.dtype_of(t) for t in interpreter.signature("main")]

    def run(*leaves):
        # JAX may have canonicalized a dtype (float64 to float32 without x64).
        leaves = [tnp.astype(x, w) if np.dtype(x.dtype) != w else x for x, w in zip(leaves, wants)]
        with context if context is not None else contextlib.nullcontext():
            return tuple(interpreter.call("main", leaves))

    run.__name__ = name
    return _tessel_jit(run, donate_argnums=donated, in_shardings=in_shardings, out_shardings=out_shardings), len(wants)


class Jitted:
    """A JAX function compiled for the cluster, per signature."""

    def __init__(self, fun, static_argnums, static_argnames, donate_argnums, in_shardings=None, out_shardings=None):
        self._fun = fun
        self._in_shardings, self._out_shardings = in_shardings, out_shardings
        self._static = set(static_argnums)
        self._jax = jax.jit(fun, static_argnums=static_argnums, static_argnames=static_argnames, keep_unused=True)
        self._static_names = set(static_argnames)
        self._donate = set(donate_argnums)
        self._programs = {}
        self.__name__ = getattr(fun, "__name__", "jax_function")

    def _split(self, args, kwargs):
        dyn = tuple(a for i, a in enumerate(args) if i not in self._static)
        dyn_kw = {k: v for k, v in kwargs.items() if k not in self._static_names}
        return dyn, dyn_kw

    def _program(self, args, kwargs):
        abstract_args = tuple(
            a if i in self._static else jax.tree_util.tree_map(_abstract, a) for i, a in enumerate(args)
        )
        abstract_kwargs = {
            k: v if k in self._static_names else jax.tree_util.tree_map(_abstract, v) for k, v in kwargs.items()
        }
        flat, tree = jax.tree_util.tree_flatten((abstract_args, abstract_kwargs))
        dyn = tuple(a for i, a in enumerate(args) if i not in self._static)
        ins = None
        if self._in_shardings is not None:
            ins = _per_leaf(self._in_shardings, dyn, f"tessel.jax.jit of {self.__name__}: in_shardings")
            dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_names}
            ins += [None] * len(jax.tree_util.tree_leaves(dyn_kwargs))  # keyword arguments: as they are
        mesh = _mesh_of(jax.tree_util.tree_leaves((dyn, kwargs)), ins)
        key = (tree, tuple(_key(x) for x in flat), mesh and (mesh.axis_names, mesh.axis_sizes))
        program = self._programs.get(key)
        if program is None:
            with _abstract_mesh(mesh):
                lowered = self._jax.lower(*abstract_args, **abstract_kwargs)
            outs = None
            if self._out_shardings is not None:
                skeleton = jax.tree_util.tree_unflatten(lowered.out_tree, [0] * lowered.out_tree.num_leaves)
                outs = _per_leaf(self._out_shardings, skeleton, f"tessel.jax.jit of {self.__name__}: out_shardings")
            run, n = _program(
                lowered.compiler_ir("stablehlo"),
                self.__name__,
                self._donated_leaves(args, kwargs),
                in_shardings=ins,
                out_shardings=outs,
            )
            program = (run, lowered.out_tree, n)
            self._programs[key] = program
        return program

    def _donated_leaves(self, args, kwargs):
        if not self._donate:
            return ()
        out, k = [], 0
        for i, a in enumerate(args):
            if i in self._static:
                continue
            n = len(jax.tree_util.tree_leaves(a))
            if i in self._donate:
                out.extend(range(k, k + n))
            k += n
        return tuple(out)

    def _leaves(self, args, kwargs):
        run, out_tree, n = self._program(args, kwargs)
        dyn, dyn_kw = self._split(args, kwargs)
        leaves = jax.tree_util.tree_leaves((dyn, dyn_kw))
        if len(leaves) != n:
            raise TypeError(f"tessel.jax.jit of {self.__name__}: {len(leaves)} argument leaves for {n} parameters")
        leaves = [np.asarray(x) if isinstance(x, (bool, int, float)) else x for x in leaves]
        return run, out_tree, leaves

    def __call__(self, *args, **kwargs):
        run, out_tree, leaves = self._leaves(args, kwargs)
        self._last = run
        outs = run(*leaves)
        return jax.tree_util.tree_unflatten(out_tree, list(outs))

    def lower(self, *args, **kwargs):
        """The plan for these arguments, as tessel.jit's lower gives it
        (tessel.Compiled: .as_text(), .collectives with their reasons)."""
        run, _, leaves = self._leaves(args, kwargs)
        return run.lower(*leaves)

    def donation_receipts(self):
        """For the last call: per donated argument leaf, whether its buffer
        was reused and for which output, as tessel.jit's."""
        last = getattr(self, "_last", None)
        return [] if last is None else last.donation_receipts()


def jit(fun, *, in_shardings=None, out_shardings=None, static_argnums=(), static_argnames=(), donate_argnums=()):
    """jax.jit's front, Tessel's back: `fun` is written against jax,
    jax.numpy, jax.nn and jax.lax; it runs on the cluster. `in_shardings`
    and `out_shardings` are NamedShardings, Tessel's or JAX's (or None: an
    argument's own layout, propagation's choice for a result), one for
    everything or a pytree prefix of the arguments or results, as JAX takes
    them; Tessel's partitioner plans the rest. A JAX mesh maps onto the
    Tessel mesh of the same axis names and sizes, JAX's device i as the
    cluster's device i; with_sharding_constraint inside `fun`, with a JAX
    NamedSharding or a bare PartitionSpec (the arguments' mesh), constrains
    Tessel's plan."""
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    return Jitted(fun, static, names, donate, _shardings_from_jax(in_shardings), _shardings_from_jax(out_shardings))


class Loaded:
    """A jax.export.Exported program, run on the cluster."""

    def __init__(self, exported, donate_argnums=()):
        self.exported = exported
        self.__name__ = exported.fun_name
        context = jax_mlir.make_ir_context()
        with context:
            module = ir.Module.parse(exported.mlir_module())
        donated = []
        k = 0
        for i, a in enumerate(exported.in_tree.children()[0].children() if exported.in_tree.children() else []):
            n = a.num_leaves
            if i in set(donate_argnums):
                donated.extend(range(k, k + n))
            k += n
        self._run, self._n = _program(module, self.__name__, tuple(donated), context)

    def __call__(self, *args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        e = self.exported
        if tree != e.in_tree:
            raise TypeError(
                f"{self.__name__} (exported): arguments of structure {tree}; it was exported for {e.in_tree}"
            )
        for i, (x, aval) in enumerate(zip(leaves, e.in_avals)):
            shape = tuple(getattr(x, "shape", np.shape(x)))
            dtype = np.dtype(getattr(x, "dtype", np.asarray(x).dtype))
            if shape != tuple(aval.shape) or dtype != np.dtype(aval.dtype):
                raise TypeError(
                    f"{self.__name__} (exported): argument leaf {i} is {dtype.name}{list(shape)}; "
                    f"it was exported for {np.dtype(aval.dtype).name}{list(aval.shape)}"
                )
        leaves = [np.asarray(x) if isinstance(x, (bool, int, float)) else x for x in leaves]
        return jax.tree_util.tree_unflatten(e.out_tree, list(self._run(*leaves)))


def load(exported, *, donate_argnums=()):
    """tessel.jax.load: a program exported with jax.export (an Exported,
    its serialized bytes, or a file of them) as a callable on the cluster:
    its Python source is not needed. Arguments must have the shapes and
    dtypes it was exported for."""
    if isinstance(exported, (str, os.PathLike)):
        with open(exported, "rb") as f:
            exported = f.read()
    if isinstance(exported, (bytes, bytearray)):
        exported = jax_export.deserialize(bytearray(exported))
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    return Loaded(exported, donate)
