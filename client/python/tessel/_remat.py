"""Remat: tessel.checkpoint (tessel.remat), as jax.checkpoint.

A checkpointed function keeps, for its backward pass, only its arguments
and what its policy saves; the backward pass recomputes the rest. It is a
custom_vjp of the function: the forward rule runs the function once,
noting the values the policy saves (dot products, or values named with
checkpoint_name); the backward rule runs it again for the VJP, where each
saved value is taken as it was (its own gradient still flows through the
operation that made it) instead of computed again. Outside a gradient the
function runs as written.
"""

import types

from tessel import _context
from tessel import numpy as tnp
from tessel._autodiff import custom_vjp, vjp
from tessel._trace import current_builder
from tessel.numpy._dot import _dot_general

__all__ = ["checkpoint", "checkpoint_name", "checkpoint_policies", "remat"]


# Policies: (kind, has_batch_dims, name) -> whether the value is saved;
# kind is "dot" (a dot_general) or "name" (a value given to checkpoint_name).
def _everything_saveable(kind, batch, name):
    return True


def _nothing_saveable(kind, batch, name):
    return False


def _dots_saveable(kind, batch, name):
    return kind == "dot"


def _dots_with_no_batch_dims_saveable(kind, batch, name):
    return kind == "dot" and not batch


def _save_only_these_names(*names):
    wanted = frozenset(names)
    return lambda kind, batch, name: kind == "name" and name in wanted


def _save_any_names_but_these(*names):
    unwanted = frozenset(names)
    return lambda kind, batch, name: kind == "name" and name not in unwanted


checkpoint_policies = types.SimpleNamespace(
    everything_saveable=_everything_saveable,
    nothing_saveable=_nothing_saveable,
    dots_saveable=_dots_saveable,
    checkpoint_dots=_dots_saveable,
    dots_with_no_batch_dims_saveable=_dots_with_no_batch_dims_saveable,
    checkpoint_dots_with_no_batch_dims=_dots_with_no_batch_dims_saveable,
    save_only_these_names=_save_only_these_names,
    save_any_names_but_these=_save_any_names_but_these,
)


class _Recorder:
    """The hook tessel.numpy's dot and checkpoint_name call while a
    checkpointed function is traced: forward, it notes what the policy
    saves; replayed for the backward pass, it hands each back in turn."""

    def __init__(self, policy, saved=None):
        self.policy = policy
        # Only values of the checkpointed function's own graph are saved: a
        # dot inside a loop body or a nested transformation is recomputed.
        self.builder = current_builder()
        self.replaying = saved is not None
        self.saved = list(saved) if self.replaying else []
        self.next = 0

    def __call__(self, kind, value, batch=False, name=None, operands=None, dims=None):
        if getattr(value, "_builder", None) is not self.builder or not self.policy(kind, batch, name):
            return value
        if not self.replaying:
            self.saved.append(value)
            return value
        kept = self.saved[self.next]
        self.next += 1
        if kind == "dot":
            return _kept_dot(dims)(*operands, kept)
        return _kept_value(value, kept)


def _kept_dot(dims):
    """dot_general(l, r) whose value is `kept` (the forward pass's) and whose
    gradient is the dot's."""

    def fwd(l, r, kept):
        return kept, (l, r)

    def bwd(res, ct):
        _, pull = vjp(lambda a, b: _dot_general(a, b, *dims), *res)
        return (*pull(ct), tnp.zeros_like(ct))

    f = custom_vjp(lambda l, r, kept: kept)
    f.__name__ = "saved_dot"
    return f.defvjp(fwd, bwd)


def _kept_value(value, kept):
    f = custom_vjp(lambda v, k: k)
    f.__name__ = "saved_value"
    f.defvjp(lambda v, k: (k, None), lambda res, ct: (ct, tnp.zeros_like(ct)))
    return f(value, kept)


def checkpoint_name(x, name):
    """Names `x` for the policies save_only_these_names and
    save_any_names_but_these; the identity otherwise."""
    hook = _context.remat_hook()
    return x if hook is None else hook("name", x, name=name)


def checkpoint(fun, *, prevent_cse=True, policy=None, static_argnums=()):
    """jax.checkpoint: `fun`, whose backward pass recomputes what `policy`
    does not save (by default nothing but the arguments). `prevent_cse` is
    accepted for JAX's signature: nothing here merges the recomputation
    with the forward pass. Arguments in `static_argnums` pass through as
    Python values."""
    policy = policy or _nothing_saveable
    static = set((static_argnums,) if isinstance(static_argnums, int) else static_argnums)
    if policy is _everything_saveable:
        return fun

    def traced(*args):
        def call(dyn):
            it = iter(dyn)
            return fun(*[a if k in static else next(it) for k, a in enumerate(args)])

        def run(*dyn):
            return call(dyn)

        def fwd(*dyn):
            rec = _Recorder(policy)  # made here: fwd's graph is the current builder
            with _context.remat_scope(rec):
                out = call(dyn)
            return out, (dyn, tuple(rec.saved))

        def bwd(res, ct):
            dyn, saved = res

            def replay(*d):
                with _context.remat_scope(_Recorder(policy, saved)):
                    return call(d)

            _, pull = vjp(replay, *dyn)
            return pull(ct)

        f = custom_vjp(run)
        f.__name__ = f"checkpoint({getattr(fun, '__name__', 'f')})"
        f.defvjp(fwd, bwd)
        return f(*[a for k, a in enumerate(args) if k not in static])

    traced.__name__ = getattr(fun, "__name__", "checkpoint")
    traced.__wrapped__ = fun
    return traced


remat = checkpoint
