"""numpy dtypes <-> tessel.v1.DType. bfloat16 is ml_dtypes' (the numpy
extension dtype JAX uses) when that package is installed."""

import numpy as np

from tessel.v1 import ir_pb2

_TO_PROTO = {
    np.dtype(np.float32): ir_pb2.F32,
    np.dtype(np.float64): ir_pb2.F64,
    np.dtype(np.float16): ir_pb2.F16,
    np.dtype(np.int32): ir_pb2.S32,
    np.dtype(np.int64): ir_pb2.S64,
    np.dtype(np.uint8): ir_pb2.U8,
    np.dtype(np.bool_): ir_pb2.PRED,
    np.dtype(np.int8): ir_pb2.S8,
    np.dtype(np.int16): ir_pb2.S16,
    np.dtype(np.uint16): ir_pb2.U16,
    np.dtype(np.uint32): ir_pb2.U32,
    np.dtype(np.uint64): ir_pb2.U64,
}
try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
    _TO_PROTO[BFLOAT16] = ir_pb2.BF16
except ImportError:  # bf16 arrays then have no numpy dtype to live in
    BFLOAT16 = None
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}
SUPPORTED = tuple(_TO_PROTO)


def is_float(dtype):
    """True for floating dtypes, bfloat16 included (its numpy kind is 'V')."""
    d = np.dtype(dtype)
    return d.kind == "f" or d == BFLOAT16


def to_proto(dtype):
    d = np.dtype(dtype)
    if d not in _TO_PROTO:
        raise TypeError(f"dtype {d} is not supported; expected one of {', '.join(str(s) for s in SUPPORTED)}")
    return _TO_PROTO[d]


def from_proto(dt):
    if dt == ir_pb2.BF16 and BFLOAT16 is None:
        raise TypeError("a bf16 array needs the ml_dtypes package for its numpy dtype (pip install ml_dtypes)")
    return _FROM_PROTO[dt]


def tensor_type(shape, dtype):
    t = ir_pb2.TensorType(dtype=to_proto(dtype))
    t.dims.extend(int(d) for d in shape)
    return t


def type_string(shape, dtype):
    return f"{np.dtype(dtype).name}[{','.join(str(d) for d in shape)}]"


def _dtype_of(x):
    if isinstance(x, (type, str, np.dtype)):
        return np.dtype(x)
    return np.dtype(getattr(x, "dtype", x))


def finfo(dtype):
    """numpy.finfo of a float dtype (or of an array's), bfloat16 included."""
    d = _dtype_of(dtype)
    if BFLOAT16 is not None and d == BFLOAT16:
        return ml_dtypes.finfo(d)
    return np.finfo(d)


def iinfo(int_type):
    """numpy.iinfo of an integer dtype (or of an array's)."""
    return np.iinfo(_dtype_of(int_type))
