"""Per-step latency, eager vs compiled: one forward of the target (and of a draft model) for a
1-token decode step and a K+1-token verify, at batch 1, 4 and 8, on a filled KV cache.

Both paths run on the same runner and cache in one process, interleaved (eager, compiled, eager,
...) so machine noise hits both alike; the table prints medians and the compiled / eager ratio.

    python -m loadtest.bench.steps                        # CPU default: SmolLM2-135M bf16, draft
                                                          # = its first 8 layers
    python -m loadtest.bench.steps --random-config llama-8b --draft-config llama-1b --device cuda \
        --dtype bfloat16 --mode cuda-graphs               # real-shape random-weight models (GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from engine.config import EngineConfig
from engine.kcontrol.timing import time_call, time_calls
from engine.model.compiled import CompileConfig
from engine.model.loader import load_model
from engine.model.runner import ModelRunner

# real model shapes, random weights (no download): for GPU figures
SHAPES = {
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "tiny": dict(  # CPU checks of a benchmark's plumbing
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    ),
}


def in_dtype(dtype: torch.dtype, device, make):
    """``make()`` with ``dtype`` as the default dtype on ``device``: modules are created in it
    directly (no transient float32 copy of an 8B model)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make().to(dtype).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(old)


def random_model(name: str, dtype: torch.dtype, device: str):
    """A random-weight Llama of the shape ``SHAPES[name]``, built in ``dtype`` on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=8192, rope_theta=500000.0, **SHAPES[name])
    return in_dtype(dtype, device, lambda: LlamaForCausalLM(cfg))


def time_forward(
    runner: ModelRunner, batch: int, q: int, reps: int, warmup: int = 0
) -> list[float]:
    """Seconds of each of ``reps`` forwards of ``q`` random tokens in each of rows 0..batch-1
    (engine.kcontrol.timing: the device synchronised before and after each), after ``warmup``
    untimed."""
    ids = torch.randint(0, runner.vocab_size, (batch, q), device=runner.device)
    slots = list(range(batch))
    logits = "all" if q > 1 else "last"
    return time_calls(
        lambda: runner.forward(ids, slots, counts=[q] * batch, logits=logits),
        runner.device,
        reps,
        warmup,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.bench.steps",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--random-config", default=None, help=f"target shape, one of {sorted(SHAPES)}")
    ap.add_argument("--draft-config", default=None, help="draft shape (random weights)")
    ap.add_argument(
        "--draft-layers",
        type=int,
        default=8,
        help="without --draft-config: the target's first N layers as the draft",
    )
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--k", type=int, default=4, help="verify = K+1 tokens")
    ap.add_argument("--context", type=int, default=256, help="tokens already in every row's cache")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="eager/compiled alternations")
    ap.add_argument("--mode", default="default", help="torch.compile mode")
    ap.add_argument(
        "--native-q4",
        action="store_true",
        help="GGUF Q4_1 layers kept 4-bit (model.native_q4) in every runner",
    )
    ap.add_argument("--json", default="loadtest/results/bench_steps.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    batches = [int(b) for b in args.batches.split(",")]
    slots = max(batches)
    max_len = args.context + 64
    cfg = EngineConfig.from_yaml(args.config)
    device = args.device or cfg.model.device
    dtype = getattr(torch, args.dtype)
    if args.random_config:
        target = random_model(args.random_config, dtype, device)
    else:
        target, _ = load_model(cfg.model.source, args.dtype, device, cfg.cache_dir)
    weights = None
    if args.native_q4:
        from engine.model.quant import native_q4

        weights = native_q4(cfg.model.source, target)
    ccfg = CompileConfig(
        enabled=True, mode=args.mode, batch_buckets=batches, q_buckets=sorted({1, args.k + 1})
    )
    fast = dict(compile=ccfg, k_max=args.k)
    runners = {"target": ModelRunner(target, slots, max_len, weights=weights, **fast)}
    if args.draft_config:
        draft = random_model(args.draft_config, dtype, device)
        runners["draft"] = ModelRunner(draft, slots, max_len, name="draft", **fast)
    elif args.draft_layers:
        runners[f"draft ({args.draft_layers} layers)"] = ModelRunner(
            target, slots, max_len, args.draft_layers, name="draft", weights=weights, **fast
        )
    rows = []
    for name, runner in runners.items():
        dev = runner.device
        ctx = torch.randint(0, runner.vocab_size, (slots, args.context), device=dev)
        runner.forward(ctx, list(range(slots)), counts=[args.context] * slots)  # fill the cache
        for s in range(slots):
            runner.cache.commit(s, args.context)
        compile_s = time_call(runner.warm_up, dev)
        path = runner.fast
        assert path is not None, "the compile failed (see the log)"
        shapes = len(path.batch_buckets) * len(path.q_buckets)
        print(f"{name}: compiled {shapes} shapes in {compile_s:.1f} s", flush=True)
        for b in batches:
            for q in (1, args.k + 1):
                times = {"eager": [], "compiled": []}
                for _ in range(args.rounds):
                    with runner.eager():
                        times["eager"] += time_forward(runner, b, q, args.reps, warmup=2)
                    times["compiled"] += time_forward(runner, b, q, args.reps, warmup=2)
                e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
                rows.append(
                    {
                        "model": name,
                        "batch": b,
                        "q": q,
                        "eager_ms": e * 1e3,
                        "compiled_ms": c * 1e3,
                        "speedup": e / c,
                        "compile_s": compile_s,
                    }
                )
                print(
                    f"  batch {b} q {q}: eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms",
                    flush=True,
                )

    desc = (args.random_config or cfg.model.name) + f", {args.dtype}, {device}"
    if args.native_q4:
        desc += ", Q4_1 layers 4-bit"
    if device == "cpu":
        desc += f", {torch.get_num_threads()} threads"
    print(
        f"\nPer-step latency ({desc}; {args.context} tokens in cache; median of "
        f"{args.rounds}x{args.reps}; torch.compile mode {args.mode})"
    )
    print(
        f"{'model':<22}{'batch':>6}{'tokens/row':>11}{'eager ms':>10}{'compiled ms':>12}"
        f"{'speedup':>9}"
    )
    for r in rows:
        kind = "decode 1" if r["q"] == 1 else f"verify {r['q']}"
        print(
            f"{r['model']:<22}{r['batch']:>6}{kind:>11}{r['eager_ms']:>10.1f}"
            f"{r['compiled_ms']:>12.1f}{r['speedup']:>8.2f}x"
        )
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": str(device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
