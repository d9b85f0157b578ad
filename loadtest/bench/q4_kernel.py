"""The target's compiled step with specd's 4-bit kernel against torch's int4 kernel, side by side.

Two runners over one SmolLM2 model (the config's GGUF), their Q4_1 layers and Q8_0 head packed
once for specd's kernel (engine/model/csrc/q4_avx512.cpp) and once for torch's
``_weight_int4pack_mm_for_cpu`` (engine/model/q4_matmul.py), each compiled as the default config
compiles (groups of 6 layers), caches filled with the same ``--context`` tokens. Forwards of
``q`` tokens in ``b`` rows alternate between the two ``--rounds`` times; the table prints median
milliseconds, the ratio torch / specd, and each kernel's cost of a verify relative to its decode
(what the adaptive K prices).

    python -m loadtest.bench.q4_kernel
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from engine.config import EngineConfig
from engine.model.compiled import CompileConfig
from engine.model.loader import load_model
from engine.model.q4_matmul import kernel_available, only_torch_kernel
from engine.model.quant import native_q4
from engine.model.runner import ModelRunner
from loadtest.bench.steps import time_forward

SHAPES = [(1, 1), (1, 2), (1, 4), (1, 8), (8, 1), (8, 2), (8, 4)]  # (rows, tokens per row)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.q4_kernel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--context", type=int, default=256, help="tokens already in every row's cache")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5, help="specd / torch alternations")
    ap.add_argument("--json", default="loadtest/results/bench_q4_kernel.json")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not kernel_available():
        raise SystemExit("specd's 4-bit kernel is not available here (see the log)")
    cfg = EngineConfig.from_yaml(a.config)
    model, _ = load_model(cfg.model.source, "bfloat16", "cpu", cfg.cache_dir)
    slots = max(b for b, _ in SHAPES)
    ccfg = CompileConfig(
        enabled=True,
        batch_buckets=sorted({b for b, _ in SHAPES}),
        q_buckets=sorted({q for _, q in SHAPES}),
        layers_per_graph=cfg.compile.layers_per_graph,
    )
    fast = dict(compile=ccfg, k_max=max(q for _, q in SHAPES) - 1)
    weights = native_q4(cfg.model.source, model)
    with only_torch_kernel():
        torch_weights = native_q4(cfg.model.source, model)
    runners = {
        "specd": ModelRunner(model, slots, a.context + 64, weights=weights, **fast),
        "torch": ModelRunner(model, slots, a.context + 64, weights=torch_weights, **fast),
    }
    ctx = torch.randint(0, model.config.vocab_size, (slots, a.context))
    for r in runners.values():
        r.forward(ctx, list(range(slots)), counts=[a.context] * slots)
        for s in range(slots):
            r.cache.commit(s, a.context)
        r.warm_up()
    ms: dict[tuple[str, int, int], float] = {}
    for b, q in SHAPES:
        times: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(a.rounds):
            for name, r in runners.items():
                times[name] += time_forward(r, b, q, a.reps, warmup=2)
        for name in runners:
            ms[name, b, q] = statistics.median(times[name]) * 1e3
    print(f"\nCompiled target step, {cfg.model.name} bf16, Q4_1 layers + Q8_0 head 4-bit, "
          f"{torch.get_num_threads()} threads, {a.context} tokens in cache; median of "
          f"{a.rounds}x{a.reps}, kernels alternating")  # fmt: skip
    print(f"{'rows':>4} {'tokens':>6} {'specd ms':>9} {'torch ms':>9} {'torch/specd':>12} "
          f"{'specd / its decode':>19} {'torch / its decode':>19}")  # fmt: skip
    rows = []
    for b, q in SHAPES:
        s, t = ms["specd", b, q], ms["torch", b, q]
        s1, t1 = ms["specd", b, 1], ms["torch", b, 1]
        rows.append(dict(rows=b, q=q, specd_ms=s, torch_ms=t))
        print(f"{b:>4} {q:>6} {s:>9.2f} {t:>9.2f} {t / s:>11.2f}x "
              f"{s / s1:>18.2f}x {t / t1:>18.2f}x")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
