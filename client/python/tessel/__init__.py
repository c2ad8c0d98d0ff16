"""Tessel's Python SDK: numpy-like tracing onto a cluster, remote arrays, and
the contracts (transfer guard, donation receipts, no recompiles, no memory
growth) as Python you can assert on.

    import tessel
    import tessel.numpy as tnp

    with tessel.local_cluster(workers=2, devices_per_worker=2):
        @tessel.jit(donate_argnums=0)
        def step(state, x):
            return state * 0.9 + tnp.tanh(x)

        state = tessel.device_put(np.zeros(1024, np.float32))
        with tessel.transfer_guard("disallow"):
            for _ in range(100):
                state = step(state, state)
        print(state.fetch())

Threads: a session may be used from several threads; the transfer guard set
by `transfer_guard` is per thread.

Layering: imports run one way and never inside a function, from plain
values (`_dtypes`, `_sharding`'s types) through the session, arrays, pytrees
(`_tree`), `tessel.numpy` and the region tracer (`_region`, which lax, jit,
shard_map, autodiff and vmap share) up to the transformations and this
module; tests/test_import_layers.py holds the order and checks it. No lock in a finalizer: Python's
cyclic collector runs `__del__` and weakref callbacks at any allocation, on a
thread that may hold any SDK lock, so a finalizer only appends to a lock-free
queue (`Session.drop`), drained by the next SDK call.
"""

from tessel import errors, numpy
from tessel import lax  # control flow on the device
from tessel import nn  # after numpy, which it composes
from tessel import random  # counter-based random numbers, as jax.random
from tessel import tree_util  # pytrees, as jax.tree_util
from tessel import checkpoints  # saved and restored by the workers (zarr)
from tessel import profiler  # timelines of the cluster (Perfetto)
from tessel._autodiff import custom_jvp, custom_vjp, grad, jvp, value_and_grad, vjp
from tessel._remat import checkpoint, checkpoint_name, checkpoint_policies, remat
from tessel._api import (
    assert_no_memory_growth,
    cluster_events,
    compile,
    device_put,
    devices,
    forbid_compiles,
    memory_stats,
    on_cluster_event,
    session_options,
    stats,
)
from tessel._array import Array, install as _install_array_ops
from tessel.numpy._array_api import install as _install_array_api
from tessel._cluster import LocalCluster, connect, local_cluster
from tessel._compiled import Compiled
from tessel._context import transfer_guard
from tessel._jit import DonationWarning, jit
from tessel._session import TransferReceipt, tune_allocator
from tessel._vmap import vmap
from tessel._shard_map import (
    all_gather,
    all_to_all,
    axis_index,
    custom_kernel,
    pmax,
    pmin,
    ppermute,
    psum,
    psum_scatter,
    shard_map,
    with_sharding_constraint,
)
from tessel._sharding import Device, Mesh, NamedSharding, P, ReplicatedSharding, SingleDeviceSharding
from tessel.errors import (
    DonatedArrayError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OutOfMemoryError,
    RecompileError,
    TesselError,
    TransferGuardError,
    WorkerLostError,
)

_install_array_ops(numpy, device_put)
_install_array_api(device_put=device_put, devices=devices, with_sharding_constraint=with_sharding_constraint)

__version__ = "0.1.0"
__all__ = [
    "Array",
    "Compiled",
    "Device",
    "TransferReceipt",
    "LocalCluster",
    "Mesh",
    "NamedSharding",
    "P",
    "ReplicatedSharding",
    "SingleDeviceSharding",
    "all_gather",
    "all_to_all",
    "axis_index",
    "custom_kernel",
    "pmax",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "shard_map",
    "with_sharding_constraint",
    "assert_no_memory_growth",
    "compile",
    "connect",
    "device_put",
    "devices",
    "errors",
    "forbid_compiles",
    "cluster_events",
    "on_cluster_event",
    "jit",
    "checkpoint",
    "checkpoint_name",
    "checkpoint_policies",
    "custom_jvp",
    "custom_vjp",
    "grad",
    "jvp",
    "lax",
    "local_cluster",
    "memory_stats",
    "nn",
    "numpy",
    "random",
    "remat",
    "session_options",
    "stats",
    "transfer_guard",
    "tree_util",
    "checkpoints",
    "profiler",
    "tune_allocator",
    "value_and_grad",
    "vjp",
    "vmap",
    "DonatedArrayError",
    "DonationWarning",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfMemoryError",
    "RecompileError",
    "TesselError",
    "TransferGuardError",
    "WorkerLostError",
]

# tessel.numpy.linalg, an attribute of tessel.numpy once tessel is imported.
from tessel.numpy import linalg as _numpy_linalg  # noqa: E402, F401
