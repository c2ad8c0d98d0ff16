"""StableHLO to Tessel: a module that jax lowers, read through jaxlib's own
MLIR Python bindings and emitted op by op through tessel.numpy and
tessel.lax inside a Tessel trace. What those ops already do (type rules,
gradients are not needed here, partitioning, kernels) is what the module
gets; an op with no counterpart yet is an error naming it and where it
stands in the module."""

import re

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import sdy, stablehlo

from tessel import _convolution
from tessel import _gather_scatter, _rng_bits, _stablehlo_manual
from tessel import _lax_linalg as linalg
from tessel import lax as tlax
from tessel import numpy as tnp
from tessel._bodies import sort_by
from tessel._shard_map import with_sharding_constraint
from tessel._sharding import Mesh, NamedSharding, P
from tessel.errors import InvalidArgumentError
from tessel.numpy._dot import _dot_general
from tessel.numpy._layout import _pad_general

_DTYPES = {
    "f16": np.float16,
    "f32": np.float32,
    "f64": np.float64,
    "i1": np.bool_,
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
    "ui8": np.uint8,
    "ui16": np.uint16,
    "ui32": np.uint32,
    "ui64": np.uint64,
}


def _defining(v):
    """The operation that defines `v`, or None for a block argument."""
    owner = v.owner
    return None if isinstance(owner, ir.Block) else owner.operation


def _constant_value(v):
    """The value of `v` if a stablehlo.constant defines it, else None."""
    op = _defining(v)
    return np.asarray(_constant(op)) if op is not None and op.name == "stablehlo.constant" else None


def _arg_combiner(direction):
    """JAX's argmax (GT) or argmin (LT) reduce body over (a value, a index,
    b value, b index), one (op, direction, operands) per op: pick a where its
    value compares `direction` with b's or is NaN; on equal values, the
    smaller index."""
    return [
        ("compare", direction, ("a0", "a2")),
        ("compare", "NE", ("a0", "a0")),
        ("or", None, ("r0", "r1")),
        ("compare", "EQ", ("a0", "a2")),
        ("compare", "LT", ("a1", "a3")),
        ("and", None, ("r3", "r4")),
        ("or", None, ("r2", "r5")),
        ("select", None, ("r2", "a0", "a2")),
        ("select", None, ("r6", "a1", "a3")),
        ("return", None, ("r7", "r8")),
    ]


def _canonical_key(v, key):
    """`v` is the comparator's argument `key`, or it through JAX's float
    canonicalization: select(x == 0, 0, x) and select(x != x, NaN, x)."""
    while v != key:
        select = _defining(v)
        if select is None or select.name != "stablehlo.select":
            return False
        pred, fill, rest = select.operands
        cond, value = _defining(pred), _constant_value(fill)
        if cond is None or cond.name != "stablehlo.compare" or value is None:
            return False
        direction = stablehlo.ComparisonDirectionAttr(cond.attributes["comparison_direction"]).value
        # The condition reads the key or the value on its way (equivalent here).
        x, y = cond.operands
        same = x in (rest, key)
        zero_of_y = _constant_value(y)
        zero = direction == "EQ" and same and value == 0 and zero_of_y is not None and zero_of_y == 0
        nan = direction == "NE" and same and y == x and np.isnan(value)
        if not (zero or nan):
            return False
        v = rest
    return True


# JAX's CPU lowering of jax.lax.linalg: lapack_<s|d|c|z><routine>_ffi.
_LAPACK = re.compile(r"lapack_([sdcz])(potrf|trsm|getrf|syevd|gesdd|geqrf|orgqr)_ffi")


def dtype_of(mlir_type):
    t = ir.RankedTensorType(mlir_type)
    name = str(t.element_type)
    if name == "bf16":
        return np.dtype(tnp.bfloat16)
    if name not in _DTYPES:
        raise NotImplementedError(f"element type {name} has no Tessel dtype")
    return np.dtype(_DTYPES[name])


def shape_of(mlir_type):
    return tuple(ir.RankedTensorType(mlir_type).shape)


def _ints(attr):
    return [int(v) for v in ir.DenseI64ArrayAttr(attr)]


def _opt_ints(attrs, name, n):
    return _ints(attrs[name]) if name in attrs else [1] * n


def _pads(attrs, n):
    if "padding" not in attrs:
        return [(0, 0)] * n
    flat = [int(v) for v in np.asarray(ir.DenseIntElementsAttr(attrs["padding"])).ravel()]
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(n)]


def _scalar(attr):
    for kind in (ir.FloatAttr, ir.IntegerAttr, ir.BoolAttr):
        try:
            return kind(attr).value
        except (ValueError, TypeError):
            continue
    raise NotImplementedError(f"a constant element {attr}")


def _constant(op):
    a = ir.DenseElementsAttr(op.attributes["value"])
    shape, dtype = shape_of(op.result.type), dtype_of(op.result.type)
    if a.is_splat:
        # A broadcast view: the trace ships one value, filled on the device
        # (tessel._trace.compact_constant), never the whole array.
        return np.broadcast_to(np.asarray(_scalar(a.get_splat_value()), dtype), shape)
    if dtype == np.bool_:
        return np.array([bool(_scalar(a[i])) for i in range(len(a))], np.bool_).reshape(shape)
    return np.asarray(a).astype(dtype).reshape(shape)


def _broadcast_in_dim(x, dims, shape):
    ns = np if isinstance(x, (np.ndarray, np.generic)) else tnp  # a constant stays one, on the host
    x = ns.asarray(x) if not hasattr(x, "ndim") else x
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    if order != list(range(len(dims))):
        x = ns.transpose(x, order)
        dims = [dims[i] for i in order]
    full = [1] * len(shape)
    for i, d in enumerate(dims):
        full[d] = x.shape[i]
    return ns.broadcast_to(ns.reshape(x, tuple(full)), tuple(shape))


# Giles' single-precision approximation of erfinv ("Approximating the
# erfinv function", GPU Computing Gems, 2011), as XLA evaluates it for f32:
# a polynomial in w = -log(1 - x^2), one for w < 5 and one beyond.
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                   -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)  # fmt: skip
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)  # fmt: skip


def _erf_inv(x):
    x = tnp.asarray(x)
    w = -tnp.log((1 - x) * (1 + x))
    central, tail = w - 2.5, tnp.sqrt(w) - 3
    p_c, p_t = _ERFINV_CENTRAL[0], _ERFINV_TAIL[0]
    for a, b in zip(_ERFINV_CENTRAL[1:], _ERFINV_TAIL[1:]):
        p_c, p_t = a + p_c * central, b + p_t * tail
    y = tnp.where(w < 5, p_c, p_t) * x
    if np.dtype(x.dtype) == np.float64:
        # two Newton steps on erf(y) = x bring it to double precision
        for _ in range(2):
            y = y - (tlax.erf(y) - x) / (2 / np.sqrt(np.pi) * tnp.exp(-y * y))
    return tnp.where(tnp.abs(x) == 1, x * np.inf, y)


def _bitcast(x, to):
    """stablehlo.bitcast_convert: CONVERT with `bitcast` (the shapes of
    different widths as jax.lax.bitcast_convert_type's)."""
    return tlax.bitcast_convert_type(x, to)


_UNARY = {
    "stablehlo.popcnt": tlax.population_count,
    "stablehlo.count_leading_zeros": tlax.clz,
    "stablehlo.negate": tnp.negative,
    "stablehlo.abs": tnp.abs,
    "stablehlo.exponential": tnp.exp,
    "stablehlo.exponential_minus_one": tnp.expm1,
    "stablehlo.log": tnp.log,
    "stablehlo.log_plus_one": tnp.log1p,
    "stablehlo.tanh": tnp.tanh,
    "stablehlo.logistic": tnp.sigmoid,
    "stablehlo.sqrt": tnp.sqrt,
    "stablehlo.rsqrt": tnp.rsqrt,
    "stablehlo.cbrt": tnp.cbrt,
    "stablehlo.floor": tnp.floor,
    "stablehlo.ceil": tnp.ceil,
    "stablehlo.round_nearest_afz": tlax.round,
    "stablehlo.round_nearest_even": tnp.rint,
    "stablehlo.sign": tnp.sign,
    "stablehlo.not": tnp.invert,
    "stablehlo.sine": tnp.sin,
    "stablehlo.cosine": tnp.cos,
    "stablehlo.tan": tnp.tan,
    "stablehlo.is_finite": tnp.isfinite,
    "chlo.erf": tlax.erf,
    "chlo.asinh": tnp.arcsinh,
    "chlo.acosh": tnp.arccosh,
    "chlo.atanh": tnp.arctanh,
    "chlo.sinh": tnp.sinh,
    "chlo.cosh": tnp.cosh,
    "chlo.asin": tnp.arcsin,
    "chlo.acos": tnp.arccos,
    "chlo.atan": tnp.arctan,
    "chlo.square": tnp.square,
    "chlo.erf_inv": _erf_inv,
    "chlo.tan": tnp.tan,
    "stablehlo.optimization_barrier": lambda x: x,
}
_BINARY = {
    "stablehlo.add": tnp.add,
    "stablehlo.subtract": tnp.subtract,
    "stablehlo.multiply": tnp.multiply,
    "stablehlo.divide": tlax.div,
    "stablehlo.remainder": tlax.rem,
    "stablehlo.maximum": tnp.maximum,
    "stablehlo.minimum": tnp.minimum,
    "stablehlo.power": tnp.power,
    "stablehlo.atan2": tnp.arctan2,
    "stablehlo.and": tnp.bitwise_and,
    "stablehlo.or": tnp.bitwise_or,
    "stablehlo.xor": tnp.bitwise_xor,
    "stablehlo.shift_left": tnp.left_shift,
    "stablehlo.shift_right_arithmetic": tnp.right_shift,
    "stablehlo.shift_right_logical": tlax.shift_right_logical,
    "chlo.next_after": lambda x, y: tnp._nextafter(x, y, "c"),
}
_COMPARE = {"EQ": tnp.equal, "NE": tnp.not_equal, "LT": tnp.less, "LE": tnp.less_equal, "GT": tnp.greater}
_COMPARE["GE"] = tnp.greater_equal
_REDUCERS = {
    "stablehlo.add": "add",
    "stablehlo.maximum": "max",
    "stablehlo.minimum": "min",
    "stablehlo.multiply": "mul",
    "stablehlo.and": "and",
    "stablehlo.or": "or",
}


# A reduce body's op: the reduction over dimensions, and how the init value joins it.
_REDUCTIONS = {
    "add": (tnp.sum, tnp.add),
    "max": (tnp.max, tnp.maximum),
    "min": (tnp.min, tnp.minimum),
    "mul": (tnp.prod, tnp.multiply),
    "and": (tnp.all, tnp.logical_and),
    "or": (tnp.any, tnp.logical_or),
}


class Interpreter:
    """Emits a module's functions into the current Tessel trace."""

    def __init__(self, module, context=None):
        # Both kept alive: the operations below belong to the module.
        self.module, self.context = module, context
        self._householder = {}  # geqrf's stand-in result -> (it, Q), for orgqr
        self.manual = []  # the manual computations (jax.shard_map) being read, innermost last
        self.functions = {}
        for op in module.body.operations:
            if op.operation.name == "func.func":
                self.functions[ir.StringAttr(op.attributes["sym_name"]).value] = op

    def mesh(self, ref):
        """The Tessel mesh of the module's `sdy.mesh` @ref: the same axis
        names and sizes, JAX's device i as the cluster's device i."""
        for op in self.module.body.operations:
            if op.operation.name == "sdy.mesh" and ir.StringAttr(op.attributes["sym_name"]).value == ref:
                mesh = sdy.MeshAttr(op.attributes["mesh"])
                axes = [sdy.MeshAxisAttr(x) for x in mesh.axes]
                ids = list(mesh.device_ids) or None
                return Mesh([(x.name, x.size) for x in axes], devices=ids)
        raise ValueError(f"a sharding names the mesh @{ref}, which the module does not define")

    def named_sharding(self, attr):
        """A Shardy sharding (#sdy.sharding<@mesh, [{"data"}, {}]>) as a
        Tessel NamedSharding: one entry per dimension, None where no axis
        splits it, a tuple where several do (in order)."""
        t = sdy.TensorShardingAttr(attr)
        ref = t.mesh_or_ref
        if not isinstance(ref, ir.FlatSymbolRefAttr):
            raise ValueError(f"a sharding over an inline mesh ({ref}); Tessel maps meshes the module names")
        spec = []
        for d in t.dimension_shardings:
            names = []
            for axis in sdy.DimensionShardingAttr(d).axes:
                axis = sdy.AxisRefAttr(axis)
                if axis.sub_axis_info is not None:
                    raise ValueError(
                        f"a sharding over part of mesh axis {axis.name!r} ({attr}), which Tessel's meshes do not split"
                    )
                names.append(axis.name)
            spec.append(None if not names else names[0] if len(names) == 1 else tuple(names))
        while spec and spec[-1] is None:
            spec.pop()
        return NamedSharding(self.mesh(ref.value), P(*spec))

    def signature(self, name):
        """The parameter types of function @name."""
        fn = self.functions[name]
        return list(ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value).inputs)

    def call(self, name, args):
        fn = self.functions.get(name)
        if fn is None:
            raise InvalidArgumentError(f"StableHLO module: function @{name} is called but not defined")
        return self.region(fn.regions[0], args, f"@{name}", {})

    def region(self, region, args, where, outer):
        """The region's results; it may read values of `outer` (StableHLO's
        regions capture what is defined above them)."""
        block = region.blocks[0]
        env = dict(outer)
        for arg, value in zip(block.arguments, args):
            env[arg] = value
        for i, op in enumerate(block.operations):
            name = op.operation.name
            if name in ("func.return", "stablehlo.return", "sdy.return"):
                return [self.value(env, v) for v in op.operands]
            try:
                results = self.op(op, name, [self.value(env, v) for v in op.operands], env)
            except InvalidArgumentError:
                raise
            except (NotImplementedError, ValueError, TypeError) as e:
                raise InvalidArgumentError(f"StableHLO {name} (op {i} of {where}): {e}") from None
            for r, v in zip(op.results, results):
                env[r] = v
        raise InvalidArgumentError(f"StableHLO {where}: a block without a return")

    @staticmethod
    def value(env, v):
        return env[v]

    def op(self, op, name, args, env):
        a = op.attributes
        out_types = [r.type for r in op.results]
        if name in _BINARY:
            return [_BINARY[name](*args)]
        if name in _UNARY:
            return [_UNARY[name](*args)]
        if name == "stablehlo.constant":
            return [_constant(op)]
        if name == "stablehlo.compare":
            direction = stablehlo.ComparisonDirectionAttr(a["comparison_direction"]).value
            return [_COMPARE[direction](*args)]
        if name == "stablehlo.select":
            return [tnp.where(*args)]
        if name == "stablehlo.clamp":
            return [tnp.clip(args[1], args[0], args[2])]
        if name == "stablehlo.convert":
            return [tnp.astype(args[0], dtype_of(out_types[0]))]
        if name == "stablehlo.bitcast_convert":
            return [_bitcast(args[0], dtype_of(out_types[0]))]
        if name == "stablehlo.reduce_precision":
            return [tlax.reduce_precision(args[0], int(a["exponent_bits"]), int(a["mantissa_bits"]))]
        if name == "stablehlo.broadcast_in_dim":
            return [_broadcast_in_dim(args[0], _ints(a["broadcast_dimensions"]), shape_of(out_types[0]))]
        if name in ("stablehlo.reshape", "stablehlo.dynamic_reshape"):
            return [tnp.reshape(args[0], shape_of(out_types[0]))]
        if name == "stablehlo.transpose":
            return [tnp.transpose(args[0], _ints(a["permutation"]))]
        if name == "stablehlo.reverse":
            return [tnp.flip(args[0], tuple(_ints(a["dimensions"])))]
        if name == "stablehlo.slice":
            start, limit, strides = _ints(a["start_indices"]), _ints(a["limit_indices"]), _ints(a["strides"])
            return [tnp.asarray(args[0])[tuple(slice(s, e, k) for s, e, k in zip(start, limit, strides))]]
        if name == "stablehlo.concatenate":
            return [tnp.concatenate(args, axis=ir.IntegerAttr(a["dimension"]).value)]
        if name == "stablehlo.pad":
            x = tnp.asarray(args[0])
            low, high, interior = (
                _ints(a["edge_padding_low"]),
                _ints(a["edge_padding_high"]),
                _ints(a["interior_padding"]),
            )
            return [_pad_general(x, args[1], low, high, interior)]
        if name == "stablehlo.iota":
            shape, dim = shape_of(out_types[0]), ir.IntegerAttr(a["iota_dimension"]).value
            line = tnp.arange(shape[dim], dtype=dtype_of(out_types[0]))
            return [_broadcast_in_dim(line, [dim], shape)]
        if name == "stablehlo.dot_general":
            d = stablehlo.DotDimensionNumbers(a["dot_dimension_numbers"])
            out = _dot_general(
                args[0],
                args[1],
                list(d.lhs_batching_dimensions),
                list(d.rhs_batching_dimensions),
                list(d.lhs_contracting_dimensions),
                list(d.rhs_contracting_dimensions),
            )
            return [tnp.astype(out, dtype_of(out_types[0]))]
        if name == "stablehlo.reduce":
            return self.reduce(op, args, env)
        if name == "stablehlo.gather":
            dn = stablehlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
            return [_gather_scatter.gather(dn, _ints(a["slice_sizes"]), *args)]
        if name == "stablehlo.scatter":
            return [self.scatter(op, args)]
        if name == "stablehlo.convolution":
            return [self.convolution(op, args)]
        if name == "stablehlo.reduce_window":
            return self.reduce_window(op, args)
        if name == "stablehlo.sort":
            return self.sort(op, args, env)
        if name == "stablehlo.select_and_scatter":
            return [self.select_and_scatter(op, args)]
        if name == "stablehlo.while":
            return self.while_(op, args, env)
        if name == "stablehlo.case":
            return self.case(op, args, env)
        if name == "func.call":
            return self.call(ir.FlatSymbolRefAttr(a["callee"]).value, args)
        if name == "stablehlo.rng_bit_generator":
            algorithm = stablehlo.RngAlgorithmAttr(a["rng_algorithm"]).value
            return list(_rng_bits.rng_bit_generator(args[0], algorithm, shape_of(out_types[1]), dtype_of(out_types[1])))
        if name == "stablehlo.composite":  # its decomposition: Tessel has no kernel by the composite's name
            return self.call(ir.FlatSymbolRefAttr(a["decomposition"]).value, args)
        if name == "stablehlo.if":
            branches = [(lambda r=r: tuple(self.region(r, [], "an if branch", env))) for r in op.regions]
            return list(tlax.cond(args[0], *branches))
        if name == "stablehlo.broadcast":  # the legacy form: broadcast_sizes go first
            shape = shape_of(out_types[0])
            return [_broadcast_in_dim(args[0], list(range(len(shape) - len(args[0].shape), len(shape))), shape)]
        if name == "stablehlo.dot":  # the legacy form: vectors and matrices, contracting lhs's last dim
            return [tnp.astype(tnp.dot(args[0], args[1]), dtype_of(out_types[0]))]
        if name == "stablehlo.cholesky":  # as lowered for platforms without LAPACK calls
            return [self.cholesky(args[0], ir.BoolAttr(a["lower"]).value if "lower" in a else False)]
        if name == "stablehlo.triangular_solve":
            transpose = stablehlo.TransposeAttr(a["transpose_a"]).value
            return [
                linalg.triangular_solve(
                    args[0],
                    args[1],
                    left_side=ir.BoolAttr(a["left_side"]).value,
                    lower=ir.BoolAttr(a["lower"]).value,
                    unit_diagonal=ir.BoolAttr(a["unit_diagonal"]).value,
                    transpose_a=transpose != "NO_TRANSPOSE",
                    conjugate_a=transpose == "ADJOINT",
                )
            ]
        if name == "stablehlo.dynamic_slice":
            return [tlax.dynamic_slice(args[0], args[1:], _ints(a["slice_sizes"]))]
        if name == "stablehlo.dynamic_update_slice":
            return [tlax.dynamic_update_slice(args[0], args[1], args[2:])]
        if name == "stablehlo.custom_call":
            target = ir.StringAttr(a["call_target_name"]).value
            if target in ("Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape") and len(args) == 1:
                return [args[0]]  # layout hints: Tessel's partitioner plans the layouts
            m = _LAPACK.fullmatch(target)
            if m:
                return self.lapack(m.group(1), m.group(2), a, args, out_types)
            raise NotImplementedError(f"custom_call @{target} has no Tessel counterpart")
        if name == "sdy.manual_computation":
            return _stablehlo_manual.manual_computation(self, op, args, env, name)
        if self.manual:
            results = _stablehlo_manual.collective(self, self.manual[-1], name, op, args)
            if results is not None:
                return results
        if name == "sdy.sharding_constraint":
            sharding = self.named_sharding(a["sharding"])
            if not sharding.mesh.axis_names:  # JAX's empty mesh (a typed key's, a shard_map's): nothing to lay out
                return [args[0]]
            return [with_sharding_constraint(args[0], sharding)]
        raise NotImplementedError(f"the op {name} has no Tessel counterpart yet")

    def sort(self, op, args, env):
        """A comparator of operand 0's pair (LT: ascending, GT: descending),
        each key at most canonicalized as jax.numpy's float sorts do (-0.0
        as 0.0, every NaN as one NaN, which sorts last), is the IR's SORT:
        the order tnp.argsort gives, every operand moved by it. Any other
        comparator is applied by SORT_WITH_COMPARATOR."""
        block = op.regions[0].blocks[0]
        ops = list(block.operations)
        keys = list(block.arguments)[:2]
        axis = ir.IntegerAttr(op.attributes["dimension"]).value
        final = _defining(ops[-1].operands[0]) if ops[-1].operation.name == "stablehlo.return" else None
        direction = None
        if (
            final is not None
            and final.name == "stablehlo.compare"
            and all(_canonical_key(v, k) for v, k in zip(final.operands, keys))
        ):
            direction = stablehlo.ComparisonDirectionAttr(final.attributes["comparison_direction"]).value
        if direction in ("LT", "GT"):
            order = tnp.argsort(args[0], axis=axis, stable=True, descending=direction == "GT")
            return [tnp.take_along_axis(tnp.asarray(x), order, axis=axis) for x in args]
        region = op.regions[0]
        return sort_by(args, axis, lambda *ab: self.region(region, list(ab), "a sort's comparator", env)[0])

    def lapack(self, kind, routine, a, args, out_types):
        """JAX's CPU lowering of jax.lax.linalg: LAPACK calls (column-major
        layouts, which describe the same logical matrices), each as the IR's
        factorization. The `info` results are 0, or 1 where a Cholesky
        factorization failed (its factor is NaN), as LAPACK's."""
        if kind not in ("s", "d"):
            raise NotImplementedError(f"LAPACK's {kind}{routine}: complex types have no Tessel dtype")
        cfg = {}
        if "mhlo.backend_config" in a:
            for named in ir.DictAttr(a["mhlo.backend_config"]):
                cfg[named.name] = chr(ir.IntegerAttr(named.attr).value)
        x = args[0]

        def info(k, failed=None):
            zeros = tnp.zeros(shape_of(out_types[k]), np.int32)
            return zeros if failed is None else tnp.astype(failed, np.int32)

        if routine == "potrf":
            lower = cfg.get("uplo", "L") == "L"
            factor = linalg.cholesky(x if lower else x.mT, symmetrize_input=False)
            return [factor if lower else factor.mT, info(1, tnp.isnan(factor[..., 0, 0]))]
        if routine == "trsm":
            side, trans = cfg.get("side", "L"), cfg.get("trans_x", "N")
            out = linalg.triangular_solve(
                x,
                args[1],
                left_side=side == "L",
                lower=cfg.get("uplo", "L") == "L",
                transpose_a=trans in ("T", "C"),
                unit_diagonal=cfg.get("diag", "N") == "U",
            )
            return [out * args[2] if len(args) > 2 else out]
        if routine == "getrf":
            if x.shape[-1] != x.shape[-2]:
                raise NotImplementedError(f"LU of a non-square {list(x.shape)} matrix")
            factors, pivots, _ = linalg.lu(x)
            return [factors, pivots + 1, info(2)]  # LAPACK counts pivots from 1
        if routine == "syevd":
            v, w = linalg.eigh(x, lower=cfg.get("uplo", "L") == "L", symmetrize_input=False)
            return [v, w, info(2)]
        if routine == "gesdd":
            mode = cfg.get("mode", "S")
            m, n = x.shape[-2:]
            if mode == "N":
                s = linalg.svd(x, compute_uv=False)
                return (
                    [tnp.zeros(shape_of(out_types[0]), x.dtype), s]
                    + [tnp.zeros(shape_of(t), x.dtype) for t in out_types[2:4]]
                    + [info(4)]
                )
            u, s, vh = linalg.svd(x, full_matrices=mode == "A")
            return [tnp.zeros(shape_of(out_types[0]), x.dtype), s, u, vh, info(4)]
        if routine == "geqrf":
            # geqrf's Householder vectors are read only by orgqr: stand R (in
            # the upper triangle, zeros below) for its first result, and let
            # orgqr find Q by it.
            m, n = x.shape[-2:]
            q, r = linalg.qr(x, full_matrices=False)
            if r.shape[-2] < m:
                r = tnp.concatenate([r, tnp.zeros(r.shape[:-2] + (m - r.shape[-2], n), x.dtype)], axis=-2)
            self._householder[id(r)] = (r, q)
            return [r, tnp.zeros(shape_of(out_types[1]), x.dtype)]
        if routine == "orgqr":
            held = self._householder.get(id(x))
            if held is None or held[0] is not x:
                raise NotImplementedError("orgqr of a matrix that no geqrf in this module factored")
            q = held[1]
            want = shape_of(out_types[0])
            if tuple(q.shape) != tuple(want):
                raise NotImplementedError(f"orgqr's complete Q {list(want)} (the reduced one is {list(q.shape)})")
            return [q]
        raise NotImplementedError(f"LAPACK's {kind}{routine} has no Tessel counterpart yet")

    def _body_reducer(self, region, what):
        ops = [o for o in region.blocks[0].operations]
        if len(ops) == 2 and ops[0].operation.name in _REDUCERS and ops[1].operation.name == "stablehlo.return":
            return _REDUCERS[ops[0].operation.name]
        raise NotImplementedError(
            f"{what} with a body other than one add, maximum, minimum, multiply, and or or: "
            + ", ".join(o.operation.name for o in ops)
        )

    def reduce(self, op, args, env):
        """A body of one add, maximum, minimum, multiply, and or or is the
        IR's REDUCE; argmax's and argmin's (values, iota) pair with their
        comparators is ARGMAX or ARGMIN; any other body is applied by
        REDUCE_WITH_BODY."""
        n = len(op.results)
        dims = tuple(_ints(op.attributes["dimensions"]))
        kind = None
        if n == 1:
            try:
                kind = self._body_reducer(op.regions[0], "reduce")
            except NotImplementedError:
                kind = None
        if kind is not None:
            x, init = args
            reduce, combine = _REDUCTIONS[kind]
            out = tnp.astype(reduce(x, axis=dims), dtype_of(op.results[0].type))
            return [combine(out, init)]
        if n == 2:
            out = self.arg_reduce(op, args)
            if out is not None:
                return out
        region = op.regions[0]

        def body(acc, x):
            return tuple(self.region(region, list(acc) + list(x), "a reduce's body", env))

        out = tlax.reduce(tuple(args[:n]), tuple(args[n:]), body, dims)
        return [tnp.astype(o, dtype_of(r.type)) for o, r in zip(out, op.results)]

    def arg_reduce(self, op, args):
        """jnp.argmax and argmin: a reduce of (values, iota) over one
        dimension whose body is exactly JAX's combiner (_ARG_COMBINER: the
        first pair where its values compare GT, for argmax, or LT, or are
        NaN; on equal values the smaller index). None for any other body,
        which REDUCE_WITH_BODY applies as it is."""
        block = op.regions[0].blocks[0]
        dims = _ints(op.attributes["dimensions"])
        producer = op.operands[1].owner
        if len(dims) != 1 or getattr(producer, "name", "") != "stablehlo.iota":
            return None
        if ir.IntegerAttr(producer.attributes["iota_dimension"]).value != dims[0]:
            return None
        named = [(v, f"a{k}") for k, v in enumerate(block.arguments)]
        body = []
        for k, o in enumerate(block.operations):
            ids = []
            for v in o.operands:
                found = [n for w, n in named if w == v]
                if not found:
                    return None
                ids.append(found[0])
            direction = None
            if o.operation.name == "stablehlo.compare":
                direction = stablehlo.ComparisonDirectionAttr(o.attributes["comparison_direction"]).value
            body.append((o.operation.name.removeprefix("stablehlo."), direction, tuple(ids)))
            named += [(r, f"r{k}") for r in o.results]
        kind = {"GT": "max", "LT": "min"}.get(body[0][1] if body else None)
        if kind is None or body != _arg_combiner(body[0][1]):
            return None
        x = args[0]
        index = (tnp.argmax if kind == "max" else tnp.argmin)(x, axis=dims[0])
        value = (tnp.max if kind == "max" else tnp.min)(x, axis=dims[0])
        return [value, tnp.astype(index, dtype_of(op.results[1].type))]

    def scatter(self, op, args):
        if len(op.results) != 1:
            raise NotImplementedError(f"a variadic scatter ({len(op.results)} results)")
        ops = list(op.regions[0].blocks[0].operations)
        block = op.regions[0].blocks[0]
        if len(ops) == 1 and ops[0].operation.name == "stablehlo.return" and ops[0].operands[0] == block.arguments[1]:
            mode = "set"
        else:
            kind = self._body_reducer(op.regions[0], "scatter")
            mode = {"add": "add", "max": "max", "min": "min", "mul": "multiply"}.get(kind)
            if mode is None:
                raise NotImplementedError(f"scatter combining with {kind}")
        dn = stablehlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
        return _gather_scatter.scatter(dn, args[0], args[1], args[2], mode)

    def convolution(self, op, args):
        a = op.attributes
        d = stablehlo.ConvDimensionNumbers(a["dimension_numbers"])
        specs = (
            (d.input_batch_dimension, d.input_feature_dimension, *d.input_spatial_dimensions),
            (d.kernel_output_feature_dimension, d.kernel_input_feature_dimension, *d.kernel_spatial_dimensions),
            (d.output_batch_dimension, d.output_feature_dimension, *d.output_spatial_dimensions),
        )
        ns = len(d.input_spatial_dimensions)
        out = _convolution.conv_general_dilated(
            args[0],
            args[1],
            _opt_ints(a, "window_strides", ns),
            _pads(a, ns),
            _opt_ints(a, "lhs_dilation", ns),
            _opt_ints(a, "rhs_dilation", ns),
            dimension_numbers=specs,
            feature_group_count=ir.IntegerAttr(a["feature_group_count"]).value,
            batch_group_count=ir.IntegerAttr(a["batch_group_count"]).value,
        )
        return tnp.astype(out, dtype_of(op.results[0].type))

    def reduce_window(self, op, args):
        if len(op.results) != 1:
            raise NotImplementedError(f"a variadic reduce_window ({len(op.results)} results)")
        kind = self._body_reducer(op.regions[0], "reduce_window")
        if kind not in ("add", "max", "min", "mul"):
            raise NotImplementedError(f"reduce_window with {kind}")
        a = op.attributes
        x, init = args
        nd = len(shape_of(op.operands[0].type))
        if not isinstance(init, np.ndarray):  # a constant of the module stays one on the host
            raise NotImplementedError("reduce_window with an init value computed on the device")
        out = _convolution.reduce_window(
            x,
            init,
            _convolution.COMBINE[kind],
            _ints(a["window_dimensions"]),
            _opt_ints(a, "window_strides", nd),
            _pads(a, nd),
            _opt_ints(a, "base_dilations", nd),
            _opt_ints(a, "window_dilations", nd),
        )
        return [out]

    def select_and_scatter(self, op, args):
        """A max or min pool's gradient: select one compare of its two
        arguments, scatter one add."""
        ops = list(op.regions[0].blocks[0].operations)
        if len(ops) != 2 or ops[0].operation.name != "stablehlo.compare":
            raise NotImplementedError("select_and_scatter whose select is not one compare")
        direction = stablehlo.ComparisonDirectionAttr(ops[0].attributes["comparison_direction"]).value
        if (
            direction not in ("GE", "GT", "LE", "LT")
            or self._body_reducer(op.regions[1], "select_and_scatter") != "add"
        ):
            raise NotImplementedError(f"select_and_scatter with a {direction} select or a scatter other than add")
        a = op.attributes
        x, source, init = args
        nd = len(shape_of(op.operands[0].type))
        out = _convolution.select_and_scatter_add(
            source,
            x,
            direction.lower(),
            _ints(a["window_dimensions"]),
            _opt_ints(a, "window_strides", nd),
            _pads(a, nd),
        )
        return out + init

    def while_(self, op, args, env):
        cond_region, body_region = op.regions[0], op.regions[1]

        def cond(carry):
            return self.region(cond_region, list(carry), "a while's condition", env)[0]

        def body(carry):
            return tuple(self.region(body_region, list(carry), "a while's body", env))

        return list(tlax.while_loop(cond, body, tuple(args)))

    @staticmethod
    def cholesky(x, lower):
        """stablehlo.cholesky: the factor of the triangle `lower` names, read
        from that triangle alone (the other's values are StableHLO's to
        choose: here the factor's zeros). The upper factor U (x = Uᵀ U) is
        the lower factor of xᵀ, transposed."""
        if lower:
            return linalg.cholesky(x, symmetrize_input=False)
        t = tnp.swapaxes(x, -1, -2)
        return tnp.swapaxes(linalg.cholesky(t, symmetrize_input=False), -1, -2)

    def case(self, op, args, env):
        branches = [(lambda r=r: tuple(self.region(r, [], "a case branch", env))) for r in op.regions]
        return list(tlax.switch(args[0], branches))


__all__ = ["Interpreter", "dtype_of", "shape_of"]
