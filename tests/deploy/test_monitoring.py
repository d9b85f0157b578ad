"""Monitoring in the Helm chart: the PrometheusRule (recording rules and alerts) and the Grafana
dashboard ConfigMap render the very files docker-compose's Prometheus and Grafana load (one source:
the chart's files/ link them), promtool accepts the rendered rules and passes the alerts' unit
tests, and every series and label the rules, alerts and dashboard read is on the /metrics page of
a running specd (the names are collected from the page, not listed here)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile

import httpx
import pytest
import yaml

from tests.deploy.promql import Reads, reads, variable_reads
from tests.deploy.test_helm_chart import CHART, ROOT, by_kind, helm, render

PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
MONITORING = {"prometheusRule": {"enabled": True}, "grafanaDashboards": {"enabled": True}}
ALERTS = {
    "SpecdNoProgress",
    "SpecdHighErrorRatio",
    "SpecdDrafterFaults",
    "SpecdEagerFallback",
    "SpecdQueueGrowing",
}
# labels Prometheus adds to every scraped series: job and instance always; namespace, pod,
# service, container and endpoint under a ServiceMonitor (prometheus-operator's promcfg.go)
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
needs_promtool = pytest.mark.skipif(
    not shutil.which("promtool"),
    reason="Debian's prometheus package is not installed (scripts/setup.sh installs it as root)",
)


def source_groups() -> list[dict]:
    return [
        g
        for name in ("rules.yml", "alerts.yml")
        for g in yaml.safe_load((PROMETHEUS / name).read_text())["groups"]
    ]


def rendered_rules(values: dict) -> list[dict]:
    return by_kind(render(values))["PrometheusRule"]["spec"]["groups"]


def rendered_dashboards(values: dict) -> dict[str, dict]:
    cm = by_kind(render(values))["ConfigMap/dashboards"]
    return {k: json.loads(v) for k, v in cm["data"].items()}


def test_off_by_default():
    assert not {"PrometheusRule", "ConfigMap/dashboards"} & set(by_kind(render({})))


def test_the_rule_is_compose_prometheus_rules_and_alerts():
    groups = rendered_rules(MONITORING)
    assert groups == source_groups()
    assert {r["alert"] for g in groups for r in g["rules"] if "alert" in r} == ALERTS
    compose = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert compose["rule_files"] == ["rules.yml", "alerts.yml"]  # both setups load both files
    for g in groups:
        for r in g["rules"]:
            if "alert" in r:
                assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
                assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_the_dashboards_are_compose_grafanas_and_the_generators_output():
    files = {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}
    assert rendered_dashboards(MONITORING) == files and "specd.json" in files
    sys.path.insert(0, str(ROOT / "deploy" / "grafana"))
    try:
        import make_dashboard
    finally:
        sys.path.pop(0)
    assert (DASHBOARDS / "specd.json").read_text() == make_dashboard.render()
    dash = files["specd.json"]
    variables = [v["name"] for v in dash["templating"]["list"]]
    assert variables[:2] == ["namespace", "pod"] and {"model", "drafter"} <= set(variables)
    assert all(v["allValue"] == ".*" for v in dash["templating"]["list"])  # compose: no namespace
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for panel in ("request", "end-to-end latency", "queue time", "finish reason", "drafter fault"):
        assert panel in titles, panel
    for p in dash["panels"]:  # every query filters by every variable
        for t in p["targets"]:
            assert all(f'{v}=~"${v}"' in t["expr"] for v in variables), (p["title"], t["expr"])


def test_the_chart_links_the_compose_files_and_packages_their_content(tmp_path):
    """One copy of each file: the chart's files/ are links into deploy/prometheus and
    deploy/grafana/dashboards, and a packaged chart carries their content (Helm follows links)."""
    links = {
        CHART / "files/prometheus/rules.yml": PROMETHEUS / "rules.yml",
        CHART / "files/prometheus/alerts.yml": PROMETHEUS / "alerts.yml",
        **{CHART / "files/dashboards" / p.name: p for p in DASHBOARDS.glob("*.json")},
    }
    assert {p.name for p in (CHART / "files/dashboards").iterdir()} == {
        p.name for p in DASHBOARDS.glob("*.json")
    }
    for link, target in links.items():
        assert link.is_symlink() and link.resolve() == target.resolve(), link
    archive = helm.package(str(CHART), destination=str(tmp_path))
    with tarfile.open(archive) as tar:
        for link, target in links.items():
            member = tar.extractfile(f"specd/{link.relative_to(CHART)}")
            assert member is not None and member.read() == target.read_bytes(), link


def test_alerts_can_be_left_out_and_labelled():
    values = {
        "prometheusRule": {
            "enabled": True,
            "disabledAlerts": ["SpecdEagerFallback"],
            "alertLabels": {"team": "ml", "severity": "page-me"},
            "labels": {"release": "prom"},
        }
    }
    rule = by_kind(render(values))["PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prom"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert set(alerts) == ALERTS - {"SpecdEagerFallback"}
    assert all(a["labels"]["team"] == "ml" for a in alerts.values())
    assert alerts["SpecdNoProgress"]["labels"]["severity"] == "critical"  # the file's label wins
    records = [r for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r]
    assert all("labels" not in r for r in records)  # recording rules untouched
    everything = ["SpecdEagerFallback", *ALERTS]
    groups = rendered_rules({"prometheusRule": {"enabled": True, "disabledAlerts": everything}})
    assert [g["name"] for g in groups] == ["specd"]  # an emptied group is left out


def test_dashboard_configmap_labels_annotations_and_namespace_are_settable():
    values = {
        "grafanaDashboards": {
            "enabled": True,
            "namespace": "monitoring",
            "labels": {"grafana_dashboard": None, "my_dashboards": "yes"},
            "annotations": {"grafana_folder": "specd"},
        }
    }
    cm = by_kind(render(values))["ConfigMap/dashboards"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["my_dashboards"] == "yes"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["annotations"] == {"grafana_folder": "specd"}
    default = by_kind(render(MONITORING))["ConfigMap/dashboards"]
    assert default["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert default["metadata"]["namespace"] == "llm"


@needs_promtool
def test_promtool_accepts_the_rendered_rules_and_passes_the_alert_unit_tests(tmp_path):
    rules = tmp_path / "rendered.yml"
    rules.write_text(yaml.safe_dump({"groups": rendered_rules(MONITORING)}))
    r = subprocess.run(
        ["promtool", "check", "rules", str(rules)], check=False, capture_output=True, text=True
    )
    assert r.returncode == 0 and "SUCCESS: 15 rules found" in r.stdout, r.stdout + r.stderr
    test = PROMETHEUS / "alerts.test.yml"
    r = subprocess.run(
        ["promtool", "test", "rules", test.name],
        check=False,
        cwd=PROMETHEUS,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    tested = {
        t["alertname"]
        for c in yaml.safe_load(test.read_text())["tests"]
        for t in c["alert_rule_test"]
    }
    assert tested == ALERTS  # every alert has its case
    fires = {
        t["alertname"]
        for c in yaml.safe_load(test.read_text())["tests"]
        for t in c["alert_rule_test"]
        if t["exp_alerts"]
    }
    assert fires == ALERTS  # and is seen firing in it


def queries(values: dict) -> dict[str, Reads]:
    """Every PromQL the chart ships, by where it sits: rules, alerts, panels, variables."""
    out = {}
    for g in rendered_rules(values):
        for r in g["rules"]:
            out[f"rule {r.get('record') or r.get('alert')}"] = reads(r["expr"])
    for name, dash in rendered_dashboards(values).items():
        for p in dash["panels"]:
            for t in p["targets"]:
                out[f"{name} panel {p['title']!r} {t['refId']}"] = reads(t["expr"])
        for v in dash["templating"]["list"]:
            out[f"{name} variable {v['name']}"] = variable_reads(v["query"])
    return out


@pytest.mark.real_model
def test_every_series_and_label_the_chart_reads_is_on_a_live_metrics_page(live):
    """Traffic through a real server (chat, streamed completions, a 404), then its /metrics page:
    each series a rule, alert, panel or variable reads is exported there or recorded by a rule,
    and each label they filter or group by is on it, or a label Prometheus adds to a target."""
    from tests.conftest import MODEL
    from tests.server.helpers import scrape

    chat = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(f"{live.base_url}/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    stream = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{live.base_url}/completions", json=stream, timeout=120) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    r = httpx.post(f"{live.base_url}/completions", json={**stream, "model": "x"}, timeout=120)
    assert r.status_code == 404
    samples = scrape(httpx.get(f"{live.url}/metrics", timeout=120).text)
    labels: dict[str, set[str]] = {}
    for name, lab in samples:
        labels.setdefault(name, set()).update(k for k, _ in lab)
    recorded = {  # a recorded series has the labels its rule keeps
        r["record"]: reads(r["expr"]).grouping - {"le"}
        for g in rendered_rules(MONITORING)
        for r in g["rules"]
        if "record" in r
    }
    known = {**labels, **recorded}
    every_label = set().union(*labels.values(), *recorded.values(), TARGET_LABELS, {"le"})

    shipped = queries(MONITORING)
    assert len(shipped) >= 15 + 17 + 4  # rules and alerts, panels, variables
    for where, q in shipped.items():
        assert q.selectors, where
        for sel in q.selectors:
            assert sel.name in known, f"{where}: {sel.name} is not on the page nor recorded"
            for label, _, _ in sel.matchers:
                assert label in known[sel.name] | TARGET_LABELS, f"{where}: {sel.name}{{{label}}}"
        assert q.grouping <= every_label, f"{where}: {q.grouping - every_label}"

    # vLLM's dashboard and gateway queries (tests/server/test_metrics.py runs them through
    # Prometheus where it is installed): each series and label they read is on the page itself
    from tests.server.test_metrics import VLLM_QUERIES

    for q in VLLM_QUERIES:
        got = reads(q)
        for sel in got.selectors:
            assert sel.name in labels, f"{q}: {sel.name} is not on the page"
            for label, _, _ in sel.matchers:
                assert label in labels[sel.name], f"{q}: {sel.name}{{{label}}}"
        assert got.grouping <= set().union(*labels.values(), {"le"}), q

    # the eager-fallback alert's matcher meets the path values the code sets: this server runs
    # its target eagerly (the fp32 test config), so the alert would see it
    (sel,) = shipped["rule SpecdEagerFallback"].selectors
    (matcher,) = sel.matchers
    paths = {dict(lab)["path"]: v for (n, lab), v in samples.items() if n == sel.name}
    assert matcher[:2] == ("path", "=~") and any(re.fullmatch(matcher[2], p) for p in paths)
    assert paths["eager"] == 1
