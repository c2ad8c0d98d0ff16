"""tessel.checkpoints: save and restore pytrees of arrays, shaped like Orbax.

The workers that hold the arrays write them: each array is a zarr v3 array
(one chunk file per distinct block, each with a CRC32C) under the
checkpoint's directory, beside a manifest, tessel.json, that records the
pytree, the step and where each array lay. No array byte passes through
this process or the coordinator. The directory is one every worker sees
at the same path (a shared volume; on a local cluster, any local path).

    tessel.checkpoints.save("/ckpt/100", state, step=100)     # returns once snapshotted
    state = tessel.checkpoints.restore("/ckpt/100", target=state)

A save returns once every device has snapshotted its blocks, in step
order: the next step may donate the state at once. The bytes are written in
the background; the checkpoint appears under its path only when all of
them are (written under a temporary name, a commit marker last, then
renamed). `restore` puts each array where the target says, on any mesh:
each device reads the chunks its block overlaps and checks their CRC32C.

CheckpointManager keeps a directory of steps, as Orbax's does.
"""

import json
import os
import re
import sys
import threading

import numpy as np
from google.protobuf import json_format

from tessel import _context, _tree
from tessel._array import Array
from tessel import _dtypes
from tessel._session import _rpc
from tessel._api import device_put
from tessel._sharding import Mesh, NamedSharding, P, to_placement
from tessel.v1 import session_pb2

__all__ = ["CheckpointManager", "PendingSave", "restore", "save", "read_manifest"]


# ---------------------------------------------------------------- pytrees

_KEY = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+)\]|\.([A-Za-z_]\w*)")


def _jax():
    return sys.modules.get("jax")


def _components(path):
    """A tessel path ("['a'][0].b") as its keys: ['a', 0, 'b']."""
    out = []
    for m in _KEY.finditer(path):
        k, attr = m.groups()
        if attr is not None:
            out.append(attr)
        elif k[0] in "'\"":
            out.append(k[1:-1])
        else:
            out.append(int(k))
    return out


def _jax_components(path):
    jax = _jax()
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key if isinstance(k.key, (int, str)) else str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        else:
            out.append(str(getattr(k, "key", k)))
    return out


def _flatten(tree):
    """(leaves, the keys of each, unflatten): JAX's pytrees when JAX is
    loaded (Flax, Optax and Equinox states are those), else Tessel's."""
    jax = _jax()
    if jax is not None:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Array))
        leaves = [x for _, x in pairs]
        keys = [_jax_components(p) for p, _ in pairs]
        return leaves, keys, lambda xs: jax.tree_util.tree_unflatten(treedef, xs)
    leaves, paths, structure = _tree.flatten(tree, is_leaf=lambda x: isinstance(x, Array))
    return leaves, [_components(p) for p in paths], lambda xs: _tree.unflatten(structure, xs)


def _names(keys):
    """A directory name per leaf: its keys joined by '.', other characters
    as '_'; a repeated name gets a suffix."""
    names, seen = [], set()
    for k in keys:
        base = ".".join(re.sub(r"[^A-Za-z0-9_\-]+", "_", str(c)) for c in k) or "value"
        base = base.lstrip("._") or "value"
        name, n = base, 1
        while name in seen:
            n += 1
            name = f"{base}_{n}"
        seen.add(name)
        names.append(name)
    return names


def _nested(keys, values):
    """A tree of dicts (and lists, where the keys are 0..n-1) from each
    leaf's keys: what restore gives without a target."""
    root = {}
    for k, v in zip(keys, values):
        if not k:
            return v
        node = root
        for c in k[:-1]:
            node = node.setdefault(c, {})
        node[k[-1]] = v

    def lists(n):
        if not isinstance(n, dict):
            return n
        n = {c: lists(x) for c, x in n.items()}
        if n and all(isinstance(c, int) for c in n) and sorted(n) == list(range(len(n))):
            return [n[i] for i in range(len(n))]
        return n

    return lists(root)


# ---------------------------------------------------------------- save


def _absolute(path):
    return os.path.abspath(os.fspath(path))


def _orbax_metadata(arrays):
    """Orbax's _METADATA for these leaves (each a numpy array to Orbax), so
    that orbax.checkpoint restores the checkpoint too; None where a leaf's
    directory is not the name Orbax gives it (its keys joined by '.')."""
    tree = {}
    for name, keys, _ in arrays:
        if not keys or name != ".".join(str(k) for k in keys):
            return None
        tree[repr(tuple(str(k) for k in keys))] = {
            "key_metadata": [{"key": str(k), "key_type": 1 if isinstance(k, int) else 2} for k in keys],
            "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False},
        }
    return json.dumps(
        {
            "tree_metadata": tree,
            "use_ocdbt": False,
            "use_zarr3": True,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": None,
        }
    )


class PendingSave:
    """A save snapshotted on the devices, its bytes being written. wait()
    returns the checkpoint's path once it is committed, or raises why not."""

    def __init__(self, session, checkpoint, path, response, then=None):
        self.path = path
        self.bytes = response.bytes
        self.chunks = response.chunks
        self.workers = list(response.workers)
        self.bytes_written = None
        self._error = None
        self._thread = threading.Thread(
            target=self._commit, args=(session, checkpoint, then), name="tessel-checkpoint-commit", daemon=True
        )
        self._thread.start()

    def _commit(self, session, checkpoint, then):
        try:
            r = _rpc(
                session._stub.CommitCheckpoint,
                session_pb2.CommitCheckpointRequest(session_id=session.id, checkpoint=checkpoint),
            )
            self.bytes_written = r.bytes_written
            if then is not None:
                then()
        except Exception as e:  # surfaced by wait()
            self._error = e

    def done(self):
        return not self._thread.is_alive()

    def wait(self, timeout=None):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"checkpoint {self.path}: still being written after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.path


def save(path, tree, step=None, wait=False, metadata=None, session=None, _then=None):
    """Saves `tree` (a pytree of tessel.Arrays; numpy values and scalars are
    put on device 0 first) as the checkpoint `path`, which must not exist.
    Returns once every device has snapshotted its blocks: a PendingSave,
    already committed with wait=True."""
    s = session or _context.session()
    path = _absolute(path)
    leaves, keys, _ = _flatten(tree)
    if not leaves:
        raise ValueError(f"checkpoint {path}: the tree has no arrays")
    names = _names(keys)
    arrays = []
    for name, k, x in zip(names, keys, leaves):
        if not isinstance(x, Array):
            x = device_put(np.asarray(x))
        if x._deleted is not None:
            raise ValueError(f"checkpoint {path}: leaf {name} was {x._deleted}")
        arrays.append((name, k, x))
    s._collect_before_alloc()
    s.flush()
    meta = {
        "step": step,
        "leaves": [{"name": n, "keys": k} for n, k, _ in arrays],
        "user": metadata if metadata is not None else {},
    }
    req = session_pb2.SaveCheckpointRequest(
        session_id=s.id,
        path=path,
        arrays=[session_pb2.CheckpointArray(name=n, handle=x.handle) for n, _, x in arrays],
        metadata=json.dumps(meta),
    )
    orbax = _orbax_metadata(arrays)
    if orbax is not None:
        req.files["_METADATA"] = orbax
    resp = _rpc(s._stub.SaveCheckpoint, req)
    pending = PendingSave(s, resp.checkpoint, path, resp, then=_then)
    if wait:
        pending.wait()
    return pending


# ---------------------------------------------------------------- restore


def read_manifest(path, session=None):
    """The checkpoint's manifest (tessel.json) as a dict: its arrays (dtype,
    shape, chunk shape, placement) and metadata (step, leaves, user)."""
    s = session or _context.session()
    r = _rpc(s._stub.ReadCheckpoint, session_pb2.ReadCheckpointRequest(session_id=s.id, path=_absolute(path)))
    return json.loads(r.manifest)


def _np_dtype(zarr_name):
    if zarr_name == "bfloat16":
        if _dtypes.BFLOAT16 is None:
            raise TypeError("a bfloat16 array needs the ml_dtypes package (pip install ml_dtypes)")
        return np.dtype(_dtypes.BFLOAT16)
    return np.dtype(zarr_name)


def _saved_placement(entry, num_devices):
    """Where the array lay when saved, if this cluster has those devices; else device 0."""
    p = json_format.ParseDict(entry.get("placement", {}), session_pb2.Placement())
    if p.HasField("sharded"):
        ids = list(p.sharded.mesh.devices) or list(range(int(np.prod(p.sharded.mesh.axis_sizes))))
        if max(ids, default=0) < num_devices:
            return p
    elif p.HasField("device") and p.device < num_devices:
        return p
    return session_pb2.Placement(device=0)


def _target_placement(x):
    if isinstance(x, Array):
        return x._placement
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return session_pb2.Placement(device=0)
    jax = _jax()
    if jax is not None and isinstance(sharding, jax.sharding.NamedSharding):
        # JAX's device i is the cluster's device i (as tessel.jax maps them).
        mesh = sharding.mesh
        ids = [int(d.id) for d in np.asarray(mesh.devices).reshape(-1)]
        sharding = NamedSharding(Mesh(list(zip(mesh.axis_names, mesh.axis_sizes)), devices=ids), P(*sharding.spec))
    elif jax is not None and isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return session_pb2.Placement(device=int(next(iter(sharding.device_set)).id))
    return to_placement(sharding)


def restore(path, target=None, session=None):
    """The checkpoint at `path` as a pytree of tessel.Arrays.

    With `target` (a pytree of tessel.Arrays, ShapeDtypeStructs with or
    without a sharding, or numpy arrays), the result has its structure, and
    each array its leaf's placement: restore onto any mesh. Without one,
    nested dicts (lists where the keys are 0..n-1), each array where it lay
    when saved if this cluster has those devices, else on device 0."""
    s = session or _context.session()
    path = _absolute(path)
    manifest = read_manifest(path, session=s)
    saved = manifest["arrays"]
    leaves_meta = manifest.get("metadata", {}).get("leaves", [])
    if target is None:
        names = [m["name"] for m in leaves_meta] or sorted(saved)
        keys = [m["keys"] for m in leaves_meta] or [[n] for n in names]
        num_devices = len(s.list_devices().devices)
        placements = [_saved_placement(saved[n], num_devices) for n in names]
        types = [(tuple(saved[n]["shape"]), _np_dtype(saved[n]["dtype"])) for n in names]
        rebuild = lambda xs: _nested(keys, xs)  # noqa: E731
    else:
        leaves, keys, rebuild = _flatten(target)
        names = _names(keys)
        missing = [n for n in names if n not in saved]
        extra = sorted(set(saved) - set(names))
        if missing or extra:
            raise ValueError(
                f"checkpoint {path} has another structure than the target: "
                + (f"the target's {missing} are not in it" if missing else "")
                + ("; " if missing and extra else "")
                + (f"it holds {extra}, which the target has not" if extra else "")
            )
        types, placements = [], []
        for n, x in zip(names, leaves):
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"checkpoint {path}: target leaf {n} is a {type(x).__name__}; expected an array")
            want = (tuple(x.shape), np.dtype(x.dtype))
            got = (tuple(saved[n]["shape"]), _np_dtype(saved[n]["dtype"]))
            if want != got:
                raise ValueError(
                    f"checkpoint {path}: array {n} was saved as {got[1]}{list(got[0])}; "
                    f"the target is {want[1]}{list(want[0])}"
                )
            types.append(want)
            placements.append(_target_placement(x))
    s._collect_before_alloc()
    s.flush()
    handles = [s.new_handle() for _ in names]
    req = session_pb2.RestoreCheckpointRequest(session_id=s.id, path=path)
    for n, h, (shape, dtype), p in zip(names, handles, types, placements):
        req.arrays.add(name=n, handle=h, type=_dtypes.tensor_type(shape, dtype), placement=p)
    _rpc(s._stub.RestoreCheckpoint, req)
    out = [Array(s, h, shape, dtype, p) for h, (shape, dtype), p in zip(handles, types, placements)]
    return rebuild(out)


# ---------------------------------------------------------------- manager


class CheckpointManager:
    """A directory of checkpoints, one per step (`directory/<step>`), as
    Orbax's CheckpointManager: save every `save_interval_steps`, keep the
    `max_to_keep` latest and every step divisible by `keep_period`. One
    save is written at a time (a save waits for the one before); another
    manager on the same directory is refused while this one lives."""

    def __init__(self, directory, max_to_keep=None, save_interval_steps=1, keep_period=None, session=None):
        self._session = session or _context.session()
        self.directory = _absolute(directory)
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.keep_period = keep_period
        self._pending = None
        self._lock = threading.Lock()
        s = self._session
        _rpc(s._stub.HoldCheckpoints, session_pb2.HoldCheckpointsRequest(session_id=s.id, directory=self.directory))
        self._closed = False

    def _path(self, step):
        return os.path.join(self.directory, str(int(step)))

    def all_steps(self):
        """The committed steps, ascending."""
        s = self._session
        r = _rpc(s._stub.ListCheckpoints, session_pb2.ListCheckpointsRequest(session_id=s.id, directory=self.directory))
        return sorted(int(n) for n in r.committed if n.isdigit())

    def latest_step(self):
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step):
        return step % self.save_interval_steps == 0 and step not in self.all_steps()

    def save(self, step, tree, wait=False, metadata=None, force=False):
        """Saves `tree` as step `step` when due (or `force`); returns whether it did."""
        self.wait_until_finished()  # the one before, which all_steps counts once committed
        if not force and not self.should_save(step):
            return False
        self._pending = save(
            self._path(step), tree, step=int(step), metadata=metadata, session=self._session, _then=self._prune
        )
        if wait:
            self.wait_until_finished()
        return True

    def _prune(self):
        steps = self.all_steps()
        if self.max_to_keep is None or len(steps) <= self.max_to_keep:
            return
        s = self._session
        for step in steps[: -self.max_to_keep]:
            if self.keep_period and step % self.keep_period == 0:
                continue
            _rpc(s._stub.RemoveCheckpoint, session_pb2.RemoveCheckpointRequest(session_id=s.id, path=self._path(step)))

    def wait_until_finished(self):
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def restore(self, step=None, target=None):
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return restore(self._path(step), target=target, session=self._session)

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_until_finished()
        finally:
            s = self._session
            _rpc(
                s._stub.HoldCheckpoints,
                session_pb2.HoldCheckpointsRequest(session_id=s.id, directory=self.directory, release=True),
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
