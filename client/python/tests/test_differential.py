"""Differential testing: random array programs (hypothesis) run through
Tessel in every mode and checked against numpy, with JAX on CPU settling
what numpy and XLA disagree on (differential/oracle.py has the table of
documented differences; everything else must match).

Programs are 5 to 30 steps over every op and dtype tessel.numpy has
(differential/programs.py): arithmetic, comparisons and logical ops with
broadcasting and Python and numpy scalars (NEP 50, out-of-range ints
included), the unary functions, where, clip, astype, reductions over axes
with keepdims, reshape, transpose, broadcast_to, expand_dims, slicing
(negative steps too), flip, roll, cumsum, sort, argsort, concatenate,
stack, pad, matmul, dot, einsum, numpy.linalg (det, slogdet, inv, solve,
cholesky, eigvalsh and norms, singular values included, of well-conditioned
matrices) and the
constructors, over
bool, uint8, int32, int64, float16, bfloat16, float32 and float64, rank 0 to
3 with size-0 and size-1 dimensions and edge values (NaN, +-inf, -0.0,
subnormals, the largest floats, integer extremes). A program returns its
last value and up to two others (an argument itself at times), and leaves
dead values behind.

Modes: under jit; eagerly (each op a one-op jit on tessel.Arrays); under
jit with every argument donated; replicated on every device; and sharded
over random valid shardings on {a:4}, {a:2,b:2} or {a:4,b:1}, with random
out_shardings checked against each result's .sharding. Plans of sharded
programs must hold no collective over a mesh axis of size 1, and none that
only dead values need (test_plans_*; see PLAN_CHECKS).

Through tessel.jax: the same programs written against jax.numpy (with
jax.lax and jax.vmap) run through tessel.jax.jit, which reads what jax.jit
lowers them to, and must equal JAX's own run of them on CPU (a program JAX
refuses, where numpy's semantics are not JAX's, is skipped).

Seeded: the default run draws DEFAULT_PROGRAMS programs from seed
DEFAULT_SEED (a few minutes on 2 cores). TESSEL_SOAK=1 draws SOAK_PROGRAMS
from a random seed; TESSEL_DIFF_SEED=<n> and TESSEL_DIFF_PROGRAMS=<n> choose.
A failure names the seed, the mode, and the shrunk program as source with
its inputs.
"""

import dataclasses
import os
import random
import warnings

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, seed, settings, strategies as st  # noqa: E402

import tessel  # noqa: E402
from conftest import DEVICE_KIND, suite_cluster  # noqa: E402
import tessel.numpy as tnp  # noqa: E402
from tessel import Mesh, NamedSharding, P  # noqa: E402

from differential import oracle, programs  # noqa: E402

SOAK = os.environ.get("TESSEL_SOAK") == "1"
DEFAULT_SEED = 15
DEFAULT_PROGRAMS = 1200
SOAK_PROGRAMS = 3000
SEED = int(os.environ.get("TESSEL_DIFF_SEED") or (random.randrange(1 << 30) if SOAK else DEFAULT_SEED))
PROGRAMS = int(os.environ.get("TESSEL_DIFF_PROGRAMS") or (SOAK_PROGRAMS if SOAK else DEFAULT_PROGRAMS))

# The plan checks (no collective for a dead value, none over an axis of
# size 1) hold since the coordinator drops dead values before partitioning
# and skips size-1 axes. Against daemons built before that, set this False:
# the plan tests then run as strict xfails.
PLAN_CHECKS = os.environ.get("TESSEL_DIFF_PLAN_CHECKS", "1") == "1"

HEALTH = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.function_scoped_fixture,
    HealthCheck.large_base_example,
]


def _settings(n):
    return settings(max_examples=n, deadline=None, database=None, print_blob=True, suppress_health_check=HEALTH)


def _reproduce(test):
    return (
        f"seed {SEED} ({'soak' if SOAK else 'default'} run): TESSEL_DIFF_SEED={SEED} "
        f"TESSEL_DIFF_PROGRAMS={PROGRAMS} python3 -m pytest client/python/tests/test_differential.py::{test}"
    )


@pytest.fixture(scope="module")
def cluster():
    """This module's own cluster (the suites' shape, conftest.py): a program
    that breaks a worker takes down this module's tests, not the suite's."""
    with suite_cluster() as c:
        yield c


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with np.errstate(all="ignore"):
            yield


# ---------------------------------------------------------------- modes


@st.composite
def layouts(draw, program):
    """A mesh, a spec per argument and a spec per output."""
    mesh = draw(st.sampled_from(programs.MESHES))
    outs = [] if program.error else oracle.reference_runs(program, program.arrays)[0]
    return (
        mesh,
        [draw(programs.specs(mesh, a.shape)) for a in program.arrays],
        [draw(programs.specs(mesh, o.shape)) for o in outs],
    )


@st.composite
def cases(draw):
    program = draw(programs.programs())
    return program, draw(layouts(program))


def _fetch(outs):
    return [o.fetch() for o in outs]


def _sharded(program, layout, fn=None):
    mesh_shape, in_specs, out_specs = layout
    mesh = Mesh(mesh_shape)
    f = fn or program.function(tnp)
    outs_sharding = tuple(NamedSharding(mesh, s) for s in out_specs) if out_specs else None
    j = tessel.jit(f, out_shardings=outs_sharding)
    args = [tessel.device_put(a, NamedSharding(mesh, s)) for a, s in zip(program.arrays, in_specs)]
    return j, args, mesh


def modes(program, layout):
    """(name, run) for every mode; run() gives the outputs as tessel.Arrays."""
    f = program.function(tnp)
    arrays = program.arrays
    put = lambda: [tessel.device_put(a) for a in arrays]  # noqa: E731
    yield "jit", lambda: tessel.jit(f)(*put())
    yield "eager", lambda: f(*put())
    yield "donated", lambda: tessel.jit(f, donate_argnums=tuple(range(len(arrays))))(*put())
    yield (
        "replicated",
        lambda: tessel.jit(f, replicated=True)(*[tessel.device_put(a, tessel.ReplicatedSharding()) for a in arrays]),
    )

    if DEVICE_KIND != "cpu":
        return  # partitioned programs need NCCL, one GPU per device; the suite's workers share their GPUs
    mesh_shape, in_specs, out_specs = layout

    def sharded():
        j, args, mesh = _sharded(program, layout, f)
        outs = j(*args)
        for i, (o, s) in enumerate(zip(outs, out_specs)):
            assert o.sharding == NamedSharding(
                mesh, s
            ), f"output {i}: .sharding is {o.sharding}, out_shardings asked for {s}"
        return outs

    yield f"sharded {mesh_shape}, in {in_specs}, out {out_specs}", sharded


def _smallest_failing_part(program, layout, mode_name):
    """The steps the first wrong value needs: the program is run in the same
    mode returning every value, and the first that differs from the oracle
    is kept with what it depends on. None if none differs that way."""
    import dataclasses

    names = [n for n, _ in program.steps]
    every = dataclasses.replace(program, outputs=names)
    layout = (layout[0], layout[1], [])  # the shardings the partitioner chooses

    def run_in_mode(p):
        return _fetch(next(r for m, r in modes(p, layout) if m.split()[0] == mode_name.split()[0])())

    try:
        runs = oracle.reference_runs(every, every.arrays)
        got = run_in_mode(every)
    except Exception:
        # It raises: the first value whose part raises alone.
        for n in names:
            part = dataclasses.replace(program, outputs=[n])
            part = dataclasses.replace(part, steps=part.live())
            try:
                run_in_mode(part)
            except Exception:
                return part
        return None
    for i, (g, out_runs) in enumerate(zip(got, zip(*runs))):
        if oracle.mismatch(np.asarray(g), list(out_runs), program.exact[names[i]]):
            part = dataclasses.replace(program, outputs=[names[i]])
            return dataclasses.replace(part, steps=part.live())
    return None


def _check_program(program, layout, test, only=None):
    """Runs `program` in every mode (or those named in `only`) and checks
    each result against the oracle's runs."""
    header = f"{_reproduce(test)}\nprogram:{program!r}"
    every = [(m, r) for m, r in modes(program, layout) if only is None or m.split()[0] in only]
    if program.error is not None:
        for mode, run in every:
            with pytest.raises(program.error):
                _fetch(run())
                pytest.fail(f"{header}\n{mode}: numpy raises {program.error.__name__}, Tessel did not")
        return
    runs = oracle.reference_runs(program, program.arrays)
    outputs = list(zip(*runs))  # per output: its runs
    for mode, run in every:
        try:
            got = _fetch(run())
        except Exception as e:
            part = _smallest_failing_part(program, layout, mode)
            part = f"\nthe first value that raises, with what it needs:{part!r}" if part else ""
            raise AssertionError(f"{header}\n{mode}: raised {type(e).__name__}: {e}{part}") from e
        assert len(got) == len(outputs), f"{header}\n{mode}: {len(got)} outputs, expected {len(outputs)}"
        for i, (g, out_runs) in enumerate(zip(got, outputs)):
            why = oracle.mismatch(np.asarray(g), list(out_runs), program.exact[program.outputs[i]])
            if why:
                part = _smallest_failing_part(program, layout, mode)
                part = f"\nthe first value that differs, with what it needs:{part!r}" if part else ""
                raise AssertionError(f"{header}\n{mode}, output {i} ({program.outputs[i]}): {why}{part}")


@seed(SEED)
@_settings(PROGRAMS)
@given(cases())
def test_programs_match_the_oracle_in_every_mode(session, case):
    program, layout = case
    _check_program(program, layout, "test_programs_match_the_oracle_in_every_mode")


ELEMENTWISE_EXAMPLES = max(4, PROGRAMS // 100)


@pytest.mark.parametrize("op", sorted(programs.ELEMENTWISE))
def test_elementwise_ops_match_the_oracle_over_edge_values(session, op):
    """Each elementwise op alone over long vectors of edge values, under jit
    and eagerly (the other modes run an elementwise op the same way)."""

    @seed(SEED + 2)
    @_settings(ELEMENTWISE_EXAMPLES)
    @given(programs.elementwise_programs(op))
    def check(program):
        layout = ({"a": 4}, [P() for _ in program.arrays], [])
        _check_program(
            program, layout, f"test_elementwise_ops_match_the_oracle_over_edge_values[{op}]", only=("jit", "eager")
        )

    check()


# ---------------------------------------------------------------- through tessel.jax

JAX_EXAMPLES = max(10, PROGRAMS // 4)


def _jax_function(program):
    import jax

    oracle._jnp()  # JAX with 64-bit types, as numpy has them
    return program.function(jax.numpy, lax=jax.lax, vmap=jax.vmap)


def _flush_subnormals(a):
    if not oracle.is_float(a.dtype):
        return a
    tiny = float(oracle.finfo(a.dtype).smallest_normal)
    wide = a.astype(np.float64)
    return np.where((wide != 0) & (np.abs(wide) < tiny), np.copysign(0.0, wide), wide).astype(a.dtype)


def _around(want, spread, exact, comparable):
    """JAX's value `want`, then runs around it that span the rounding an
    inexact output may carry: the oracle's perturbed runs moved to JAX's
    value (where they are comparable), and 2**-16 of the output's largest
    magnitude either side. The second covers what the oracle's runs cannot
    see: JAX computes in float32 where numpy promotes to float64 (tanh of
    an int32), so a last-bit difference of a float32 step reaches a float64
    output."""
    if exact:
        return [want]
    w = want.astype(np.float64)
    moved = [want]
    if comparable:
        base = spread[0].astype(np.float64)
        for r in spread[1:]:
            delta = r.astype(np.float64) - base
            moved.append((w + np.where(np.isfinite(delta), delta, 0.0)).astype(want.dtype))
    finite = np.abs(w[np.isfinite(w)])
    scale = float(finite.max()) if finite.size else 0.0
    tol = max(2.0**-16, 4 * float(oracle.finfo(want.dtype).eps)) * (np.where(np.isfinite(w), np.abs(w), 0.0) + scale)
    moved += [(w - tol).astype(want.dtype), (w + tol).astype(want.dtype)]
    return moved


@seed(SEED + 3)
@_settings(JAX_EXAMPLES)
@given(programs.programs())
def test_programs_written_with_jax_run_unchanged_through_tessel_jax(session, program):
    """The same program written against jax.numpy (with jax.lax and
    jax.vmap) runs through tessel.jax.jit, which reads what jax.jit lowers
    it to: each output equals JAX's own run of it on CPU, bit for bit where
    the oracle holds the value exact, and within the spread of the oracle's
    perturbed runs around JAX's value where it carries rounding."""
    import jax
    import tessel.jax as tjax

    if program.error is not None:
        return
    # JAX on CPU treats subnormals as zero (XLA sets the CPU's FTZ and DAZ
    # modes), Tessel keeps them as numpy does: inputs go in flushed, and a
    # subnormal that a step makes is settled by the numpy oracle below.
    program = dataclasses.replace(program, inputs=[(n, _flush_subnormals(a)) for n, a in program.inputs])
    f = _jax_function(program)
    try:
        want = [np.asarray(o) for o in jax.jit(f)(*program.arrays)]
    except Exception:
        return  # a program JAX itself refuses (numpy's semantics JAX lacks): nothing to compare
    header = f"{_reproduce('test_programs_written_with_jax_run_unchanged_through_tessel_jax')}\nprogram:{program!r}"
    try:
        got = _fetch(tjax.jit(f)(*[tessel.device_put(a) for a in program.arrays]))
    except Exception as e:
        raise AssertionError(f"{header}\ntessel.jax: raised {type(e).__name__}: {e}") from e
    runs = oracle.reference_runs(program, program.arrays)
    for i, (g, w) in enumerate(zip(got, want)):
        exact = program.exact[program.outputs[i]]
        spread = [r[i] for r in runs]
        comparable = all(r.shape == w.shape and r.dtype == w.dtype for r in spread)
        why = oracle.mismatch(np.asarray(g), _around(w, spread, exact, comparable), exact)
        if why and comparable and oracle.mismatch(np.asarray(g), spread, exact) is None:
            continue  # JAX on CPU flushes subnormals to zero; Tessel keeps them, as numpy does
        assert why is None, f"{header}\noutput {i} ({program.outputs[i]}) against JAX: {why}"


# ---------------------------------------------------------------- plans


def _collectives(compiled):
    return sorted((c["op"], c["axes"], c["bytes_per_device"]) for c in compiled.collectives)


plan_check = pytest.mark.xfail(
    not PLAN_CHECKS, strict=True, reason="daemons from before dead values and size-1 axes were left out of plans"
)


@plan_check
@pytest.mark.skipif(
    DEVICE_KIND != "cpu",
    reason="plans are made by the coordinator whatever the device kind; " "its meshes need 4 devices",
)
@seed(SEED + 1)
@_settings(max(20, PROGRAMS // 3))
@given(cases())
def test_plans_hold_no_collective_for_dead_values_or_size1_axes(session, case):
    """A collective over mesh axes of size 1 moves nothing; one that only a
    dead value needs moves bytes for nothing. The plan of the program must
    equal the plan of its live part, and name no axis of size 1."""
    program, layout = case
    if program.error is not None:
        return
    mesh_shape = layout[0]
    j, args, _ = _sharded(program, layout)
    plan = j.lower(*args)
    where = (
        f"{_reproduce('test_plans_hold_no_collective_for_dead_values_or_size1_axes')}\nprogram:{program!r}\n"
        f"on {mesh_shape}, in {layout[1]}, out {layout[2]}"
    )
    for c in plan.collectives:
        # Over a group of one device every collective is the identity. (A
        # collective over ('a', 'b') with b of size 1 is over a: allowed.)
        group = int(np.prod([mesh_shape[a] for a in c["axes"]]))
        assert group > 1, f"{where}\na collective over axes of size 1: {c}"
    live = program.live()
    if len(live) < len(program.steps):
        f = program.function(tnp, steps=live)
        jl, args, _ = _sharded(program, layout, f)
        extra = _collectives(plan)
        for c in _collectives(jl.lower(*args)):
            if c in extra:
                extra.remove(c)
        assert not extra, f"{where}\ncollectives only dead values need: {extra}\n{plan.as_text()}"


# ---------------------------------------------------------------- settled by JAX


def test_documented_differences_are_what_jax_computes(session):
    """Where the table of documented differences says XLA's semantics, JAX on
    CPU agrees with Tessel (and so with the oracle)."""
    jnp = oracle._jnp()
    f = np.array([np.nan, 1e10, -1e10, np.inf, -np.inf, 2.7, -2.7, 300.0, -0.0], np.float32)
    for d in (np.int32, np.int64, np.uint8):
        got = tnp.astype(tessel.device_put(f), d).fetch()
        np.testing.assert_array_equal(got, np.asarray(jnp.asarray(f).astype(d)), err_msg=str(d))
    x = np.array([7, -7, 0, 5], np.int32)
    y = np.array([0, 0, 0, 2], np.int32)
    got = tessel.jit(lambda x, y: tnp.maximum(x, y))(tessel.device_put(x), tessel.device_put(y)).fetch()
    np.testing.assert_array_equal(got, np.asarray(jnp.maximum(x, y)))
    a = np.array([np.nan, 1.0, -np.inf], np.float32)
    b = np.array([1.0, np.nan, 2.0], np.float32)
    got = tessel.jit(lambda a, b: (tnp.maximum(a, b), tnp.max(a)))(tessel.device_put(a), tessel.device_put(b))
    np.testing.assert_array_equal(np.isnan(got[0].fetch()), np.isnan(np.asarray(jnp.maximum(a, b))))
    assert np.isnan(got[1].fetch()) and np.isnan(np.asarray(jnp.max(a)))


def test_the_harness_bounds_linalg_by_the_condition_number():
    """A determinant and a solve of a well-conditioned matrix: LAPACK's
    rounding is inside the oracle's range, an error of 0.1% is not."""
    m = np.array([[2.0, 0.5], [0.5, 3.0]], np.float32)
    b = np.array([[1.0], [-2.0]], np.float32)
    p = programs.Program(
        [("a", m), ("b", b)],
        [("v0", "xp.linalg.det(a)"), ("v1", "xp.linalg.solve(a, b)")],
        ["v0", "v1"],
        {"a": True, "b": True, "v0": False, "v1": False},
    )
    runs = oracle.reference_runs(p, p.arrays)
    for k, want in enumerate((np.linalg.det(m), np.linalg.solve(m, b))):
        outs = [r[k] for r in runs]
        assert oracle.mismatch(want, outs, exact=False) is None
        assert oracle.mismatch((want * np.float32(1.001)).astype(np.float32), outs, exact=False)


def test_the_harness_finds_a_wrong_result():
    """The oracle is not vacuous: a result one ulp off, a flipped integer or
    a zero of the wrong sign is a mismatch; rounding inside the perturbed
    range is not."""
    p = programs.Program(
        [("a", np.array([0.5, -1.0], np.float32))],
        [("v0", "xp.exp(a)"), ("v1", "(a * 2)")],
        ["v0", "v1"],
        {"a": True, "v0": False, "v1": True},
    )
    runs = oracle.reference_runs(p, p.arrays)
    exp_runs, dbl_runs = [r[0] for r in runs], [r[1] for r in runs]
    assert oracle.mismatch(np.exp(p.arrays[0]), exp_runs, exact=False) is None
    assert oracle.mismatch(np.exp(p.arrays[0]) * np.float32(1.01), exp_runs, exact=False)
    assert oracle.mismatch(p.arrays[0] * 2, dbl_runs, exact=True) is None
    assert oracle.mismatch(np.nextafter(p.arrays[0] * 2, np.float32(9)), dbl_runs, exact=True)
    assert oracle.mismatch(np.array([-0.0], np.float32), [np.array([0.0], np.float32)], exact=True)
    assert oracle.mismatch(np.array([1, 3]), [np.array([1, 2])], exact=True)
    assert oracle.mismatch(np.array([1, 2], np.int32), [np.array([1, 2])], exact=True)  # dtype
