"""Plan diagrams: a compiled program as a Graphviz digraph. Graphviz's own
`dot` parses and lays out what Tessel writes; the diagram's collectives
and donations are the plan's."""

import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp
from tessel import Mesh, NamedSharding, P
from tessel._cluster import find_binary

pytestmark = pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz (apt-get install graphviz)")


def sgd_step(w1, w2, x, t):
    def loss(w1, w2):
        return ((tnp.tanh(x @ w1) @ w2 - t) ** 2).mean()

    l, (g1, g2) = tessel.value_and_grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - 0.1 * g1, w2 - 0.1 * g2, l


def test_a_data_parallel_step_draws_its_collectives_and_donations(session):
    mesh = Mesh([("data", 4)])
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(0)
    w1 = tessel.device_put(rng.standard_normal((16, 32)).astype(np.float32), rep)
    w2 = tessel.device_put(rng.standard_normal((32, 4)).astype(np.float32), rep)
    x = tessel.device_put(rng.standard_normal((64, 16)).astype(np.float32), split)
    t = tessel.device_put(rng.standard_normal((64, 4)).astype(np.float32), split)
    compiled = tessel.jit(sgd_step, donate_argnums=(0, 1)).lower(w1, w2, x, t)
    dot = compiled.as_dot()
    assert dot.startswith("digraph ")
    # One coloured node per collective of the plan, each with its reason.
    drawn = re.findall(r'label="all_reduce\\n%([^\\"]+):', dot)
    assert sorted(drawn) == sorted(c["value"] for c in compiled.collectives if c["op"] == "all_reduce")
    assert all(c["reason"][:40].replace('"', '\\"') in dot for c in compiled.collectives)
    assert dot.count("donated: becomes output") == 2
    assert "fusion (" in dot
    svg = compiled.as_svg()  # Graphviz parses and lays it out
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg


def test_cli_draws_a_partitioned_plan(cluster, tmp_path):
    out = tmp_path / "dense.svg"
    r = subprocess.run(
        [
            find_binary("tessel"),
            "compile",
            "examples/graphs/dense.textproto",
            "--mesh",
            "data=2,model=2",
            "--shard",
            "x=P('data', 'model')",
            "--shard",
            "w=P('model', None)",
            "--svg",
            str(out),
            f"--coordinator={cluster.address}",
        ],
        capture_output=True,
        text=True,
        cwd=pathlib.Path(__file__).resolve().parents[3],
    )
    assert r.returncode == 0, r.stderr
    assert "<svg" in out.read_text()
    dot = subprocess.run(
        [
            find_binary("tessel"),
            "compile",
            "examples/graphs/dense.textproto",
            "--dot",
            f"--coordinator={cluster.address}",
        ],
        capture_output=True,
        text=True,
        cwd=pathlib.Path(__file__).resolve().parents[3],
    )
    assert dot.returncode == 0 and dot.stdout.startswith("digraph "), dot.stderr


def test_an_unknown_executable_is_a_clear_error(session):
    with pytest.raises(tessel.TesselError, match="is not in this tenant's compile cache"):
        session.plan_dot("0" * 32)
