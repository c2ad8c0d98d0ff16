"""The Kubernetes manifests (deploy/k8s): the base and the GPU overlay
(its patch merged as kustomize merges it: containers by name, maps key by
key) validated with kubernetes-validate against a recent Kubernetes, and
the properties an operator relies on checked one by one."""

import copy
import pathlib
import subprocess
import sys
import tempfile

import yaml

K8S = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.33.0"


def load(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def merge(base, patch):
    """A strategic merge patch: maps merge key by key; lists of named maps
    merge by name; other values replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in base + patch)
    ):
        out = [copy.deepcopy(x) for x in base]
        for p in patch:
            hit = [i for i, x in enumerate(out) if x["name"] == p["name"]]
            if hit:
                out[hit[0]] = merge(out[hit[0]], p)
            else:
                out.append(copy.deepcopy(p))
        return out
    return copy.deepcopy(patch)


def overlay(docs, patches):
    out = []
    for d in docs:
        for p in patches:
            if (p["kind"], p["metadata"]["name"]) == (d["kind"], d["metadata"]["name"]):
                d = merge(d, p)
        out.append(d)
    return out


def validate(docs, what):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump_all(docs, f)
        f.flush()
        r = subprocess.run(
            [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", VERSION, f.name],
            capture_output=True,
            text=True,
        )
    assert r.returncode == 0, f"{what}: kubernetes-validate failed:\n{r.stdout}{r.stderr}"


def check(docs, what):
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    workloads = by_kind.get("Deployment", []) + by_kind.get("StatefulSet", [])
    assert len(workloads) == 2, what
    for w in workloads:
        name = f"{what}: {w['kind']} {w['metadata']['name']}"
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod.get("automountServiceAccountToken") is False, name
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"], name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert c["resources"]["limits"]["memory"], name
            if c["name"] not in ("coordinator", "worker"):
                continue  # a sidecar: hardened as the daemons are, above
            # Secured: TLS and tokens from mounted Secrets, probed over TLS.
            command = " ".join(c["command"])
            for flag in ("--tls_cert=", "--tls_key=", "--tls_ca=", "--join_token_file="):
                assert flag in command, f"{name}: {flag} missing from its command"
            for probe in (c["livenessProbe"], c["readinessProbe"]):
                assert probe["exec"]["command"][:2] == ["tessel", "health"], name
                assert any(a.startswith("--tls-ca=") for a in probe["exec"]["command"]), name
        labels = w["spec"]["selector"]["matchLabels"]
        assert any(
            p["spec"]["selector"]["matchLabels"] == labels for p in by_kind["PodDisruptionBudget"]
        ), f"{name}: no PodDisruptionBudget selects it"
    assert any(
        p["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "worker"
        for p in by_kind["NetworkPolicy"]
    ), f"{what}: no NetworkPolicy confines the workers' ports"
    for s in by_kind["StatefulSet"]:
        svc = [v for v in by_kind["Service"] if v["metadata"]["name"] == s["spec"]["serviceName"]]
        assert (
            svc and svc[0]["spec"].get("clusterIP") == "None"
        ), f"{what}: StatefulSet {s['metadata']['name']} names no headless Service '{s['spec']['serviceName']}'"


def main():
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == ["checkpoints.yaml", "coordinator.yaml", "worker.yaml"]
    base = [d for r in kustomization["resources"] for d in load(K8S / "base" / r)]
    # Every worker mounts the shared checkpoint volume where --checkpoint_root says.
    claims = {d["metadata"]["name"] for d in base if d["kind"] == "PersistentVolumeClaim"}
    pod = [d for d in base if d["kind"] == "StatefulSet"][0]["spec"]["template"]["spec"]
    volume = [v for v in pod["volumes"] if "persistentVolumeClaim" in v][0]
    assert volume["persistentVolumeClaim"]["claimName"] in claims
    mount = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]][0]
    assert f"--checkpoint_root={mount['mountPath']}" in pod["containers"][0]["command"][-1]
    assert "ReadWriteMany" in [d for d in base if d["kind"] == "PersistentVolumeClaim"][0]["spec"]["accessModes"]
    drain = int(pod["containers"][0]["command"][-1].split("--drain_s=")[1].split()[0])
    assert drain < pod["terminationGracePeriodSeconds"], "the drain must end within the grace period"
    validate(base, "base")
    check(base, "base")
    gpu_k = yaml.safe_load((K8S / "overlays" / "gpu" / "kustomization.yaml").read_text())
    patches = [d for p in gpu_k["patches"] for d in load(K8S / "overlays" / "gpu" / p["path"])]
    gpu = overlay(base, patches)
    validate(gpu, "gpu overlay")
    check(gpu, "gpu overlay")
    worker = [d for d in gpu if d["kind"] == "StatefulSet"][0]["spec"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--device_kind=cuda" in worker["command"][-1]
    assert worker["securityContext"]["readOnlyRootFilesystem"]  # kept from the base
    check_metrics_overlay(base)
    print(f"deploy/k8s: base, gpu and metrics overlays valid for Kubernetes {VERSION}; checks passed")


def check_metrics_overlay(base):
    """The metrics overlay: each daemon serves its metrics on loopback only,
    a sidecar proxies them over mutual TLS, and a ServiceMonitor scrapes
    each daemon's Service by a port that reaches that sidecar."""
    root = K8S / "overlays" / "metrics"
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    patches = [d for p in k["patches"] for d in load(root / p["path"])]
    added = [d for r in k["resources"] if not r.startswith("..") for d in load(root / r)]
    docs = overlay(base, patches) + added
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    core = [d for d in docs if d["kind"] != "ServiceMonitor"]  # a CRD: checked below, by hand
    validate(core, "metrics overlay")
    check(core, "metrics overlay")
    services = [d for d in docs if d["kind"] == "Service"]
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    assert {m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for m in monitors} == {
        "coordinator",
        "worker",
    }
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        labels = m["spec"]["selector"]["matchLabels"]
        svc = [s for s in services if all(s["metadata"]["labels"].get(a) == b for a, b in labels.items())]
        assert len(svc) == 1, m["metadata"]["name"]
        (w,) = [w for w in workloads if w["spec"]["selector"]["matchLabels"] == svc[0]["spec"]["selector"]]
        pod = w["spec"]["template"]["spec"]
        for e in m["spec"]["endpoints"]:
            assert e["scheme"] == "https" and e["path"] == "/metrics"
            tls = e["tlsConfig"]
            assert {tls["ca"]["secret"]["key"], tls["cert"]["secret"]["key"], tls["keySecret"]["key"]} == {
                "ca.crt",
                "tls.crt",
                "tls.key",
            }
            assert tls["serverName"] == w["metadata"]["name"]  # the name the daemon's certificate carries
            (port,) = [p for p in svc[0]["spec"]["ports"] if p["name"] == e["port"]]
            (proxy,) = [
                c for c in pod["containers"] if any(p["name"] == port["targetPort"] for p in c.get("ports", []))
            ]
            args = " ".join(proxy["args"])
            assert "--cacert=" in args and "--allow-cn=prometheus" in args, args
            daemon = [c for c in pod["containers"] if c["name"] == w["metadata"]["name"].split("-")[-1]][0]
            target = args.split("--target=")[1].split()[0]
            assert target.startswith("127.0.0.1:"), target
            assert f"--metrics_address={target}" in " ".join(daemon["command"]), daemon["command"]
    # The policy opens the workers' metrics port only, to Prometheus' namespace.
    (policy,) = [d for d in added if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    assert [p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]] == [9443]


if __name__ == "__main__":
    main()
