"""A secured cluster as an operator runs it and as an attacker on the same
network meets it: TLS on every port (mutual between the daemons), client
tokens mapped to tenants with the operator's quotas, a join token for
workers, and each worker's service open only to its coordinator. Real
daemons on loopback; certificates made with the openssl command; every
attack is a real gRPC call that must be refused with the stated code, after
which the cluster still computes what numpy computes."""

import os
import queue
import subprocess
import time

import grpc
import numpy as np
import pytest

import tessel
from tessel import Mesh, NamedSharding, P, _context, errors
from tessel._cluster import find_binary
from tessel._channel import make_channel
from tessel.v1 import admin_pb2, admin_pb2_grpc, common_pb2, session_pb2, session_pb2_grpc, worker_pb2
from tessel.v1 import worker_pb2_grpc

from test_service import free_port


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        cwd=d,
    )
    return os.path.join(d, f"{name}.pem")


def make_cert(d, ca, name):
    """A certificate for 127.0.0.1 and localhost signed by `ca`, good for
    serving and for presenting as a client."""
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=d,
    )
    openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.pem",
        cwd=d,
    )
    return os.path.join(d, f"{name}.pem"), os.path.join(d, f"{name}.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    ca = make_ca(d, "ca")
    cert, key = make_cert(d, "ca", "daemon")
    make_ca(d, "rogue-ca")
    rogue_cert, rogue_key = make_cert(d, "rogue-ca", "rogue")
    with open(os.path.join(d, "tokens"), "w") as f:
        f.write(
            "# token tenant options\n"
            "alice-token alice memory_quota=1MiB max_sessions=2\n"
            "bob-token   bob\n"
            "ops-token   ops admin\n"
        )
    with open(os.path.join(d, "join"), "w") as f:
        f.write("join-3f9c1a7e5b\n")
    return dict(
        dir=d,
        ca=ca,
        cert=cert,
        key=key,
        rogue_cert=rogue_cert,
        rogue_key=rogue_key,
        tokens=os.path.join(d, "tokens"),
        join=os.path.join(d, "join"),
    )


def tls_flags(pki):
    return [f"--tls_cert={pki['cert']}", f"--tls_key={pki['key']}", f"--tls_ca={pki['ca']}"]


@pytest.fixture(scope="module")
def secured(pki):
    previous = _context.default_session_or_none()
    with tessel.LocalCluster(
        2,
        2,
        coordinator_flags=tls_flags(pki) + [f"--auth_tokens_file={pki['tokens']}", f"--join_token_file={pki['join']}"],
        worker_flags=tls_flags(pki) + [f"--join_token_file={pki['join']}"],
        client=dict(token="ops-token", tls_ca=pki["ca"]),
    ) as c:
        yield c
    _context.set_default_session(previous)


def stubs(address, **kw):
    ch = make_channel(address, **kw)
    return (session_pb2_grpc.SessionStub(ch), admin_pb2_grpc.AdminStub(ch), admin_pb2_grpc.RegistryStub(ch))


def code_of(call, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as e:
        call(*args, timeout=10, **kwargs)
    return e.value.code(), e.value.details()


def sharded_sum_matches_numpy():
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    mesh = Mesh({"data": 2, "model": 2})
    a = tessel.device_put(x, NamedSharding(mesh, P("data", "model")))
    got = tessel.jit(lambda v: tessel.numpy.sum(v * 2, axis=0))(a).fetch()
    np.testing.assert_allclose(got, (x * 2).sum(axis=0))


def test_secured_cluster_computes_over_tls_with_collectives(secured):
    _context.set_default_session(secured.session)
    sharded_sum_matches_numpy()  # its all-reduce crosses the two workers


def test_plaintext_and_unverified_clients_cannot_reach_a_tls_coordinator(secured, pki):
    session, _, _ = stubs(secured.address, token="ops-token", tls_ca="")
    code, _ = code_of(session.GetVersion, common_pb2.GetVersionRequest())
    assert code == grpc.StatusCode.UNAVAILABLE
    # A client trusting another CA refuses the coordinator's certificate.
    session, _, _ = stubs(secured.address, token="ops-token", tls_ca=pki["dir"] + "/rogue-ca.pem")
    code, _ = code_of(session.GetVersion, common_pb2.GetVersionRequest())
    assert code == grpc.StatusCode.UNAVAILABLE


def test_sessions_need_a_known_token(secured, pki):
    for token in ("", "mallory-token"):
        session, _, _ = stubs(secured.address, token=token, tls_ca=pki["ca"])
        code, details = code_of(session.OpenSession, session_pb2.OpenSessionRequest(client="x"))
        assert code == grpc.StatusCode.UNAUTHENTICATED, details
    with pytest.raises(errors.TesselError, match="token"):
        tessel.connect(secured.address, tls_ca=pki["ca"], token="mallory-token", make_default=False)


def test_a_tenant_cannot_touch_another_tenants_session(secured, pki):
    alice = tessel.connect(secured.address, token="alice-token", tls_ca=pki["ca"])
    try:
        x = np.arange(12, dtype=np.float32)
        a = tessel.device_put(x)
        session, _, _ = stubs(secured.address, token="bob-token", tls_ca=pki["ca"])
        attacks = [
            (session.ArrayInfo, session_pb2.ArrayInfoRequest(session_id=alice.id, handle=a.handle)),
            (session.Delete, session_pb2.DeleteRequest(session_id=alice.id, handles=[a.handle])),
            (session.Stats, session_pb2.StatsRequest(session_id=alice.id)),
            (session.CloseSession, session_pb2.CloseSessionRequest(session_id=alice.id)),
            (session.SetSessionOptions, session_pb2.SetSessionOptionsRequest(session_id=alice.id)),
        ]
        for call, req in attacks:
            code, details = code_of(call, req)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (call, details)
        code, _ = code_of(
            lambda r, timeout: list(session.Fetch(r, timeout=timeout)),
            session_pb2.FetchRequest(session_id=alice.id, handle=a.handle),
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # Pipelined calls naming alice's session are refused one by one.
        replies = list(
            session.Dispatch(
                iter(
                    [
                        session_pb2.DispatchBatch(
                            calls=[session_pb2.ExecuteRequest(session_id=alice.id, executable_id="x", wait=True)]
                        )
                    ]
                ),
                timeout=10,
            )
        )
        assert replies[0].replies[0].code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        # Alice's array is untouched.
        np.testing.assert_array_equal(a.fetch(), x)
    finally:
        _context.set_default_session(secured.session)
        alice.close()


def test_admin_needs_an_admin_token_and_lists_tenants(secured, pki):
    alice = tessel.connect(secured.address, token="alice-token", tls_ca=pki["ca"], make_default=False)
    try:
        _, admin, _ = stubs(secured.address, token="bob-token", tls_ca=pki["ca"])
        code, details = code_of(admin.GetCluster, admin_pb2.GetClusterRequest())
        assert code == grpc.StatusCode.PERMISSION_DENIED and "admin" in details
        code, _ = code_of(admin.ListSessions, admin_pb2.ListSessionsRequest())
        assert code == grpc.StatusCode.PERMISSION_DENIED
        _, admin, _ = stubs(secured.address, token="ops-token", tls_ca=pki["ca"])
        sessions = admin.ListSessions(admin_pb2.ListSessionsRequest(), timeout=10).sessions
        assert {s.session_id: s.tenant for s in sessions}[alice.id] == "alice"
    finally:
        alice.close()


def test_tenant_quota_and_session_limit_come_from_the_operator(secured, pki):
    alice = tessel.connect(secured.address, token="alice-token", tls_ca=pki["ca"])
    try:
        kept = tessel.device_put(np.zeros(150_000, np.float32))  # 600 KB
        # The session lifts its own quota; the tenant's (1 MiB) still holds.
        with tessel.session_options(memory_quota_bytes=0):
            with pytest.raises(errors.TesselError, match="tenant alice memory quota") as e:
                tessel.device_put(np.zeros(150_000, np.float32)).fetch()
        assert e.value.code == "RESOURCE_EXHAUSTED"
        second = tessel.connect(secured.address, token="alice-token", tls_ca=pki["ca"], make_default=False)
        with pytest.raises(errors.TesselError, match="max_sessions=2"):
            tessel.connect(secured.address, token="alice-token", tls_ca=pki["ca"], make_default=False)
        second.close()
        third = tessel.connect(secured.address, token="alice-token", tls_ca=pki["ca"], make_default=False)
        third.close()
        # Bob's tenant has no quota: alice's use does not bound him.
        bob = tessel.connect(secured.address, token="bob-token", tls_ca=pki["ca"])
        tessel.device_put(np.zeros(150_000, np.float32)).fetch()
        tessel.device_put(np.zeros(150_000, np.float32)).fetch()
        bob.close()
        del kept
    finally:
        _context.set_default_session(secured.session)
        alice.close()


def live_worker(address, pki):
    _, admin, _ = stubs(address, token="ops-token", tls_ca=pki["ca"])
    return admin.GetCluster(admin_pb2.GetClusterRequest(), timeout=10).workers[0]


def test_only_joined_workers_register_heartbeat_and_meet(secured, pki):
    w = live_worker(secured.address, pki)
    _, _, registry = stubs(secured.address, tls_ca=pki["ca"], token="")
    code, _ = code_of(
        registry.RegisterWorker,
        admin_pb2.RegisterWorkerRequest(
            address="127.0.0.1:1", num_devices=1, protocol_version=1, worker_secret="x" * 32
        ),
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # Even with the join token, nobody else speaks for a registered worker
    # or reads or writes its groups' rendezvous keys.
    _, _, registry = stubs(secured.address, tls_ca=pki["ca"], token="join-3f9c1a7e5b")
    code, _ = code_of(registry.Heartbeat, admin_pb2.HeartbeatRequest(worker_id=w.worker_id, worker_secret="0" * 32))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    key = "devices:0,1,2,3@1/rank_0"
    code, _ = code_of(
        registry.KvSet, admin_pb2.KvSetRequest(key=key, value=b"x", worker_id=w.worker_id, worker_secret="0" * 32)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = code_of(registry.KvGet, admin_pb2.KvGetRequest(key=key, worker_id=w.worker_id))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    _context.set_default_session(secured.session)
    sharded_sum_matches_numpy()


def worker_stub(address, pki, cert=None, key=None):
    creds = grpc.ssl_channel_credentials(
        open(pki["ca"], "rb").read(), open(key, "rb").read() if key else None, open(cert, "rb").read() if cert else None
    )
    return worker_pb2_grpc.WorkerStub(grpc.secure_channel(address, creds))


def test_worker_port_refuses_everyone_but_its_coordinator(secured, pki):
    w = live_worker(secured.address, pki)
    # Without a certificate the CA signed, no TLS connection at all.
    for cert, key in ((None, None), (pki["rogue_cert"], pki["rogue_key"])):
        code, _ = code_of(worker_stub(w.address, pki, cert, key).GetStats, worker_pb2.WorkerStatsRequest())
        assert code == grpc.StatusCode.UNAVAILABLE
    # With a cluster certificate but not the worker's secret: refused.
    stub = worker_stub(w.address, pki, pki["cert"], pki["key"])
    code, _ = code_of(
        lambda r, timeout: list(stub.FetchShard(r, timeout=timeout)), worker_pb2.FetchShardRequest(device=0, buffer=1)
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, _ = code_of(stub.Free, worker_pb2.FreeRequest(device=0, seq=1 << 40, queue_epoch=1))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    _context.set_default_session(secured.session)
    sharded_sum_matches_numpy()  # the claimed step numbers never reached the queue


def test_plaintext_cluster_worker_port_and_registry_refuse_strangers(cluster):
    """The default loopback cluster (no TLS, no tokens) still keeps strangers
    off its workers and out of their names."""
    admin = admin_pb2_grpc.AdminStub(grpc.insecure_channel(cluster.address))
    w = admin.GetCluster(admin_pb2.GetClusterRequest(), timeout=10).workers[0]
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(w.address))
    code, _ = code_of(
        lambda r, timeout: list(stub.FetchShard(r, timeout=timeout)), worker_pb2.FetchShardRequest(device=0, buffer=1)
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, _ = code_of(stub.Free, worker_pb2.FreeRequest(device=0, seq=1 << 40, queue_epoch=1))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    registry = admin_pb2_grpc.RegistryStub(grpc.insecure_channel(cluster.address))
    code, _ = code_of(registry.Heartbeat, admin_pb2.HeartbeatRequest(worker_id=w.worker_id))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = code_of(registry.KvGet, admin_pb2.KvGetRequest(key="devices:0,1@1/x", worker_id=w.worker_id))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    _context.set_default_session(cluster.session)
    sharded_sum_matches_numpy()


@pytest.mark.parametrize("daemon", ["tessel-coordinator", "tessel-worker"])
def test_plaintext_off_loopback_needs_insecure(daemon):
    args = [find_binary(daemon), "--host=0.0.0.0", "--port=0", "--coordinator=127.0.0.1:1", "--register_timeout_s=1"]
    if daemon == "tessel-coordinator":
        args = args[:3]
    p = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--insecure" in p.stdout + p.stderr and "not a loopback address" in p.stdout + p.stderr


def served_subject(port):
    out = subprocess.run(
        f"openssl s_client -connect 127.0.0.1:{port} </dev/null 2>/dev/null | " "openssl x509 -noout -subject",
        shell=True,
        capture_output=True,
        text=True,
    ).stdout
    return out.strip()


def test_certificates_are_reloaded_when_their_files_change(pki, tmp_path):
    d = str(tmp_path)
    for f in ("ca.pem", "ca.key"):
        with open(os.path.join(pki["dir"], f), "rb") as src, open(os.path.join(d, f), "wb") as dst:
            dst.write(src.read())
    cert, key = make_cert(d, "ca", "first")
    port = free_port()
    p = subprocess.Popen(
        [
            find_binary("tessel-coordinator"),
            f"--port={port}",
            f"--tls_cert={cert}",
            f"--tls_key={key}",
            f"--tls_ca={pki['ca']}",
            "--tls_reload_s=1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while "CN = first" not in served_subject(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "CN = first" in served_subject(port)
        new_cert, new_key = make_cert(d, "ca", "second")
        os.replace(new_key, key)
        os.replace(new_cert, cert)
        deadline = time.monotonic() + 15
        while "CN = second" not in served_subject(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "CN = second" in served_subject(port)
    finally:
        p.terminate()
        p.wait(10)


def test_tokens_file_changes_apply_without_a_restart(tmp_path):
    """An operator revokes one token and issues another by rewriting the
    tokens file: the revoked token is refused from then on, the new one works,
    and a file that no longer parses leaves the tokens in force."""
    tokens = str(tmp_path / "tokens")

    def write(text):
        with open(tokens + ".tmp", "w") as f:
            f.write(text)
        os.replace(tokens + ".tmp", tokens)

    write("alice-token alice\n")
    port = free_port()
    log = open(tmp_path / "coordinator.log", "w")
    p = subprocess.Popen(
        [find_binary("tessel-coordinator"), f"--port={port}", f"--auth_tokens_file={tokens}", "--auth_reload_s=1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    address = f"127.0.0.1:{port}"

    def open_code(token):
        session, _, _ = stubs(address, token=token)
        try:
            session.OpenSession(session_pb2.OpenSessionRequest(client="x"), timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    def eventually(token, code):
        deadline = time.monotonic() + 15
        while open_code(token) != code and time.monotonic() < deadline:
            time.sleep(0.2)
        return open_code(token)

    try:
        assert eventually("alice-token", grpc.StatusCode.OK) == grpc.StatusCode.OK
        assert open_code("carol-token") == grpc.StatusCode.UNAUTHENTICATED
        # A Dispatch stream alice opened before the change.
        alice, _, _ = stubs(address, token="alice-token")
        sid = alice.OpenSession(session_pb2.OpenSessionRequest(client="x"), timeout=10).session_id
        batches = queue.Queue()
        replies = alice.Dispatch(iter(batches.get, None))

        def dispatch_code():
            batches.put(
                session_pb2.DispatchBatch(
                    calls=[
                        session_pb2.ExecuteRequest(
                            session_id=sid, executable_id="no-such-executable", outputs=[7], wait=True
                        )
                    ]
                )
            )
            return next(replies).replies[0].code

        assert dispatch_code() == grpc.StatusCode.NOT_FOUND.value[0]  # alice may call; the executable is unknown
        write("carol-token carol\n")
        assert eventually("alice-token", grpc.StatusCode.UNAUTHENTICATED) == grpc.StatusCode.UNAUTHENTICATED
        assert open_code("carol-token") == grpc.StatusCode.OK
        assert dispatch_code() == grpc.StatusCode.UNAUTHENTICATED.value[0]  # the open stream too
        batches.put(None)
        write("carol-token carol max_sessions=many\n")
        deadline = time.monotonic() + 15
        while (
            "previous tokens stay in force" not in open(tmp_path / "coordinator.log").read()
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        text = open(tmp_path / "coordinator.log").read()
        assert "previous tokens stay in force" in text and "max_sessions" in text, text
        assert open_code("carol-token") == grpc.StatusCode.OK
        assert p.poll() is None  # still serving
    finally:
        p.terminate()
        p.wait(10)
        log.close()


def test_metrics_endpoint_asks_for_basic_auth_and_stays_on_loopback(pki, tmp_path):
    """--metrics_auth_file makes a scrape present basic auth; the endpoint is
    plaintext HTTP, so off loopback it needs --insecure even when the
    daemon's own port has TLS."""
    import base64
    import urllib.error
    import urllib.request

    auth = tmp_path / "metrics-auth"
    auth.write_text("prometheus:s3cr3t-scrape\n")
    port_file = tmp_path / "metrics.port"
    p = subprocess.Popen(
        [
            find_binary("tessel-coordinator"),
            "--port=0",
            *tls_flags(pki),
            "--metrics_address=127.0.0.1:0",
            f"--metrics_port_file={port_file}",
            f"--metrics_auth_file={auth}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while not port_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        port = int(port_file.read_text())

        def get(credentials=None):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
            if credentials:
                req.add_header("Authorization", "Basic " + base64.b64encode(credentials.encode()).decode())
            return urllib.request.urlopen(req, timeout=10).read().decode()

        assert "tessel_sessions" in get("prometheus:s3cr3t-scrape")
        for wrong in (None, "prometheus:guess", "someone:s3cr3t-scrape"):
            with pytest.raises(urllib.error.HTTPError) as e:
                get(wrong)
            assert e.value.code == 401
        assert p.poll() is None
    finally:
        p.terminate()
        p.wait(10)
    for flags in ([], tls_flags(pki)):
        r = subprocess.run(
            [find_binary("tessel-coordinator"), "--port=0", *flags, "--metrics_address=0.0.0.0:0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 2
        assert "--metrics_address=0.0.0.0:0 is not a loopback address" in r.stdout + r.stderr
    bad = tmp_path / "bad-auth"
    bad.write_text("no-colon-here\n")
    r = subprocess.run(
        [find_binary("tessel-coordinator"), "--port=0", "--metrics_address=127.0.0.1:0", f"--metrics_auth_file={bad}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "expected USER:PASSWORD" in r.stdout + r.stderr
