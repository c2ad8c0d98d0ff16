"""The SDK's modules import one way, from the bottom layer up, and never
inside a function: a module may import only modules listed before it in
LAYERS. Checked on the source, without importing it."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tessel"

# Bottom to top; each may import only those before it.
LAYERS = [
    "errors",
    "_dtypes",
    "_context",  # plain values and process state
    "_profile",  # the client's events of a trace
    "_trace",  # the graph builder and traced values
    "_sharding",  # meshes, specs, shardings: plain types
    "_channel",  # gRPC channels: TLS and the bearer token
    "_dispatcher",  # the pipelined Execute stream
    "_session",  # the gRPC client
    "_array",  # remote arrays
    "_tree",  # pytrees
    "tree_util",  # tessel.tree_util
    "numpy._core",  # tessel.numpy's helpers, then its ops by kind
    "numpy._elementwise",
    "numpy._creation",
    "numpy._layout",
    "numpy._reductions",
    "numpy._indexing",
    "numpy._dot",
    "numpy._sorting",
    "numpy._array_api",  # the Array API standard's names, over those above
    "numpy",  # tessel.numpy, naming them
    "_convolution",  # convolutions and windows, composed of tessel.numpy's ops
    "_lax_linalg",  # tessel.lax.linalg: the factorizations
    "numpy.linalg",  # tessel.numpy.linalg, over them
    "_region",  # tracing a sub-function into a region
    "_compiled",  # tessel.Compiled
    "_jit",  # tessel.jit
    "_bodies",  # lax.reduce and lax.sort: functions applied by the op
    "_shard_map",  # shard_map, collectives, custom kernels
    "lax",  # control flow, and jax.lax's collectives from _shard_map
    "_api",  # devices, device_put, the contracts
    "_autodiff",
    "_remat",  # checkpoint, over custom_vjp
    "_vmap",  # transformations
    "nn",
    "random",  # libraries over tessel.numpy
    "_cluster",  # local clusters
    "_gather_scatter",  # StableHLO's gather and scatter, composed of tessel.numpy's ops
    "_rng_bits",  # StableHLO's rng_bit_generator, XLA's bits in tessel.numpy's ops
    "_stablehlo_manual",  # jax.shard_map's manual computations and their collectives
    "_stablehlo",  # StableHLO read through jaxlib's MLIR bindings
    "jax",  # tessel.jax: JAX programs on the cluster (needs jax)
    "checkpoints",  # tessel.checkpoints: saved and restored by the workers
    "profiler",  # tessel.profiler: traces of the cluster
    "__init__",
]


# Sub-packages (tessel.v1 is generated code below every layer): a package is
# named by its own name, its modules as "package.module".
PACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py") if p.parent.name != "v1")


def _modules():
    names = [p.stem for p in PACKAGE.glob("*.py")]
    for package in PACKAGES:
        names += [package if p.stem == "__init__" else f"{package}.{p.stem}" for p in (PACKAGE / package).glob("*.py")]
    return sorted(names)


def _path(module):
    if module in PACKAGES:
        return PACKAGE / module / "__init__.py"
    return PACKAGE / (module.replace(".", "/") + ".py")


def _tessel_imports(node):
    """The tessel modules an import statement names (tessel.v1 is generated
    code below every layer)."""
    names = []
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        parts = node.module.split(".")
        if parts[0] == "tessel":
            if len(parts) == 1:
                names += [a.name for a in node.names]
            elif parts[1] in PACKAGES and len(parts) > 2:
                names.append(f"{parts[1]}.{parts[2]}")
            else:
                names.append(parts[1])
    elif isinstance(node, ast.Import):
        for a in node.names:
            parts = a.name.split(".")
            if parts[0] == "tessel" and len(parts) > 1:
                names.append(".".join(parts[1:3]) if parts[1] in PACKAGES else parts[1])
    return [n for n in names if n != "v1"]


def test_every_module_has_a_layer():
    assert sorted(LAYERS) == _modules(), "a module of tessel/ is missing from LAYERS (or LAYERS names one that is gone)"


@pytest.mark.parametrize("module", _modules())
def test_imports_run_one_way(module):
    tree = ast.parse(_path(module).read_text())
    mine = LAYERS.index(module)
    for node in ast.walk(tree):
        for name in _tessel_imports(node):
            assert name in LAYERS, f"{module}.py line {node.lineno} imports tessel.{name}, which has no layer"
            assert LAYERS.index(name) < mine, (
                f"{module}.py line {node.lineno} imports tessel.{name}, a layer above "
                f"it (LAYERS: {' < '.join(LAYERS)})"
            )


@pytest.mark.parametrize("module", _modules())
def test_no_import_inside_a_function(module):
    tree = ast.parse(_path(module).read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                assert not isinstance(node, (ast.Import, ast.ImportFrom)), (
                    f"{module}.py line {node.lineno}: an import inside {getattr(fn, 'name', 'a lambda')}; "
                    "imports go at the top, in layer order"
                )


def test_the_checks_can_fail():
    """The checks see a violation: an import of a higher layer inside a function."""
    tree = ast.parse("def f():\n    from tessel import _jit\n")
    found = [
        n
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef)
        for n in ast.walk(fn)
        if isinstance(n, ast.ImportFrom)
    ]
    assert found and _tessel_imports(found[0]) == ["_jit"]
