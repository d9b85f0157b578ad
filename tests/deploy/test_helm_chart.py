"""The Helm chart (deploy/helm/specd), proven without a cluster: rendered by Helm's own library
(helm-python-sdk binds Helm v4's Go SDK), linted strictly, every built-in object validated
against the Kubernetes schemas of the oldest and newest versions the chart claims
(kubernetes-validate, strict: unknown fields fail) and every custom resource against the schema
in its own vendored CRD (deploy/crds, VERSIONS.md), unknown fields failing there too. Then what
the chart promises: probes, rollout, drain timing, autoscaling on the queue, the pool, and a
config file specd itself accepts."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="the k8s test extra (pip install -e '.[test]')")
kv = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "specd"
CRDS = ROOT / "deploy" / "crds"
KUBE_VERSIONS = ["1.29.0", "1.37.0"]  # Chart.yaml's kubeVersion floor, and the newest schemas
EVERYTHING = {  # every optional object on
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "grafanaDashboards": {"enabled": True},
    "autoscaling": {"keda": {"enabled": True}},
    "inferencePool": {"enabled": True},
    "apiKey": {"existingSecret": "specd-keys"},
}
VALUE_SETS = {
    "default": {},
    "everything": EVERYTHING,
    "hpa": {"autoscaling": {"hpa": {"enabled": True}}},
    "scale-to-zero": {
        "autoscaling": {
            "keda": {
                "enabled": True,
                "scaleToZero": {"activationQuery": 'sum(rate(gw_requests_total{svc="x"}[2m]))'},
            }
        }
    },
    "compile-cache": {"compileCache": {"persistence": {"enabled": True}}},
    "compile-cache-claim": {
        "compileCache": {"persistence": {"enabled": True, "existingClaim": "warm-cache"}}
    },
    "gpu-llama": yaml.safe_load((CHART / "values-gpu-llama3.1-8b.yaml").read_text()),
    "gpu-qwen": yaml.safe_load((CHART / "values-gpu-qwen2.5-7b.yaml").read_text()),
}
GPU_VALUES = ["values-gpu-llama3.1-8b.yaml", "values-gpu-qwen2.5-7b.yaml"]


def render(values: dict) -> list[dict]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values, name="demo", namespace="llm", is_install=True)
    manifests = [text for path, text in out.items() if path.endswith(".yaml")]  # not NOTES.txt
    return [d for text in manifests for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    """kind -> the object (one of each); the Grafana dashboards' ConfigMap under
    "ConfigMap/dashboards" (the config's is "ConfigMap")."""
    out = {}
    for d in docs:
        key = d["kind"] + ("/dashboards" if d["metadata"]["name"].endswith("-dashboards") else "")
        assert key not in out, key
        out[key] = d
    return out


def go_pattern(pattern: str) -> str:
    """A CRD's (Go RE2) pattern as Python's re reads it: RE2 takes flags anywhere, Python only
    at the start (the PrometheusRule CRD's "^(?i)(abort|warn)?$" means "(?i)^(abort|warn)?$")."""
    return re.sub(r"^\^\(\?([a-zA-Z]+)\)", r"(?\1)^", pattern)


def closed(schema):
    """The CRD schema with unknown fields refused wherever the CRD lists the fields (the API
    server would prune them silently: a typo in the chart must fail here instead)."""
    if isinstance(schema, dict):
        schema = {
            k: go_pattern(v) if k == "pattern" and isinstance(v, str) else closed(v)
            for k, v in schema.items()
        }
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the served version's openAPIV3Schema, from each vendored CRD."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            if v.get("served"):
                out[(f"{group}/{v['name']}", kind)] = closed(v["schema"]["openAPIV3Schema"])
    return out


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_object_validates_strictly(name):
    docs = render(VALUE_SETS[name])
    custom = crd_schemas()
    kinds = set()
    for doc in docs:
        kinds.add(doc["kind"])
        key = (doc["apiVersion"], doc["kind"])
        if key in custom:
            jsonschema.validate(doc, custom[key])
            continue
        assert "." not in doc["apiVersion"].split("/")[0] or doc["apiVersion"].startswith(
            ("apps/", "policy/", "autoscaling/")
        ), f"{key}: a custom resource without a vendored CRD"
        for version in KUBE_VERSIONS:
            kv.validate(doc, version, strict=True)
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds


def test_the_vendored_crds_have_what_the_chart_renders():
    kinds = {"ScaledObject", "ServiceMonitor", "InferencePool", "PrometheusRule"}
    assert {k for _, k in crd_schemas()} >= kinds
    docs = by_kind(render(EVERYTHING))
    assert kinds <= set(docs)
    bad = copy.deepcopy(docs["ScaledObject"])
    bad["spec"]["triggers"][0]["metricTyp"] = "AverageValue"  # a typo must not pass
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, crd_schemas()[("keda.sh/v1alpha1", "ScaledObject")])
    bad = copy.deepcopy(docs["PrometheusRule"])
    bad["spec"]["groups"][1]["rules"][0]["fro"] = "5m"  # in an alert too
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, crd_schemas()[("monitoring.coreos.com/v1", "PrometheusRule")])


def test_the_vendored_crds_are_the_upstream_blobs_versions_md_records():
    """Byte for byte: each file's git blob id is the one VERSIONS.md names (upstream's)."""
    table = [
        [c.strip(" `") for c in line.strip("|").split("|")]
        for line in (CRDS / "VERSIONS.md").read_text().splitlines()
        if line.startswith("| `")
    ]
    recorded = {row[0]: row[-1] for row in table}
    assert set(recorded) == {p.name for p in CRDS.glob("*.yaml")}
    for name, blob in recorded.items():
        data = (CRDS / name).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, name
    operator = {row[4] for row in table if row[0].startswith("monitoring.coreos.com_")}
    assert len(operator) == 1  # ServiceMonitor and PrometheusRule from one operator commit


def test_lint_is_clean():
    for values in VALUE_SETS.values():
        report = helm.lint(str(CHART), values, strict=True, kube_version="v1.29.0")
        assert not report["errors"], report
        assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


def test_deployment_probes_rollout_and_drain_timing():
    d = by_kind(render({}))["Deployment"]
    spec, pod = d["spec"], d["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert c["readinessProbe"]["failureThreshold"] >= 2
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # model load + warm-up
    env = {e["name"]: e.get("value") for e in c["env"]}
    timeout = float(env["SPECD_SHUTDOWN_TIMEOUT_S"])
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + timeout + 3  # + the watchdog
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["command"][:2] == ["specd", "serve"]


def test_the_config_is_the_repository_config_and_specd_accepts_it():
    from engine.config import EngineConfig
    from server.settings import ServerSettings

    for values, config in [
        ({}, "default.yaml"),
        (VALUE_SETS["gpu-llama"], "gpu-llama3.1-8b.yaml"),
        (VALUE_SETS["gpu-qwen"], "gpu-qwen2.5-7b.yaml"),
    ]:
        cm = by_kind(render(values))["ConfigMap"]
        rendered = yaml.safe_load(cm["data"]["config.yaml"])
        repo = yaml.safe_load((ROOT / "configs" / config).read_text())
        assert rendered["engine"] == repo["engine"], config  # no drift from configs/
        assert rendered["server"] == {"host": "0.0.0.0", "port": 8000}
        ServerSettings.from_sources(rendered["server"], env={})
        EngineConfig.from_dict(rendered["engine"])
        (c,) = by_kind(render(values))["Deployment"]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}  # the environment beats the file:
        assert env["SPECD_DEVICE"] == repo["engine"]["model"]["device"]  # (the image says cuda)


def test_gpu_values_ask_for_a_gpu_and_mount_the_model_cache():
    d = by_kind(render(VALUE_SETS["gpu-llama"]))["Deployment"]
    (c,) = d["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    assert vols["models"]["persistentVolumeClaim"]["claimName"] == "hf-models"


def test_autoscaling_on_queue_depth():
    docs = by_kind(render(EVERYTHING))
    assert "replicas" not in docs["Deployment"]["spec"]  # KEDA owns the count
    (trigger,) = docs["ScaledObject"]["spec"]["triggers"]
    assert trigger["metricType"] == "AverageValue"
    assert "specd_waiting_sequences" in trigger["metadata"]["query"]
    assert docs["ScaledObject"]["spec"]["minReplicaCount"] == 1
    zero = by_kind(render(VALUE_SETS["scale-to-zero"]))["ScaledObject"]["spec"]
    assert zero["minReplicaCount"] == 0 and len(zero["triggers"]) == 2
    hpa = by_kind(render(VALUE_SETS["hpa"]))["HorizontalPodAutoscaler"]["spec"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "specd_waiting_sequences"
    assert hpa["metrics"][0]["pods"]["target"]["type"] == "AverageValue"
    both = {"autoscaling": {"keda": {"enabled": True}, "hpa": {"enabled": True}}}
    with pytest.raises(helm.HelmError, match="not both"):
        render(both)


def test_the_inference_pool_selects_the_pods_on_the_serving_port():
    docs = by_kind(render(EVERYTHING))
    pool, deploy = docs["InferencePool"]["spec"], docs["Deployment"]["spec"]
    assert pool["selector"]["matchLabels"] == deploy["selector"]["matchLabels"]
    assert pool["targetPorts"] == [{"number": 8000}]
    assert pool["endpointPickerRef"]["name"] == "demo-specd-epp"
    assert "InferencePool" not in by_kind(render({}))  # off by default


def test_the_compile_cache_outlives_pods_on_a_claim_when_asked():
    """/cache is an emptyDir by default (every pod compiles); with compileCache.persistence a
    claim, the chart's (ReadWriteMany, kept on uninstall) or one named, shared by the pods."""

    def cache_volume(values):
        docs = by_kind(render(values))
        vols = {v["name"]: v for v in docs["Deployment"]["spec"]["template"]["spec"]["volumes"]}
        (c,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
        assert {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]
        return vols["cache"], docs

    vol, docs = cache_volume({})
    assert vol["emptyDir"] == {"sizeLimit": "20Gi"} and "PersistentVolumeClaim" not in docs
    vol, docs = cache_volume(VALUE_SETS["compile-cache"])
    assert vol["persistentVolumeClaim"] == {"claimName": "demo-specd-cache"}
    pvc = docs["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == "demo-specd-cache"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert "storageClassName" not in pvc["spec"]  # the cluster's default
    vol, docs = cache_volume(VALUE_SETS["compile-cache-claim"])
    assert vol["persistentVolumeClaim"] == {"claimName": "warm-cache"}
    assert "PersistentVolumeClaim" not in docs  # the named claim is the user's own
    sized = {"compileCache": {"persistence": {"enabled": True, "size": "5Gi"}}}
    sized["compileCache"]["persistence"].update(storageClassName="fast", accessModes=["RWO"])
    pvc = by_kind(render(sized))["PersistentVolumeClaim"]["spec"]
    assert pvc["storageClassName"] == "fast" and pvc["resources"]["requests"]["storage"] == "5Gi"


def test_an_http_route_sends_the_gateways_traffic_to_the_pool_or_the_service():
    """Rendered only when asked, attached to the named Gateway; its backend is the
    InferencePool (group and kind as the Gateway API Inference Extension names them) or, without
    the pool, the Service's port. The Gateway API CRDs are not vendored: checked here by shape."""
    assert "HTTPRoute" not in by_kind(render(EVERYTHING))  # off by default
    gateway = [{"name": "inference-gateway", "namespace": "gw"}]
    route_values = {"enabled": True, "parentRefs": gateway, "hostnames": ["llm.example"]}
    docs = by_kind(render({**EVERYTHING, "httpRoute": route_values}))
    route = docs["HTTPRoute"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == gateway and route["spec"]["hostnames"] == ["llm.example"]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": docs["InferencePool"]["metadata"]["name"],
        }
    ]
    assert rule["timeouts"] == {"request": "300s"}
    plain = by_kind(render({"httpRoute": {**route_values, "timeout": ""}}))
    (rule,) = plain["HTTPRoute"]["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": plain["Service"]["metadata"]["name"], "port": 8000}]
    assert "timeouts" not in rule
    with pytest.raises(helm.HelmError, match="parentRefs"):
        render({"httpRoute": {"enabled": True}})


def test_the_notes_say_the_pool_needs_a_picker_the_chart_does_not_deploy():
    def notes(values):
        out = helm.Chart.load(str(CHART)).render(values, name="demo", namespace="llm")
        return next(text for path, text in out.items() if path.endswith("NOTES.txt"))

    assert "endpoint picker" not in notes({})
    text = notes({"inferencePool": {"enabled": True}})
    assert "demo-specd-epp port 9002" in text and "NOT deployed by this chart" in text


def test_the_hpa_metric_is_what_the_adapter_rules_serve_and_specd_exports():
    from server.metrics import Metrics

    rules = yaml.safe_load((ROOT / "deploy" / "helm" / "prometheus-adapter-rules.yaml").read_text())
    (rule,) = rules["rules"]["custom"]
    hpa = by_kind(render(VALUE_SETS["hpa"]))["HorizontalPodAutoscaler"]["spec"]
    name = hpa["metrics"][0]["pods"]["metric"]["name"]
    assert rule["name"]["as"] == name and rule["seriesQuery"].startswith(name + "{")
    exported = {m.name for m in Metrics("m", "ngram").registry.collect()}
    assert name in exported


@pytest.mark.parametrize("values", ["values.yaml", *GPU_VALUES])
def test_rollout_outlasts_the_startup_probe_and_is_settable(values):
    """progressDeadlineSeconds beyond the startup probe's window (a pod still warming up is not a
    failed rollout); maxUnavailable a value (a full GPU pool upgrades with maxSurge 0)."""
    v = yaml.safe_load((CHART / values).read_text()) if values != "values.yaml" else {}
    d = by_kind(render(v))["Deployment"]
    (c,) = d["spec"]["template"]["spec"]["containers"]
    startup = c["startupProbe"]
    assert (
        d["spec"]["progressDeadlineSeconds"]
        > startup["periodSeconds"] * startup["failureThreshold"]
    )
    full_pool = {"rollout": {"maxSurge": 0, "maxUnavailable": 1}}
    strategy = by_kind(render(full_pool))["Deployment"]["spec"]["strategy"]["rollingUpdate"]
    assert (strategy["maxSurge"], strategy["maxUnavailable"]) == (0, 1)


# kube-prometheus-stack's defaults (chart 88.5.3, prometheus-community/helm-charts cf408a29,
# charts/kube-prometheus-stack): its Prometheus selects ServiceMonitors and PrometheusRules with
# matchLabels release: <its release name> in every namespace (serviceMonitorSelector and
# ruleSelector {} with ...SelectorNilUsesHelmValues: true, namespace selectors {};
# templates/prometheus/prometheus.yaml), and its Grafana's dashboard sidecar loads ConfigMaps
# labelled grafana_dashboard: "1" from every namespace (grafana.sidecar.dashboards.label,
# labelValue, searchNamespace: ALL) with the datasource uid "prometheus"
# (grafana.sidecar.datasources.uid).
KUBE_PROMETHEUS_STACK = {
    "ServiceMonitor": {"release": "kube-prometheus-stack"},
    "PrometheusRule": {"release": "kube-prometheus-stack"},
    "ConfigMap": {"grafana_dashboard": "1"},
}


@pytest.mark.parametrize("values", GPU_VALUES)
def test_gpu_values_are_selected_by_kube_prometheus_stack(values):
    """Installed as release kube-prometheus-stack, its Prometheus scrapes the pods (without it
    KEDA would see no data) and loads the rules the dashboard reads, and its Grafana loads the
    dashboard, whose queries name that Grafana's datasource."""
    v = yaml.safe_load((CHART / values).read_text())
    docs = render(v)
    for kind, match_labels in KUBE_PROMETHEUS_STACK.items():
        selected = [
            d
            for d in docs
            if d["kind"] == kind and match_labels.items() <= d["metadata"].get("labels", {}).items()
        ]
        assert len(selected) == 1, kind
    cm = by_kind(docs)["ConfigMap/dashboards"]
    (dash,) = [json.loads(text) for text in cm["data"].values()]
    sources = {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}
    sources |= {v["datasource"]["uid"] for v in dash["templating"]["list"]}
    assert sources == {"prometheus"}
    assert "grafana_dashboard" not in by_kind(render({}))["ConfigMap"]["metadata"]["labels"]
