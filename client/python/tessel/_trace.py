"""Tracing: a Python function over Tracers becomes a tessel.v1.Graph.

A Tracer stands for a value of the graph being built: it has a static shape
and dtype, and every numpy-like operation on it appends nodes. Python scalars
are weakly typed (numpy 2 / NEP 50): they take the dtype of the array they
meet; so do Tracers made from Python scalar arguments.
"""

import threading

import numpy as np

from tessel import _dtypes
from tessel.v1 import ir_pb2

_state = threading.local()

# Captured constants larger than this (the compiler's large-literal bound)
# become hidden arguments of a jitted function instead of literals.
HOIST_BYTES = 1 << 20
# A constant over this many bytes is shipped in its smallest form: one value
# filled on the device, or the block it is broadcast from (compact_constant).
COMPACT_BYTES = 4096


def compact_constant(array):
    """The smaller array `array` is a broadcast of (each dim it repeats
    kept at size 1), or None when it repeats nothing. A dim repeats when
    its stride is 0 (a numpy broadcast view, as np.broadcast_to and the JAX
    importer's splats make); an array with no such dim repeats everywhere
    when every element has the first one's bits (-0.0 beside 0.0 does not,
    and a NaN, which a fill would not keep bit for bit, goes as a block of
    one)."""
    if array.size <= 1:
        return None
    if any(st == 0 and n > 1 for st, n in zip(array.strides, array.shape)):
        return array[tuple(slice(0, 1) if st == 0 else slice(None) for st, n in zip(array.strides, array.shape))]
    if array.dtype.kind not in "biuf" or array.dtype.itemsize not in (1, 2, 4, 8):
        return None
    bits = np.ascontiguousarray(array).reshape(-1).view(f"u{array.dtype.itemsize}")
    if (bits == bits[0]).all():
        return array.reshape(-1)[:1].reshape((1,) * array.ndim)
    return None


def current_builder():
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


class placement_requests:
    """Collects, while a jitted function is traced, where its body asks to
    run: (what, mesh) for each with_sharding_constraint and shard_map (mesh
    None for a bare PartitionSpec). The jit checks them against its own
    placement, so that no request is silently ignored."""

    def __enter__(self):
        if not hasattr(_state, "requests"):
            _state.requests = []
        self.items = []
        _state.requests.append(self.items)
        return self.items

    def __exit__(self, *exc):
        _state.requests.pop()


def request_placement(what, mesh):
    stack = getattr(_state, "requests", None)
    if stack:
        stack[-1].append((what, mesh))


class Builder:
    def __init__(self, name, root=None):
        self.graph = ir_pb2.Graph(name=name)
        self._count = 0
        # The builder whose graph holds the functions control flow runs (the
        # jitted function's): functions traced anywhere inside are listed there.
        self.root = root.root if root is not None else self
        self._functions = 0
        # A jitted function's root builder hoists large captured constants
        # into hidden parameters numbered from hoist_base (list of (array,
        # parameter)); elsewhere None, and constants stay literals.
        self.hoist = None
        self.hoist_base = 0

    def new_function_name(self, kind):
        self.root._functions += 1
        return f"{kind}{self.root._functions}"

    def capture(self, tracer):
        """`tracer` as a value of this graph: itself, or (in a function of
        control flow) a parameter bound to it outside."""
        if tracer._builder is self:
            return tracer
        raise ValueError("a traced value from another function was used here (closed over a tracer?)")

    def __enter__(self):
        if not hasattr(_state, "stack"):
            _state.stack = []
        _state.stack.append(self)
        return self

    def __exit__(self, *exc):
        _state.stack.pop()

    def node(self, op, operands, shape, dtype, weak=False, set_attrs=None, with_type=False, name=None):
        # Before the node: a capture adds a parameter.
        names = [o._name if o._builder is self else self.capture(o)._name for o in operands]
        n = self.graph.nodes.add()
        # Inner values are numbered; parameters take their argument's path
        # ("state", "params['w']"), which never reads as a number.
        name = name or str(self._count)
        self._count += 1
        n.name = name
        n.op = op
        if names:
            n.operands.extend(names)
        if with_type:
            n.type.CopyFrom(_dtypes.tensor_type(shape, dtype))
        if set_attrs is not None:
            set_attrs(n)
        return Tracer(self, name, tuple(map(int, shape)), np.dtype(dtype), weak)

    def parameter(self, index, shape, dtype, name, weak=False):
        def attrs(n):
            n.parameter.index = index

        return self.node(ir_pb2.PARAMETER, [], shape, dtype, weak, attrs, with_type=True, name=name)

    def fill(self, value, shape, dtype):
        dtype = np.dtype(dtype)

        def attrs(n):
            if _dtypes.is_float(dtype):
                n.constant.fill.f = float(value)
            else:
                # numpy's cast, whatever the value: full(3, 0.5, bool) is all
                # True, and a NaN or 1e30 fill of an int32 is what numpy makes of it.
                # A uint64 travels as its int64 bit pattern (the kernel wraps it back).
                with np.errstate(invalid="ignore", over="ignore"):
                    bits = np.array(value).astype(dtype)
                    n.constant.fill.i = int(bits.view(np.int64) if dtype == np.uint64 else bits)

        return self.node(ir_pb2.CONSTANT, [], shape, dtype, False, attrs, with_type=True)

    def iota(self, shape, dtype, dimension):
        def attrs(n):
            n.constant.iota.dimension = dimension

        return self.node(ir_pb2.CONSTANT, [], shape, dtype, False, attrs, with_type=True)

    def literal(self, array):
        array = np.asarray(array)
        if array.nbytes > COMPACT_BYTES and (small := compact_constant(array)) is not None:
            # Never whole: the value or the block, broadcast on the device.
            if small.size == 1 and (array.dtype.kind in "biu" or array.dtype.kind == "f" and not np.isnan(small).any()):
                return self.fill(small.reshape(()).item(), array.shape, array.dtype)  # -0.0 keeps its sign
            shape = tuple(map(int, array.shape))

            def attrs(n):
                n.broadcast_in_dim.dims.extend(shape)
                n.broadcast_in_dim.broadcast_dimensions.extend(range(len(shape)))

            return self.node(ir_pb2.BROADCAST_IN_DIM, [self.literal(small)], shape, array.dtype, set_attrs=attrs)
        array = np.asarray(array, order="C")  # keeps 0-d values 0-d (ascontiguousarray makes them 1-d)
        _dtypes.to_proto(array.dtype)
        root = self.root
        if root.hoist is not None and array.nbytes > HOIST_BYTES:
            # Too big to ship inside the program: a hidden argument, put once
            # per placement through the chunked stream (tessel._jit).
            for a, t in root.hoist:
                if a is array:
                    return self.capture(t)
            t = Builder.parameter(
                root, root.hoist_base + len(root.hoist), array.shape, array.dtype, f"constant{len(root.hoist)}"
            )
            root.hoist.append((array, t))
            return self.capture(t)

        def attrs(n):
            n.constant.literal.data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()

        return self.node(ir_pb2.CONSTANT, [], array.shape, array.dtype, False, attrs, with_type=True)


class FunctionBuilder(Builder):
    """Traces a function that control flow runs (a loop body, a branch).
    Values it reads from enclosing functions become its parameters after
    the declared ones (`captures`), as jax's closure conversion does; the
    caller passes them in."""

    def __init__(self, kind, parent):
        super().__init__(parent.new_function_name(kind), parent)
        self.parent = parent
        self._mesh = getattr(parent, "_mesh", None)
        self.num_declared = 0
        self.captures = []  # (value in the parent's graph, this graph's parameter)
        self._captured = {}

    def parameter(self, index, shape, dtype, name, weak=False):
        self.num_declared = max(self.num_declared, index + 1)
        return super().parameter(index, shape, dtype, name, weak)

    def capture(self, tracer):
        if tracer._builder is self:
            return tracer
        outer = self.parent.capture(tracer)
        key = outer._name
        if key not in self._captured:
            index = 1_000_000 + len(self.captures)  # renumbered by the caller (set_capture_index)
            p = Builder.parameter(self, index, outer.shape, outer.dtype, f"capture{len(self.captures)}", outer.weak)
            self._captured[key] = p
            self.captures.append((outer, p))
        return self._captured[key]

    def set_parameter_index(self, param, index):
        for n in self.graph.nodes:
            if n.name == param._name:
                n.parameter.index = index
                return
        raise AssertionError(f"no parameter {param._name}")


class Tracer:
    """A value of the graph being traced (inside @tessel.jit)."""

    __array_priority__ = 1000

    def __init__(self, builder, name, shape, dtype, weak=False):
        self._builder = builder
        self._name = name
        self.shape = shape
        self.dtype = dtype
        self.weak = weak

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))

    def __repr__(self):
        return f"Tracer({_dtypes.type_string(self.shape, self.dtype)})"

    def _concrete(self, what):
        raise TypeError(
            f"{what} of a traced value ({self!r}): its value is not known while tracing; "
            "compute it inside the graph, or return it and fetch it"
        )

    def __bool__(self):
        self._concrete("bool()")

    def __float__(self):
        self._concrete("float()")

    def __int__(self):
        self._concrete("int()")

    def __index__(self):
        self._concrete("use as an index")

    def __array__(self, *args, **kwargs):
        self._concrete("conversion to a numpy array")

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d traced value")
        return self.shape[0]

    def __iter__(self):
        if not self.shape:
            raise TypeError("iteration over a 0-d traced value")
        return (self[i] for i in range(self.shape[0]))


def install_operators(cls, tnp):
    """Arithmetic, comparison and indexing operators of `cls`, through `tnp`."""
    binary = {
        "add": tnp.add,
        "sub": tnp.subtract,
        "mul": tnp.multiply,
        "truediv": tnp.divide,
        "floordiv": tnp.floor_divide,
        "mod": tnp.remainder,
        "pow": tnp.power,
        "matmul": tnp.matmul,
        "and": tnp.bitwise_and,
        "or": tnp.bitwise_or,
        "xor": tnp.bitwise_xor,
        "lshift": tnp.left_shift,
        "rshift": tnp.right_shift,
    }
    for name, fn in binary.items():
        setattr(cls, f"__{name}__", lambda a, b, fn=fn: fn(a, b))
        setattr(cls, f"__r{name}__", lambda a, b, fn=fn: fn(b, a))
    for name, fn in {
        "lt": tnp.less,
        "le": tnp.less_equal,
        "gt": tnp.greater,
        "ge": tnp.greater_equal,
        "eq": tnp.equal,
        "ne": tnp.not_equal,
    }.items():
        setattr(cls, f"__{name}__", lambda a, b, fn=fn: fn(a, b))
    cls.__hash__ = object.__hash__
    cls.__neg__ = lambda a: tnp.negative(a)
    cls.__pos__ = lambda a: a
    cls.__abs__ = lambda a: tnp.abs(a)
    cls.__invert__ = lambda a: tnp.invert(a)
    cls.__getitem__ = lambda a, idx: tnp._getitem(a, idx)
    cls.at = property(lambda a: tnp._IndexUpdateHelper(a))
    cls.clip = lambda a, min=None, max=None: tnp.clip(a, min, max)
    cls.astype = lambda a, dtype: tnp.astype(a, dtype)
    cls.reshape = lambda a, *shape: tnp.reshape(
        a, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
    )
    cls.transpose = lambda a, *axes: tnp.transpose(a, axes if axes else None)
    cls.T = property(lambda a: tnp.transpose(a))
    cls.sum = lambda a, axis=None, dtype=None, keepdims=False, where=None: tnp.sum(
        a, axis, dtype=dtype, keepdims=keepdims, where=where
    )
    cls.mean = lambda a, axis=None, dtype=None, keepdims=False, where=None: tnp.mean(
        a, axis, dtype=dtype, keepdims=keepdims, where=where
    )
    cls.max = lambda a, axis=None, keepdims=False: tnp.max(a, axis, keepdims=keepdims)
    cls.min = lambda a, axis=None, keepdims=False: tnp.min(a, axis, keepdims=keepdims)
    cls.prod = lambda a, axis=None, keepdims=False: tnp.prod(a, axis, keepdims=keepdims)
    cls.argmax = lambda a, axis=None, keepdims=False: tnp.argmax(a, axis, keepdims=keepdims)
    cls.argmin = lambda a, axis=None, keepdims=False: tnp.argmin(a, axis, keepdims=keepdims)
    # The rest of jax.Array's array methods (those whose result shape does
    # not depend on the values).
    cls.all = lambda a, axis=None, keepdims=False: tnp.all(a, axis, keepdims=keepdims)
    cls.any = lambda a, axis=None, keepdims=False: tnp.any(a, axis, keepdims=keepdims)
    cls.argsort = lambda a, axis=-1, kind=None, order=None, *, stable=True, descending=False: tnp.argsort(
        a, axis, stable=stable, descending=descending
    )
    cls.sort = lambda a, axis=-1, kind=None, order=None, *, stable=True, descending=False: tnp.sort(
        a, axis, stable=stable, descending=descending
    )
    cls.searchsorted = lambda a, v, side="left", sorter=None: tnp.searchsorted(a, v, side=side, sorter=sorter)
    cls.cumsum = lambda a, axis=None, dtype=None: tnp.cumsum(a, axis, dtype=dtype)
    cls.cumprod = lambda a, axis=None, dtype=None: tnp.cumprod(a, axis, dtype=dtype)
    cls.var = lambda a, axis=None, dtype=None, ddof=0, keepdims=False: tnp.var(
        a, axis, dtype=dtype, ddof=ddof, keepdims=keepdims
    )
    cls.std = lambda a, axis=None, dtype=None, ddof=0, keepdims=False: tnp.std(
        a, axis, dtype=dtype, ddof=ddof, keepdims=keepdims
    )
    cls.ptp = lambda a, axis=None, keepdims=False: tnp.subtract(
        tnp.max(a, axis, keepdims=keepdims), tnp.min(a, axis, keepdims=keepdims)
    )
    cls.copy = lambda a, order="C": tnp.copy(a)
    cls.ravel = lambda a, order="C": tnp.ravel(a)
    cls.flatten = lambda a, order="C": tnp.ravel(a)
    cls.squeeze = lambda a, axis=None: tnp.squeeze(a, axis)
    cls.swapaxes = lambda a, axis1, axis2: tnp.swapaxes(a, axis1, axis2)
    cls.repeat = lambda a, repeats, axis=None: tnp.repeat(a, repeats, axis)
    cls.take = lambda a, indices, axis=None, mode=None, fill_value=None: tnp.take(
        a, indices, axis, mode=mode, fill_value=fill_value
    )
    cls.diagonal = lambda a, offset=0, axis1=0, axis2=1: tnp.diagonal(a, offset, axis1, axis2)
    cls.trace = lambda a, offset=0, axis1=0, axis2=1, dtype=None: tnp.trace(a, offset, axis1, axis2, dtype)
    cls.dot = lambda a, b, *, precision=None, preferred_element_type=None: tnp.dot(
        a, b, preferred_element_type=preferred_element_type
    )
    cls.round = lambda a, decimals=0: tnp.round(a, decimals)
    cls.conj = cls.conjugate = lambda a: a  # real dtypes only
    cls.imag = property(lambda a: tnp.zeros_like(a))
    cls.real = property(lambda a: a)
    cls.mT = property(lambda a: tnp.swapaxes(a, -1, -2))
    cls.__array_namespace__ = lambda a, *, api_version=None: tnp
    cls.itemsize = property(lambda a: a.dtype.itemsize)
    cls.nbytes = property(lambda a: a.size * a.dtype.itemsize)
