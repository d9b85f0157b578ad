"""``python -m loadtest``: drive any OpenAI-compatible server with a workload and a load shape,
measure latencies and throughput per request, and write a table, a JSON file and PNG plots.

    # specd already serving on :8000, MT-Bench + HumanEval, closed loop at 1, 4 and 16 clients
    python -m loadtest --base-url http://127.0.0.1:8000/v1 --concurrency 1,4,16
    # A/B: the same prompts with speculation on and off, interleaved (ABBA), 3 repeats
    python -m loadtest --spawn-specd configs/default.yaml --ab --repeat 3 --concurrency 1,4,16
    # open loop: Poisson arrivals at 0.5 and 1 request/s, 60 s at most each
    python -m loadtest --rate 0.5,1 --duration 60 --workload jsonl:prompts.jsonl

Modes (``--modes``, ``--ab`` = ``on,off``) set specd's per-request ``speculation`` option:
``default``/``on`` send nothing (the server's default), ``off`` sends ``{"enabled": false}``,
``kN`` a fixed K = N. Another server only ever needs ``default``. With two or more modes each load
point runs every mode once per repeat, the order alternating (A B, B A, ...) so machine noise
hits both, and the A/B table gives the first mode's ratio to each other mode, per repeat, with a
95% t interval over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import openai
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest import report, stats, workloads
from loadtest.client import Options, run_item
from loadtest.modes import AB, interleaved, parse_modes, spec_option
from loadtest.shapes import closed_loop, open_loop


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument(
        "--spawn-specd",
        metavar="CONFIG",
        help="start `specd serve --config CONFIG` on a free port for the run",
    )
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    ap.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    ap.add_argument(
        "--workload",
        default="mtbench,humaneval",
        help="comma list of mtbench, mtbench:2 (both turns), humaneval, jsonl:PATH",
    )
    ap.add_argument("--per-category", type=int, help="first N items of each category")
    ap.add_argument("--endpoint", default="auto", choices=("auto", "chat", "completions"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int)
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default="1", help="closed loop: comma list of client counts")
    load.add_argument("--rate", help="open loop: comma list of Poisson request rates (1/s)")
    ap.add_argument(
        "--requests",
        type=int,
        help="requests per run (default: one per workload item; a conversation counts once)",
    )
    ap.add_argument("--duration", type=float, default=600.0, help="time bound per run, seconds")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    ap.add_argument(
        "--max-retries",
        type=int,
        default=0,
        help="the openai client's retries of a failed connection (0: every failure counts; "
        "2, the client's default, for servers that drop idle keep-alive connections)",
    )
    ap.add_argument("--modes", default="default", help="comma list: default|on, off, kN")
    ap.add_argument("--ab", action="store_true", help="same as --modes on,off")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    ap.add_argument("--out", help="results folder (default loadtest/results/run-<time>)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.ab:
        args.modes = AB
    parse_modes(args.modes)  # fails early on a bad name
    return args


def load_points(args) -> list[tuple[str, float]]:
    if args.rate:
        return [("open", float(x)) for x in args.rate.split(",")]
    return [("closed", int(x)) for x in args.concurrency.split(",")]


async def run_once(
    args, items, model: str, shape: str, value: float, mode: str, n: int, progress_cb
) -> tuple[list, float]:
    opts = Options(model, args.max_tokens, args.temperature, args.seed, args.timeout)
    spec = spec_option(mode)
    async with openai.AsyncOpenAI(
        base_url=args.base_url,
        api_key=args.api_key,
        max_retries=args.max_retries,
        timeout=args.timeout,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=1024)),
    ) as client:
        t_run = time.perf_counter()

        async def send(item, sink):
            await run_item(client, item, opts, spec, t_run, sink)

        if shape == "closed":
            return await closed_loop(items, send, int(value), n, args.duration, on_done=progress_cb)
        return await open_loop(
            items, send, value, n, args.duration, seed=args.seed or 0, on_done=progress_cb
        )


def _ratios(pick: dict, a: str, b: str, reps: list[int], f) -> dict:
    """mean_ci of f(A) / f(B) over the repeats where both are known."""
    out = []
    for rep in reps:
        x, y = f(pick[(a, rep)]), f(pick[(b, rep)])
        if x is not None and y:
            out.append(x / y)
    return stats.mean_ci(out)


def ab_rows(runs: list[dict], modes: list[str]) -> list[dict]:
    """Per load point and per mode B after the first (A): A / B ratios from the same repeat."""
    rows = []
    for load in dict.fromkeys(report.point_label(r) for r in runs):
        pick = {
            (r["mode"], r["repeat"]): r["summary"] for r in runs if report.point_label(r) == load
        }
        reps = sorted({rep for _, rep in pick})
        a = modes[0]
        for b in modes[1:]:
            rows.append(
                {
                    "load": load,
                    "a": a,
                    "b": b,
                    "tok_s_ratio": _ratios(pick, a, b, reps, lambda s: s["output_tok_s"]),
                    "itl_p95_ratio": _ratios(pick, a, b, reps, lambda s: s["itl_token"]["p95_ms"]),
                    "ttft_p50_ratio": _ratios(pick, a, b, reps, lambda s: s["ttft"]["p50_ms"]),
                }
            )
    return rows


def run(args) -> dict:
    items = workloads.build(args.workload.split(","), args.per_category, args.endpoint)
    if not items:
        raise SystemExit("the workload has no items")
    model = (
        args.model
        or openai.OpenAI(base_url=args.base_url, api_key=args.api_key).models.list().data[0].id
    )
    modes = parse_modes(args.modes)
    points = load_points(args)
    n = args.requests or len(items)
    console = Console(stderr=True)
    results = {
        "meta": {
            "base_url": args.base_url,
            "model": model,
            "args": vars(args),
            "items": len(items),
            "requests_per_run": n,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "runs": [],
    }
    if args.warmup:
        asyncio.run(run_once(args, items, model, "closed", 1, modes[0], args.warmup, lambda: None))
    total = len(points) * args.repeat * len(modes) * n
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=args.no_progress,
    ) as bar:
        task = bar.add_task("requests", total=total)
        for shape, value in points:
            for rep, mode in interleaved(modes, args.repeat):
                label = f"c={value}" if shape == "closed" else f"{value}/s"
                bar.update(task, description=f"{label} {mode} #{rep}")
                before = stats.scrape(args.base_url, args.api_key)
                records, wall = asyncio.run(
                    run_once(args, items, model, shape, value, mode, n, lambda: bar.advance(task))
                )
                after = stats.scrape(args.base_url, args.api_key)
                results["runs"].append(
                    {
                        "shape": shape,
                        "concurrency": value if shape == "closed" else None,
                        "rate": value if shape == "open" else None,
                        "mode": mode,
                        "repeat": rep,
                        "summary": stats.summarize(records, wall),
                        "server": stats.server_delta(before, after),
                        "requests": [asdict(r) for r in records],
                    }
                )
    if len(modes) > 1:
        results["ab"] = ab_rows(results["runs"], modes)
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out or f"loadtest/results/run-{time.strftime('%Y%m%d-%H%M%S')}")
    with contextlib.ExitStack() as stack:
        server = None
        if args.spawn_specd:
            from loadtest.server_proc import specd_server

            max_c = max([int(x) for x in args.concurrency.split(",")] if not args.rate else [16])
            server = stack.enter_context(specd_server(Path(args.spawn_specd), max_c))
            args.base_url = server.base_url
        results = run(args)
        if server is not None:
            results["meta"]["server_peak_rss_mib"] = server.rss.peak
    if not args.no_plots:
        results["meta"]["plots"] = [str(p) for p in report.plots(results, out)]
    report.write_json(results, out / "results.json")
    report.table(results)
    Console(stderr=True).print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    sys.exit(main())
