"""The connection to a coordinator: one tessel.v1 session over gRPC.

Execute calls are pipelined: they queue, and the stream's request iterator
hands gRPC everything queued as one batch. Unary calls that name arrays first
wait until every queued call has been answered (flush), so they never
overtake the call that makes their arrays.
"""

import collections
import ctypes
import os
import queue
import random
import threading
import time

import grpc
import numpy as np

from tessel import _dtypes, _profile, errors
from tessel._channel import make_channel
from tessel._dispatcher import Dispatcher, handle_batch, keep_alive
from tessel.v1 import admin_pb2, admin_pb2_grpc, common_pb2, session_pb2, session_pb2_grpc, worker_pb2, worker_pb2_grpc

PROTOCOL_VERSION = 1
CHUNK = 1 << 20
_LEVELS = {
    None: session_pb2.TRANSFER_UNSET,
    "allow": session_pb2.TRANSFER_ALLOW,
    "log": session_pb2.TRANSFER_LOG,
    "disallow": session_pb2.TRANSFER_DISALLOW,
    "log_explicit": session_pb2.TRANSFER_LOG_EXPLICIT,
    "disallow_explicit": session_pb2.TRANSFER_DISALLOW_EXPLICIT,
}


def guard_proto(guard):
    """{'host_to_device': 'disallow', ...} -> TransferGuard."""
    g = session_pb2.TransferGuard()
    for direction, level in (guard or {}).items():
        if level not in _LEVELS:
            raise ValueError(f"transfer guard level {level!r}: expected one of {', '.join(k for k in _LEVELS if k)}")
        setattr(g, direction, _LEVELS[level])
    return g


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_tuned = []


def tune_allocator():
    """Raises glibc's mmap and trim thresholds for this whole process, as every
    Tessel binary does at start-up (core/process_tuning.h): glibc maps and
    unmaps each block of 128 KiB or more, so every 1 MiB message of a Put or
    Fetch stream is a fresh mapping, and streaming runs 2-4x slower. It changes
    the allocator of the user's process, so it is opt-in: call it, or set
    TESSEL_TUNE_MALLOC=1 before the first session. Once per process; a no-op
    off glibc."""
    if _tuned:
        return
    _tuned.append(True)
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 64 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)
        libc.mallopt(_M_TOP_PAD, 16 << 20)
    except (OSError, AttributeError):
        pass


def _rpc(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except grpc.RpcError as e:
        raise errors.from_rpc_error(e) from None


def _drain(call):
    for _ in call:
        pass


def _box(b):
    """The index of a DirectBlock's or DirectWrite's box in its array."""
    return tuple(slice(s, s + n) for s, n in zip(b.start, b.shape))


def _check_box(where, start, shape, nbytes, array):
    if (
        len(start) != array.ndim
        or len(shape) != array.ndim
        or any(s < 0 or n < 0 or s + n > d for s, n, d in zip(start, shape, array.shape))
        or int(np.prod(shape, dtype=np.int64)) * array.itemsize != nbytes
    ):
        raise errors.TesselError(
            f"{where}: box {list(start)}+{list(shape)} ({nbytes} bytes) does not fit "
            f"{array.dtype}{list(array.shape)}",
            "INTERNAL",
        )


class _WorkerStub(worker_pb2_grpc.WorkerStub):
    """tessel.v1.Worker, and FetchShard with its replies left serialized."""

    def __init__(self, channel):
        super().__init__(channel)
        self.fetch_shard_raw = channel.unary_stream(
            "/tessel.v1.Worker/FetchShard",
            request_serializer=worker_pb2.FetchShardRequest.SerializeToString,
            response_deserializer=None,
        )


def _fetched_data(raw):
    """The `data` of a serialized FetchShardResponse, without copying it:
    field 1, length-delimited (tag 0x0a, the length as a varint), alone."""
    if not raw:
        return b""
    if raw[0] == 0x0A:
        n, shift, i = 0, 0, 1
        while i < len(raw) and i < 11:
            b = raw[i]
            n |= (b & 0x7F) << shift
            i += 1
            if b < 0x80:
                if i + n == len(raw):
                    return memoryview(raw)[i:]
                break
            shift += 7
    return worker_pb2.FetchShardResponse.FromString(raw).data  # fields this client does not know


def _run_all(fn, items):
    """fn(item) for every item at once, the first on this thread; raises the
    first TesselError, else returns what each returned, in order."""
    failures = [None] * len(items)
    results = [None] * len(items)

    def run(i):
        try:
            results[i] = fn(items[i])
        except errors.TesselError as e:
            failures[i] = e

    threads = [threading.Thread(target=run, args=(i,), name="tessel-transfer") for i in range(1, len(items))]
    for t in threads:
        t.start()
    if items:
        run(0)
    for t in threads:
        t.join()
    for e in failures:
        if e is not None:
            raise e
    return results


class _Progress:
    """Bytes moved by several streams, reported to a progress callback."""

    def __init__(self, callback, total):
        self._callback, self._total, self._done = callback, total, 0
        self._lock = threading.Lock()

    def add(self, n):
        if self._callback:
            with self._lock:
                self._done += n
                self._callback(self._done, self._total)


TransferReceipt = collections.namedtuple("TransferReceipt", "direct blocks relayed_because")
TransferReceipt.__doc__ = """How a put or fetch moved the array's bytes: `direct`, straight between
this client and the workers, over `blocks` streams at once; otherwise
`relayed_because` says why a direct transfer that was granted failed (empty
when none was granted)."""

# A worker that could not be reached is not tried again for this long,
# doubling while it stays so, up to 10 minutes; one not connected within
# _WORKER_CONNECT_S is taken as unreachable.
_WORKER_RETRY_S, _WORKER_RETRY_MAX_S, _WORKER_CONNECT_S = 30.0, 600.0, 2.0


class Session:
    def __init__(
        self,
        address,
        client="tessel-python",
        timeout=10.0,
        *,
        token=None,
        tls_ca=None,
        tls_cert=None,
        tls_key=None,
        tls_server_name=None,
        direct_transfers=True,
        direct_min_bytes=1 << 20,
    ):
        if os.environ.get("TESSEL_TUNE_MALLOC") == "1":
            tune_allocator()
        self.address = address
        opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        self._channel = make_channel(
            address,
            token=token,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_server_name=tls_server_name,
            options=opts,
        )
        self._stub = session_pb2_grpc.SessionStub(self._channel)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)
        # Put and fetch move blocks straight to and from the workers when the
        # coordinator grants it (the workers are checked against their own
        # names).
        self.direct_transfers = direct_transfers
        self.direct_min_bytes = direct_min_bytes  # smaller arrays: one round trip through the coordinator
        self._worker_channel = lambda a: make_channel(
            a, token="", tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, options=opts
        )
        self._workers = {}  # address -> (channel, stub)
        self._unreachable = {}  # address -> (retry after, why, seconds waited)
        self._reached = set()  # addresses that answered
        self.last_transfer = None  # a TransferReceipt
        # Fail fast: a refused port answers at once (no retrying until the
        # timeout); the timeout bounds an address that does not answer at all.
        try:
            v = self._stub.GetVersion(
                common_pb2.GetVersionRequest(min_version=PROTOCOL_VERSION, max_version=PROTOCOL_VERSION),
                timeout=timeout,
                wait_for_ready=False,
            )
        except grpc.RpcError as e:
            self._channel.close()
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                why = (
                    "no answer within %g s" % timeout if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.details()
                )
                raise errors.WorkerLostError(f"no coordinator at {address}: {why}", e.code().name) from None
            raise errors.from_rpc_error(e) from None
        self.protocol_version = v.version
        self.options = session_pb2.SessionOptions()
        opened = _rpc(self._stub.OpenSession, session_pb2.OpenSessionRequest(client=client))
        self.id = opened.session_id
        # The coordinator ends a session whose client goes quiet for its
        # lease; a background thread renews it every third of that.
        self._stop_keepalive = threading.Event()
        if opened.lease_ms > 0:
            threading.Thread(
                target=keep_alive,
                args=(self._stub, self.id, opened.lease_ms / 3000, self._stop_keepalive),
                name="tessel-keepalive",
                daemon=True,
            ).start()
        self._rng = random.Random()
        self._handles = iter(())
        self._lock = threading.Lock()
        self._dispatcher = None
        # Arrays dropped by finalizers: (handle, bytes, could_donate) appended to a deque,
        # which takes no lock a thread could already hold (the cyclic
        # collector runs finalizers at any allocation, inside SDK calls too).
        # collect() moves them to _garbage, under _collect_lock, and deletes
        # them in batches.
        self._dropped = collections.deque()
        self._forgotten = collections.deque()  # (could_donate, bytes) of dropped arrays, to report
        self._collect_lock = threading.Lock()
        self._garbage = []  # handles taken from _dropped, not yet deleted
        self._garbage_bytes = 0  # what those handles hold on the devices
        self.closed = False

    def new_handle(self):
        return self.take_handle()[0]

    def take_handle(self):
        """A fresh handle and its varint encoding (for requests built as bytes)."""
        try:
            return next(self._handles)
        except StopIteration:
            with self._lock:
                self._handles = handle_batch(self._rng)
            return next(self._handles)

    def dispatcher(self):
        d = self._dispatcher
        if d is not None:
            return d
        with self._lock:
            if self._dispatcher is None:
                self._dispatcher = Dispatcher(self._channel)
            return self._dispatcher

    def flush(self):
        d = self._dispatcher
        if d is not None:
            d.flush()

    def close(self):
        if self.closed:
            return
        self.closed = True
        self._stop_keepalive.set()
        try:
            if self._dispatcher is not None:
                self._dispatcher.close()
            self._stub.CloseSession(session_pb2.CloseSessionRequest(session_id=self.id), timeout=5)
        except Exception:  # the coordinator may already be gone
            pass
        self._channel.close()
        for channel, _ in self._workers.values():
            channel.close()

    # ------------------------------------------------------------ options

    def set_options(self, options):
        _rpc(self._stub.SetSessionOptions, session_pb2.SetSessionOptionsRequest(session_id=self.id, options=options))
        self.options = options

    # ------------------------------------------------------------ calls

    def compile(self, graph, donated=(), strict=False, mesh=None, in_shardings=(), out_shardings=()):
        req = session_pb2.CompileRequest(session_id=self.id, graph=graph, strict_donation=strict)
        req.donated_parameters.extend(donated)
        if mesh is not None:
            req.mesh.CopyFrom(mesh)
            req.parameter_shardings.extend(in_shardings)
            req.output_shardings.extend(out_shardings)
        t0 = _profile.begin()
        resp = _rpc(self._stub.Compile, req)
        _profile.end(
            t0,
            f"compile '{graph.name}'",
            "compile",
            "compile",
            executable=resp.executable_id,
            cache="hit" if resp.cache_hit else "miss",
        )
        return resp

    def plan_dot(self, executable_id):
        """A compiled executable's per-device program as DOT text."""
        req = session_pb2.PlanDotRequest(session_id=self.id, executable_id=executable_id)
        return _rpc(self._stub.PlanDot, req).dot

    def _collect_before_alloc(self):
        """Before a call that makes arrays: a full batch of dropped arrays
        goes first. Arrays Python dropped count against a quota until
        deleted: with a quota set, they all go before anything judged
        against it."""
        if self._dropped or self._garbage:
            self.collect(force=bool(self.options.memory_quota_bytes))

    def put(self, array, placement, implicit=False, guard=None, progress=None, direct=None):
        """Puts `array` on `placement`: its blocks written straight to the
        workers when the coordinator grants it (`direct`: default, as the
        session says), else through the coordinator; `last_transfer` says
        which. Returns the handle."""
        self._collect_before_alloc()
        array = np.require(array, requirements="C")  # keeps 0-d arrays 0-d
        header = session_pb2.PutRequest.Header(
            session_id=self.id,
            handle=self.new_handle(),
            type=_dtypes.tensor_type(array.shape, array.dtype),
            placement=placement,
            implicit=implicit,
            transfer_guard=guard_proto(guard),
        )
        self.last_transfer = TransferReceipt(False, 0, "")
        if (self.direct_transfers and array.nbytes >= self.direct_min_bytes) if direct is None else direct:
            if self._put_direct(header, array, progress):
                return header.handle
            # Through the coordinator, under a handle no worker has seen.
            header.handle = self.new_handle()
        data = memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")

        def messages():
            yield session_pb2.PutRequest(header=header)
            for off in range(0, len(data), CHUNK):
                yield session_pb2.PutRequest(data=bytes(data[off : off + CHUNK]))
                if progress:
                    progress(min(off + CHUNK, len(data)), len(data))

        _rpc(self._stub.Put, messages())
        return header.handle

    def _put_direct(self, header, array, progress):
        """PutDirect: True once put; False when the put is to go through the
        coordinator (it relays everything, or a write failed: then the
        coordinator has freed the array and `last_transfer` says why)."""
        done = queue.Queue()

        def requests():
            yield session_pb2.PutDirectRequest(header=header)
            msg = done.get()
            if msg is not None:
                yield msg

        call = self._stub.PutDirect(requests())
        try:
            plan = next(call)
        except grpc.RpcError as e:
            done.put(None)
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a coordinator without PutDirect
                return False
            raise errors.from_rpc_error(e) from None
        except StopIteration:
            done.put(None)
            raise errors.TesselError("put: the coordinator closed PutDirect without an answer", "UNAVAILABLE")
        if plan.relay:
            done.put(None)
            _drain(call)
            return False
        failed = "the client stopped writing"
        receipts = []
        try:
            receipts = self._write_direct(array, list(plan.blocks), progress)
            failed = ""
        except errors.TesselError as e:
            failed = str(e)
        finally:  # whatever happened, the coordinator hears of it (and frees the array unless put)
            done.put(
                session_pb2.PutDirectRequest(done=session_pb2.PutDirectRequest.Done(error=failed, receipts=receipts))
            )
        try:
            _drain(call)
        except grpc.RpcError as e:
            if not failed:
                raise errors.from_rpc_error(e) from None
        if failed:
            self.last_transfer = TransferReceipt(False, 0, failed)
            return False
        self.last_transfer = TransferReceipt(True, len(plan.blocks), "")
        return True

    def execute(self, request, want_reply, forget=None):
        """Queues an Execute. A rejected call's error lands on its output
        handles (so it surfaces when they are awaited or fetched); with
        `want_reply` the reply (donation receipts) is also kept for reply().
        `request`: an ExecuteRequest, or one serialized that names this
        session and does not wait."""
        t0 = _profile.begin()
        release = self._take_dropped() if self._dropped or self._garbage or self._forgotten else ()
        if not isinstance(request, bytes):
            request.session_id = self.id
            request.wait = False
        seq = self.dispatcher().send(request, want_reply, forget, release)
        _profile.end(t0, "dispatch", "dispatch", "dispatch")
        return seq

    def reply(self, seq):
        r = self.dispatcher().reply(seq)
        if r.code:
            raise errors.from_status_int(r.code, r.error)
        return r.response

    def await_(self, handles, raise_errors=True):
        d = self._dispatcher
        if d is None:  # nothing queued: a plain Await
            resp = _rpc(self._stub.Await, session_pb2.AwaitRequest(session_id=self.id, handles=handles))
        else:
            # On the stream, after the calls queued before it: one round
            # trip, where a flush and an Await would take two.
            req = session_pb2.ExecuteRequest(session_id=self.id, outputs=handles, await_outputs=True, wait=True)
            r = d.reply(d.send(req, want_reply=True))
            if r.code:
                raise errors.from_status_int(r.code, r.error)
            resp = r.outputs
        for h, err, code in zip(handles, resp.errors, resp.codes):
            if err and raise_errors:
                raise errors.from_status_int(code, f"array {h:#x}: {err}")
        return resp

    def fetch(self, handle, implicit=False, guard=None, progress=None, direct=None):
        """The array's bytes as a numpy array: read straight from the workers
        holding its blocks when the coordinator grants it (`direct`: default,
        as the session says), else through the coordinator. `last_transfer`
        (a TransferReceipt) says which."""
        self.flush()
        req = session_pb2.FetchRequest(
            session_id=self.id,
            handle=handle,
            implicit=implicit,
            transfer_guard=guard_proto(guard),
            direct=self.direct_transfers if direct is None else direct,
            direct_min_bytes=self.direct_min_bytes if direct is None else 0,
        )
        out, plan = self._fetch_once(req, progress)
        if not plan:
            self.last_transfer = TransferReceipt(False, 0, "")
            return out
        try:
            self._read_direct(out, plan, progress)
            self.last_transfer = TransferReceipt(True, len(plan), "")
            return out
        except errors.TesselError as e:
            why = str(e)
        # A worker this client cannot reach (or a read that failed): the
        # coordinator relays the bytes, and the receipt says why.
        req.direct = False
        out, _ = self._fetch_once(req, progress)
        self.last_transfer = TransferReceipt(False, 0, why)
        return out

    def _fetch_once(self, req, progress):
        """One Fetch call: (the array, []) with its bytes through the
        coordinator, or (an empty array of its type, the DirectBlocks to read)."""
        out, offset, total, plan = None, 0, 0, []
        try:
            for msg in self._stub.Fetch(req):
                if out is None:
                    dtype = _dtypes.from_proto(msg.type.dtype)
                    out = np.empty(tuple(msg.type.dims), dtype)
                    flat = out.reshape(-1).view(np.uint8)
                    total = flat.size
                    plan = list(msg.direct_blocks)
                data = msg.data  # each read of the field is a fresh copy: read it once
                n = len(data)
                if offset + n > total:
                    raise errors.TesselError(
                        f"fetch of array {req.handle:#x}: more bytes than its type holds", "DATA_LOSS"
                    )
                flat[offset : offset + n] = np.frombuffer(data, np.uint8)
                offset += n
                if progress:
                    progress(offset, total)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None
        if out is None or (not plan and offset != total):
            raise errors.TesselError(
                f"fetch of array {req.handle:#x}: expected {total} bytes, got {offset}", "DATA_LOSS"
            )
        return out, plan

    def _worker_call(self, address, where, call):
        """call(the worker's stub), its gRPC errors as TesselErrors naming
        `where`; a worker that cannot be reached is not tried again for a
        while."""
        with self._lock:
            retry = self._unreachable.get(address)
            if retry is not None and time.monotonic() < retry[0]:
                raise errors.TesselError(f"{retry[1]} (not retried for {retry[2]:g} s)", "UNAVAILABLE")
            if address not in self._workers:
                channel = self._worker_channel(address)
                self._workers[address] = (channel, _WorkerStub(channel))
            channel, stub = self._workers[address]

        def unreachable(why):
            with self._lock:
                last = self._unreachable.get(address)
                wait = min(_WORKER_RETRY_MAX_S, last[2] * 2) if last else _WORKER_RETRY_S
                self._unreachable[address] = (time.monotonic() + wait, why, wait)
            raise errors.TesselError(why, "UNAVAILABLE")

        try:
            if address not in self._reached:
                # A refused port answers at once; the timeout bounds one that
                # does not answer at all.
                stub.GetVersion(
                    common_pb2.GetVersionRequest(min_version=PROTOCOL_VERSION, max_version=PROTOCOL_VERSION),
                    timeout=_WORKER_CONNECT_S,
                    wait_for_ready=False,
                )
                with self._lock:
                    self._reached.add(address)
                    self._unreachable.pop(address, None)
            return call(stub)
        except grpc.RpcError as e:
            why = f"{where}: {e.code().name}: {e.details()}"
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                with self._lock:
                    self._reached.discard(address)
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # only the probe has a deadline
                    why = f"{where}: UNAVAILABLE: no answer within {_WORKER_CONNECT_S:g} s"
                unreachable(why)
            raise errors.TesselError(why, e.code().name) from None

    def _read_direct(self, out, plan, progress):
        """Reads every block of `plan` into `out`, one stream per block, all at
        once; raises the first block's error."""
        flat = out.reshape(-1).view(np.uint8)
        count = _Progress(progress, flat.size)

        def read(b):
            where = f"block of device {b.global_device} at worker {b.address}"
            _check_box(where, b.start, b.shape, b.bytes, out)
            whole = tuple(b.shape) == out.shape
            dst = flat if whole else np.empty(b.bytes, np.uint8)
            req = worker_pb2.FetchShardRequest(device=b.device, buffer=b.buffer, ticket=b.ticket, chunk_bytes=CHUNK)

            def stream(stub):
                off = 0
                for raw in stub.fetch_shard_raw(req, wait_for_ready=False):
                    data = _fetched_data(raw)
                    n = len(data)
                    if off + n > b.bytes:
                        raise errors.TesselError(f"{where}: more than the {b.bytes} bytes expected", "DATA_LOSS")
                    dst[off : off + n] = np.frombuffer(data, np.uint8)
                    off += n
                    count.add(n)
                return off

            got = self._worker_call(b.address, where, stream)
            if got != b.bytes:
                raise errors.TesselError(f"{where}: expected {b.bytes} bytes, got {got}", "DATA_LOSS")
            if not whole:
                out[_box(b)] = dst.view(out.dtype).reshape(tuple(b.shape))

        _run_all(read, plan)

    def _write_direct(self, array, plan, progress):
        """Writes every (block, worker) of `plan` from `array`, one stream each,
        all at once; raises the first write's error. Returns each worker's
        receipt for its block, in order, for the coordinator."""
        count = _Progress(progress, sum(int(np.prod(w.shape, dtype=np.int64)) for w in plan) * array.itemsize)

        def write(w):
            where = f"block for devices {','.join(map(str, w.global_devices))} at worker {w.address}"
            nbytes = int(np.prod(w.shape, dtype=np.int64)) * array.itemsize
            _check_box(where, w.start, w.shape, nbytes, array)
            block = array if tuple(w.shape) == array.shape else np.ascontiguousarray(array[_box(w)])
            data = memoryview(block.reshape(-1).view(np.uint8)) if block.size else memoryview(b"")
            header = worker_pb2.PutShardRequest.Header(buffer=w.buffer, type=w.type, devices=w.devices, ticket=w.ticket)

            def messages():
                yield worker_pb2.PutShardRequest(header=header)
                for off in range(0, len(data), CHUNK):
                    yield worker_pb2.PutShardRequest(data=bytes(data[off : off + CHUNK]))
                    count.add(min(CHUNK, len(data) - off))

            return self._worker_call(
                w.address, where, lambda stub: stub.PutShard(messages(), wait_for_ready=False)
            ).receipt

        return _run_all(write, plan)

    def reshard(self, handle, placement, guard=None):
        """A copy of array `handle` on `placement`, moved worker to worker:
        (its handle, the ReshardResponse)."""
        self._collect_before_alloc()
        self.flush()
        out = self.new_handle()
        resp = _rpc(
            self._stub.Reshard,
            session_pb2.ReshardRequest(
                session_id=self.id, handle=handle, output=out, placement=placement, transfer_guard=guard_proto(guard)
            ),
        )
        return out, resp

    def delete(self, handles):
        if not handles:
            return
        self.flush()
        _rpc(self._stub.Delete, session_pb2.DeleteRequest(session_id=self.id, handles=handles))

    def drop(self, handle, nbytes=0, could_donate=None, again=False):
        """From a finalizer: delete later, in a batch. Takes no lock and
        never blocks (deque.append is atomic): a finalizer may run on a
        thread that holds any of the SDK's locks. `could_donate`: the call
        it was last passed to could have taken it donated (reported by the
        next collect, on the caller's thread). `again`: a drop interrupted
        by a signal, which may or may not have been queued already."""
        dropped = self._dropped
        if again and dropped and dropped[-1][0] == handle:
            return
        dropped.append((handle, nbytes, could_donate))  # one append: a signal lands before it or after

    # A batch goes at 256 handles or 64 MiB, whichever comes first: the bytes
    # bound keeps a loop of large outputs inside the devices' block cache
    # rather than mapping fresh pages for hundreds of dead arrays.
    _GARBAGE_HANDLES = 256
    _GARBAGE_BYTES = 64 << 20

    def _drain_dropped(self):
        """Moves every dropped handle to the garbage batch and every
        forgotten donation to its report. Under `_collect_lock`."""
        dropped = self._dropped
        while dropped:
            handle, nbytes, could_donate = dropped.popleft()
            self._garbage.append(handle)
            self._garbage_bytes += nbytes
            if could_donate is not None:
                self._forgotten.append((could_donate, nbytes))

    def _report_forgotten(self):
        while self._forgotten:
            (jit, leaf, path, output), nbytes = self._forgotten.popleft()
            jit.forgotten_donation(leaf, path, output, nbytes, self.options.strict_donation)

    def _take_dropped(self):
        """Every handle dropped and not yet deleted, for the next call's
        `release`: the coordinator deletes them before planning it, so a
        loop's dead outputs go back to the device's cache at once, with
        neither a round trip nor a drained pipeline. A forgotten donation
        is reported first; when that raises, the handles wait in the batch."""
        with self._collect_lock:
            self._drain_dropped()
        self._report_forgotten()
        with self._collect_lock:
            handles, self._garbage, self._garbage_bytes = self._garbage, [], 0
        return handles

    def collect(self, force=False):
        with self._collect_lock:
            self._drain_dropped()
        self._report_forgotten()
        with self._collect_lock:
            if not self._garbage or (
                len(self._garbage) < self._GARBAGE_HANDLES and self._garbage_bytes < self._GARBAGE_BYTES and not force
            ):
                return
            handles, self._garbage, self._garbage_bytes = self._garbage, [], 0
        try:
            self.delete(handles)
        except errors.NotFoundError:
            # Delete is all or nothing: one handle the coordinator no longer
            # knows must not keep the rest alive.
            for h in handles:
                try:
                    self.delete([h])
                except errors.NotFoundError:
                    pass

    def info(self, handle):
        self.flush()
        return _rpc(self._stub.ArrayInfo, session_pb2.ArrayInfoRequest(session_id=self.id, handle=handle))

    def list_devices(self):
        """The live devices and this session's tenant's arrays on each."""
        return _rpc(self._stub.ListDevices, session_pb2.ListDevicesRequest(session_id=self.id))

    def list_sessions(self):
        """Admin.ListSessions (an admin token's call)."""
        return _rpc(self._admin.ListSessions, admin_pb2.ListSessionsRequest())

    def reconcile(self):
        """Admin.Reconcile: every buffer the workers hold, checked against the
        coordinator's arrays (an admin token's call). This session's queued
        calls reach the coordinator first: a call still in the stream would
        otherwise retire a donated array the reconciliation then finds on its
        worker, its step not yet sent."""
        self.flush()
        return _rpc(self._admin.Reconcile, admin_pb2.ReconcileRequest())

    def cluster(self, with_memory=False):
        return _rpc(self._admin.GetCluster, admin_pb2.GetClusterRequest(with_memory=with_memory))

    def stats(self, with_arrays=False):
        self.collect(force=True)  # what the program holds, not what Python has yet to hand back
        self.flush()
        return _rpc(self._stub.Stats, session_pb2.StatsRequest(session_id=self.id, with_arrays=with_arrays))
