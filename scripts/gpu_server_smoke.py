"""Smoke check of the specd HTTP server on a GPU (or CPU), with nothing downloaded.

A random-weight LlamaForCausalLM of SmolLM2-135M's shape (seed 0) with SmolLM2's real tokenizer
(--tokenizer) is served by ``python -m server.cli serve`` (n-gram drafter, K 4, adaptive) on a
free port and driven with the ``openai`` client: a chat completion, two concurrent streamed chats,
a seeded streamed completion, a bad parameter (400 in OpenAI's error shape), /v1/models, /health,
/metrics. Exit status 0 only if all pass. --compile-mode: none (not compiled) | cuda-graphs
(the eager stack captured as CUDA graphs, engine/model/cuda_graphs.py) | another compile.mode. E.g.:
``python scripts/gpu_server_smoke.py --tokenizer .gpu/tok --log /tmp/smoke.log``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import yaml

ROOT = Path(__file__).resolve().parent.parent
NAME = "smoke-smollm2-shape"
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152)
SHAPE.update(num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
SHAPE.update(max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5)
SHAPE.update(bos_token_id=1, eos_token_id=2, pad_token_id=2)
MSGS = [{"role": "user", "content": "Name three colours of the rainbow."}]
results: list[bool] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    results.append(bool(ok))
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def build_model(out: Path, tokenizer: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (tokenizer / "tokenizer.json").is_file():
        raise SystemExit(f"no tokenizer.json in {tokenizer}")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(out, safe_serialization=True)
    skip = shutil.ignore_patterns("*.safetensors", "*.bin", "*.gguf", "config.json", "gen*.json")
    shutil.copytree(tokenizer, out, ignore=skip, dirs_exist_ok=True)  # its files, no weights


def write_config(path: Path, model: Path, args, port: int) -> None:
    mode = args.compile_mode
    comp = {"enabled": False} if mode == "none" else {"enabled": True, "mode": mode}
    model_ = {"source": str(model), "name": NAME, "dtype": args.dtype, "device": args.device}
    drafter = {"method": "ngram", "k": 4, "controller": "adaptive"}
    engine = {"model": model_, "drafter": drafter, "compile": comp}
    engine.update(max_running=8, max_model_len=1024)
    data = {"engine": engine, "server": {"host": "127.0.0.1", "port": port}}
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def wait_ready(proc: subprocess.Popen, base: str, log: Path, timeout=240.0) -> tuple[bool, str]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            tail = "".join(log.read_text(errors="replace").splitlines(True)[-30:])
            return False, f"the server exited with {proc.returncode}; its log's tail:\n{tail}"
        if get(f"{base}/ready")[0] == 200:
            return True, f"{time.monotonic() - t0:.1f} s after start"
        time.sleep(1.0)
    return False, f"no 200 from /ready in {timeout:.0f} s (log: {log})"


def stream(client, name: str, kind: str, **kw) -> None:
    t0, n, first, finish, usage = time.perf_counter(), 0, 0.0, None, None
    try:
        create = client.chat.completions.create if kind == "chat" else client.completions.create
        for chunk in create(model=NAME, stream=True, stream_options={"include_usage": True}, **kw):
            usage = chunk.usage or usage
            for c in chunk.choices:
                if c.delta.content if kind == "chat" else c.text:
                    n, first = n + 1, first or time.perf_counter() - t0
                finish = c.finish_reason or finish
    except Exception as e:  # noqa: BLE001 (reported as a failed check)
        return check(name, False, repr(e))
    tokens, wall = usage.completion_tokens if usage else 0, time.perf_counter() - t0
    detail = f"{tokens} tokens ({n} text chunks), finish {finish}, first text {first:.2f} s"
    check(name, tokens > 0 and finish in ("length", "stop"), f"{detail}, wall {wall:.2f} s")


def chat(client) -> tuple[bool, str]:
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=16, temperature=0)
    n, c, wall = r.usage.completion_tokens, r.choices[0], time.perf_counter() - t0
    ok = n > 0 and isinstance(c.message.content, str)
    return ok, f"{n} tokens, finish {c.finish_reason}, wall {wall:.2f} s"


def bad_parameter(client) -> tuple[bool, str]:
    try:
        client.chat.completions.create(model=NAME, messages=MSGS, temperature=-1)
        return False, "temperature -1 was accepted"
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        err = body.get("error", body)
        ok = e.status_code == 400 and isinstance(err, dict) and {"message", "type"} <= set(err)
        return ok, f"{e.status_code} {err}"


def models(client) -> tuple[bool, str]:
    ids = [m.id for m in client.models.list().data]
    return NAME in ids, str(ids)


def run_checks(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=300, max_retries=0)
    for name, fn in (
        ("chat", chat),
        ("bad parameter -> 400", bad_parameter),
        ("GET /v1/models", models),
    ):
        try:
            check(name, *fn(client))
        except Exception as e:  # noqa: BLE001 (reported as a failed check)
            check(name, False, repr(e))

    def count(i: int) -> None:
        msgs = [{"role": "user", "content": f"Count to {10 + i}, one number a line."}]
        stream(client, f"chat stream {i}/2 (concurrent)", "chat", messages=msgs, max_tokens=32)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(count, (1, 2)))
    kw = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.8, "seed": 7}
    stream(client, "completion stream (temperature 0.8, seed 7)", "text", **kw)
    check("GET /health", (health := get(f"{base}/health")[0]) == 200, str(health))
    status, text = get(f"{base}/metrics")
    rows = [ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#")]
    rows = [(k.split("{")[0], v) for k, v in reversed(rows) if k.split("{")[0].endswith("_total")]
    hits = {n: v for n, v in rows if "accept" in n or "tokens" in n}  # a first series per name
    shown = ", ".join(f"{k}={float(v):g}" for k, v in sorted(hits.items())[:6])
    check("GET /metrics", status == 200 and bool(hits), f"{status}; {shown}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="tok", help="folder with SmolLM2's tokenizer files")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile-mode", default="cuda-graphs")
    ap.add_argument("--log", type=Path, default="gpu_server_smoke.log", help="server output")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="specd-smoke-") as tmp:
        model, config, t0 = Path(tmp) / "model", Path(tmp) / "serve.yaml", time.perf_counter()
        build_model(model, Path(args.tokenizer))
        what = f"{args.device}, {args.dtype}, compile {args.compile_mode}"
        print(f"random SmolLM2-135M-shaped model in {time.perf_counter() - t0:.1f} s; {what}")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        write_config(config, model, args, port)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
        cmd = [sys.executable, "-m", "server.cli", "serve", "--config", str(config)]  # cwd: ROOT
        with open(args.log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            ready = wait_ready(proc, base, args.log)
            check("server ready", *ready)
            if ready[0]:
                run_checks(base)
        finally:
            proc.terminate()  # SIGTERM: the server drains, then exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=40)
            proc.kill()  # (nothing if it has exited)
            proc.wait()
            print(f"server exited with {proc.returncode} (log: {args.log})", flush=True)
    passed = bool(results) and all(results)
    print(f"{'PASS' if passed else 'FAIL'}: {sum(results)}/{len(results)} checks", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
