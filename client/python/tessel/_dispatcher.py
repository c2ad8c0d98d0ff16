"""The Dispatch stream: Execute calls pipelined as serialized bytes, their
handles drawn in batches and encoded once; and the session's keep-alive."""

import threading

import grpc
import numpy as np

from tessel import errors
from tessel.v1 import session_pb2


def varint(v):
    """Protobuf's base-128 encoding of a non-negative int."""
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


# ExecuteRequest.release (field 11), length-delimited: packed varints.
_RELEASE_TAG = bytes(((11 << 3) | 2,))


def handle_batch(rng, n=4096):
    """n fresh handles and their varint encodings, as an iterator of
    (handle, bytes). A handle is 62 random bits with bit 62 set: nonzero,
    and always 9 bytes on the wire, so a whole batch encodes at once."""
    v = np.frombuffer(rng.randbytes(8 * n), np.uint64) & np.uint64((1 << 62) - 1) | np.uint64(1 << 62)
    enc = np.empty((n, 9), np.uint8)
    for i in range(8):
        enc[:, i] = (v >> np.uint64(7 * i)) & np.uint64(0x7F) | np.uint64(0x80)
    enc[:, 8] = v >> np.uint64(56)
    flat = enc.tobytes()
    return zip(v.tolist(), [flat[i : i + 9] for i in range(0, 9 * n, 9)])


class Dispatcher:
    """The Dispatch stream: ExecuteRequests queue as serialized bytes, each
    framed as a DispatchBatch entry, and the stream's request iterator hands
    gRPC everything queued as one batch. Replies are read in order; only the
    ones a caller asked for are kept."""

    def __init__(self, channel):
        self._cv = threading.Condition(threading.Lock())
        self._queue = []
        self._sender_waiting = False  # the request iterator sleeps: a call queued must wake it
        self._sent = 0
        self._acked = 0
        self._wanted = {}
        self._closing = False
        self._error = None
        self._done = False
        # The batch goes out as the bytes queued: no message is built per call.
        dispatch = channel.stream_stream(
            "/tessel.v1.Session/Dispatch",
            request_serializer=None,
            response_deserializer=session_pb2.DispatchReplies.FromString,
        )
        self._call = dispatch(self._requests())
        self._reader = threading.Thread(target=self._read, name="tessel-dispatch", daemon=True)
        self._reader.start()

    def _requests(self):
        while True:
            with self._cv:
                self._sender_waiting = True
                self._cv.wait_for(lambda: self._queue or self._closing or self._done)
                self._sender_waiting = False
                if not self._queue:
                    return
                batch = b"".join(self._queue)
                self._queue = []
            yield batch

    def _read(self):
        try:
            for replies in self._call:
                rs = replies.replies
                with self._cv:
                    base = self._acked
                    self._acked = end = base + len(rs)
                    for seq in [s for s in self._wanted if base <= s < end]:
                        self._wanted[seq] = rs[seq - base]
                    self._cv.notify_all()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED or not self._closing:
                self._error = errors.from_rpc_error(e)
        finally:
            with self._cv:
                self._done = True
                if self._error is None and not self._closing:
                    self._error = errors.WorkerLostError("the execute stream to the coordinator closed", "UNAVAILABLE")
                self._cv.notify_all()

    def send(self, request, want_reply, forget=None, release=()):
        """Queues one call (an ExecuteRequest, or its serialized bytes) and
        returns its sequence number; `forget`: an earlier call's number
        whose reply is no longer wanted; `release`: handles the session
        dropped, deleted before the call (ExecuteRequest.release)."""
        if not isinstance(request, bytes):
            request = request.SerializeToString()
        if release:
            # Serialized messages merge when concatenated: the packed field
            # appended extends the call's `release`.
            packed = b"".join(map(varint, release))
            request += _RELEASE_TAG + varint(len(packed)) + packed
        framed = b"\x0a" + (bytes((len(request),)) if len(request) < 0x80 else varint(len(request))) + request
        with self._cv:
            if self._error is not None:
                raise self._error
            if forget is not None:
                self._wanted.pop(forget, None)  # in flight or answered: its reply is dropped
            seq = self._sent
            self._sent += 1
            if want_reply:
                self._wanted[seq] = None
            self._queue.append(framed)
            if self._sender_waiting:
                self._cv.notify_all()
            return seq

    def reply(self, seq):
        with self._cv:
            self._cv.wait_for(lambda: self._acked > seq or self._done)
            if self._acked <= seq:
                raise self._error
            return self._wanted.pop(seq)

    def forget(self, seq):
        with self._cv:
            self._wanted.pop(seq, None)

    def flush(self):
        with self._cv:
            self._cv.wait_for(lambda: self._acked == self._sent or self._done)
            if self._acked != self._sent:
                raise self._error

    def close(self):
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._reader.join(timeout=10)


def keep_alive(stub, session_id, every, stop):
    every = max(every, 0.02)
    while not stop.wait(every):
        try:
            stub.KeepAlive(session_pb2.KeepAliveRequest(session_id=session_id), timeout=max(every, 1.0))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return  # the session ended; its calls say why
        except ValueError:
            return  # the channel was closed
