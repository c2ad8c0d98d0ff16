"""The seed scenarios written as a user would write them in Python.

000: a host loop over two jitted steps must move nothing to the host, donate
     every buffer it says it donates, never recompile and not grow memory -
     and each way of breaking that is caught, with a message that says what.
001: constants made inside a step are generated on each device, never
     shipped, and results stay on the devices until fetched.
"""

import numpy as np
import pytest

import tessel
import tessel.numpy as tnp

N = 1024
STEPS = 200


def f1(state):
    x = state["x"]
    return {"x": tnp.tanh(x * 0.5) + 0.25, "count": state["count"] + 1}


def f2(state):
    x = state["x"]
    return {"x": x - 0.125 * tnp.mean(x), "count": state["count"] * 1}


def naive_loop(x0, steps):
    x = x0.astype(np.float32)
    for _ in range(steps):
        x = np.tanh(x * np.float32(0.5)) + np.float32(0.25)
        x = x - np.float32(0.125) * np.float32(np.mean(x, dtype=np.float64))
    return x


def initial_state():
    x0 = np.linspace(-2, 2, N, dtype=np.float32)
    return x0, {"x": tessel.device_put(x0), "count": tessel.device_put(np.int32(0))}


def test_seed_loop_moves_nothing_donates_everything_and_never_recompiles(session):
    fn1 = tessel.jit(f1, donate_argnums=0)
    fn2 = tessel.jit(f2, donate_argnums=0)
    x0, state = initial_state()
    # Ahead-of-time compiles; the plans say the donations are in place.
    for fn in (fn1, fn2):
        plan = fn.lower(state)
        assert [a["output"] >= 0 for a in plan.aliases] == [True, True], plan.aliases
        assert "(in place)" in plan.as_text()
    before = tessel.stats()
    receipts = []
    with tessel.transfer_guard("disallow"), tessel.forbid_compiles(), tessel.assert_no_memory_growth():
        for i in range(STEPS):
            state = fn1(state)
            state = fn2(state)
            if i % 50 == 0:
                receipts += fn1.donation_receipts() + fn2.donation_receipts()
    after = tessel.stats()
    assert after["bytes_device_to_host"] == before["bytes_device_to_host"]
    assert after["bytes_host_to_device"] == before["bytes_host_to_device"]
    assert after["bytes_device_to_device"] == before["bytes_device_to_device"]
    assert after["compiles"] == before["compiles"] == 2
    assert after["donations"] - before["donations"] == 2 * 2 * STEPS
    state["x"].block_until_ready()
    assert tessel.stats()["donations_reused"] - before["donations_reused"] == 2 * 2 * STEPS
    assert receipts and all(r["reused"] for r in receipts), receipts
    # Outside the guarded block, the explicit fetch is the only transfer.
    np.testing.assert_allclose(state["x"].fetch(), naive_loop(x0, STEPS), rtol=1e-5, atol=1e-6)
    assert int(state["count"].fetch()) == STEPS


def test_a_stray_read_in_the_loop_is_refused_and_named(session):
    fn1 = tessel.jit(f1, donate_argnums=0)
    _, state = initial_state()
    with tessel.transfer_guard("disallow"):
        state = fn1(state)
        with pytest.raises(tessel.TransferGuardError) as e:
            print(state["x"])  # host-side logic touching a device value
        msg = str(e.value)
        assert "device->host" in msg and f"{state['x'].handle:#x}" in msg and "4096 bytes" in msg, msg
        with pytest.raises(tessel.TransferGuardError):
            float(state["count"])
        # An explicit fetch is still allowed under "disallow" ...
        assert state["count"].fetch() == 1
    # ... but not under "disallow_explicit".
    with tessel.transfer_guard(device_to_host="disallow_explicit"):
        with pytest.raises(tessel.TransferGuardError, match="device->host"):
            state["x"].fetch()


def test_a_host_value_passed_as_an_argument_is_an_implicit_transfer(session):
    fn1 = tessel.jit(f1)
    with tessel.transfer_guard(host_to_device="disallow"):
        with pytest.raises(tessel.TransferGuardError, match="host->device"):
            fn1({"x": np.zeros(N, np.float32), "count": np.int32(0)})
    out = fn1({"x": np.zeros(N, np.float32), "count": np.int32(0)})  # allowed by default
    assert int(out["count"].fetch()) == 1


def test_a_changed_signature_is_refused_and_explained(session):
    fn1 = tessel.jit(f1, donate_argnums=0)
    _, state = initial_state()
    state = fn1(state)
    # The seed's mistake: a value initialised as int where float was meant.
    wrong = {"x": state["x"], "count": tessel.device_put(np.float32(0))}
    with tessel.forbid_compiles():
        with pytest.raises(tessel.RecompileError) as e:
            fn1(wrong)
    msg = str(e.value)
    assert "argument state['count']: int32[] -> float32[]" in msg, msg
    assert "forbids new compiles" in msg, msg


def test_a_donation_that_cannot_happen_is_visible_and_strict_makes_it_an_error(session):
    def shrink(state):
        return state[: N // 2] * 2.0  # no output has the donated parameter's type

    f = tessel.jit(shrink, donate_argnums=0)
    x = tessel.device_put(np.ones(N, np.float32))
    f(x)
    r = f.donation_receipts()
    assert len(r) == 1 and not r[0]["reused"] and "f32[1024]" in r[0]["reason"], r
    assert x.is_deleted()  # donated all the same: the array is gone
    with tessel.session_options(strict_donation=True):
        g = tessel.jit(shrink, donate_argnums=0)
        with pytest.raises(tessel.InvalidArgumentError, match="parameter 0 'state'"):
            g(tessel.device_put(np.ones(N, np.float32)))


def test_keeping_old_states_alive_is_caught_as_memory_growth(session):
    fn1 = tessel.jit(f1)  # forgot to donate ...
    _, state = initial_state()
    history = []
    with pytest.raises(tessel.FailedPreconditionError) as e:
        with tessel.assert_no_memory_growth():
            for _ in range(5):
                history.append(state)  # ... and kept every state
                state = fn1(state)
    assert "memory grew" in str(e.value) and "made by f1 in execution" in str(e.value), str(e.value)


def test_using_a_donated_array_again_names_the_execution(session):
    fn1 = tessel.jit(f1, donate_argnums=0)
    _, state = initial_state()
    old = state
    state = fn1(state)
    assert old["x"].is_deleted()
    with pytest.raises(tessel.DonatedArrayError) as e:
        fn1(old)
    assert "was donated to execution" in str(e.value) and "'f1'" in str(e.value)


def test_seed_001_constants_are_generated_on_each_device_and_results_stay_there(session):
    big = 1 << 22  # 16 MiB of f32 per device

    @tessel.jit(replicated=True)
    def foo(x):
        z = tnp.zeros((big,), tnp.float32)
        return z[: x.shape[0]] + x

    x = tessel.device_put(np.arange(16, dtype=np.float32), tessel.ReplicatedSharding())
    plan = foo.lower(x)
    assert "fill=0" in plan.as_text() and "literal" not in plan.as_text(), plan.as_text()
    before = tessel.stats()
    y = foo(x)
    y.block_until_ready()
    after = tessel.stats()
    assert after["bytes_host_to_device"] == before["bytes_host_to_device"]  # nothing shipped
    assert after["bytes_device_to_host"] == before["bytes_device_to_host"]  # nothing gathered
    assert y.sharding == tessel.ReplicatedSharding()
    assert y.devices() == tuple(d.id for d in tessel.devices())  # on every device
    np.testing.assert_array_equal(y.fetch(), np.arange(16, dtype=np.float32))
