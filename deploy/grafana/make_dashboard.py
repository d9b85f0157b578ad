"""Writes deploy/grafana/dashboards/specd.json (run: python deploy/grafana/make_dashboard.py).
The dashboard reads specd's recording rules (deploy/prometheus/rules.yml) and raw series, by the
template variables $namespace, $pod, $model and $drafter (under docker-compose namespace and pod
are empty: "All" matches them). docker-compose's Grafana provisions the file; the Helm chart ships
it as a ConfigMap for Grafana's dashboard sidecar (deploy/helm/specd/files/dashboards links it).
tests/deploy/test_monitoring.py checks the file equals this script's output."""

import json
from pathlib import Path

SEL = '{namespace=~"$namespace", pod=~"$pod", model=~"$model", drafter=~"$drafter"}'
PER_POD = "{{pod}} {{model}} {{drafter}}"  # the recording rules keep one series per pod
DS = {"type": "prometheus", "uid": "prometheus"}  # kube-prometheus-stack's uid too


def rate(series: str) -> str:
    return f"rate({series}{SEL}[$__rate_interval])"


def quantiles(histogram: str) -> list[tuple[str, str]]:
    """p50/p95/p99 of a histogram over the selected pods."""
    return [
        (
            f"p{q}",
            f"histogram_quantile(0.{q}, sum by (le) ({rate(histogram + '_bucket')}))",
        )
        for q in ("50", "95", "99")
    ]


PANELS = [  # (title, unit, [(legend, expr)])
    ("Acceptance rate", "percentunit", [(PER_POD, f"specd:acceptance_rate:rate1m{SEL}")]),
    ("Tokens per target pass", "none", [(PER_POD, f"specd:tokens_per_target_pass:rate1m{SEL}")]),
    (
        "Acceptance by draft position",
        "percentunit",
        [("{{pod}} position {{position}}", f"specd:acceptance_rate_by_position:rate1m{SEL}")],
    ),
    (
        "Inter-token latency (per token)",
        "s",
        [
            ("{{pod}} p50", f"specd:inter_token_latency_seconds:p50{SEL}"),
            ("{{pod}} p95", f"specd:inter_token_latency_seconds:p95{SEL}"),
            ("{{pod}} p99", f"specd:inter_token_latency_seconds:p99{SEL}"),
        ],
    ),
    (
        "Time to first token p95",
        "s",
        [("{{pod}} p95", f"specd:time_to_first_token_seconds:p95{SEL}")],
    ),
    ("Output tokens / s", "short", [(PER_POD, f"specd:output_tokens_per_second:rate1m{SEL}")]),
    (
        "Running / waiting sequences",
        "short",
        [
            ("running", f"sum by (model, drafter) (specd_running_sequences{SEL})"),
            ("waiting", f"sum by (model, drafter) (specd_waiting_sequences{SEL})"),
        ],
    ),
    (
        "Draft length K (rounds per second by K bucket)",
        "short",
        [
            (
                "K <= {{le}}",
                f"sum by (le) (rate(specd_draft_length_bucket{SEL}[$__rate_interval]))",
            ),
            ("{{pod}} mean K", f"specd:draft_length:mean1m{SEL}"),
        ],
    ),
    ("KV cache usage", "percentunit", [("{{pod}} {{model}}", f"specd_kv_cache_usage_ratio{SEL}")]),
    (
        "Error rate (5xx generation requests)",
        "percentunit",
        [(PER_POD, f"specd:request_errors:ratio_rate1m{SEL}")],
    ),
    (
        "Round phases p95",
        "s",
        [
            (
                "{{phase}}",
                (
                    "histogram_quantile(0.95, sum by (le, phase) "
                    f"(rate(specd_round_phase_seconds_bucket{SEL}[$__rate_interval])))"
                ),
            )
        ],
    ),
    (
        "Requests / s by endpoint and status",
        "reqps",
        [
            (
                "{{endpoint}} {{status}}",
                f"sum by (endpoint, status) (rate(specd_requests_total{SEL}[$__rate_interval]))",
            )
        ],
    ),
    ("End-to-end latency (per sequence)", "s", quantiles("specd_request_latency_seconds")),
    ("Queue time (waiting for a KV slot)", "s", quantiles("specd_queue_time_seconds")),
    (
        "Finish reasons (sequences / s)",
        "short",
        [
            (
                "{{finish_reason}}",
                f"sum by (finish_reason) ({rate('specd_sequences_finished_total')})",
            )
        ],
    ),
    (
        "Drafter faults (per second; each falls back to plain decoding)",
        "short",
        [
            (
                "{{pod}} {{drafter}}",
                f"sum by (pod, drafter) ({rate('specd_drafter_failures_total')})",
            )
        ],
    ),
    (
        "Forward paths (1: the path taken now, 0: a path left)",
        "none",
        [
            (
                "{{pod}} {{component}} {{path}}",
                f"max by (pod, component, path) (specd_forward_path{SEL})",
            )
        ],
    ),
]

# each variable narrows the next; "All" is .* (matches an empty label too: docker-compose)
VARIABLES = [
    ("namespace", "specd_output_tokens_total"),
    ("pod", 'specd_output_tokens_total{namespace=~"$namespace"}'),
    ("model", 'specd_output_tokens_total{namespace=~"$namespace", pod=~"$pod"}'),
    ("drafter", 'specd_output_tokens_total{namespace=~"$namespace", pod=~"$pod"}'),
]


def variable(name: str, series: str) -> dict:
    return {
        "name": name,
        "type": "query",
        "datasource": DS,
        "query": f"label_values({series}, {name})",
        "refresh": 2,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"text": "All", "value": "$__all"},
    }


def build() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "datasource": DS,
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(65 + j), "expr": expr, "legendFormat": legend, "datasource": DS}
                    for j, (legend, expr) in enumerate(targets)
                ],
            }
        )
    return {
        "uid": "specd",
        "title": "specd: speculative decoding",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "tags": ["specd"],
        "templating": {"list": [variable(n, s) for n, s in VARIABLES]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=1) + "\n"


OUT = Path(__file__).parent / "dashboards" / "specd.json"


def main():
    OUT.write_text(render())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
