"""tessel.checkpoints against readers nobody here wrote: zarr-python and
TensorStore open what the workers wrote and must find the arrays' values
(each verifying every chunk's CRC32C); restore onto other meshes must give
numpy's values back; every bad input is a clear error naming the path."""

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore
import zarr

import tessel
from tessel import Mesh, NamedSharding, P
from tessel import checkpoints as ckpt
from tessel._cluster import find_binary

RNG = np.random.default_rng(5)


def state_on(mesh):
    """A 2x2-sharded matrix, a row-split vector, a replicated bias and a scalar, as numpy and on the devices."""
    host = {
        "w": RNG.standard_normal((8, 12)).astype(np.float32),
        "v": np.arange(10, dtype=np.int32) * 3 - 7,
        "opt": {"b": RNG.standard_normal(5), "count": np.int64(41)},
    }
    dev = {
        "w": tessel.device_put(host["w"], NamedSharding(mesh, P("x", "y"))),
        "v": tessel.device_put(host["v"], NamedSharding(mesh, P("x"))),
        "opt": {
            "b": tessel.device_put(host["opt"]["b"], NamedSharding(mesh, P())),
            "count": tessel.device_put(host["opt"]["count"]),
        },
    }
    return host, dev


@pytest.fixture
def mesh(cluster):
    return Mesh([("x", 2), ("y", 2)])


def files_under(path):
    return sorted(str(p.relative_to(path)) for p in pathlib.Path(path).rglob("*") if p.is_file())


def test_workers_write_zarr_that_zarr_and_tensorstore_read(cluster, mesh, tmp_path):
    host, dev = state_on(mesh)
    path = tmp_path / "step_1"
    pending = ckpt.save(path, dev, step=1)
    assert pending.wait() == str(path)
    # Each distinct block once: 4 of w, 2 of v (replicated over y), 1 of the
    # replicated b, 1 of the scalar.
    assert pending.chunks == 8
    assert pending.bytes_written == host["w"].nbytes + host["v"].nbytes + host["opt"]["b"].nbytes + 8
    assert len(pending.workers) == 2  # both workers wrote
    files = files_under(path)
    assert "tessel.commit" in files and "tessel.json" in files and "w/c/1/1" in files
    assert not any("tessel-tmp" in str(p) for p in tmp_path.iterdir())
    group = zarr.open_group(str(path), mode="r")
    np.testing.assert_array_equal(group["w"][:], host["w"])
    np.testing.assert_array_equal(group["v"][:], host["v"])
    np.testing.assert_array_equal(group["opt.b"][:], host["opt"]["b"])
    assert group["opt.count"][()] == host["opt"]["count"]
    for name, want in (("w", host["w"]), ("opt.b", host["opt"]["b"])):
        store = tensorstore.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / name)}}).result()
        np.testing.assert_array_equal(store.read().result(), want)
    # Orbax restores it too (its _METADATA beside ours), as numpy arrays.
    theirs = ocp.StandardCheckpointer().restore(str(path))
    np.testing.assert_array_equal(theirs["w"], host["w"])
    np.testing.assert_array_equal(theirs["opt"]["b"], host["opt"]["b"])
    manifest = json.loads((path / "tessel.json").read_text())
    assert manifest["metadata"]["step"] == 1
    assert manifest["arrays"]["w"]["chunk_shape"] == [4, 6]


@pytest.mark.parametrize(
    "target_mesh,spec",
    [(None, None), ([("a", 4)], P(None, "a")), ([("a", 4)], P("a")), ([("x", 2), ("y", 2)], P("y", "x"))],
    ids=["one_device", "1x4", "4x1", "2x2_transposed"],
)
def test_restore_onto_any_mesh_gives_the_same_values(cluster, mesh, tmp_path, target_mesh, spec):
    host, dev = state_on(mesh)
    ckpt.save(tmp_path / "c", dev, wait=True)
    sharding = tessel.SingleDeviceSharding(0) if target_mesh is None else NamedSharding(Mesh(target_mesh), spec)
    target = {
        "w": tessel.device_put(np.zeros((8, 12), np.float32), sharding),
        "v": np.zeros(10, np.int32),
        "opt": {"b": np.zeros(5), "count": np.int64(0)},
    }
    got = ckpt.restore(tmp_path / "c", target=target)
    assert got["w"]._placement == target["w"]._placement
    np.testing.assert_array_equal(np.asarray(got["w"]), host["w"])
    np.testing.assert_array_equal(np.asarray(got["v"]), host["v"])
    np.testing.assert_array_equal(np.asarray(got["opt"]["b"]), host["opt"]["b"])
    assert int(got["opt"]["count"]) == 41


def test_restore_without_target_keeps_the_saved_layout_and_tree(cluster, mesh, tmp_path):
    host, dev = state_on(mesh)
    dev["layers"] = [tessel.device_put(np.float32(i)) for i in range(3)]
    ckpt.save(tmp_path / "c", dev, wait=True, metadata={"note": "hello"})
    got = ckpt.restore(tmp_path / "c")
    assert got["w"]._placement == dev["w"]._placement
    np.testing.assert_array_equal(np.asarray(got["w"]), host["w"])
    assert [float(x) for x in got["layers"]] == [0.0, 1.0, 2.0]
    assert ckpt.read_manifest(tmp_path / "c")["metadata"]["user"] == {"note": "hello"}


def test_save_returns_at_the_snapshot_and_a_donating_step_may_follow(cluster, mesh, tmp_path):
    # Chunks over 1 MiB, not a multiple of 4 KiB: the bulk goes with
    # O_DIRECT where the filesystem takes it, the tail buffered.
    x0 = RNG.standard_normal((1030, 520)).astype(np.float32)
    x = tessel.device_put(x0, NamedSharding(mesh, P("x")))
    step = tessel.jit(lambda a: a * 2.0 + 1.0, donate_argnums=0)
    pending = ckpt.save(tmp_path / "c", {"x": x})
    for _ in range(3):
        x = step(x)  # overwrites the state the save snapshotted, at once
    pending.wait()
    np.testing.assert_allclose(np.asarray(x), ((x0 * 2 + 1) * 2 + 1) * 2 + 1, rtol=1e-6)
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "c" / "x"), mode="r")[:], x0)
    np.testing.assert_array_equal(np.asarray(ckpt.restore(tmp_path / "c")["x"]), x0)


def test_corrupt_torn_missing_and_uncommitted_checkpoints_are_errors_naming_the_file(cluster, mesh, tmp_path):
    host, dev = state_on(mesh)
    ckpt.save(tmp_path / "c", dev, wait=True)
    chunk = tmp_path / "c" / "w" / "c" / "0" / "1"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x40
    chunk.write_bytes(bytes(data))
    with pytest.raises(tessel.TesselError, match=r"array w: chunk .*w/c/0/1 is corrupt"):
        np.asarray(ckpt.restore(tmp_path / "c")["w"])
    with pytest.raises(Exception, match="(?i)checksum|crc"):  # zarr's own check agrees
        zarr.open_array(str(tmp_path / "c" / "w"), mode="r")[:]
    chunk.write_bytes(bytes(data[:-9]))
    with pytest.raises(tessel.TesselError, match="torn"):
        np.asarray(ckpt.restore(tmp_path / "c")["w"])
    chunk.unlink()
    with pytest.raises(tessel.TesselError, match=r"w/c/0/1"):
        np.asarray(ckpt.restore(tmp_path / "c")["w"])
    (tmp_path / "c" / "tessel.commit").unlink()
    with pytest.raises(tessel.TesselError, match="not complete: it has no commit marker"):
        ckpt.restore(tmp_path / "c")
    # The daemons keep serving.
    np.testing.assert_array_equal(np.asarray(dev["w"]), host["w"])


def test_bad_input_is_a_clear_error_naming_the_path(cluster, mesh, tmp_path):
    host, dev = state_on(mesh)
    ckpt.save(tmp_path / "c", dev, wait=True)
    with pytest.raises(tessel.TesselError, match=r"checkpoint .*/c already exists"):
        ckpt.save(tmp_path / "c", dev)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(tessel.TesselError, match=r"cannot make checkpoint directory .*/file/c"):
        ckpt.save(blocker / "c", dev)
    with pytest.raises(ValueError, match=r"another structure than the target: the target's \['extra'\] are not in it"):
        ckpt.restore(tmp_path / "c", target={**host, "extra": np.zeros(2)})
    with pytest.raises(ValueError, match=r"it holds \['v'\], which the target has not"):
        ckpt.restore(tmp_path / "c", target={k: x for k, x in host.items() if k != "v"})
    bad = {**host, "w": np.zeros((8, 12), np.float64)}
    with pytest.raises(ValueError, match=r"array w was saved as float32\[8, 12\]; the target is float64\[8, 12\]"):
        ckpt.restore(tmp_path / "c", target=bad)
    bad = {**host, "v": np.zeros(11, np.int32)}
    with pytest.raises(ValueError, match=r"array v was saved as int32\[10\]; the target is int32\[11\]"):
        ckpt.restore(tmp_path / "c", target=bad)
    with pytest.raises(tessel.TesselError, match=r"checkpoint .*/nothing does not exist"):
        ckpt.restore(tmp_path / "nothing")
    # Nothing saved was lost.
    np.testing.assert_array_equal(np.asarray(ckpt.restore(tmp_path / "c", target=host)["w"]), host["w"])


def test_a_target_of_jax_shape_dtype_structs_places_each_array_as_its_sharding_says(cluster, mesh, tmp_path):
    """JAX's way of naming a restore's layout: ShapeDtypeStructs, with a
    jax.sharding.NamedSharding (JAX's device i is the cluster's device i),
    a SingleDeviceSharding, or none (device 0)."""
    import jax

    host, dev = state_on(mesh)
    ckpt.save(tmp_path / "c", dev, wait=True)
    jmesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]).reshape(1, 4), ("a", "b"))
    target = {
        "w": jax.ShapeDtypeStruct((8, 12), np.float32, sharding=jax.sharding.NamedSharding(jmesh, jax.P(None, "b"))),
        "v": jax.ShapeDtypeStruct((10,), np.int32, sharding=jax.sharding.SingleDeviceSharding(jax.devices("cpu")[3])),
        "opt": {"b": jax.ShapeDtypeStruct((5,), np.float64), "count": jax.ShapeDtypeStruct((), np.int64)},
    }
    got = ckpt.restore(tmp_path / "c", target=target)
    np.testing.assert_array_equal(got["w"].fetch(), host["w"])
    np.testing.assert_array_equal(got["v"].fetch(), host["v"])
    np.testing.assert_array_equal(got["opt"]["b"].fetch(), host["opt"]["b"])
    assert int(got["opt"]["count"].fetch()) == 41
    assert got["w"].sharding.spec == P(None, "b") and dict(got["w"].sharding.mesh.shape) == {"a": 1, "b": 4}
    assert sorted(got["v"].devices()) == [3]
    assert sorted(got["opt"]["b"].devices()) == [0]
    with pytest.raises(ValueError, match=r"array w was saved as float32\[8, 12\]; the target is float32\[12, 8\]"):
        ckpt.restore(tmp_path / "c", target={**target, "w": jax.ShapeDtypeStruct((12, 8), np.float32)})


def test_a_checkpoint_still_being_written_is_not_restored(cluster, mesh, tmp_path):
    big = tessel.device_put(np.ones((1024, 1024), np.float32), NamedSharding(mesh, P("x")))
    s = tessel._context.session()
    resp = s._stub.SaveCheckpoint(
        tessel.v1.session_pb2.SaveCheckpointRequest(
            session_id=s.id,
            path=str(tmp_path / "c"),
            arrays=[tessel.v1.session_pb2.CheckpointArray(name="a", handle=big.handle)],
        )
    )
    try:
        assert not (tmp_path / "c").exists()
        temp = [p for p in tmp_path.iterdir() if "tessel-tmp" in p.name]
        assert len(temp) == 1 and not (temp[0] / "tessel.commit").exists()
        with pytest.raises(tessel.TesselError, match="still being written"):
            ckpt.restore(tmp_path / "c")
        with pytest.raises(tessel.TesselError, match="not complete"):
            ckpt.restore(temp[0])
    finally:
        s._stub.CommitCheckpoint(
            tessel.v1.session_pb2.CommitCheckpointRequest(session_id=s.id, checkpoint=resp.checkpoint, abandon=True)
        )
    assert list(tmp_path.iterdir()) == []  # an abandoned save leaves nothing


def test_checkpoint_manager_keeps_the_latest_and_the_periodic_steps(cluster, mesh, tmp_path):
    x = tessel.device_put(np.zeros(16, np.float32), NamedSharding(mesh, P("x")))
    step = tessel.jit(lambda a: a + 1.0)
    with ckpt.CheckpointManager(tmp_path, max_to_keep=2, keep_period=4, save_interval_steps=1) as m:
        other = tessel.connect(cluster.address, make_default=False)
        with pytest.raises(tessel.TesselError, match="already has a CheckpointManager"):
            ckpt.CheckpointManager(tmp_path, session=other)
        other.close()
        for i in range(7):
            assert m.save(i, {"x": x})
            x = step(x)
        assert not m.save(6, {"x": x})  # already saved
        m.wait_until_finished()
        assert m.all_steps() == [0, 4, 5, 6]
        assert m.latest_step() == 6
        got = m.restore(target={"x": x})
        np.testing.assert_array_equal(np.asarray(got["x"]), np.full(16, 6.0, np.float32))
        np.testing.assert_array_equal(np.asarray(m.restore(4)["x"]), np.full(16, 4.0, np.float32))
    # Released: a new manager may take the directory.
    with ckpt.CheckpointManager(tmp_path) as again:
        assert again.latest_step() == 6


@contextlib.contextmanager
def worker_in_its_own_mount_namespace(cluster, mounts):
    """A second worker of `cluster`, started after the shell commands
    `mounts` in a private mount namespace (root and unshare(1); else the
    test is skipped), registered when the block starts, stopped when it ends."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    worker = subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'{mounts} && exec "{find_binary("tessel-worker")}" "$@"',
            "worker",
            f"--coordinator={cluster.address}",
            f"--parent_pid={os.getpid()}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while len(tessel.devices()) < 2:
            assert worker.poll() is None, "the namespaced worker exited"
            assert time.monotonic() < deadline, "the namespaced worker never registered"
            time.sleep(0.1)
        yield
    finally:
        worker.terminate()
        worker.wait(timeout=10)


def test_a_path_a_worker_cannot_write_is_an_error_naming_the_worker_and_why(cluster, tmp_path):
    """A second worker sees the volume read-only (a read-only bind mount in a
    mount namespace of its own): its block's save fails naming the worker,
    the directory and the system's reason; the failed checkpoint leaves
    nothing, and one saved before is still whole."""
    shared = tmp_path / "volume"
    shared.mkdir()
    read_only = f'mount --bind "{shared}" "{shared}" && mount -o remount,bind,ro "{shared}"'
    with tessel.local_cluster(workers=1, devices_per_worker=1) as c, worker_in_its_own_mount_namespace(c, read_only):
        before = np.arange(6, dtype=np.float32)
        ckpt.save(shared / "before", {"x": tessel.device_put(before, tessel.devices()[0])}, wait=True)
        y = tessel.device_put(np.ones(4, np.float32), tessel.devices()[1])  # on the read-only worker
        with pytest.raises(
            tessel.TesselError,
            match=r"save of checkpoint .*volume/after: worker 127\.0\.0\.1:\d+: cannot make the directory of "
            r".*volume/after\.tessel-tmp-[0-9a-f]+-\d+/y/c/0: Read-only file system",
        ):
            ckpt.save(shared / "after", {"y": y}, wait=True)
        assert sorted(p.name for p in shared.iterdir()) == ["before"]
        np.testing.assert_array_equal(np.asarray(ckpt.restore(shared / "before")["x"]), before)
    tessel._context.set_default_session(cluster.session)


def test_workers_that_do_not_share_the_path_are_an_error_naming_the_worker(cluster, tmp_path):
    """A second worker in a mount namespace of its own, with a private
    tmpfs over the checkpoint directory: it cannot see what the first made."""
    shared = tmp_path / "volume"
    shared.mkdir()
    private = f'mount -t tmpfs tmpfs "{shared}"'
    with tessel.local_cluster(workers=1, devices_per_worker=1) as c, worker_in_its_own_mount_namespace(c, private):
        x = tessel.device_put(np.ones(4, np.float32), tessel.ReplicatedSharding())
        with pytest.raises(
            tessel.TesselError,
            match=r"worker 127\.0\.0\.1:\d+: does not see the checkpoint directory .*volume/c\.tessel-tmp",
        ):
            ckpt.save(shared / "c", {"x": x})
        assert list(shared.iterdir()) == []  # the failed save removed its directory
    tessel._context.set_default_session(cluster.session)


def test_cli_lists_and_verifies_checkpoints(cluster, mesh, tmp_path):
    host, dev = state_on(mesh)
    ckpt.save(tmp_path / "7", dev, step=7, wait=True)
    cli = find_binary("tessel")
    ls = subprocess.run([cli, "checkpoint", "ls", str(tmp_path)], capture_output=True, text=True)
    assert ls.returncode == 0, ls.stderr
    assert re.search(r"^7\s+committed\s+7\s+4\s", ls.stdout, re.M), ls.stdout
    ok = subprocess.run([cli, "checkpoint", "inspect", str(tmp_path / "7"), "--verify"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert re.search(r"^w\s+float32\s+\[8,12\]\s+\[4,6\]\s+4\s", ok.stdout, re.M), ok.stdout
    chunk = tmp_path / "7" / "v" / "c" / "1"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    bad = subprocess.run(
        [cli, "checkpoint", "inspect", str(tmp_path / "7"), "--verify"], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "v/c/1 is corrupt" in bad.stdout, bad.stdout


def test_a_draining_worker_is_announced_and_a_checkpoint_saved_in_its_grace_period(cluster, tmp_path):
    """SIGTERM to a worker with --drain_s: it keeps serving, cordoned; the
    clients see worker_draining, save what it holds, and see worker_lost
    once it has stopped."""
    with tessel.local_cluster(workers=2, devices_per_worker=1, worker_flags=["--drain_s=20"]) as c:
        x0 = np.arange(12, dtype=np.float32)
        x = tessel.device_put(x0, NamedSharding(Mesh([("d", 2)]), P("d")))
        seen = []
        stop = tessel.on_cluster_event(seen.append, interval=0.05)
        c.kill_worker(1, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not any(e["kind"] == "worker_draining" for e in seen):
            assert time.monotonic() < deadline, f"no draining event: {seen}"
            time.sleep(0.05)
        draining = next(e for e in seen if e["kind"] == "worker_draining")
        assert draining["devices"] == [1] and draining["deadline"] > time.time() + 5
        ckpt.save(tmp_path / "before_stop", {"x": x}, wait=True)  # the draining worker writes its half
        x.delete()  # nothing held there any more: it stops before its grace period ends
        deadline = time.monotonic() + 15
        while not any(e["kind"] == "worker_lost" for e in seen):
            assert time.monotonic() < deadline, f"no lost event: {seen}"
            time.sleep(0.1)
        stop()
        assert [d.id for d in tessel.devices()] == [0]
        back = ckpt.restore(tmp_path / "before_stop", target={"x": np.zeros(12, np.float32)})
        np.testing.assert_array_equal(np.asarray(back["x"]), x0)
        kinds = [e["kind"] for e in tessel.cluster_events()]
        assert "worker_draining" not in kinds  # each event once per session
    tessel._context.set_default_session(cluster.session)
