"""The client side of multihost_netns_test.sh, run in the coordinator's
namespace: Tessel across three network namespaces as across machines.

  multihost_client.py COORDINATOR_ADDRESS WORKER0_HOST WORKER1_HOST CUT_CMD RESTORE_CMD

1. Both workers registered with their namespace addresses.
2. A program split over the two workers (one device each) runs: its psum
   goes worker to worker over the veth links (Gloo), and matches numpy.
3. CUT_CMD takes worker 1's link down: a step that needs worker 1 fails
   with an error naming it, worker 0 keeps serving.
4. RESTORE_CMD brings the link back: worker 1 registers again and the split
   program runs again.

The cluster is secured as an operator would run it across machines: TLS on
every port, mutual between the daemons; the client's token and CA come from
$TESSEL_TOKEN and $TESSEL_TLS_CA.
"""

import subprocess
import sys
import time

import grpc
import numpy as np

import tessel
from tessel import Mesh, P
from tessel._channel import make_channel
from tessel.v1 import admin_pb2, admin_pb2_grpc

coordinator, host0, host1, cut, restore = sys.argv[1:6]
admin = admin_pb2_grpc.AdminStub(make_channel(coordinator))
# Plaintext is not served across the namespaces.
try:
    admin_pb2_grpc.AdminStub(grpc.insecure_channel(coordinator)).GetCluster(admin_pb2.GetClusterRequest(), timeout=5)
    sys.exit("a plaintext client reached the coordinator across the network")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.UNAVAILABLE, e


def alive():
    resp = admin.GetCluster(admin_pb2.GetClusterRequest(), timeout=5)
    return [w for w in resp.workers if w.alive]


def wait(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}; workers: {alive()}")


def split_sum(x):
    """x split over the two workers' devices; each sums its block and psums."""
    devices = {}
    for w in alive():
        for d in w.devices:
            devices[w.address.rsplit(":", 1)[0]] = d.id
    mesh = Mesh((("data", 2),), devices=[devices[host0], devices[host1]])
    f = tessel.jit(lambda a: tessel.shard_map(lambda b: tessel.psum(b.sum(), "data"), mesh, P("data"), P())(a))
    return f(x).fetch()


workers = wait(lambda: len(alive()) == 2 and alive(), 30, "two live workers")
hosts = sorted(w.address.rsplit(":", 1)[0] for w in workers)
assert hosts == sorted([host0, host1]), f"workers advertise {hosts}, expected {sorted([host0, host1])}"
print(f"registered: {[w.address for w in workers]}")

tessel.connect(coordinator)
x = np.arange(1 << 16, dtype=np.float32) / 1000
got = split_sum(x)
np.testing.assert_allclose(got, x.sum(dtype=np.float64), rtol=1e-5)
print(f"split over both namespaces: psum {got} matches numpy")

on1 = [d.id for w in alive() if w.address.startswith(host1 + ":") for d in w.devices][0]
on0 = [d.id for w in alive() if w.address.startswith(host0 + ":") for d in w.devices][0]
a1 = tessel.device_put(np.ones(8, np.float32), on1)
a0 = tessel.device_put(np.ones(8, np.float32), on0)
a1.block_until_ready()
subprocess.run(cut, shell=True, check=True)
t0 = time.monotonic()
try:
    for _ in range(200):  # until the coordinator notices
        (a1 * 2).fetch()
        time.sleep(0.05)
    raise AssertionError("a step on the cut-off worker kept succeeding")
except tessel.WorkerLostError as e:
    assert host1 in str(e), f"the error does not name worker {host1}: {e}"
    print(f"cut: worker {host1} lost after {time.monotonic() - t0:.1f} s: {e}")
np.testing.assert_array_equal((a0 * 2).fetch(), np.full(8, 2, np.float32))
print("worker 0 keeps serving")

subprocess.run(restore, shell=True, check=True)
wait(lambda: len(alive()) == 2, 30, "worker 1 to register again")
got = split_sum(x)
np.testing.assert_allclose(got, x.sum(dtype=np.float64), rtol=1e-5)
print(f"restored: worker 1 registered again, the split program gives {got} again")
