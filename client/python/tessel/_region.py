"""Tracing a sub-function into a function of the graph (a region): a loop
body, a branch, a shard_map body, a mesh region, the function a derivative
or a batch is taken of. Its values read from the enclosing trace become
parameters (closure conversion); the caller passes them as operands. Used
by tessel.lax, jit, shard_map, autodiff and vmap."""

import numpy as np

from tessel import numpy as tnp
from tessel._trace import Builder, FunctionBuilder, Tracer, current_builder
from tessel._tree import flatten
from tessel.v1 import ir_pb2


def in_trace(leaves):
    return current_builder() is not None or any(isinstance(x, Tracer) for x in leaves)


def spec(t):
    return (tuple(t.shape), np.dtype(t.dtype), bool(t.weak))


def describe(shape, dtype):
    return f"{np.dtype(dtype).name}[{','.join(str(d) for d in shape)}]"


def trace(parent, kind, fn, specs, paths, build_args):
    """Traces `fn` as a function of `parent`'s graph: parameters of `specs`
    ((shape, dtype, weak) each), passed as build_args(params). Returns the
    builder, the result leaves (values of that builder) and their structure."""
    b = FunctionBuilder(kind, parent)
    with b:
        params = [b.parameter(i, s, d, p or f"arg{i}", w) for i, ((s, d, w), p) in enumerate(zip(specs, paths))]
        out = fn(*build_args(params))
        leaves, out_paths, structure = flatten(out)
        leaves = [b.capture(x) if isinstance(x, Tracer) else tnp.asarray_in_trace(x) for x in leaves]
    return b, leaves, out_paths, structure


def match(b, leaves, paths, specs, what):
    """`leaves` (results of function builder `b`) as `specs`: a weakly typed
    result takes the wanted dtype; anything else must match exactly."""
    out = []
    with b:
        for x, p, (shape, dtype, _) in zip(leaves, paths, specs):
            if tuple(x.shape) != tuple(shape) or (x.dtype != dtype and not x.weak):
                raise TypeError(
                    f"{what}: result{p} is {describe(x.shape, x.dtype)}; expected "
                    f"{describe(shape, dtype)} (a loop body keeps each carry's shape and dtype; "
                    "branches give the same types)"
                )
            out.append(tnp.astype(x, dtype) if x.dtype != dtype else x)
    return out


def bind_captures(builders, first_index):
    """Gives every function of `builders` the union of their captures as
    parameters first_index, first_index + 1, ... (the caller passes them as
    operands in that order). Returns the captured outer values and, per
    builder, its parameter for each."""
    outer, seen = [], {}
    for b in builders:
        for o, _ in b.captures:
            if o._name not in seen:
                seen[o._name] = len(outer)
                outer.append(o)
    params = []
    for b in builders:
        mine = {o._name: p for o, p in b.captures}
        ps = []
        for j, o in enumerate(outer):
            if o._name in mine:
                b.set_parameter_index(mine[o._name], first_index + j)
                ps.append(mine[o._name])
            else:
                ps.append(
                    Builder.parameter(b, first_index + j, o.shape, o.dtype, f"capture{len(b.captures) + j}", o.weak)
                )
        params.append(ps)
    return outer, params


def finish(b, outputs):
    b.graph.ClearField("outputs")
    b.graph.outputs.extend(x._name for x in outputs)
    b.root.graph.functions.append(b.graph)


def control_node(parent, op, operands, set_attrs, result_specs):
    node = parent.node(op, operands, (), np.bool_, set_attrs=set_attrs)
    results = []
    for k, (shape, dtype, weak) in enumerate(result_specs):

        def attrs(n, k=k):
            n.tuple_element.index = k

        results.append(parent.node(ir_pb2.TUPLE_ELEMENT, [node], shape, dtype, weak, attrs))
    return results


def operands(leaves):
    return [x if isinstance(x, Tracer) else tnp.asarray_in_trace(x) for x in leaves]
