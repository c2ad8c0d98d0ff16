"""Autodiff: tessel.grad, value_and_grad and vjp (reverse mode), jvp (forward).

Each traces the function once into a function of the graph and emits a VJP
node; the coordinator expands it into the forward pass and its transpose
(scheduler/autodiff.cc), so every SDK gets the same gradients. Outside a
trace each call runs as a one-off jitted program.
"""

import numpy as np

from tessel import _region
from tessel import numpy as tnp
from tessel._array import Array
from tessel._jit import jit
from tessel._trace import Tracer, current_builder
from tessel._tree import flatten, unflatten
from tessel.v1 import ir_pb2

__all__ = ["custom_jvp", "custom_vjp", "grad", "jvp", "value_and_grad", "vjp"]

_FLOATS = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}


def _is_float(dtype):
    d = np.dtype(dtype)
    return d in _FLOATS or d.name == "bfloat16"


def _emit_vjp(parent, fun, leaves, paths, structure, cotangent_of, wrt):
    """Traces `fun` over `leaves` (rebuilt into `structure`) as a function of
    `parent`'s graph and emits its VJP: returns (the function's result leaves,
    their structure, the cotangents of the leaves in `wrt`)."""
    ops = _region.operands(leaves)
    specs = [_region.spec(x) for x in ops]
    b, out, out_paths, out_structure = _region.trace(
        parent, "grad_fn", fun, specs, paths, lambda ps: unflatten(structure, ps)
    )
    captured, (caps,) = _region.bind_captures([b], len(ops))
    _region.finish(b, out)
    cts = cotangent_of(out, out_structure)

    def attrs(node):
        node.grad.function = b.graph.name
        node.grad.wrt.extend(wrt)

    result_specs = [_region.spec(x) for x in out] + [specs[i] for i in wrt]
    results = _region.control_node(parent, ir_pb2.VJP, ops + captured + cts, attrs, result_specs)
    return results[: len(out)], out_structure, results[len(out) :]


def _positions(args, positions):
    """Leaves of the arguments at `positions`, their paths, the structure of
    their tuple, and per position the leaf indices it covers."""
    leaves, paths, spans = [], [], []
    structures = []
    for k in positions:
        ls, ps, st = flatten(args[k], f"[{k}]")
        spans.append(range(len(leaves), len(leaves) + len(ls)))
        leaves += ls
        paths += ps
        structures.append(st)
    return leaves, paths, ("tuple", tuple(structures)), spans


def _passes_through(x):
    return all(not isinstance(leaf, (Array, Tracer, np.ndarray, np.generic)) for leaf in flatten(x)[0])


def _hashable(x):
    try:
        hash(x)
    except TypeError:
        return False
    return True


def value_and_grad(fun, argnums=0, has_aux=False):
    """jax.value_and_grad: (fun(*args), the gradient of its scalar result
    with respect to the arguments in `argnums`) -- ((value, aux), grads)
    with `has_aux`."""
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)

    def wrapped(*args):
        # Arguments not differentiated whose leaves are plain Python values
        # (a layer count, a flag) pass through as they are, as in JAX: they
        # are not traced, so the function may branch or shape on them.
        fixed = {k: a for k, a in enumerate(args) if k not in nums and _passes_through(a)}
        if current_builder() is None and not any(isinstance(x, Tracer) for x in flatten(args)[0]):
            return jit(wrapped, static_argnums=tuple(k for k in fixed if _hashable(args[k])))(*args)
        for k in nums:
            if k >= len(args):
                raise TypeError(
                    f"value_and_grad of {getattr(fun, '__name__', 'f')}: argnums {k} but " f"{len(args)} arguments"
                )
        dyn = [k for k in range(len(args)) if k not in fixed]
        leaves, paths, structure, spans = _positions(args, dyn)
        wrt = [i for k in nums for i in spans[dyn.index(k)]]
        for i in wrt:
            x = leaves[i]
            dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
            if not _is_float(dtype):
                raise TypeError(
                    f"grad requires real-valued (floating-point) inputs; argument leaf {paths[i]} is "
                    f"{np.dtype(dtype).name}"
                )

        def cotangents(out, out_structure):
            value = out[0]
            if value.shape != () or not _is_float(value.dtype):
                raise TypeError(
                    "grad of a function whose result is not a real scalar: got "
                    f"{_region.describe(value.shape, value.dtype)}"
                    + (" (with has_aux the function returns (value, aux))" if has_aux else "")
                )
            return [tnp.ones((), value.dtype)] + [tnp.zeros(x.shape, x.dtype) for x in out[1:]]

        def call(*rebuilt):
            full = list(args)
            for k, a in zip(dyn, rebuilt):
                full[k] = a
            out = fun(*full)
            if has_aux:
                if not isinstance(out, (tuple, list)) or len(out) != 2:
                    raise TypeError("value_and_grad with has_aux: the function must return (value, aux)")
                return out
            return out

        out, out_structure, grads = _emit_vjp(
            current_builder(), lambda *a: call(*a), leaves, paths, ("tuple", structure[1]), cotangents, wrt
        )
        value = unflatten(out_structure, out)
        per_arg = []
        it = iter(grads)
        for k in nums:
            j = dyn.index(k)
            per_arg.append(unflatten(structure[1][j], [next(it) for _ in spans[j]]))
        g = per_arg[0] if single else tuple(per_arg)
        return value, g

    return wrapped


def grad(fun, argnums=0, has_aux=False):
    """jax.grad: the gradient of fun's scalar result with respect to the
    arguments in `argnums` ((grads, aux) with `has_aux`)."""
    vg = value_and_grad(fun, argnums, has_aux)

    def wrapped(*args):
        value, g = vg(*args)
        return (g, value[1]) if has_aux else g

    return wrapped


def vjp(fun, *primals):
    """jax.vjp: (fun(*primals), vjp_fn) where vjp_fn(cotangent) gives one
    cotangent per primal. Inside a trace."""
    if current_builder() is None:
        raise TypeError(
            "tessel.vjp works inside a traced function (tessel.jit); use grad or value_and_grad " "for a one-off call"
        )
    out = fun(*primals)
    leaves, paths, structure, spans = _positions(primals, range(len(primals)))
    for i, x in enumerate(leaves):
        dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
        if not _is_float(dtype):
            raise TypeError(f"vjp requires floating-point primals; leaf {paths[i]} is {np.dtype(dtype).name}")

    def vjp_fn(cotangent):
        ct_leaves = flatten(cotangent)[0]

        def cotangents(outs, out_structure):
            if len(ct_leaves) != len(outs):
                raise TypeError(f"vjp_fn: {len(ct_leaves)} cotangent leaves for {len(outs)} results")
            return [tnp.astype(_region.operands([c])[0], o.dtype) for c, o in zip(ct_leaves, outs)]

        _, _, grads = _emit_vjp(current_builder(), fun, leaves, paths, structure, cotangents, list(range(len(leaves))))
        it = iter(grads)
        return tuple(unflatten(structure[1][k], [next(it) for _ in spans[k]]) for k in range(len(primals)))

    return out, vjp_fn


def jvp(fun, primals, tangents):
    """jax.jvp: (fun(*primals), the directional derivative of fun at primals
    along tangents), forward mode; differentiates through while_loop too."""
    primals, tangents = tuple(primals), tuple(tangents)
    leaves, paths, structure, _ = _positions(primals, range(len(primals)))
    t_leaves, _, t_structure, _ = _positions(tangents, range(len(tangents)))
    if t_structure != structure:
        raise TypeError(f"jvp: tangents have structure {t_structure}; primals {structure}")
    if current_builder() is None and not any(isinstance(x, Tracer) for x in leaves + t_leaves):
        return jit(lambda p, t: jvp(fun, p, t))(primals, tangents)
    parent = current_builder()
    ops = _region.operands(leaves)
    specs = [_region.spec(x) for x in ops]
    wrt = [i for i, x in enumerate(ops) if _is_float(x.dtype)]
    b, out, _, out_structure = _region.trace(parent, "jvp_fn", fun, specs, paths, lambda ps: unflatten(structure, ps))
    captured, _ = _region.bind_captures([b], len(ops))
    _region.finish(b, out)
    tans = [tnp.astype(_region.operands([t_leaves[i]])[0], ops[i].dtype) for i in wrt]

    def attrs(node):
        node.grad.function = b.graph.name
        node.grad.wrt.extend(wrt)

    result_specs = [_region.spec(x) for x in out] * 2
    results = _region.control_node(parent, ir_pb2.JVP, ops + captured + tans, attrs, result_specs)
    n = len(out)
    return unflatten(out_structure, results[:n]), unflatten(out_structure, results[n:])


class custom_vjp:
    """jax.custom_vjp: `fun` with a reverse-mode rule of your own.

        f = tessel.custom_vjp(fun)
        f.defvjp(fwd, bwd)   # fwd(*args) -> (out, residuals); bwd(residuals, ct) -> one ct per argument

    Outside a gradient f runs `fun`; under grad/value_and_grad/vjp the
    backward pass runs `bwd` on what `fwd` kept. The three functions take
    the arguments explicitly: they may not close over traced values."""

    def __init__(self, fun):
        self.fun, self.fwd, self.bwd = fun, None, None
        self.__name__ = getattr(fun, "__name__", "custom_vjp")
        self._in_rule = 0  # > 0 while fwd or bwd is traced

    def defvjp(self, fwd, bwd):
        self.fwd, self.bwd = fwd, bwd
        return self

    def __call__(self, *args):
        if self.fwd is None:
            raise TypeError(f"custom_vjp {self.__name__}: call defvjp(fwd, bwd) first")
        if self._in_rule:
            # fwd or bwd calling the function itself (as jax.custom_vjp
            # allows): there it is the plain function.
            return self.fun(*args)
        leaves, paths, structure, _ = _positions(args, range(len(args)))
        if current_builder() is None and not any(isinstance(x, Tracer) for x in leaves):
            return jit(self)(*args)
        parent = current_builder()
        ops = _region.operands(leaves)
        specs = [_region.spec(x) for x in ops]
        rebuild = lambda ps: unflatten(structure, ps)  # noqa: E731

        def closed(b, what):
            if b.captures:
                raise TypeError(
                    f"custom_vjp {self.__name__}: {what} closes over traced values; pass them as " "arguments"
                )

        fb, out, _, out_structure = _region.trace(parent, "custom_fun", self.fun, specs, paths, rebuild)
        closed(fb, "the function")
        _region.finish(fb, out)
        self._in_rule += 1
        try:
            wb, wout, _, wstructure = _region.trace(parent, "custom_fwd", self.fwd, specs, paths, rebuild)
        finally:
            self._in_rule -= 1
        closed(wb, "fwd")
        if wstructure[0] not in ("tuple", "list") or len(wstructure[1]) != 2 or wstructure[1][0] != out_structure:
            raise TypeError(f"custom_vjp {self.__name__}: fwd must return (the function's result, residuals)")
        n = len(out)
        wout = (
            _region.match(wb, wout[:n], [""] * n, [_region.spec(x) for x in out], f"custom_vjp {self.__name__} fwd")
            + wout[n:]
        )
        _region.finish(wb, wout)
        res_structure = wstructure[1][1]
        res_specs = [_region.spec(x) for x in wout[n:]]
        nr = len(res_specs)
        out_specs = [(s, d, False) for s, d, _ in (_region.spec(x) for x in out)]
        self._in_rule += 1
        try:
            bb, bout, bpaths, bstructure = _region.trace(
                parent,
                "custom_bwd",
                lambda *ls: self.bwd(unflatten(res_structure, ls[:nr]), unflatten(out_structure, ls[nr:])),
                res_specs + out_specs,
                [""] * (nr + n),
                lambda ps: ps,
            )
        finally:
            self._in_rule -= 1
        closed(bb, "bwd")
        if len(bout) != len(ops):
            raise TypeError(
                f"custom_vjp {self.__name__}: bwd returned {len(bout)} cotangents for {len(ops)} " "argument leaves"
            )
        bout = _region.match(bb, bout, bpaths, specs, f"custom_vjp {self.__name__} bwd")
        _region.finish(bb, bout)

        def attrs(node):
            node.custom_vjp.function = fb.graph.name
            node.custom_vjp.fwd = wb.graph.name
            node.custom_vjp.bwd = bb.graph.name

        results = _region.control_node(parent, ir_pb2.CUSTOM_VJP, ops, attrs, [_region.spec(x) for x in out])
        return unflatten(out_structure, results)


class custom_jvp:
    """jax.custom_jvp: `fun` with a forward-mode rule of your own.

        f = tessel.custom_jvp(fun)

        @f.defjvp
        def f_jvp(primals, tangents):   # -> (f(*primals), tangent of the result)
            ...

    Outside a derivative f runs `fun`. Forward mode runs the rule; reverse
    mode transposes the rule's tangent part, which must be linear in the
    tangents (as JAX requires). The rule may call f itself; the functions
    may not close over traced values."""

    def __init__(self, fun):
        self.fun, self.rule = fun, None
        self.__name__ = getattr(fun, "__name__", "custom_jvp")
        self._in_rule = 0

    def defjvp(self, rule):
        self.rule = rule
        return rule

    def __call__(self, *args):
        if self.rule is None:
            raise TypeError(f"custom_jvp {self.__name__}: call defjvp(rule) first")
        if self._in_rule:
            return self.fun(*args)
        leaves, paths, structure, _ = _positions(args, range(len(args)))
        if current_builder() is None and not any(isinstance(x, Tracer) for x in leaves):
            return jit(self)(*args)
        parent = current_builder()
        ops = _region.operands(leaves)
        specs = [_region.spec(x) for x in ops]
        n_in = len(ops)

        def closed(b, what):
            if b.captures:
                raise TypeError(
                    f"custom_jvp {self.__name__}: {what} closes over traced values; pass them as " "arguments"
                )

        fb, out, out_paths, out_structure = _region.trace(
            parent, "custom_fun", self.fun, specs, paths, lambda ps: unflatten(structure, ps)
        )
        closed(fb, "the function")
        _region.finish(fb, out)
        out_specs = [_region.spec(x) for x in out]
        self._in_rule += 1
        try:
            rb, rout, _, rstructure = _region.trace(
                parent,
                "custom_jvp_rule",
                lambda *ls: self.rule(tuple(unflatten(structure, ls[:n_in])), tuple(unflatten(structure, ls[n_in:]))),
                specs + specs,
                [f"primals{p}" for p in paths] + [f"tangents{p}" for p in paths],
                lambda ps: ps,
            )
        finally:
            self._in_rule -= 1
        closed(rb, "the rule")
        if (
            rstructure[0] not in ("tuple", "list")
            or len(rstructure[1]) != 2
            or rstructure[1][0] != out_structure
            or rstructure[1][1] != out_structure
        ):
            raise TypeError(
                f"custom_jvp {self.__name__}: the rule must return (the function's result, its "
                "tangent), each shaped as the function's result"
            )
        n = len(out)
        rout = _region.match(rb, rout, out_paths + out_paths, out_specs + out_specs, f"custom_jvp {self.__name__} rule")
        _region.finish(rb, rout)

        def attrs(node):
            node.custom_jvp.function = fb.graph.name
            node.custom_jvp.jvp = rb.graph.name

        results = _region.control_node(parent, ir_pb2.CUSTOM_JVP, ops, attrs, out_specs)
        return unflatten(out_structure, results[:n])
