"""Console table (rich), JSON results file and PNG plots of a load run."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table


def _ms(x):
    return "-" if x is None else f"{x:.0f}"


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def point_label(run: dict) -> str:
    return f"c={run['concurrency']}" if run["shape"] == "closed" else f"{run['rate']}/s"


def table(results: dict, console: Console | None = None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 180)
    t = Table(title=f"{results['meta']['model']} at {results['meta']['base_url']}")
    for col in (
        "load",
        "mode",
        "rep",
        "req",
        "err",
        "tok/s",
        "req/s",
        "TTFT p50",
        "TTFT p95",
        "ITL p50",
        "ITL p95",
        "ITL p99",
        "chunk p95",
        "e2e p95",
        "accept",
        "tok/pass",
    ):
        t.add_column(col, justify="right")
    for run in results["runs"]:
        s, srv = run["summary"], run.get("server") or {}
        t.add_row(
            point_label(run),
            run["mode"],
            str(run["repeat"]),
            str(s["requests"]),
            str(s["errors"]),
            f"{s['output_tok_s']:.1f}",
            f"{s['requests_s']:.2f}",
            _ms(s["ttft"]["p50_ms"]),
            _ms(s["ttft"]["p95_ms"]),
            _ms(s["itl_token"]["p50_ms"]),
            _ms(s["itl_token"]["p95_ms"]),
            _ms(s["itl_token"]["p99_ms"]),
            _ms(s["itl_chunk"]["p95_ms"]),
            _ms(s["e2e"]["p95_ms"]),
            _f(srv.get("acceptance", s["acceptance"])),
            _f(srv.get("tokens_per_pass", s["tokens_per_pass"])),
        )
    console.print(t)
    if results.get("ab"):
        a = Table(title="A/B: ratio A / B from the same repeat (95% t interval over repeats)")
        for col in (
            "load",
            "A",
            "B",
            "tok/s ratio",
            "95% CI",
            "ITL p95 ratio",
            "TTFT p50 ratio",
            "n",
        ):
            a.add_column(col, justify="right")
        for row in results["ab"]:
            r, i, f = row["tok_s_ratio"], row["itl_p95_ratio"], row["ttft_p50_ratio"]
            lo, hi = r["ci95"]
            a.add_row(
                row["load"],
                row["a"],
                row["b"],
                _f(r["mean"]),
                "-" if lo is None else f"{lo:.2f}..{hi:.2f}",
                _f(i["mean"]),
                _f(f["mean"]),
                str(r["n"]),
            )
        console.print(a)


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=asdict))


def plots(results: dict, out_dir: Path) -> list[Path]:
    """latency_cdf.png, load_curves.png (throughput and p95 ITL against load) and
    acceptance_by_category.png; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    runs = results["runs"]
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    written = []

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in zip(
        axes,
        ("ttft", "itl_token", "e2e"),
        ("time to first token", "inter-token latency (per token)", "end-to-end latency"),
    ):
        for run in runs:
            if run["repeat"]:
                continue
            xs = sorted(_values(run, key))
            if xs:
                ax.plot(
                    [1000 * x for x in xs],
                    [(i + 1) / len(xs) for i in range(len(xs))],
                    label=f"{run['mode']} {point_label(run)}",
                )
        ax.set(title=title, xlabel="ms", ylabel="fraction of samples")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "latency_cdf.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in modes:
        pts = _by_load(runs, mode)
        xs = list(pts)
        a1.plot(
            xs,
            [sum(r["summary"]["output_tok_s"] for r in pts[x]) / len(pts[x]) for x in xs],
            "o-",
            label=mode,
        )
        a2.plot(
            xs,
            [_mean(r["summary"]["itl_token"]["p95_ms"] for r in pts[x]) for x in xs],
            "o-",
            label=mode,
        )
    xlabel = "concurrency" if runs and runs[0]["shape"] == "closed" else "request rate (1/s)"
    a1.set(title="output throughput", xlabel=xlabel, ylabel="tok/s")
    a2.set(title="p95 inter-token latency", xlabel=xlabel, ylabel="ms")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    written.append(out_dir / "load_curves.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.2))
    cats = sorted({c for r in runs for c in r["summary"]["by_category"]})
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        acc = []
        for c in cats:
            d = a = 0
            for r in runs:
                if r["mode"] == mode and c in r["summary"]["by_category"]:
                    d += r["summary"]["by_category"][c]["drafted"]
                    a += r["summary"]["by_category"][c]["accepted"]
            acc.append(a / d if d else 0.0)
        ax.bar([i + j * width for i in range(len(cats))], acc, width, label=mode)
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(cats))], cats, rotation=30)
    ax.set(
        title="acceptance rate by category (accepted / drafted tokens)",
        ylabel="acceptance",
        ylim=(0, 1),
    )
    ax.legend()
    fig.tight_layout()
    written.append(out_dir / "acceptance_by_category.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written


def _values(run: dict, key: str) -> list[float]:
    reqs = [r for r in run["requests"] if r["error"] is None]
    if key == "itl_token":
        return [x for r in reqs for x in r["itl_token"]]
    return [r[key] for r in reqs if r[key] is not None]


def _by_load(runs, mode):
    out: dict = {}
    for r in runs:
        if r["mode"] == mode:
            out.setdefault(r["concurrency"] if r["shape"] == "closed" else r["rate"], []).append(r)
    return dict(sorted(out.items()))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")
