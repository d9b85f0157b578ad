"""Cross-check ``python -m loadtest`` against an independent client, GuideLLM (0.8.x): one specd
server, the same prompts, the same closed-loop concurrency levels, the same ``max_tokens`` and
temperature 0, measured by both tools one after the other, printed as one table. The machine's
other load moves between the two runs, so ``--repeat N`` runs the pair N times, the order
alternating (A B, B A, ...), one row per tool, level and repeat.

    .venv/bin/python -m loadtest.compare_guidellm                      # defaults below
    .venv/bin/python -m loadtest.compare_guidellm --concurrency 1,4 --max-tokens 64 \\
        --guidellm /tmp/glvenv/bin/guidellm --config configs/default.yaml

GuideLLM lives in its own virtual environment (``--guidellm`` is the path of its CLI); nothing of
it is imported here. It runs offline (``HF_HUB_OFFLINE=1``) from a local JSONL of chat prompts and
is given the model's local tokenizer folder (the one ``specd prepare`` converted). With a JSON
data file and a server that reports ``usage`` GuideLLM never loads that tokenizer (it is loaded
lazily, for synthetic data; without ``--tokenizer`` it would take the served model name as a Hub
id, and a run without it works offline too), so token counts are the server's for both tools.
The command it gets is::

    guidellm run \\
      --backend  kind=openai_http,target=URL,model=NAME,request_format=/v1/chat/completions,\\
                 stream=true,max_tokens=64,extras.body.temperature=0
      --profile  kind=concurrent,streams=1 --override profile.streams 1,4
      --constraint kind=max_requests,count=18     # per level: every prompt once
      --data     kind=json_file,path=prompts.jsonl   # {"messages": [...]} per line
      --tokenizer kind=huggingface_auto,model=LOCAL_TOKENIZER_DIR
      --output   kind=json,path=guidellm.json --output kind=console --disable-progress

Both tools send the same body fields that matter (model, messages, stream with
``stream_options.include_usage``, a max of 64 completion tokens, temperature 0). GuideLLM sends
``max_completion_tokens`` plus ``continuous_usage_stats``, loadtest sends ``max_tokens``; specd
reads both token caps and ignores unknown fields. ``ignore_eos`` (``--ignore-eos`` passes
``extras.body.ignore_eos=true`` to GuideLLM) is ignored by specd's protocol models, so the output
length is "at most max_tokens" for both tools; with greedy decoding both see the same lengths
(the ``tok/req`` column shows it). Each GuideLLM level restarts at the first prompt, as loadtest
does, and each level sends exactly ``--requests`` requests. The server is warmed with two
requests once, before either tool runs; neither tool then warms up on its own.

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

The rows go to ``--json`` (default loadtest/results/compare_guidellm.json); the raw outputs (the
prompts, GuideLLM's JSON and log, loadtest's results.json and log) to ``--raw-dir`` (default a
fresh folder under /tmp, printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtest import workloads

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


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.compare_guidellm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default="configs/default.yaml", help="specd config to serve")
    ap.add_argument("--base-url", help="use a server already running here instead of starting one")
    ap.add_argument("--guidellm", default="/tmp/glvenv/bin/guidellm", help="GuideLLM's CLI")
    ap.add_argument(
        "--tokenizer",
        help="local tokenizer folder for GuideLLM "
        "(default: the folder `specd prepare` made for the config's model)",
    )
    ap.add_argument("--workload", default="mtbench,humaneval")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, help="requests per level (default: one per prompt)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="also send ignore_eos=true from GuideLLM (specd ignores the field)",
    )
    ap.add_argument("--order", default="guidellm,loadtest", help="which tool runs first")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run both tools this many times, the order alternating (A B, B A, ...)",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per tool run")
    ap.add_argument("--json", default="loadtest/results/compare_guidellm.json")
    ap.add_argument("--raw-dir", help="folder for the raw outputs (default: a new /tmp folder)")
    return ap.parse_args(argv)


# -- statistics shared by both tools' per-request records --------------------------------------
def nearest_rank(values: list[tuple[float, float]], p: float) -> float | None:
    """GuideLLM's percentile: the first value (sorted) whose cumulative weight share reaches p."""
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


# -- the two tools -------------------------------------------------------------------------------
def write_prompts(args, path: Path) -> int:
    items = workloads.build(args.workload.split(","), args.per_category, "chat")
    with path.open("w") as f:
        for it in items:
            f.write(
                json.dumps({"id": it.id, "category": it.category, "messages": list(it.messages)})
                + "\n"
            )
    return len(items)


def default_tokenizer(config: str) -> str:
    from engine.config import EngineConfig
    from engine.loader import prepare

    cfg = EngineConfig.from_yaml(config)
    return str(prepare(cfg.model.source, cfg.cache_dir, progress=False))


def warm(base_url: str, model: str, prompts: Path, n: int = 2) -> None:
    lines = prompts.read_text().splitlines()[:n]
    for line in lines:
        httpx.post(
            f"{base_url}/chat/completions",
            timeout=300,
            json={
                "model": model,
                "messages": json.loads(line)["messages"],
                "max_tokens": 16,
                "temperature": 0,
            },
        ).raise_for_status()


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


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> float:
    t0 = time.monotonic()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    if proc.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{cmd[0]} exited with {proc.returncode}; log {log}:\n{tail}")
    return time.monotonic() - t0


# -- parsing -------------------------------------------------------------------------------------
def guidellm_rows(path: Path) -> list[dict]:
    rows = []
    for b in json.loads(path.read_text())["benchmarks"]:
        m = b["metrics"]

        def pct(name, p, scale=1.0):
            v = m[name]["successful"]["percentiles"][p]
            return None if v is None else v * scale

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
                "itl_definition": "per-request (last-first)/(tokens-1), token-weighted, nearest rank",
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


# -- main ----------------------------------------------------------------------------------------
def main(argv=None) -> None:
    args = parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    order = args.order.split(",")
    if sorted(order) != ["guidellm", "loadtest"]:
        raise SystemExit("--order must name guidellm and loadtest")
    if not Path(args.guidellm).exists():
        raise SystemExit(f"no GuideLLM CLI at {args.guidellm} (--guidellm)")
    raw = Path(args.raw_dir or tempfile.mkdtemp(prefix="compare_guidellm-"))
    raw.mkdir(parents=True, exist_ok=True)
    prompts = raw / "prompts.jsonl"
    n_items = write_prompts(args, prompts)
    n = args.requests or n_items
    tokenizer = args.tokenizer or default_tokenizer(args.config)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with contextlib.ExitStack() as stack:
        if args.base_url:
            base_url = args.base_url.rstrip("/")
        else:
            from loadtest.server_proc import specd_server

            base_url, _ = stack.enter_context(specd_server(Path(args.config), max(levels)))
        model = httpx.get(f"{base_url}/models", timeout=30).json()["data"][0]["id"]
        warm(base_url, model, prompts)
        cmds, walls, rows = {}, [], []
        for r in range(args.repeat):
            sfx = f"-{r}" if args.repeat > 1 else ""
            cmds[r] = {
                "guidellm": guidellm_cmd(
                    args,
                    base_url,
                    model,
                    prompts,
                    tokenizer,
                    levels,
                    n,
                    raw / f"guidellm{sfx}.json",
                ),
                "loadtest": loadtest_cmd(
                    args, base_url, model, prompts, levels, n, raw / f"loadtest{sfx}"
                ),
            }
            for tool in order if r % 2 == 0 else order[::-1]:
                print(f"repeat {r}: running {tool} ...", file=sys.stderr, flush=True)
                walls.append(
                    {
                        "repeat": r,
                        "tool": tool,
                        "wall_s": run_logged(
                            cmds[r][tool],
                            raw / f"{tool}{sfx}.log",
                            args.timeout,
                            env if tool == "guidellm" else None,
                        ),
                    }
                )
            new = guidellm_rows(raw / f"guidellm{sfx}.json") + loadtest_rows(
                raw / f"loadtest{sfx}" / "results.json"
            )
            rows += [dict(row, repeat=r) for row in new]
    version = (
        subprocess.run([args.guidellm, "--version"], capture_output=True, text=True, env=env)
        .stdout.strip()
        .removeprefix("guidellm version:")
        .strip()
    )
    meta = {
        "started": started,
        "model": model,
        "config": args.config,
        "server": args.base_url or "specd_server (own process, free loopback port)",
        "prompts": n_items,
        "requests_per_level": n,
        "concurrency": levels,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": args.ignore_eos,
        "order": order,
        "repeat": args.repeat,
        "tool_runs": walls,
        "guidellm_version": version,
        "tokenizer": tokenizer,
        "raw_dir": str(raw),
        "commands": cmds[0],
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(
        f"GuideLLM ({version}) vs python -m loadtest, {model}, {n} requests per level "
        f"({args.workload}, {args.per_category} per category, chat), max_tokens "
        f"{args.max_tokens}, temperature 0, closed loop at {args.concurrency}; order: "
        f"{', '.join(order)}" + (", alternating" if args.repeat > 1 else "") + f"; {started}"
    )
    print(
        "ms except tok/req and out tok/s; ITL = each tool's own definition (GuideLLM: "
        "per-request mean, token-weighted; loadtest: per token), ITLreq = GuideLLM's "
        "definition for both tools (see the module docstring)\n"
    )
    print(render(rows, args.repeat > 1))
    print(f"\nrows: {out}\nraw outputs: {raw}")
    for tool in order:
        print(f"{tool}: {' '.join(cmds[0][tool])}")


if __name__ == "__main__":
    sys.exit(main())
