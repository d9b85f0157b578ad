"""specd against llama.cpp and ``transformers serve`` on this machine, in one run.

The same 24 requests for every server: 16 MT-Bench first turns (2 per category, chat endpoint)
and 8 HumanEval prompts (completions endpoint), greedy, max_tokens 128, streamed, through
``python -m loadtest`` (the official openai client). Each server is started alone (the others
are stopped: they would share the cores), warmed with 2 requests, then measured one request at
a time and 8 at a time. Reported per server and level: output tok/s, TTFT p50, p95 inter-token
latency (per token, see loadtest/client.py), and the server's peak RSS (loadtest/server_proc.py:
the sum over its process tree, sampled from start to stop, warm-up and compilation included).
Every server listens on a port the kernel picks (``--port 0``), read back by server_proc.

    python -m loadtest.bench.servers                          # all three, c = 1 and 8
    python -m loadtest.bench.servers --rounds 2               # twice, order reversed: medians
    python -m loadtest.bench.servers --servers specd --concurrency 1

Servers:
* ``specd``: ``specd serve --config configs/cpu-compiled.yaml`` (n-gram speculation with adaptive
  K, compiled forwards, bf16);
* ``llamacpp``: ``python -m llama_cpp.server --model <SmolLM2 Q4_1 GGUF> --n_threads 2
  --n_threads_batch 2 --interrupt_requests False`` from its own venv, built by
  ``loadtest/envs/setup_llamacpp.sh`` (never a dependency of specd);
* ``hf``: ``transformers serve <the safetensors folder specd prepared>`` (plain decoding, bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx

from engine.config import EngineConfig
from engine.model.loader import prepare, resolve_source
from loadtest import cli, workloads
from loadtest.modes import interleaved
from loadtest.server_proc import HOST, spawn, specd_argv

ROOT = Path(__file__).resolve().parents[2]
LLAMACPP_VENV = ROOT / "loadtest" / "envs" / "llamacpp"


def mix_file(path: Path) -> Path:
    """16 MT-Bench first turns (2 per category) + 8 HumanEval prompts, as a loadtest JSONL."""
    items = workloads.build(["mtbench"], 2) + workloads.build(["humaneval"], 8)
    with path.open("w") as f:
        for it in items:
            d = {"id": it.id, "category": it.category}
            d.update(
                {"prompt": it.prompt} if it.prompt is not None else {"messages": list(it.messages)}
            )
            f.write(json.dumps(d) + "\n")
    return path


def server_command(name: str, args) -> tuple[list[str], str, dict]:
    """(argv listening on port 0 of HOST, readiness URL path, extra env) of one server."""
    cfg = EngineConfig.from_yaml(args.config)
    listen = ["--host", HOST, "--port", "0"]
    if name == "specd":
        return specd_argv(args.config), "/ready", {}
    if name == "llamacpp":
        gguf = resolve_source(cfg.model.source).location
        python = str(Path(args.llamacpp_venv) / "bin" / "python")
        threads = ["--n_threads", "2", "--n_threads_batch", "2"]
        argv = [python, "-m", "llama_cpp.server", "--model", gguf, *threads]
        return (
            argv + ["--interrupt_requests", "False", "--n_ctx", "2048", *listen],
            "/v1/models",
            {},
        )
    if name == "hf":
        folder = prepare(cfg.model.source, cfg.cache_dir, progress=False)
        cache = Path(args.out) / "hf_hub_cache"  # it lists this (empty) Hub cache on /v1/models
        cache.mkdir(parents=True, exist_ok=True)
        argv = [str(Path(sys.executable).parent / "transformers"), "serve", folder, *listen]
        return argv + ["--dtype", "bfloat16"], "/health", {"HF_HUB_CACHE": str(cache.resolve())}
    raise ValueError(f"unknown server {name!r} (specd, llamacpp, hf)")


@contextmanager
def started(name: str, args):
    """The server ``name`` in a child process (its output in OUT/NAME.log), ready."""
    argv, ready_path, env = server_command(name, args)
    with spawn(
        argv,
        ready_path=ready_path,
        name=name,
        env={"HF_HUB_OFFLINE": "1", **env},
        cwd=ROOT,
        log=Path(args.out) / f"{name}.log",
        timeout=args.start_timeout,
    ) as server:
        print(f"{name}: ready in {server.ready_s:.0f} s", flush=True)
        yield server


def model_id(base: str, name: str, args) -> str:
    if name == "hf":  # the model it was started with (its list shows the Hub cache only)
        cfg = EngineConfig.from_yaml(args.config)
        return prepare(cfg.model.source, cfg.cache_dir, progress=False)
    return httpx.get(base + "/models", timeout=30).json()["data"][0]["id"]


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.bench.servers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--servers", default="specd,llamacpp,hf")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, help="requests per level (default: the 24 items)")
    ap.add_argument("--config", default="configs/cpu-compiled.yaml", help="specd's config")
    ap.add_argument("--llamacpp-venv", default=str(LLAMACPP_VENV))
    ap.add_argument("--start-timeout", type=float, default=1200)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the servers this many times, the order reversed every other round "
        "(A B C, C B A, ...); the table shows medians, ratios per round",
    )
    ap.add_argument("--out", default="loadtest/results/servers")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = mix_file(out / "mix.jsonl")
    rows = []
    names = args.servers.split(",")
    for rnd, name in interleaved(names, args.rounds):
        with started(name, args) as server:
            base, ready_s = server.base_url, server.ready_s
            model = model_id(base, name, args)
            largs = cli.parse_args(
                [
                    "--base-url",
                    base,
                    "--model",
                    model,
                    "--workload",
                    f"jsonl:{data}",
                    "--max-tokens",
                    str(args.max_tokens),
                    "--concurrency",
                    args.concurrency,
                    "--no-progress",
                    "--no-plots",
                ]
                + (["--requests", str(args.requests)] if args.requests else [])
            )
            res = cli.run(largs)
            peak = server.rss.peak
        for r in res["runs"]:
            s = r["summary"]
            rows.append(
                {
                    "server": name,
                    "round": rnd,
                    "concurrency": r["concurrency"],
                    "ready_s": ready_s,
                    "output_tok_s": s["output_tok_s"],
                    "ttft_p50_ms": s["ttft"]["p50_ms"],
                    "itl_p95_ms": s["itl_token"]["p95_ms"],
                    "errors": s.get("errors", 0),
                    "requests": s.get("requests"),
                    "peak_rss_mib": peak,
                    "server_stats": r.get("server"),
                }
            )
        suffix = f"-{rnd}" if args.rounds > 1 else ""
        (out / f"{name}{suffix}.json").write_text(json.dumps(res, indent=1, default=str))

    print(
        f"\nServers on this machine ({os.cpu_count()} cores): 16 MT-Bench chats + 8 HumanEval "
        f"completions, greedy, max_tokens {args.max_tokens}, streamed"
        + (
            f"; median of {args.rounds} rounds (order reversed every other round), peak RSS "
            f"the largest"
            if args.rounds > 1
            else ""
        )
    )
    print(
        f"{'server':<10}{'clients':>8}{'out tok/s':>11}{'TTFT p50 ms':>13}{'ITL p95 ms':>12}"
        f"{'peak RSS MiB':>14}{'errors':>8}{'ready s':>9}"
    )
    levels = sorted({r["concurrency"] for r in rows})
    med = {}
    for name in names:
        for c in levels:
            rs = [r for r in rows if r["server"] == name and r["concurrency"] == c]
            if not rs:
                continue
            m = {
                k: statistics.median(r[k] for r in rs)
                for k in ("output_tok_s", "ttft_p50_ms", "itl_p95_ms", "ready_s")
            }
            m.update(
                peak_rss_mib=max(r["peak_rss_mib"] for r in rs), errors=sum(r["errors"] for r in rs)
            )
            med[name, c] = m
            print(
                f"{name:<10}{c:>8}{m['output_tok_s']:>11.1f}{m['ttft_p50_ms']:>13.0f}"
                f"{m['itl_p95_ms']:>12.1f}{m['peak_rss_mib']:>14.0f}{m['errors']:>8}"
                f"{m['ready_s']:>9.0f}"
            )
    for c in levels:
        for other in ("llamacpp", "hf"):
            if ("specd", c) not in med or (other, c) not in med:
                continue
            per_round = [
                s["output_tok_s"] / o["output_tok_s"]
                for s in rows
                if s["server"] == "specd" and s["concurrency"] == c
                for o in rows
                if o["server"] == other
                and o["concurrency"] == c
                and o["round"] == s["round"]
                and o["output_tok_s"]
            ]
            line = (
                f"c={c}: specd / {other} output tok/s = "
                f"{med['specd', c]['output_tok_s'] / med[other, c]['output_tok_s']:.2f}"
            )
            if len(per_round) > 1:
                line += " (per round " + ", ".join(f"{x:.2f}" for x in per_round) + ")"
            print(line)
    for c in levels:
        st = [
            r["server_stats"]
            for r in rows
            if r["server"] == "specd" and r["concurrency"] == c and r.get("server_stats")
        ]
        if st:
            print(
                f"specd c={c}: acceptance "
                + ", ".join(f"{x['acceptance']:.2f}" for x in st)
                + "; tokens per target pass "
                + ", ".join(f"{x['tokens_per_pass']:.2f}" for x in st)
            )
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
