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
import functools
import inspect
import os

import jax
import numpy as np
from jax import export as jax_export
from jax._src.interpreters import mlir as jax_mlir
from jaxlib.mlir import ir

from tessel import _stablehlo
from tessel._array import Array
from tessel import numpy as tnp
from tessel._jit import jit as _tessel_jit
from tessel._sharding import Mesh, NamedSharding, P

__all__ = ["filter_jit", "jit", "load"]


def _is_key(x):
    """A typed PRNG key array (jax.random.key): JAX's module takes its key
    data (uint32, the impl's words last) in its place."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_key_type(t):
    return jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key)


def _abstract(x):
    """A leaf as JAX lowers it: a ShapeDtypeStruct of its shape and dtype;
    a Python scalar stays weakly typed, as JAX keeps it; a typed PRNG key
    keeps its key type."""
    if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
        return jax.ShapeDtypeStruct((), jax.numpy.asarray(x).dtype, weak_type=True)
    if _is_key(x):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    key = getattr(x, "_jax_key", None)  # a key a tessel.jax function returned, held as its key data
    if key is not None:
        return key
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

    def __init__(
        self,
        fun,
        static_argnums,
        static_argnames,
        donate_argnums,
        donate_argnames=(),
        in_shardings=None,
        out_shardings=None,
    ):
        self._fun = fun
        self._in_shardings, self._out_shardings = in_shardings, out_shardings
        self._static = set(static_argnums)
        self._jax = jax.jit(fun, static_argnums=static_argnums, static_argnames=static_argnames, keep_unused=True)
        self._static_names = set(static_argnames)
        self._donate, self._donate_names = _donated_arguments(fun, donate_argnums, donate_argnames)
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
            # The results that are typed keys: they come back as their key
            # data, marked so that a later call takes them as those keys.
            keys = [t if _is_key_type(t) else None for t in jax.tree_util.tree_leaves(lowered.out_info)]
            program = (run, lowered.out_tree, n, keys)
            self._programs[key] = program
        return program

    def _donated_leaves(self, args, kwargs):
        """The flat parameters of the donated arguments: positional ones by
        number, keyword ones by name (their leaves follow the positional
        ones', in the keys' order, as tree_util flattens a dict)."""
        if not self._donate and not self._donate_names:
            return ()
        out, k = [], 0
        named = [(i, a) for i, a in enumerate(args) if i not in self._static]
        named += [(name, kwargs[name]) for name in sorted(kwargs) if name not in self._static_names]
        for which, a in named:
            n = len(jax.tree_util.tree_leaves(a))
            if which in self._donate or which in self._donate_names:
                out.extend(range(k, k + n))
            k += n
        return tuple(out)

    def _leaves(self, args, kwargs):
        run, out_tree, n, keys = self._program(args, kwargs)
        dyn, dyn_kw = self._split(args, kwargs)
        leaves = jax.tree_util.tree_leaves((dyn, dyn_kw))
        if len(leaves) != n:
            raise TypeError(f"tessel.jax.jit of {self.__name__}: {len(leaves)} argument leaves for {n} parameters")
        leaves = [
            np.asarray(jax.random.key_data(x))
            if _is_key(x)
            else np.asarray(x)
            if isinstance(x, (bool, int, float))
            else x
            for x in leaves
        ]
        return run, out_tree, leaves, keys

    def __call__(self, *args, **kwargs):
        run, out_tree, leaves, keys = self._leaves(args, kwargs)
        self._last = run
        outs = list(run(*leaves))
        for out, key in zip(outs, keys):
            if key is not None:
                out._jax_key = key
        return jax.tree_util.tree_unflatten(out_tree, outs)

    def lower(self, *args, **kwargs):
        """The plan for these arguments, as tessel.jit's lower gives it
        (tessel.Compiled: .as_text(), .collectives with their reasons)."""
        run, _, leaves, _ = self._leaves(args, kwargs)
        return run.lower(*leaves)

    def donation_receipts(self):
        """For the last call: per donated argument leaf, whether its buffer
        was reused and for which output, as tessel.jit's."""
        last = getattr(self, "_last", None)
        return [] if last is None else last.donation_receipts()


def _donated_arguments(fun, donate_argnums, donate_argnames):
    """The donated arguments' numbers and names, each completed from the
    other through `fun`'s signature, as jax.jit resolves them: a parameter
    donated by name is donated when passed by position, and the reverse."""
    numbers = {donate_argnums} if isinstance(donate_argnums, int) else set(donate_argnums)
    names = {donate_argnames} if isinstance(donate_argnames, str) else set(donate_argnames)
    try:
        parameters = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return numbers, names
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    known = {p.name for p in parameters if p.kind != p.VAR_POSITIONAL}
    for name in names:
        if name not in known and not any(p.kind == p.VAR_KEYWORD for p in parameters):
            raise ValueError(f"tessel.jax.jit: donate_argnames names {name!r}, which is not a parameter of {fun}")
        if name in positional:
            numbers.add(positional.index(name))
    names |= {positional[i] for i in numbers if i < len(positional)}
    return numbers, names


def jit(
    fun,
    *,
    in_shardings=None,
    out_shardings=None,
    static_argnums=(),
    static_argnames=(),
    donate_argnums=(),
    donate_argnames=(),
):
    """jax.jit's front, Tessel's back: `fun` is written against jax,
    jax.numpy, jax.nn and jax.lax; it runs on the cluster. `in_shardings`
    and `out_shardings` are NamedShardings, Tessel's or JAX's (or None: an
    argument's own layout, propagation's choice for a result), one for
    everything or a pytree prefix of the arguments or results, as JAX takes
    them; Tessel's partitioner plans the rest. A JAX mesh maps onto the
    Tessel mesh of the same axis names and sizes, JAX's device i as the
    cluster's device i; with_sharding_constraint inside `fun`, with a JAX
    NamedSharding or a bare PartitionSpec (the arguments' mesh), constrains
    Tessel's plan. `donate_argnums` and `donate_argnames` donate whole
    arguments (every leaf), by position or by name, as jax.jit's."""
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    return Jitted(
        fun,
        static,
        names,
        donate_argnums,
        donate_argnames,
        _shardings_from_jax(in_shardings),
        _shardings_from_jax(out_shardings),
    )


def _is_array(x):
    """What Equinox traces: JAX and numpy arrays (and numpy scalars), and
    Tessel's arrays; everything else is held static."""
    return isinstance(x, (np.ndarray, np.generic, jax.Array, Array))


class _Static:
    """The static part of a filter_jit call: the pytree structure and its
    non-array leaves (None where an array goes), hashable as jax.jit's
    static arguments must be."""

    def __init__(self, treedef, leaves):
        self.treedef, self.leaves = treedef, tuple(leaves)

    def __hash__(self):
        return hash((self.treedef, self.leaves))

    def __eq__(self, other):
        return isinstance(other, _Static) and (self.treedef, self.leaves) == (other.treedef, other.leaves)

    def fill(self, arrays):
        arrays = iter(arrays)
        return jax.tree_util.tree_unflatten(self.treedef, [next(arrays) if s is None else s for s in self.leaves])


def _partition(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return [x for x in leaves if _is_array(x)], _Static(treedef, [None if _is_array(x) else x for x in leaves])


_FILTER_DONATE = {"none": (), "warn": (0, 1), "all": (0, 1), "all-except-first": (1,), "warn-except-first": (1,)}


def filter_jit(fun, *, donate="none"):
    """equinox.filter_jit's front, Tessel's back: every array leaf of the
    arguments (JAX's, numpy's or Tessel's) is traced and every other leaf
    (a Python number, a function, an eqx.Module's static field) is held
    static, so an Equinox model is passed and returned whole. Results keep
    their non-array leaves too. `donate` is Equinox's: "all",
    "all-except-first" (the first argument's arrays are kept), or "none";
    the "warn" forms donate as their plain ones."""
    if donate not in _FILTER_DONATE:
        raise ValueError(f"tessel.jax.filter_jit: donate={donate!r}; expected one of {sorted(_FILTER_DONATE)}")
    results = {}  # (static part, argument types) -> the static part of the results

    def inner(first, rest, static):
        args, kwargs = static.fill(list(first) + list(rest))
        out = fun(*args, **kwargs)
        arrays, out_static = _partition(out)
        # by shapes: JAX may have canonicalized a dtype (float64 to float32)
        results[(static, tuple(tuple(x.shape) for x in list(first) + list(rest)))] = out_static
        return arrays

    inner.__name__ = getattr(fun, "__name__", "jax_function")
    jitted = jit(inner, static_argnums=2, donate_argnums=_FILTER_DONATE[donate])

    @functools.wraps(fun)
    def call(*args, **kwargs):
        first, rest, static = _filter_arguments(args, kwargs)
        outs = jitted(first, rest, static)
        return results[(static, tuple(tuple(x.shape) for x in first + rest))].fill(outs)

    call.donation_receipts = jitted.donation_receipts
    call.lower = lambda *args, **kwargs: jitted.lower(*_filter_arguments(args, kwargs))
    return call


def _filter_arguments(args, kwargs):
    """filter_jit's three arguments: the first argument's arrays, the other
    arrays, and the static rest."""
    arrays, static = _partition((args, kwargs))
    n_first = len(_partition(args[0])[0]) if args else 0
    return arrays[:n_first], arrays[n_first:], static


class Loaded:
    """A jax.export.Exported program, run on the cluster."""

    def __init__(self, exported, donate_argnums=()):
        self.exported = exported
        self.__name__ = exported.fun_name
        context = jax_mlir.make_ir_context()
        with context:
            module = ir.Module.parse(exported.mlir_module())
            donors = _exported_donors(module)
        # The leaves @main takes: JAX drops the arguments the function never
        # reads from the module (module_kept_var_idx names the rest).
        self._kept = list(exported.module_kept_var_idx)
        donated = {leaf for leaf, donor in zip(self._kept, donors) if donor}
        k = 0
        for i, a in enumerate(exported.in_tree.children()[0].children() if exported.in_tree.children() else []):
            if i in set(donate_argnums):
                donated |= set(range(k, k + a.num_leaves))
            k += a.num_leaves
        params = tuple(j for j, leaf in enumerate(self._kept) if leaf in donated)
        self._run, self._n = _program(module, self.__name__, params, context)

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
        return jax.tree_util.tree_unflatten(e.out_tree, list(self._run(*(leaves[i] for i in self._kept))))

    def donation_receipts(self):
        """For the last call: per donated parameter, whether its buffer was
        reused and for which output, as tessel.jit's."""
        return self._run.donation_receipts()


def _exported_donors(module):
    """Per parameter of @main: whether JAX exported it donated (an argument
    of jax.jit's donate_argnums marked tf.aliasing_output, or
    jax.buffer_donor where no output has its type)."""
    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            if "arg_attrs" not in op.attributes:
                return []
            return [
                any(k in ir.DictAttr(d) for k in ("tf.aliasing_output", "jax.buffer_donor"))
                for d in op.attributes["arg_attrs"]
            ]
    return []


def load(exported, *, donate_argnums=()):
    """tessel.jax.load: a program exported with jax.export (an Exported,
    its serialized bytes, or a file of them) as a callable on the cluster:
    its Python source is not needed. Arguments must have the shapes and
    dtypes it was exported for. The arguments it was exported donating
    (jax.jit's donate_argnums) are donated, and `donate_argnums` adds
    others."""
    if isinstance(exported, (str, os.PathLike)):
        with open(exported, "rb") as f:
            exported = f.read()
    if isinstance(exported, (bytes, bytearray)):
        exported = jax_export.deserialize(bytearray(exported))
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    return Loaded(exported, donate)
