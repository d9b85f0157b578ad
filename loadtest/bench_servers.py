"""specd against llama.cpp and ``transformers serve`` on this machine, in one run (issue 9).

The same 24 requests for every server: 16 MT-Bench first turns (2 per category, chat endpoint)
and 8 HumanEval prompts (completions endpoint), greedy, max_tokens 128, streamed, through
``python -m loadtest`` (the official openai client). Each server is started alone (the others
are stopped: they would share the 2 cores), warmed with 2 requests, then measured one request at
a time and 8 at a time. Reported per server and level: output tok/s, TTFT p50, p95 inter-token
latency (per token, see loadtest/client.py), and the server's peak resident memory (the sum over
its process tree, sampled every 0.2 s from start to stop, warm-up and compilation included).

    python -m loadtest.bench_servers                          # all three, c = 1 and 8
    python -m loadtest.bench_servers --servers specd --concurrency 1

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
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from engine.config import EngineConfig
from engine.loader import prepare, resolve_spec
from loadtest import cli, workloads
from loadtest.server_proc import stop_process

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_VENV = ROOT / "loadtest" / "envs" / "llamacpp"


def mix_file(path: Path) -> Path:
    """16 MT-Bench first turns (2 per category) + 8 HumanEval prompts, as a loadtest JSONL."""
    items = workloads.build(["mtbench"], 2) + workloads.build(["humaneval"], 8)
    with path.open("w") as f:
        for it in items:
            d = {"id": it.id, "category": it.category}
            d.update({"prompt": it.prompt} if it.prompt is not None else
                     {"messages": list(it.messages)})
            f.write(json.dumps(d) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for t in Path(f"/proc/{p}/task").iterdir():
                kids = (t / "children").read_text().split()
                todo += [int(k) for k in kids]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total / 1024


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak = pid, every, 0.0
        self._stop_ev = threading.Event()

    def run(self):
        while not self._stop_ev.is_set():
            self.peak = max(self.peak, tree_rss_mib(self.pid))
            self._stop_ev.wait(self.every)

    def stop(self) -> float:
        self._stop_ev.set()
        self.join()
        return self.peak


def server_command(name: str, port: int, args) -> tuple[list[str], str, dict]:
    """(argv, readiness URL path, extra env) of one server."""
    cfg = EngineConfig.from_yaml(args.config)
    if name == "specd":
        return ([sys.executable, "-m", "server.cli", "serve", "--config", args.config,
                 "--host", "127.0.0.1", "--port", str(port)], "/ready", {})
    if name == "llamacpp":
        gguf = resolve_spec(cfg.model.spec).location
        return ([str(Path(args.llamacpp_venv) / "bin" / "python"), "-m", "llama_cpp.server",
                 "--model", gguf, "--n_threads", "2", "--n_threads_batch", "2",
                 "--interrupt_requests", "False", "--n_ctx", "2048",
                 "--host", "127.0.0.1", "--port", str(port)], "/v1/models", {})
    if name == "hf":
        folder = prepare(cfg.model.spec, cfg.cache_dir, progress=False)
        cache = Path(args.out) / "hf_hub_cache"  # it lists this (empty) Hub cache on /v1/models
        cache.mkdir(parents=True, exist_ok=True)
        return ([str(Path(sys.executable).parent / "transformers"), "serve", folder,
                 "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"],
                "/health", {"HF_HUB_CACHE": str(cache.resolve())})
    raise ValueError(f"unknown server {name!r} (specd, llamacpp, hf)")


@contextmanager
def started(name: str, args):
    port = free_port()
    argv, ready_path, env = server_command(name, port, args)
    log = open(Path(args.out) / f"{name}.log", "w")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", **env))
    sampler = RssSampler(proc.pid)
    sampler.start()
    t0 = time.monotonic()
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(base + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > args.start_timeout:
                raise RuntimeError(f"{name} did not become ready; see {log.name}")
            time.sleep(0.5)
        ready_s = time.monotonic() - t0
        print(f"{name}: ready in {ready_s:.0f} s", flush=True)
        yield base + "/v1", sampler, ready_s
    finally:
        stop_process(proc)
        sampler.stop()
        log.close()


def model_id(base: str, name: str, args) -> str:
    if name == "hf":  # the model it was started with (its list shows the Hub cache only)
        cfg = EngineConfig.from_yaml(args.config)
        return prepare(cfg.model.spec, cfg.cache_dir, progress=False)
    return httpx.get(base + "/models", timeout=30).json()["data"][0]["id"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="specd,llamacpp,hf")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, help="requests per level (default: the 24 items)")
    ap.add_argument("--config", default="configs/cpu-compiled.yaml", help="specd's config")
    ap.add_argument("--llamacpp-venv", default=str(LLAMACPP_VENV))
    ap.add_argument("--start-timeout", type=float, default=1200)
    ap.add_argument("--out", default="loadtest/results/bench_servers")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = mix_file(out / "mix.jsonl")
    rows = []
    for name in args.servers.split(","):
        with started(name, args) as (base, sampler, ready_s):
            model = model_id(base, name, args)
            largs = cli.parse_args(["--base-url", base, "--model", model,
                                    "--workload", f"jsonl:{data}", "--max-tokens",
                                    str(args.max_tokens), "--concurrency", args.concurrency,
                                    "--no-progress", "--no-plots"]
                                   + (["--requests", str(args.requests)] if args.requests else []))
            res = cli.run(largs)
            peak = sampler.peak
        for r in res["runs"]:
            s = r["summary"]
            rows.append({"server": name, "concurrency": r["concurrency"], "ready_s": ready_s,
                         "output_tok_s": s["output_tok_s"], "ttft_p50_ms": s["ttft"]["p50_ms"],
                         "itl_p95_ms": s["itl_token"]["p95_ms"], "errors": s.get("errors", 0),
                         "requests": s.get("requests"), "peak_rss_mib": peak,
                         "server_stats": r.get("server")})
        (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))

    print(f"\nServers on this machine ({os.cpu_count()} cores): 16 MT-Bench chats + 8 HumanEval "
          f"completions, greedy, max_tokens {args.max_tokens}, streamed")
    print(f"{'server':<10}{'clients':>8}{'out tok/s':>11}{'TTFT p50 ms':>13}{'ITL p95 ms':>12}"
          f"{'peak RSS MiB':>14}{'errors':>8}{'ready s':>9}")
    for r in rows:
        print(f"{r['server']:<10}{r['concurrency']:>8}{r['output_tok_s']:>11.1f}"
              f"{r['ttft_p50_ms']:>13.0f}{r['itl_p95_ms']:>12.1f}{r['peak_rss_mib']:>14.0f}"
              f"{r['errors']:>8}{r['ready_s']:>9.0f}")
    by = {(r["server"], r["concurrency"]): r for r in rows}
    for c in sorted({r["concurrency"] for r in rows}):
        s = by.get(("specd", c))
        for other in ("llamacpp", "hf"):
            o = by.get((other, c))
            if s and o and o["output_tok_s"]:
                print(f"c={c}: specd / {other} output tok/s = "
                      f"{s['output_tok_s'] / o['output_tok_s']:.2f}")
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
