"""charts/rhizome through helm-python-sdk (Helm's Go SDK, no binary): `helm lint` clean,
every rendered object valid for Kubernetes 1.37 (kubernetes-validate, strict) with the
default values and with each documented option, least-privilege RBAC, probes on the gRPC
health service, unprivileged pods, bad values refused with the key named, and
deploy/kubernetes/rhizome.yaml equal to a fresh render."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import helm_python
import pytest

from tests.kubernetes.conftest import validate

pytestmark = pytest.mark.kubernetes

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rhizome"
# The chart's defaults plus the one value it cannot guess: where Elasticsearch is.
REQUIRED = {"elasticsearch": {"url": "http://elasticsearch.logging:9200"}}


def _render_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rz_render", ROOT / "deploy/kubernetes/render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RENDER = _render_module()


def merged(*layers: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merged(out[key], value)
            else:
                out[key] = value
    return out


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    return list(RENDER.render(merged(REQUIRED, values), name="rz", namespace="rhizome"))


def find(objects: list[dict[str, Any]], kind: str, suffix: str = "") -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]


# Each documented option of values.yaml, set away from its default.
OPTIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "standby": {"daemon": {"standby": True}},
    "persistence": {"daemon": {"persistence": {"enabled": True, "storageClass": "fast"}}},
    "scheduler-off": {"scheduler": {"enabled": False}},
    "scheduler-spread": {"scheduler": {"policy": "spread"}},
    "jobs-namespace": {"jobs": {"namespace": "team-a", "createNamespace": False}},
    "external-etcd": {"etcd": {"bundled": False, "external": "http://etcd.infra:2379"}},
    "bundled-mongodb": {"mongodb": {"bundled": True}},
    "bundled-elasticsearch": {"elasticsearch": {"bundled": True, "url": ""}},
    "quota": {"quotaConfig": "users:\n  alice: {V100: 4}\n"},
    "admin-token-secret": {"adminTokenSecret": "rhizome-admin"},
    "tls": {"tls": {"secretName": "rhizome-tls"}},
    "api-from": {
        "networkPolicy": {"apiFrom": [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]}
    },
    "network-policy-off": {"networkPolicy": {"enabled": False}},
    "pdb-off": {"daemon": {"standby": True}, "podDisruptionBudget": {"enabled": False}},
    "service-lb": {"service": {"type": "LoadBalancer"}},
    "ingress": {"ingress": {"enabled": True, "host": "rhizome.example.com"}},
    "ingress-tls": {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "host": "rhizome.example.com",
            "annotations": {"nginx.ingress.kubernetes.io/proxy-body-size": "64m"},
            "tls": {"secretName": "rhizome-public-tls"},
        }
    },
    "placement": {
        "nodeSelector": {"pool": "system"},
        "tolerations": [{"key": "system", "operator": "Exists", "effect": "NoSchedule"}],
        "imagePullSecrets": [{"name": "regcred"}],
    },
}


def test_chart_lints_clean_through_the_helm_sdk() -> None:
    report = helm_python.lint(str(CHART), REQUIRED, strict=True, kube_version="v1.37.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_chart_renders_valid_objects(option: str) -> None:
    objects = render(OPTIONS[option])
    assert objects
    for obj in objects:
        validate(obj)


def test_chart_default_objects() -> None:
    objects = render({})
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == sorted(
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "Deployment",
            "Namespace",
            "NetworkPolicy",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
            "StatefulSet",
        ]
    )
    (deployment,) = find(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert find(objects, "PodDisruptionBudget") == []


def test_chart_standby_gets_two_replicas_and_a_pdb() -> None:
    objects = render(OPTIONS["standby"])
    (deployment,) = find(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    (pdb,) = find(objects, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1


def test_chart_tls_mounts_the_secret_and_passes_it_to_the_daemon() -> None:
    (deployment,) = find(render(OPTIONS["tls"]), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    daemon = next(c for c in pod["containers"] if c["name"] == "daemon")
    assert "--tls-cert=/etc/rhizome/tls/tls.crt" in daemon["args"]
    assert "--tls-key=/etc/rhizome/tls/tls.key" in daemon["args"]
    mount = next(m for m in daemon["volumeMounts"] if m["name"] == "tls")
    assert mount["mountPath"] == "/etc/rhizome/tls" and mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert volume["secret"] == {"secretName": "rhizome-tls", "defaultMode": 0o400}
    # the kubelet's gRPC probe cannot speak TLS: a TCP probe instead
    assert "tcpSocket" in daemon["readinessProbe"] and "grpc" not in daemon["readinessProbe"]
    (plain,) = find(render({}), "Deployment")
    plain_daemon = plain["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--tls-") for a in plain_daemon["args"])
    assert "grpc" in plain_daemon["readinessProbe"]


def test_chart_ingress_routes_rest_to_the_api_service_only_when_enabled() -> None:
    assert find(render({}), "Ingress") == []
    objects = render(OPTIONS["ingress-tls"])
    (ingress,) = find(objects, "Ingress")
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == [{"hosts": ["rhizome.example.com"], "secretName": "rhizome-public-tls"}]
    (rule,) = spec["rules"]
    assert rule["host"] == "rhizome.example.com"
    (path,) = rule["http"]["paths"]
    api = next(s for s in find(objects, "Service") if s["metadata"]["name"] == "rz-rhizome")
    assert path["backend"]["service"] == {"name": api["metadata"]["name"], "port": {"name": "rest"}}
    assert "rest" in [p["name"] for p in api["spec"]["ports"]]
    assert ingress["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/proxy-body-size": "64m"
    }
    (plain,) = find(render(OPTIONS["ingress"]), "Ingress")
    assert "tls" not in plain["spec"] and "ingressClassName" not in plain["spec"]


def test_chart_ingress_without_a_host_says_what_is_required() -> None:
    with pytest.raises(helm_python.HelmRenderError, match=r"ingress\.host is required"):
        render({"ingress": {"enabled": True}})


def test_chart_gives_learner_pods_the_internal_port_and_no_one_else() -> None:
    objects = render({})
    (deployment,) = find(objects, "Deployment")
    daemon = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--internal-address=0.0.0.0:50052" in daemon["args"]
    tds = next(a for a in daemon["args"] if a.startswith("--learner-tds-address="))
    internal = next(
        s for s in find(objects, "Service") if s["metadata"]["name"].endswith("-internal")
    )
    meta = internal["metadata"]
    assert tds == f"--learner-tds-address={meta['name']}.{meta['namespace']}.svc:50052"
    assert internal["spec"]["type"] == "ClusterIP"
    assert [p["port"] for p in internal["spec"]["ports"]] == [50052]
    policy = next(
        p for p in find(objects, "NetworkPolicy") if p["metadata"]["name"].endswith("-daemon")
    )
    rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 50052)
    sources = [next(iter(src)) for src in rule["from"]]
    assert sources == ["podSelector", "namespaceSelector"]  # platform pods, jobs' namespace
    public = [r for r in policy["spec"]["ingress"] if r is not rule]
    assert all(p["port"] != 50052 for r in public for p in r["ports"])


def test_chart_rbac_is_least_privilege() -> None:
    objects = render({})
    (role,) = find(objects, "Role")
    assert role["metadata"]["namespace"] == "rhizome-jobs"
    granted = {
        (res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]
    }
    assert ("pods/binding", "create") in granted
    assert ("secrets", "create") in granted and ("networkpolicies", "delete") in granted
    assert not any("*" in res or "*" in verb for res, verb in granted)
    (cluster_role,) = find(objects, "ClusterRole")
    for rule in cluster_role["rules"]:
        assert set(rule["resources"]) <= {"nodes", "pods"}
        assert set(rule["verbs"]) <= {"get", "list", "watch"}  # read only cluster-wide


def test_chart_probes_use_the_grpc_health_service() -> None:
    (deployment,) = find(render({}), "Deployment")
    daemon = next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "daemon"
    )
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert daemon[probe]["grpc"] == {"port": 50051}


def test_chart_pods_are_unprivileged() -> None:
    for obj in render({"mongodb": {"bundled": True}, "elasticsearch": {"bundled": True}}):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]


def test_chart_daemon_runs_the_kubernetes_backend_in_the_jobs_namespace() -> None:
    (deployment,) = find(render({"jobs": {"namespace": "team-a"}}), "Deployment")
    daemon = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in daemon["env"]}
    assert env["RHIZOME_BACKEND"] == "kubernetes"
    assert env["RHIZOME_K8S_NAMESPACE"] == "team-a"
    assert env["RHIZOME_ETCD"] == "http://rz-rhizome-etcd:2379"
    mongo = next(e for e in daemon["env"] if e["name"] == "RHIZOME_MONGODB_URI")
    assert mongo["valueFrom"]["secretKeyRef"] == {"name": "rhizome-mongodb", "key": "uri"}


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"jobs": {"namespace": "Bad_NS"}}, "/jobs/namespace"),
        ({"daemon": {"standbyy": True}}, "'standbyy' not allowed"),
        ({"scheduler": {"policy": "fastest"}}, "/scheduler/policy"),
        ({"service": {"grpcPort": 70000}}, "/service/grpcPort"),
        ({"ingress": {"enabled": True, "host": "Not A Host"}}, "/ingress/host"),
        ({"ingress": {"enabled": "yes"}}, "/ingress/enabled"),
    ],
)
def test_chart_bad_values_are_refused_naming_the_key(values: dict[str, Any], named: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=named):
        render(values)


def test_chart_without_elasticsearch_says_what_is_required() -> None:
    chart = helm_python.Chart.load(str(CHART))
    with pytest.raises(helm_python.HelmRenderError, match=r"elasticsearch\.url is required"):
        chart.render({}, name="rz", namespace="rhizome")


def test_plain_manifests_are_the_chart_rendered() -> None:
    committed = (ROOT / "deploy/kubernetes/rhizome.yaml").read_text()
    assert committed == RENDER.plain_manifest(), "run .venv/bin/python deploy/kubernetes/render.py"
