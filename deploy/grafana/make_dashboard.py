"""Writes deploy/grafana/dashboards/specd.json (run: python deploy/grafana/make_dashboard.py).
The dashboard reads specd's recording rules (deploy/prometheus/rules.yml) and raw series, by the
template variables $model and $drafter."""

import json
from pathlib import Path

SEL = '{model=~"$model", drafter=~"$drafter"}'
PANELS = [  # (title, unit, [(legend, expr)])
    (
        "Acceptance rate",
        "percentunit",
        [("{{model}} {{drafter}}", f"specd:acceptance_rate:rate1m{SEL}")],
    ),
    (
        "Tokens per target pass",
        "none",
        [("{{model}} {{drafter}}", f"specd:tokens_per_target_pass:rate1m{SEL}")],
    ),
    (
        "Acceptance by draft position",
        "percentunit",
        [("position {{position}}", f"specd:acceptance_rate_by_position:rate1m{SEL}")],
    ),
    (
        "Inter-token latency (per token)",
        "s",
        [
            ("p50", f"specd:inter_token_latency_seconds:p50{SEL}"),
            ("p95", f"specd:inter_token_latency_seconds:p95{SEL}"),
            ("p99", f"specd:inter_token_latency_seconds:p99{SEL}"),
        ],
    ),
    ("Time to first token p95", "s", [("p95", f"specd:time_to_first_token_seconds:p95{SEL}")]),
    (
        "Output tokens / s",
        "short",
        [("{{model}} {{drafter}}", f"specd:output_tokens_per_second:rate1m{SEL}")],
    ),
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
            ("mean K", f"specd:draft_length:mean1m{SEL}"),
        ],
    ),
    ("KV cache usage", "percentunit", [("{{model}}", f"specd_kv_cache_usage_ratio{SEL}")]),
    (
        "Error rate (5xx generation requests)",
        "percentunit",
        [("{{model}} {{drafter}}", f"specd:request_errors:ratio_rate1m{SEL}")],
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
]


def variable(name):
    return {
        "name": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "prometheus"},
        "query": f"label_values(specd_output_tokens_total, {name})",
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "current": {"text": "All", "value": "$__all"},
    }


def main():
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "datasource": {"type": "prometheus", "uid": "prometheus"},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {
                        "refId": chr(65 + j),
                        "expr": expr,
                        "legendFormat": legend,
                        "datasource": {"type": "prometheus", "uid": "prometheus"},
                    }
                    for j, (legend, expr) in enumerate(targets)
                ],
            }
        )
    dash = {
        "uid": "specd",
        "title": "specd: speculative decoding",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "tags": ["specd"],
        "templating": {"list": [variable("model"), variable("drafter")]},
        "panels": panels,
    }
    out = Path(__file__).parent / "dashboards" / "specd.json"
    out.write_text(json.dumps(dash, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
