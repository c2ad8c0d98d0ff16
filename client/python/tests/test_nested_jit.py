"""tessel.jit inside a traced function, against jax.jit on CPU (jax from
PyPI): a jit that names no devices is inlined into its caller."""

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp


def test_a_nested_jit_that_names_no_devices_is_inlined_as_in_jax(cluster):
    """A jitted helper inside a jitted step, and jax.grad of a jitted loss:
    both trace into their caller."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    x = np.linspace(-1, 1, 6)

    def make(jit, grad, np_):
        helper = jit(lambda v: np_.sin(v) * 2)
        loss = jit(lambda v: (helper(v) ** 2).sum())
        return jit(lambda v: (helper(v) + 1, grad(loss)(v)))

    ours = make(tessel.jit, tessel.grad, tnp)(x)
    theirs = make(jax.jit, jax.grad, jax.numpy)(x)
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.fetch(), np.asarray(t), rtol=1e-12)
