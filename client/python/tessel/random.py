"""tessel.random: counter-based random numbers with jax.random's API and
its bits.

A key is the Threefry-2x32 key JAX uses (jax.random.PRNGKey): two 32-bit
words, held here as int64[2] (or int64[..., 2] for many keys) with values
in [0, 2**32), since Tessel has no uint32 yet; numpy uint32 keys from JAX
are accepted as they are. Numbers come from Threefry-2x32 of each element's
flat index under the key, as JAX computes them with
jax_threefry_partitionable (its default): `uniform`, `bits`, `split`,
`fold_in` and `bernoulli` give JAX's values bit for bit, and `normal` gives
them to within a few ulps (its inverse error function is composed here).

Every element depends only on the key and its own index, so an array
generated under jit with a sharded output is generated block by block on
the devices that hold it: no host bytes move, no collective runs, and the
values equal the single-device ones for the same key. The 32-bit words are
computed in int64 (sums masked to 32 bits, rotations as a multiply and a
floor division by powers of two), elementwise ops the compiler fuses.
"""

import math

import numpy as np

from tessel import lax
from tessel import numpy as tnp
from tessel._array import Array
from tessel._trace import Tracer

__all__ = [
    "PRNGKey",
    "bernoulli",
    "bits",
    "choice",
    "fold_in",
    "gumbel",
    "key",
    "key_data",
    "normal",
    "permutation",
    "randint",
    "split",
    "uniform",
]

_MASK = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def key(seed):
    """The key of an integer seed, as jax.random.PRNGKey(seed): the seed's
    high and low 32-bit words (a negative seed as its 64-bit two's
    complement)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return np.array([s >> 32, s & _MASK], np.int64)


PRNGKey = key


def key_data(k):
    """The key's words, int64[..., 2]."""
    return _key(k)


def _key(k):
    """A key as Tessel takes it: Tessel's arrays and traced values as they
    are; host keys (JAX's uint32 ones too) as int64 numpy arrays."""
    if not isinstance(k, (Array, Tracer)):
        k = np.asarray(k)
        if k.dtype.kind not in "iu" or (k.size and (k.min() < 0 or k.max() > _MASK)):
            raise TypeError(f"a key holds two 32-bit words; got {k.dtype} values {k!r}")
        k = k.astype(np.int64)
    elif np.dtype(k.dtype) != np.int64:
        raise TypeError(f"a key is int64[..., 2] (or uint32 from jax.random); got {k.dtype}")
    if tuple(k.shape)[-1:] != (2,):
        raise ValueError(f"a key has a last dimension of 2; got shape {tuple(k.shape)}")
    return k


def _add(a, b):
    return tnp.bitwise_and(tnp.add(a, b), _MASK)


def _rotl(x, r):
    # x < 2**32, so x * 2**r < 2**63: no int64 overflow.
    return tnp.bitwise_or(tnp.bitwise_and(tnp.multiply(x, 1 << r), _MASK), tnp.floor_divide(x, 1 << (32 - r)))


def _threefry2x32(k1, k2, x1, x2):
    """Threefry-2x32 (20 rounds) of the counter words (x1, x2) under the
    key words (k1, k2); every argument int64 in [0, 2**32)."""
    ks = [k1, k2, tnp.bitwise_xor(tnp.bitwise_xor(k1, k2), _PARITY)]
    x = [_add(x1, ks[0]), _add(x2, ks[1])]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x[0] = _add(x[0], x[1])
            x[1] = tnp.bitwise_xor(_rotl(x[1], r), x[0])
        x[0] = _add(x[0], ks[(i + 1) % 3])
        x[1] = _add(_add(x[1], ks[(i + 2) % 3]), i + 1)
    return x[0], x[1]


def _shape(shape):
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


def _counters(shape):
    """Each element's flat row-major index, as its high and low words."""
    n = math.prod(shape)
    if n > 2**63:
        raise ValueError(f"random arrays hold at most 2**63 elements; shape {shape} has {n}")
    flat = tnp.arange(n) if n else tnp.zeros((0,), tnp.int64)
    flat = tnp.reshape(flat, shape)
    return tnp.floor_divide(flat, 1 << 32), tnp.bitwise_and(flat, _MASK)


def _words(k):
    k = _key(k)
    if tuple(k.shape) != (2,):
        raise ValueError(f"expected a single key of shape (2,), got shape {tuple(k.shape)}; split or index it")
    return tnp.reshape(k[0:1], ()), tnp.reshape(k[1:2], ())


def _bit_pair(k, shape):
    k1, k2 = _words(k)
    hi, lo = _counters(shape)
    return _threefry2x32(k1, k2, hi, lo)


def split(k, num=2):
    """num new keys, int64[num, 2], as jax.random.split."""
    return _split(_key(k), num)


@tnp._op
def _split(k, num=2):
    b1, b2 = _bit_pair(k, _shape(num))
    return tnp.stack([b1, b2], axis=-1)


def fold_in(k, data):
    """A new key from the key and a 32-bit integer, as jax.random.fold_in."""
    return _fold_in(_key(k), data)


@tnp._op
def _fold_in(k, data):
    d = int(data) & _MASK
    k1, k2 = _words(k)
    b1, b2 = _threefry2x32(k1, k2, tnp.zeros((), tnp.int64), tnp.full((), d, tnp.int64))
    return tnp.stack([b1, b2])


def bits(k, shape=()):
    """Uniform 32-bit words, as jax.random.bits (int64 here, in
    [0, 2**32))."""
    return _bits(_key(k), shape)


@tnp._op
def _bits(k, shape=()):
    b1, b2 = _bit_pair(k, _shape(shape))
    return tnp.bitwise_xor(b1, b2)


# Per float dtype: the random bits drawn (JAX draws 8 for fewer than 8
# mantissa bits) and the mantissa bits kept.
_FLOAT_BITS = {np.dtype(np.float64): (64, 52), np.dtype(np.float32): (32, 23), np.dtype(np.float16): (16, 10)}


def _unit(k, shape, dtype):
    """JAX's uniform numbers in [0, 1): the top mantissa-many random bits
    over 2**mantissa (the float 1.m - 1, without a bitcast)."""
    d = np.dtype(dtype)
    if d == tnp.bfloat16:
        nbits, nmant = 8, 7
    elif d in _FLOAT_BITS:
        nbits, nmant = _FLOAT_BITS[d]
    else:
        raise TypeError(f"uniform takes a floating-point dtype; got {d}")
    b1, b2 = _bit_pair(k, shape)
    if nbits == 64:
        # (b1 << 32 | b2) >> 12, without leaving int64.
        m = tnp.add(tnp.multiply(b1, 1 << 20), tnp.floor_divide(b2, 1 << 12))
    else:
        word = tnp.bitwise_and(tnp.bitwise_xor(b1, b2), (1 << nbits) - 1)
        m = tnp.floor_divide(word, 1 << (nbits - nmant))
    # m < 2**52 converts exactly; the scale is a power of two.
    wide = tnp.float64 if nbits == 64 else tnp.float32
    return tnp.astype(tnp.multiply(tnp.astype(m, wide), wide(2.0**-nmant)), d)


def uniform(k, shape=(), dtype=np.float32, minval=0.0, maxval=1.0):
    """jax.random.uniform: floats in [minval, maxval)."""
    return _uniform(_key(k), shape, dtype, minval, maxval)


@tnp._op
def _uniform(k, shape=(), dtype=np.float32, minval=0.0, maxval=1.0):
    d = np.dtype(dtype)
    shape = _shape(shape)
    lo, hi = tnp.astype(tnp.asarray(minval), d), tnp.astype(tnp.asarray(maxval), d)
    u = _unit(k, shape, d)
    return tnp.maximum(lo, tnp.add(tnp.multiply(u, tnp.subtract(hi, lo)), lo))


def _erfinv(y):
    """The inverse error function: Giles' single-precision approximation
    ("Approximating the erfinv function", GPU Computing Gems, 2011), then
    Newton steps on erf, which bring float64 to full precision."""
    d = y.dtype
    w = tnp.negative(tnp.log(tnp.multiply(tnp.subtract(1.0, y), tnp.add(1.0, y))))
    small = tnp.subtract(w, 2.5)
    p_small = 2.81022636e-08
    for c in (
        3.43273939e-07,
        -3.5233877e-06,
        -4.39150654e-06,
        0.00021858087,
        -0.00125372503,
        -0.00417768164,
        0.246640727,
        1.50140941,
    ):
        p_small = tnp.add(tnp.multiply(p_small, small), c)
    big = tnp.subtract(tnp.sqrt(tnp.maximum(w, 5.0)), 3.0)
    p_big = -0.000200214257
    for c in (
        0.000100950558,
        0.00134934322,
        -0.00367342844,
        0.00573950773,
        -0.0076224613,
        0.00943887047,
        1.00167406,
        2.83297682,
    ):
        p_big = tnp.add(tnp.multiply(p_big, big), c)
    x = tnp.multiply(tnp.where(tnp.less(w, 5.0), p_small, p_big), y)
    if d == np.float64:
        for _ in range(2):
            step = tnp.divide(
                tnp.subtract(lax.erf(x), y),
                tnp.multiply(2 / math.sqrt(math.pi), tnp.exp(tnp.negative(tnp.multiply(x, x)))),
            )
            x = tnp.where(tnp.isfinite(step), tnp.subtract(x, step), x)
    return x


def normal(k, shape=(), dtype=np.float32):
    """jax.random.normal: sqrt(2) * erfinv(u) for u uniform in (-1, 1)."""
    return _normal(_key(k), shape, dtype)


@tnp._op
def _normal(k, shape=(), dtype=np.float32):
    d = np.dtype(dtype)
    lo = np.nextafter(np.array(-1.0, d), np.array(0.0, d))
    u = uniform(k, shape, d, lo, 1.0)
    return tnp.multiply(d.type(math.sqrt(2)), _erfinv(u))


def bernoulli(k, p=0.5, shape=None):
    """jax.random.bernoulli: uniform(key, shape, float32) < p."""
    return _bernoulli(_key(k), p, shape)


@tnp._op
def _bernoulli(k, p=0.5, shape=None):
    p_shape = np.shape(p)
    shape = p_shape if shape is None else _shape(shape)
    pd = np.dtype(p.dtype) if hasattr(p, "dtype") and np.dtype(p.dtype).kind == "f" else np.dtype(np.float32)
    return tnp.less(uniform(k, shape, pd), tnp.astype(tnp.asarray(p), pd))


def _mul_mod32(a, b):
    """a * b mod 2**32 for a, b in [0, 2**32), in int64 without overflow:
    through a's high and low halves."""
    a_hi, a_lo = tnp.floor_divide(a, 1 << 16), tnp.bitwise_and(a, 0xFFFF)
    high = tnp.bitwise_and(tnp.multiply(a_hi, b), 0xFFFF)
    return tnp.bitwise_and(tnp.add(tnp.multiply(a_lo, b), tnp.multiply(high, 1 << 16)), _MASK)


def _rem(x, span):
    """x % span, with span 0 meaning 2**32 (no remainder), as uint32 wraps."""
    safe = tnp.where(tnp.equal(span, 0), 1, span)
    return tnp.where(tnp.equal(span, 0), x, tnp.remainder(x, safe))


def randint(k, shape, minval, maxval, dtype=np.int32):
    """jax.random.randint: integers in [minval, maxval), int32 (the draw
    JAX makes for 32-bit integers: two words per element, reduced modulo
    the span). Other widths draw their words differently in JAX (two 64-bit
    words for int64, packed words for 8 and 16 bits) and are not matched yet."""
    d = np.dtype(dtype)
    if d != np.int32:
        raise NotImplementedError(f"randint: dtype {d} is not supported yet; int32 is")
    return _randint(_key(k), _shape(shape), minval, maxval)


@tnp._op
def _randint(k, shape, minval, maxval):
    info = np.iinfo(np.int32)
    lo64, hi64 = tnp.astype(tnp.asarray(minval), np.int64), tnp.astype(tnp.asarray(maxval), np.int64)
    beyond = tnp.greater(hi64, info.max)
    lo, hi = tnp.clip(lo64, info.min, info.max), tnp.clip(hi64, info.min, info.max)
    keys = _split(k, 2)
    higher, lower = _bits(keys[0], shape), _bits(keys[1], shape)
    span = tnp.where(tnp.less_equal(hi, lo), 1, tnp.bitwise_and(tnp.subtract(hi, lo), _MASK))
    span = tnp.where(tnp.logical_and(beyond, tnp.greater(hi, lo)), tnp.bitwise_and(tnp.add(span, 1), _MASK), span)
    multiplier = _rem(tnp.full(np.shape(span), 1 << 16, np.int64), span)
    multiplier = _rem(_mul_mod32(multiplier, multiplier), span)
    offset = tnp.bitwise_and(tnp.add(_mul_mod32(_rem(higher, span), multiplier), _rem(lower, span)), _MASK)
    offset = _rem(offset, span)
    # minval + offset in int32 arithmetic (wrapping), as JAX adds them.
    total = tnp.bitwise_and(tnp.add(tnp.bitwise_and(lo, _MASK), offset), _MASK)
    return tnp.astype(tnp.where(tnp.greater_equal(total, 1 << 31), tnp.subtract(total, 1 << 32), total), np.int32)


def permutation(k, x, axis=0, independent=False):
    """jax.random.permutation: a shuffle of arange(x) (an int) or of x
    along `axis` (each vector on its own with independent=True, else whole
    slices of x moved by one shuffled index vector),
    by rounds of a stable sort under fresh random 32-bit keys (as JAX:
    enough rounds that ties are unlikely to survive every one)."""
    if np.ndim(x) == 0:
        if not np.issubdtype(np.asarray(x).dtype, np.integer):
            raise TypeError("permutation: x must be an integer or at least 1-dimensional")
        return _shuffle(_key(k), int(x), 0)
    if np.ndim(x) > 1 and not independent:  # as JAX: a shuffled index vector, then a gather of x's slices
        axis = int(axis) % np.ndim(x)
        return tnp.take(x, _shuffle(_key(k), int(np.shape(x)[axis]), 0), axis=axis)
    return _shuffle(_key(k), x, axis)


def gumbel(k, shape=(), dtype=np.float32):
    """jax.random.gumbel: -log(-log(u)), u uniform over [tiny, 1)."""
    d = np.dtype(dtype) if dtype is not tnp.bfloat16 else dtype
    u = uniform(k, shape, dtype, float(np.finfo(d).tiny) if d != tnp.bfloat16 else 1.1754944e-38, 1.0)
    return tnp.negative(tnp.log(tnp.negative(tnp.log(u))))


def choice(k, a, shape=(), replace=True, p=None, axis=0):
    """jax.random.choice, by JAX's construction: with replacement, randint
    indices (int32: JAX's when 64-bit types are off) or, with `p`, the
    inverse of its cumulative sum at uniform draws; without replacement, a
    permutation's head or, with `p`, the Gumbel top-k. Rows of an array are
    picked by a gather."""
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
    scalar = np.ndim(a) == 0
    if scalar:
        if not np.issubdtype(np.asarray(a).dtype, np.integer):
            raise TypeError("choice: a must be an integer or an array")
        n = int(a)
    else:
        axis = int(axis) % np.ndim(a)
        n = int(np.shape(a)[axis])
    draws = math.prod(shape)
    if draws == 0:
        return tnp.zeros(shape, dtype=np.int32 if scalar else tnp.asarray(a).dtype)
    if n <= 0:
        raise ValueError("choice: a must be greater than 0 unless no samples are taken")
    if not replace and draws > n:
        raise ValueError(
            f"choice: cannot take a larger sample (size {draws}) than the population (size {n}) " "when replace=False"
        )
    if p is None:
        if replace:
            ind = randint(k, shape, 0, n)
        else:
            ind = permutation(k, n)[:draws]
    else:
        pa = tnp.asarray(p)
        if tuple(pa.shape) != (n,):
            raise ValueError(
                f"choice: p must be None or a vector of a's length along axis ({n}), got shape " f"{tuple(pa.shape)}"
            )
        if pa.dtype.kind not in "f" and pa.dtype != tnp.bfloat16:
            pa = tnp.astype(pa, np.float64)
        if replace:
            cuml = tnp.cumsum(pa)
            r = tnp.multiply(cuml[-1], tnp.subtract(1, uniform(k, shape, pa.dtype)))
            ind = tnp.searchsorted(cuml, r)
        else:
            g = tnp.add(gumbel(k, (n,), pa.dtype), tnp.log(pa))
            ind = tnp.argsort(g, descending=True)[:draws]  # lax.top_k: ties are improbable
    if scalar:
        return tnp.reshape(ind, shape)
    out = tnp.take(a, tnp.ravel(ind) if np.ndim(ind) != 1 else ind, axis=axis)
    ash = tuple(np.shape(a))
    return tnp.reshape(out, ash[:axis] + shape + ash[axis + 1 :])


@tnp._op
def _shuffle(k, x, axis):
    x = tnp.arange(x) if isinstance(x, int) else tnp.asarray(x)
    axis = int(axis) % x.ndim
    rounds = int(np.ceil(3 * np.log(max(1, math.prod(x.shape))) / np.log(_MASK)))
    for _ in range(rounds):
        keys = _split(k, 2)
        k, sub = keys[0], keys[1]
        x = tnp._sort_node(_bits(sub, x.shape), x, axis, False)
    return x
