"""tessel.Array: a handle to an array that lives on the devices."""

import _thread
import math
import sys

import numpy as np

from tessel import _context
from tessel._sharding import NamedSharding, ReplicatedSharding, SingleDeviceSharding
from tessel._trace import install_operators
from tessel.v1 import session_pb2

_PROGRESS_MIN_BYTES = 64 << 20


def progress_bar(label):
    """A progress callback drawing on stderr when it is a terminal, else None."""
    if not sys.stderr.isatty():
        return None

    def draw(done, total):
        if total < _PROGRESS_MIN_BYTES:
            return
        width = 30
        filled = width * done // max(total, 1)
        sys.stderr.write(
            f"\r{label} [{'#' * filled}{'.' * (width - filled)}] " f"{done / 2**20:.0f}/{total / 2**20:.0f} MiB"
        )
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return draw


class Array:
    """An array on the devices. Reading its values (np.asarray, float, repr)
    is a device->host transfer and obeys the transfer guard; fetch() is the
    explicit one."""

    __array_priority__ = 1000
    _henc = None  # the handle's varint encoding, once a request built as bytes has needed it
    # After a call of a jit that takes it: None, or (jit, leaf, path, output)
    # when it was not donated but could have been (an output of its type);
    # dropped before any other use, it is reported (Session.drop).
    _could_donate = None

    def __init__(self, session, handle, shape, dtype, placement):
        self._session = session
        self.handle = handle
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._placement = placement  # session_pb2.Placement: where it was put or computed
        self._deleted = None  # None, or why: "deleted" / "donated to execution N"
        self.reshard_receipt = None  # set on a copy device_put made from another Array

    @classmethod
    def made(cls, session, handle, encoded_handle, shape, dtype, placement):
        """__init__ for a call's output on the jit's fast path: `shape` a
        tuple and `dtype` an np.dtype already, the handle's varint given."""
        a = cls.__new__(cls)
        a._session, a.handle, a._henc, a.shape, a.dtype, a._placement = (
            session,
            handle,
            encoded_handle,
            shape,
            dtype,
            placement,
        )
        a._deleted = a.reshard_receipt = None
        return a

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: math.prod(self.shape))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)

    @property
    def sharding(self):
        """Where the array lives: NamedSharding, SingleDeviceSharding or ReplicatedSharding."""
        kind = self._placement.WhichOneof("kind")
        if kind == "sharded":
            return NamedSharding.from_placement(self._placement)
        if kind == "replicated":
            return ReplicatedSharding()
        return SingleDeviceSharding(self._placement.device)

    def devices(self):
        """The global ids of the devices holding a copy (asks the coordinator)."""
        return tuple(self._info().devices)

    def _info(self):
        return self._session.info(self.handle)

    def is_deleted(self):
        if self._deleted is not None:
            return True
        state = self._info().state
        return state in (session_pb2.DELETED, session_pb2.DONATED)

    def block_until_ready(self):
        self._session.await_([self.handle])
        return self

    def fetch(self):
        """Explicit device->host transfer: the values as a numpy array."""
        self._could_donate = None
        return self._session.fetch(
            self.handle, implicit=False, guard=_context.guard(), progress=progress_bar(f"fetch {self.handle:#x}")
        )

    def _implicit_fetch(self):
        self._could_donate = None
        return self._session.fetch(self.handle, implicit=True, guard=_context.guard())

    def __array__(self, dtype=None, copy=None):
        a = self._implicit_fetch()
        return a.astype(dtype) if dtype is not None else a

    def _scalar(self, what):
        if self.size != 1:
            raise TypeError(f"{what} of an array of shape {self.shape}: only one-element arrays convert")
        return self._implicit_fetch().reshape(())[()]

    def __float__(self):
        return float(self._scalar("float()"))

    def __int__(self):
        return int(self._scalar("int()"))

    def __index__(self):
        if self.dtype.kind not in "iu":
            raise TypeError(f"__index__ of a {self.dtype.name} array: only integer arrays are indices")
        return int(self._scalar("__index__()"))

    def __bool__(self):
        return bool(self._scalar("bool()"))

    def __repr__(self):
        return f"tessel.Array({np.array2string(self._implicit_fetch(), separator=', ')}, dtype={self.dtype.name})"

    def __str__(self):
        return str(self._implicit_fetch())

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def delete(self):
        if self._deleted is None:
            self._deleted = "deleted"
            self._session.delete([self.handle])

    def _mark_donated(self):
        self._deleted = "donated"

    def _drop(self, again=False):
        if self._deleted is None and not self._session.closed:
            self._session.drop(self.handle, self.nbytes, self._could_donate, again=again)

    def __del__(self):
        try:
            self._drop()
        except KeyboardInterrupt:
            # A SIGINT whose handler ran inside this finalizer: Python prints
            # an exception raised here and forgets it, and the loop the
            # signal was meant to stop would go on. Finish the drop, then
            # deliver the signal again from another thread, so that it lands
            # once this finalizer has returned (raised here in the call's
            # own frame, it would be forgotten again). A bare thread: it
            # takes none of threading's locks.
            try:
                self._drop(again=True)
                _thread.start_new_thread(_thread.interrupt_main, ())
            except Exception:
                pass
        except Exception:
            pass


def install(tnp, device_put):
    """Array's operators (tessel.numpy's) and the Array API's device members
    (tessel.device_put): both from layers above this one."""
    install_operators(Array, tnp)
    # The Array API's device members: the sharding (a device's, for an
    # array on one), and a copy placed elsewhere (tessel.device_put).
    Array.device = property(lambda a: a.sharding)

    def to_device(a, device, /, *, stream=None):
        if stream is not None:
            raise ValueError(f"to_device: stream={stream!r}: Tessel has no user-visible streams; pass None")
        return device_put(a, device)

    Array.to_device = to_device
