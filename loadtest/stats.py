"""Aggregates of one run, the server-side view scraped from specd's /metrics, and ratios with
confidence intervals for A/B runs."""

from __future__ import annotations

import math
import statistics

import httpx
from prometheus_client.parser import text_string_to_metric_families

QUANTILES = (50, 90, 95, 99)
# Two-sided 95% Student t quantiles by degrees of freedom (1..30); beyond that the normal's.
_T95 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


def percentile(xs: list[float], p: float) -> float | None:
    """The p-th percentile (0 <= p <= 100) of ``xs`` by linear interpolation between the closest
    ranks (statistics.quantiles' "inclusive" method); None when ``xs`` is empty. The one percentile
    of the load generator's figures."""
    xs = sorted(xs)
    if not xs:
        return None
    pos = p / 100 * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles(xs: list[float | None]) -> dict:
    """count, mean and p50/p90/p95/p99 (:func:`percentile`) of seconds, in milliseconds; None
    values are left out; None figures when nothing is left."""
    vals = [x for x in xs if x is not None]
    if not vals:
        return {"count": 0, "mean_ms": None, **{f"p{q}_ms": None for q in QUANTILES}}
    vals.sort()
    return {
        "count": len(vals),
        "mean_ms": 1000 * statistics.fmean(vals),
        **{f"p{q}_ms": 1000 * percentile(vals, q) for q in QUANTILES},
    }


def summarize(records, wall: float) -> dict:
    ok = [r for r in records if r.error is None]
    errors = [r for r in records if r.error is not None and not r.error.startswith("cancelled")]
    tokens = sum(r.output_tokens for r in ok)
    drafted = sum(r.drafted or 0 for r in ok)
    passes = sum(r.passes or 0 for r in ok)
    has_spec = any(r.drafted is not None for r in ok)
    by_cat: dict[str, dict] = {}
    for r in ok:
        c = by_cat.setdefault(
            r.category,
            {"requests": 0, "output_tokens": 0, "drafted": 0, "accepted": 0, "passes": 0},
        )
        c["requests"] += 1
        c["output_tokens"] += r.output_tokens
        c["drafted"] += r.drafted or 0
        c["accepted"] += r.accepted or 0
        c["passes"] += r.passes or 0
    for c in by_cat.values():
        c["acceptance"] = c["accepted"] / c["drafted"] if c["drafted"] else None
        c["tokens_per_pass"] = c["output_tokens"] / c["passes"] if c["passes"] else None
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(errors),
        "cancelled": len(records) - len(ok) - len(errors),
        "error_rate": len(errors) / len(records) if records else 0.0,
        "error_samples": sorted({r.error for r in errors})[:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "requests_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft": percentiles([r.ttft for r in ok]),
        "itl_token": percentiles([x for r in ok for x in r.itl_token]),
        "itl_chunk": percentiles([x for r in ok for x in r.itl_chunk]),
        "e2e": percentiles([r.e2e for r in ok]),
        "acceptance": (sum(r.accepted or 0 for r in ok) / drafted if drafted else 0.0)
        if has_spec
        else None,
        "tokens_per_pass": (tokens / passes if passes else None) if has_spec else None,
        "by_category": by_cat,
    }


# -- specd's /metrics ------------------------------------------------------------------------
COUNTERS = {
    "drafted": "specd_draft_tokens",
    "accepted": "specd_accepted_tokens",
    "passes": "specd_target_passes",
    "output_tokens": "specd_output_tokens",
}


def scrape(base_url: str, api_key: str | None = None) -> dict | None:
    """Totals of specd's counters (summed over labels), or None where /metrics has none."""
    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{root}/metrics", headers=headers, timeout=10)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    totals = dict.fromkeys(COUNTERS, 0.0)
    found = False
    for fam in text_string_to_metric_families(r.text):
        for key, name in COUNTERS.items():
            if fam.name == name:
                found = True
                totals[key] += sum(s.value for s in fam.samples if s.name == f"{name}_total")
    return totals if found else None


def server_delta(before: dict | None, after: dict | None) -> dict | None:
    """Acceptance rate and tokens per target pass of the traffic between two scrapes."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in COUNTERS}
    return {
        **d,
        "acceptance": d["accepted"] / d["drafted"] if d["drafted"] else 0.0,
        "tokens_per_pass": d["output_tokens"] / d["passes"] if d["passes"] else None,
    }


# -- A/B -------------------------------------------------------------------------------------
def mean_ci(values: list[float]) -> dict:
    """Mean with a two-sided 95% Student t interval; no interval from fewer than two values."""
    n = len(values)
    if n == 0:
        return {"mean": None, "ci95": [None, None], "n": 0, "values": []}
    m = statistics.fmean(values)
    if n < 2:
        return {"mean": m, "ci95": [None, None], "n": 1, "values": values}
    t = _T95[n - 2] if n - 1 <= len(_T95) else 1.960
    h = t * statistics.stdev(values) / math.sqrt(n)
    return {"mean": m, "ci95": [m - h, m + h], "n": n, "values": values}
