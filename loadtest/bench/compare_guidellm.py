"""Cross-check ``python -m loadtest`` against an independent client, GuideLLM (0.8.x): one specd
server, the same prompts, the same closed-loop concurrency levels, the same ``max_tokens`` and
temperature 0, measured by both tools one after the other, printed as one table. The machine's
other load moves between the two runs, so ``--repeat N`` runs the pair N times, the order
alternating (A B, B A, ...), one row per tool, level and repeat.

    .venv/bin/python -m loadtest.bench.compare_guidellm                      # defaults below
    .venv/bin/python -m loadtest.bench.compare_guidellm --concurrency 1,4 --max-tokens 64 \\
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

The command lines and what each column means, per tool: loadtest/bench/compare_tools.py.

The rows go to ``--json`` (default loadtest/results/compare_guidellm.json); the raw outputs (the
prompts, GuideLLM's JSON and log, loadtest's results.json and log) to ``--raw-dir`` (default a
fresh folder under /tmp, printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtest import workloads
from loadtest.bench.compare_tools import (
    guidellm_cmd,
    guidellm_rows,
    loadtest_cmd,
    loadtest_rows,
    render,
)
from loadtest.modes import ordered


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.bench.compare_guidellm",
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


# -- inputs and runs -----------------------------------------------------------------------------
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
    from engine.model.loader import prepare

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


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> float:
    t0 = time.monotonic()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n\n")
        f.flush()
        proc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env, check=False
        )
    if proc.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{cmd[0]} exited with {proc.returncode}; log {log}:\n{tail}")
    return time.monotonic() - t0


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

            server = stack.enter_context(specd_server(Path(args.config), max(levels)))
            base_url = server.base_url
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
            for tool in ordered(order, r):
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
        subprocess.run(
            [args.guidellm, "--version"], capture_output=True, text=True, env=env, check=False
        )
        .stdout.strip()
        .removeprefix("guidellm version:")
        .strip()
    )
    meta = {
        "started": started,
        "model": model,
        "config": args.config,
        "server": args.base_url or "specd_server (own process, loopback port picked by the kernel)",
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
