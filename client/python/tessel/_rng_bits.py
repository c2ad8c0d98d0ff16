"""stablehlo.rng_bit_generator as XLA's CPU backend computes it, bit for
bit, in Tessel's uint32/uint64 ops: Threefry-2x32 (20 rounds) or
Philox-4x32 (10 rounds; RNG_DEFAULT is Philox there). The state is
uint64[2] (word 0 the key, never changed; word 1 the counter) or the
uint32[4] JAX also takes, read as two little-endian pairs. uint8 and uint16
bits are the uint32 bits of the same shape, truncated. Checked against
jax.lax.rng_bit_generator on CPU (client/python/tests/test_tessel_jax.py)."""

import numpy as np

from tessel import numpy as tnp

_U32, _U64 = np.uint32, np.uint64
_BITS = {np.dtype(np.uint8): 8, np.dtype(np.uint16): 16, np.dtype(np.uint32): 32, np.dtype(np.uint64): 64}


def _lo32(x):
    return tnp.astype(x & _U64(0xFFFFFFFF), _U32)


def _hi32(x):
    return tnp.astype(x >> _U64(32), _U32)


def _join64(lo, hi):
    return tnp.astype(lo, _U64) | (tnp.astype(hi, _U64) << _U64(32))


def _rotl32(v, d):
    return (v << _U32(d)) | (v >> _U32(32 - d))


def threefry2x32(x0, x1, k0, k1):
    """Threefry-2x32's 20 rounds over counter words x0, x1 under key words k0, k1."""
    k2 = k0 ^ k1 ^ _U32(0x1BD11BDA)
    keys = (k0, k1, k2)
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    x0, x1 = x0 + k0, x1 + k1
    for group in range(5):
        for r in rotations[group % 2]:
            x0 = x0 + x1
            x1 = _rotl32(x1, r) ^ x0
        x0 = x0 + keys[(group + 1) % 3]
        x1 = x1 + keys[(group + 2) % 3] + _U32(group + 1)
    return x0, x1


def philox4x32(x0, x1, x2, x3, k0, k1):
    """Philox-4x32's 10 rounds; the products' high halves from uint64 products."""
    for _ in range(10):
        p0 = tnp.astype(x0, _U64) * _U64(0xD2511F53)
        p1 = tnp.astype(x2, _U64) * _U64(0xCD9E8D57)
        x0, x1, x2, x3 = _hi32(p1) ^ x1 ^ k0, _lo32(p1), _hi32(p0) ^ x3 ^ k1, _lo32(p0)
        k0, k1 = k0 + _U32(0x9E3779B9), k1 + _U32(0xBB67AE85)
    return x0, x1, x2, x3


def _halves(shape):
    """Threefry's 32-bit split: the first even dimension (else the first
    of the largest) holds two words per generated element."""
    split = next((i for i, d in enumerate(shape) if d % 2 == 0), None)
    if split is None:
        split = max(range(len(shape)), key=lambda i: (shape[i], -i))
    half = list(shape)
    half[split] = -(-shape[split] // 2)
    return split, tuple(half)


def _threefry(key, counter, shape, bits):
    def words(n):
        c = counter + tnp.arange(n, dtype=_U64)
        return threefry2x32(_lo32(c), _hi32(c), _lo32(key), _hi32(key))

    n = int(np.prod(shape, dtype=np.int64))
    if bits == 64:
        y0, y1 = words(n)
        return tnp.reshape(_join64(y0, y1), shape), counter + _U64(n)
    if not shape:  # one element: the first word
        y0, _ = words(1)
        return tnp.reshape(y0, ()), counter + _U64(1)
    split, half = _halves(shape)
    m = int(np.prod(half, dtype=np.int64))
    y0, y1 = words(m)
    both = tnp.stack([tnp.reshape(y0, half), tnp.reshape(y1, half)], axis=split + 1)
    full = list(shape)
    full[split] = 2 * half[split]
    out = tnp.reshape(both, full)[tuple(slice(0, d) for d in shape)]
    return out, counter + _U64(m)


def _philox(key, counter, shape, bits):
    """The 128-bit counter is (low: counter, high: key); block b takes
    counter + b, carried into the high half."""
    n = int(np.prod(shape, dtype=np.int64))
    per = 2 if bits == 64 else 4
    blocks = -(-n // per)
    lo = counter + tnp.arange(blocks, dtype=_U64)
    hi = tnp.where(lo < counter, key + _U64(1), key)
    z = philox4x32(_lo32(lo), _hi32(lo), _lo32(hi), _hi32(hi), _lo32(key), _hi32(key))
    words = [_join64(z[0], z[1]), _join64(z[2], z[3])] if bits == 64 else list(z)
    flat = tnp.reshape(tnp.stack(words, axis=1), (blocks * per,))[:n]
    return tnp.reshape(flat, shape), counter + _U64(blocks)


def rng_bit_generator(state, algorithm, shape, dtype):
    """(the new state, the bits) of `algorithm` ("DEFAULT", "THREE_FRY",
    "PHILOX") for `shape` and unsigned `dtype`."""
    dtype, shape = np.dtype(dtype), tuple(int(d) for d in shape)
    if dtype not in _BITS:
        raise TypeError(f"rng_bit_generator of {dtype}: expected uint8, uint16, uint32 or uint64 bits")
    sdtype, sshape = np.dtype(state.dtype), tuple(state.shape)
    if (sdtype, sshape) == (np.dtype(_U32), (4,)):
        words = _join64(state[0::2], state[1::2])
    elif (sdtype, sshape) == (np.dtype(_U64), (2,)):
        words = state
    else:
        raise ValueError(f"rng_bit_generator state {sdtype}{list(sshape)}: expected uint64[2] or uint32[4]")
    key, counter = words[0], words[1]
    if algorithm in ("DEFAULT", "PHILOX"):
        out, counter = _philox(key, counter, shape, _BITS[dtype])
    elif algorithm == "THREE_FRY":
        out, counter = _threefry(key, counter, shape, _BITS[dtype])
    else:
        raise ValueError(f"rng_bit_generator algorithm {algorithm}: expected DEFAULT, THREE_FRY or PHILOX")
    new = tnp.stack([key, counter])
    if sdtype == np.dtype(_U32):
        new = tnp.reshape(tnp.stack([_lo32(new), _hi32(new)], axis=1), (4,))
    return new, tnp.astype(out, dtype)
