"""A placement request is honoured or refused naming both placements, never
silently ignored (each case below used to run on the argument's mesh with
no error). JAX raises "incompatible devices" for the same programs."""

import numpy as np
import pytest

import tessel
from tessel import Mesh, NamedSharding, P

A = Mesh({"x": 2}, devices=[0, 1])
B = Mesh({"x": 2}, devices=[2, 3])


@pytest.fixture
def on_a(session):
    return tessel.device_put(np.arange(8, dtype=np.float32), NamedSharding(A, P("x")))


def _refused(f, *names):
    with pytest.raises(ValueError, match="incompatible placements") as e:
        f()
    for n in names:
        assert n in str(e.value), str(e.value)


def test_jit_device_beside_a_mesh_is_refused(on_a):
    _refused(lambda: tessel.jit(lambda v: v * 2, device=2)(on_a), "device=2", "devices=[0, 1]", "argument 0 'v'")


def test_jit_replicated_beside_a_mesh_is_refused(on_a):
    _refused(lambda: tessel.jit(lambda v: v * 2, replicated=True)(on_a), "replicated=True", "devices=[0, 1]")


def test_a_constraint_on_another_mesh_is_refused(on_a):
    f = tessel.jit(lambda v: tessel.with_sharding_constraint(v * 2, NamedSharding(B, P("x"))))
    _refused(lambda: f(on_a), "with_sharding_constraint(P('x'))", "devices=[2, 3]", "devices=[0, 1]")


def test_a_shard_map_on_another_mesh_is_refused(on_a):
    def double(y):
        return y * 2

    f = tessel.jit(lambda v: tessel.shard_map(double, B, in_specs=P("x"), out_specs=P("x"))(v))
    _refused(lambda: f(on_a), "shard_map of double", "devices=[2, 3]")


def test_arguments_on_two_meshes_are_refused(on_a):
    on_b = tessel.device_put(np.ones(8, np.float32), NamedSharding(B, P("x")))
    _refused(lambda: tessel.jit(lambda u, v: u + v)(on_a, on_b), "argument 0 'u'", "argument 1 'v'")
    _refused(lambda: tessel.jit(lambda u: u + 1, out_shardings=NamedSharding(B, P("x")))(on_a), "out_shardings")


def test_a_constraint_naming_a_mesh_is_honoured_where_nothing_else_is_placed(session):
    f = tessel.jit(lambda v: tessel.with_sharding_constraint(v * 2, NamedSharding(B, P("x"))))
    got = f(np.arange(8, dtype=np.float32))  # a host value: put where the mesh wants it
    assert got.sharding.mesh == B
    np.testing.assert_array_equal(got.fetch(), np.arange(8, dtype=np.float32) * 2)


def test_a_bare_spec_with_no_mesh_is_refused(session):
    x = tessel.device_put(np.arange(8, dtype=np.float32))
    with pytest.raises(ValueError, match=r"with_sharding_constraint\(P\('x'\)\) names no mesh"):
        tessel.jit(lambda v: tessel.with_sharding_constraint(v * 2, P("x")))(x)


def test_the_same_mesh_everywhere_still_runs(on_a):
    f = tessel.jit(
        lambda v: tessel.with_sharding_constraint(v * 2, NamedSharding(A, P())), out_shardings=NamedSharding(A, P("x"))
    )
    np.testing.assert_array_equal(f(on_a).fetch(), np.arange(8, dtype=np.float32) * 2)


def test_a_mesh_is_written_as_jax_writes_it_or_refused_clearly():
    assert Mesh(np.array([[0, 1], [2, 3]]), ("data", "model")) == Mesh({"data": 2, "model": 2})
    assert Mesh(np.array([2, 3]), ("x",)) == B
    assert Mesh([2, 3], "x") == B
    with pytest.raises(ValueError, match=r"shape \(2,\) needs 1 axis names"):
        Mesh(np.array([0, 1]), ("x", "y"))
    with pytest.raises(ValueError, match=r"hold 2 devices, got 3"):
        Mesh({"x": 2}, devices=[0, 1, 2])
    with pytest.raises(ValueError, match="appears twice"):
        Mesh({"x": 2}, devices=[1, 1])
    with pytest.raises(ValueError, match="axis names must differ"):
        Mesh((("x", 2), ("x", 2)))
    with pytest.raises(TypeError, match="expected"):
        Mesh(5)


def test_a_jax_style_mesh_of_the_clusters_devices_runs(session):
    mesh = Mesh(np.array(tessel.devices()).reshape(2, 2), ("data", "model"))
    x = tessel.device_put(np.arange(16, dtype=np.float32).reshape(4, 4), NamedSharding(mesh, P("data", "model")))
    np.testing.assert_array_equal(
        tessel.jit(lambda v: v.sum(axis=0))(x).fetch(), np.arange(16, dtype=np.float32).reshape(4, 4).sum(axis=0)
    )
