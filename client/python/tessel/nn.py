"""tessel.nn: the neural-network helpers of jax.nn, composed from
tessel.numpy (so they trace under @tessel.jit and run eagerly on
tessel.Arrays alike), with jax.nn's formulas and defaults."""

import math

import numpy as _np

from tessel import numpy as tnp
from tessel._convolution import reduce_window


def relu(x):
    return tnp.maximum(x, 0)


def sigmoid(x):
    return tnp.sigmoid(x)


def silu(x):
    return tnp.multiply(x, tnp.sigmoid(x))


swish = silu


def gelu(x, approximate=True):
    """jax.nn.gelu: the tanh approximation by default, or exactly
    x * (1 + erf(x / sqrt(2))) / 2."""
    if not approximate:
        return tnp.multiply(tnp.multiply(x, 0.5), tnp.add(1.0, tnp._erf(tnp.multiply(x, 1 / math.sqrt(2)))))
    cube = tnp.multiply(tnp.multiply(x, x), x)
    inner = tnp.multiply(math.sqrt(2 / math.pi), tnp.add(x, tnp.multiply(0.044715, cube)))
    return tnp.multiply(x, tnp.multiply(0.5, tnp.add(1.0, tnp.tanh(inner))))


def softmax(x, axis=-1):
    unnormalized = tnp.exp(tnp.subtract(x, tnp.max(x, axis=axis, keepdims=True)))
    return tnp.divide(unnormalized, tnp.sum(unnormalized, axis=axis, keepdims=True))


def log_softmax(x, axis=-1):
    shifted = tnp.subtract(x, tnp.max(x, axis=axis, keepdims=True))
    return tnp.subtract(shifted, tnp.log(tnp.sum(tnp.exp(shifted), axis=axis, keepdims=True)))


def one_hot(x, num_classes, *, dtype=_np.float32, axis=-1):
    """x[..., None] == arange(num_classes), as `dtype`, the new axis at
    `axis`. Indices outside [0, num_classes) give all zeros, as in JAX."""
    hot = tnp.astype(tnp.equal(tnp.expand_dims(x, -1), tnp.arange(int(num_classes))), dtype)
    return hot if axis == -1 else tnp.moveaxis(hot, -1, axis)


def logsumexp(a, axis=None, keepdims=False):
    """jax.nn.logsumexp: log(sum(exp(a))) computed from the shifted values
    a - max(a), so large arguments do not overflow; an all -inf slice gives
    -inf and an inf gives inf, as in JAX."""
    peak = tnp.max(a, axis=axis, keepdims=True)
    peak = tnp.where(tnp.isfinite(peak), peak, tnp.zeros((), peak.dtype))
    total = tnp.sum(tnp.exp(tnp.subtract(a, peak)), axis=axis, keepdims=True)
    out = tnp.add(tnp.log(total), peak)
    return out if keepdims else tnp.squeeze(out, axis=axis) if axis is not None else tnp.reshape(out, ())


def _pool(inputs, init, reduce_fn, window_shape, strides, padding):
    """flax.linen.pool: `inputs` (batch..., window dims, features); the
    window covers the dimensions between the leading and the last."""
    x = tnp.asarray(inputs) if not hasattr(inputs, "shape") else inputs
    strides = tuple(strides) if strides is not None else (1,) * len(window_shape)
    lead = x.ndim - len(window_shape) - 1
    if lead < 0:
        raise ValueError(
            f"pool: inputs of shape {tuple(x.shape)} need a window dimension per entry of window_shape "
            f"{tuple(window_shape)} and a features dimension after them"
        )
    dims = (1,) * lead + tuple(window_shape) + (1,)
    steps = (1,) * lead + strides + (1,)
    if not isinstance(padding, str):
        padding = ((0, 0),) * lead + tuple(tuple(p) for p in padding) + ((0, 0),)
    return reduce_window(x, init, reduce_fn, dims, steps, padding)


def max_pool(inputs, window_shape, strides=None, padding="VALID"):
    """flax.linen.max_pool: the maximum over each window (NHWC-style:
    batch first, features last)."""
    return _pool(inputs, -_np.inf, tnp.maximum, window_shape, strides, padding)


def avg_pool(inputs, window_shape, strides=None, padding="VALID", count_include_pad=True):
    """flax.linen.avg_pool: the mean over each window; with
    count_include_pad=False, padded positions do not count."""
    y = _pool(inputs, 0.0, tnp.add, window_shape, strides, padding)
    if count_include_pad:
        return y / math.prod(window_shape)
    ones = tnp.ones(tuple(inputs.shape[-len(window_shape) - 1 : -1]) + (1,), y.dtype)
    counts = _pool(ones[None], 0.0, tnp.add, window_shape, strides, padding)
    return y / counts.reshape(counts.shape[1:])
