"""The two tools of the GuideLLM / ``python -m loadtest`` comparison (compare_guidellm.py): their
command lines, their results parsed into one row per concurrency level, and the table.

What each column means, per tool
--------------------------------
* ``out tok/s``: completed requests' output tokens (the server's ``usage.completion_tokens``, both
  tools) over the level's wall time (loadtest: first request sent to last one done; GuideLLM: the
  benchmark's ``duration``, the same span).
* ``TTFT``: request sent to the first streamed chunk carrying text (both tools; GuideLLM also
  counts a chunk with only reasoning/tool-call text, which specd never sends).
* ``E2E``: request sent to the end of the stream (both).
* ``ITL`` (each tool's own definition, so read them differently):
  - loadtest (``itl_token``, see loadtest/client.py): one sample per output token after the first
    chunk; a chunk of n tokens arriving g after the previous chunk gives n samples of g/n, n being
    the usage total split over the chunks by text length. Percentiles are over all those token
    samples of all requests (linear interpolation). A stall inside one request (another request's
    prefill, a long speculative round) shows up in the tail as it happened.
  - GuideLLM (``inter_token_latency_ms``): one value per request, (last text chunk - first text
    chunk) / (output tokens - 1), i.e. that request's mean gap; the distribution weights each
    request's value by its output tokens - 1, and its percentiles take the first value whose
    cumulative weight reaches p (nearest rank, no interpolation). A stall is averaged over its
    request, so GuideLLM's ITL p95 is the p95 of per-request *means*, normally well below
    loadtest's per-token p95; the p50s are comparable. (Its mean ITL equals loadtest's mean
    except that loadtest divides by tokens minus the first chunk's tokens, not tokens - 1.)
* ``ITLreq p50/p95``: GuideLLM's definition applied to both tools' per-request records (for
  loadtest: sum of the request's token gaps / (output tokens - 1), weighted by tokens - 1, nearest
  rank), so these two columns compare the tools like for like. For the GuideLLM rows they
  reproduce its ITL columns.
* TTFT/E2E percentiles: loadtest interpolates linearly, GuideLLM takes the nearest rank; with 18
  requests GuideLLM's p95 is the slowest request, loadtest's lies between the two slowest.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

COLUMNS = (
    "tool",
    "conc",
    "req",
    "err",
    "tok/req",
    "out tok/s",
    "TTFT p50",
    "TTFT p95",
    "ITL p50",
    "ITL p95",
    "E2E p50",
    "ITLreq p50",
    "ITLreq p95",
)


# -- the two tools' command lines ----------------------------------------------------------------
def guidellm_cmd(
    args,
    base_url: str,
    model: str,
    prompts: Path,
    tokenizer: str,
    levels: list[int],
    n: int,
    out_json: Path,
) -> list[str]:
    backend = (
        f"kind=openai_http,target={base_url},model={model},"
        f"request_format=/v1/chat/completions,stream=true,max_tokens={args.max_tokens},"
        f"extras.body.temperature=0"
    )
    if args.ignore_eos:
        backend += ",extras.body.ignore_eos=true"
    return [
        args.guidellm,
        "run",
        "--backend",
        backend,
        "--profile",
        f"kind=concurrent,streams={levels[0]}",
        "--override",
        "profile.streams",
        ",".join(map(str, levels)),
        "--constraint",
        f"kind=max_requests,count={n}",
        "--data",
        f"kind=json_file,path={prompts}",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--output",
        f"kind=json,path={out_json}",
        "--output",
        "kind=console",
        "--disable-progress",
    ]


def loadtest_cmd(
    args, base_url: str, model: str, prompts: Path, levels: list[int], n: int, out_dir: Path
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "loadtest",
        "--base-url",
        base_url,
        "--model",
        model,
        "--workload",
        f"jsonl:{prompts}",
        "--concurrency",
        ",".join(map(str, levels)),
        "--requests",
        str(n),
        "--max-tokens",
        str(args.max_tokens),
        "--temperature",
        "0",
        "--warmup",
        "0",
        "--out",
        str(out_dir),
        "--no-plots",
        "--no-progress",
    ]


# -- statistics shared by both tools' per-request records --------------------------------------
def nearest_rank(values: list[tuple[float, float]], p: float) -> float | None:
    """GuideLLM's percentile, reproduced to rebuild its columns from per-request records: the
    first value (sorted) whose cumulative weight share reaches p (0..1). loadtest's own figures
    use :func:`loadtest.stats.percentile`."""
    values = sorted((v, w) for v, w in values if w > 0)
    total = sum(w for _, w in values)
    if not values or total <= 0:
        return None
    acc = 0.0
    for v, w in values:
        acc += w
        if acc / total >= p - 1e-12:
            return v
    return values[-1][0]


def itl_per_request(pairs: list[tuple[float, int]]) -> dict:
    """p50/p95 of per-request mean ITL (ms), weighted by output tokens - 1 (GuideLLM's way)."""
    vals = [(ms, n - 1) for ms, n in pairs if ms is not None and n and n > 1]
    return {
        "p50_ms": nearest_rank(vals, 0.50),
        "p95_ms": nearest_rank(vals, 0.95),
        "count": len(vals),
    }


# -- parsing -------------------------------------------------------------------------------------
def _pct(metrics: dict, name: str, p: str, scale: float = 1.0) -> float | None:
    """GuideLLM's own percentile ``p`` of a metric over its successful requests."""
    v = metrics[name]["successful"]["percentiles"][p]
    return None if v is None else v * scale


def guidellm_rows(path: Path) -> list[dict]:
    rows = []
    for b in json.loads(path.read_text())["benchmarks"]:
        m = b["metrics"]

        def pct(name, p, scale=1.0, m=m):
            return _pct(m, name, p, scale)

        ok = b["requests"]["successful"]
        totals = m["request_totals"]
        tokens = m["output_token_count"]["successful"]["total_sum"]
        rows.append(
            {
                "tool": "guidellm",
                "concurrency": b["config"]["strategy"]["streams"],
                "requests": totals["successful"],
                "errors": totals["errored"],
                "incomplete": totals["incomplete"],
                "output_tokens": tokens,
                "tokens_per_request": tokens / totals["successful"]
                if totals["successful"]
                else None,
                "wall_s": b["duration"],
                "output_tok_s": tokens / b["duration"],
                "output_tok_s_guidellm_mean": m["output_tokens_per_second"]["successful"]["mean"],
                "ttft_p50_ms": pct("time_to_first_token_ms", "p50"),
                "ttft_p95_ms": pct("time_to_first_token_ms", "p95"),
                "itl_p50_ms": pct("inter_token_latency_ms", "p50"),
                "itl_p95_ms": pct("inter_token_latency_ms", "p95"),
                "itl_mean_ms": m["inter_token_latency_ms"]["successful"]["mean"],
                "e2e_p50_ms": pct("request_latency", "p50", 1000.0),
                "itl_definition": (
                    "per-request (last-first)/(tokens-1), token-weighted, nearest rank"
                ),
                "itl_req": itl_per_request(
                    [(r["inter_token_latency_ms"], r["output_tokens"]) for r in ok]
                ),
                "stream_iterations_per_request": m["request_streaming_iterations_count"][
                    "successful"
                ]["mean"],
            }
        )
    return rows


def loadtest_rows(path: Path) -> list[dict]:
    rows = []
    for run in json.loads(path.read_text())["runs"]:
        s = run["summary"]
        ok = [r for r in run["requests"] if r["error"] is None]
        pairs = [
            (
                1000 * sum(r["itl_token"]) / (r["output_tokens"] - 1)
                if r["output_tokens"] > 1 and r["itl_token"]
                else None,
                r["output_tokens"],
            )
            for r in ok
        ]
        itl_all = [x for r in ok for x in r["itl_token"]]
        rows.append(
            {
                "tool": "loadtest",
                "concurrency": run["concurrency"],
                "requests": s["completed"],
                "errors": s["errors"],
                "incomplete": s["cancelled"],
                "output_tokens": s["output_tokens"],
                "tokens_per_request": s["output_tokens"] / s["completed"]
                if s["completed"]
                else None,
                "wall_s": s["wall_s"],
                "output_tok_s": s["output_tok_s"],
                "ttft_p50_ms": s["ttft"]["p50_ms"],
                "ttft_p95_ms": s["ttft"]["p95_ms"],
                "itl_p50_ms": s["itl_token"]["p50_ms"],
                "itl_p95_ms": s["itl_token"]["p95_ms"],
                "itl_mean_ms": 1000 * sum(itl_all) / len(itl_all) if itl_all else None,
                "e2e_p50_ms": s["e2e"]["p50_ms"],
                "itl_definition": "per token: a chunk of n tokens after gap g gives n samples g/n, "
                "linear interpolation",
                "itl_req": itl_per_request(pairs),
                "chunks_per_request": (sum(r["chunks"] for r in ok) / len(ok)) if ok else None,
                "acceptance": s["acceptance"],
                "tokens_per_pass": s["tokens_per_pass"],
            }
        )
    return rows


def render(rows: list[dict], show_repeat: bool = False) -> str:
    def ms(x):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.0f}"

    table = [COLUMNS]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["tool"], r.get("repeat", 0))):
        label = r["tool"] + (f" #{r['repeat']}" if show_repeat else "")
        table.append(
            (
                label,
                str(r["concurrency"]),
                str(r["requests"]),
                str(r["errors"] + (r.get("incomplete") or 0)),
                f"{r['tokens_per_request']:.1f}" if r["tokens_per_request"] else "-",
                f"{r['output_tok_s']:.1f}",
                ms(r["ttft_p50_ms"]),
                ms(r["ttft_p95_ms"]),
                ms(r["itl_p50_ms"]),
                ms(r["itl_p95_ms"]),
                ms(r["e2e_p50_ms"]),
                ms(r["itl_req"]["p50_ms"]),
                ms(r["itl_req"]["p95_ms"]),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
