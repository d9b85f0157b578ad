"""Deterministic mode: how often the default forward changes output, and what the
batch-invariant forward (engine/model/invariant.py) costs, in-process on one engine built from
``--config`` with ``deterministic: request``, so each request picks its mode over the same
weights. For each mode, default and deterministic:

  * greedy, speculation on (the config's drafter, fixed K) vs off, one request at a time, and
    with all prompts batched: the prompts whose output differs;
  * greedy batched vs alone (speculation off);
  * greedy alone, its prompt whole in the prefix cache (the run repeated) vs its first run, with
    the prompt positions each took from the cache;
  * seeded sampling (T = 0.8) batched vs alone (speculation on: the controller keeps seeded
    requests at K = 0);
  * output tok/s of plain and speculative decoding, one at a time and batched; the modes run
    interleaved prompt by prompt (ABBA), so machine noise hits both alike.

    python -m loadtest.bench.deterministic --config configs/default.yaml --prompts 8
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.records.params import SamplingParams, SpecParams
from loadtest.machine import cpu_description
from prompts.sets import encode, human_eval, mt_bench

MODES = ("default", "deterministic")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.deterministic", description=__doc__)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="the fixed K of speculative runs")
    ap.add_argument("--out", default="loadtest/results/deterministic.txt")
    args = ap.parse_args(argv)
    cfg = EngineConfig.from_yaml(args.config)
    cfg.deterministic = "request"
    built = build_engine(cfg)
    engine, tok = built.engine, built.tokenizer
    chosen = (mt_bench()[::10] + human_eval())[: args.prompts]
    prompts = [encode(tok, p) for p in chosen]
    n, on, off = len(prompts), SpecParams(k=args.k), SpecParams(enabled=False)

    def run(det: bool, ps: list[list[int]], spec: SpecParams, seeds=None):
        params = [
            SamplingParams(
                temperature=0 if seeds is None else 0.8,
                seed=None if seeds is None else seeds[i],
                max_tokens=args.max_tokens,
                deterministic=det,
            )
            for i in range(len(ps))
        ]
        t0 = time.perf_counter()
        seqs = engine.generate(ps, params, spec)
        seconds = time.perf_counter() - t0
        cached[0] += sum(s.cached_tokens for s in seqs)
        return [s.output_ids for s in seqs], seconds

    cached = [0]  # prompt positions the last runs took from the prefix cache
    cached_by: dict[str, dict[str, int]] = {m: {} for m in MODES}

    engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    out: dict[str, dict] = {m: {} for m in MODES}
    speed: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}

    def record(mode: str, key: str, outputs, seconds: float) -> None:
        cached_by[mode][key] = cached_by[mode].get(key, 0) + cached[0]
        cached[0] = 0
        out[mode].setdefault(key, []).extend(outputs)
        tokens, secs = speed[mode].setdefault(key, [0.0, 0.0])
        speed[mode][key] = [tokens + sum(len(o) for o in outputs), secs + seconds]

    seeds = list(range(100, 100 + n))
    for i, p in enumerate(prompts):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            det = mode == "deterministic"
            record(mode, "alone plain", *run(det, [p], off))
            record(mode, "alone spec", *run(det, [p], on))
            record(mode, "alone seeded", *run(det, [p], SpecParams(), seeds[i : i + 1]))
            record(mode, "alone plain cached", *run(det, [p], off))
    for j, mode in enumerate(MODES + MODES[::-1]):
        det, key = mode == "deterministic", f"#{j // 2}"
        record(mode, "batch plain" + key, *run(det, prompts, off))
        record(mode, "batch spec" + key, *run(det, prompts, on))
        record(mode, "batch seeded" + key, *run(det, prompts, SpecParams(), seeds))

    def differ(mode: str, a: str, b: str) -> int:
        return sum(x != y for x, y in zip(out[mode][a], out[mode][b]))

    def rate(mode: str, key: str) -> float:
        pairs = [v for k, v in speed[mode].items() if k.startswith(key)]
        return sum(t for t, _ in pairs) / sum(s for _, s in pairs)

    dtype = cfg.model.dtype
    lines = [
        (
            f"# python -m loadtest.bench.deterministic --config {args.config} --prompts {n} "
            f"--max-tokens {args.max_tokens} --k {args.k}"
        ),
        (
            f"# {n} prompts (MT-Bench, HumanEval), {dtype}, drafter {cfg.drafter.method} at "
            f"K = {args.k}, batch {n} when batched; {cpu_description()}, "
            f"{datetime.date.today()}"
        ),
        f"# prompts whose output differs (of {n}){'':<4}{'default':>10}{'deterministic':>15}",
    ]
    checks = [
        ("greedy: speculation on vs off, alone", "alone spec", "alone plain"),
        ("greedy: speculation on vs off, batched", "batch spec#0", "batch plain#0"),
        ("greedy: batched vs alone", "batch plain#0", "alone plain"),
        ("greedy: batched, two runs", "batch plain#0", "batch plain#1"),
        ("seeded T=0.8: batched vs alone", "batch seeded#0", "alone seeded"),
        ("greedy: prompt cached vs its first run", "alone plain cached", "alone plain"),
    ]
    for label, a, b in checks:
        lines.append(f"{label:<44}{differ('default', a, b):>8}{differ('deterministic', a, b):>15}")
    lines.append(
        "# prompt positions from the prefix cache, first run / repeated: "
        + ", ".join(
            f"{m} {cached_by[m]['alone plain']} / {cached_by[m]['alone plain cached']}"
            for m in MODES
        )
        + f" (of {sum(len(p) for p in prompts)} each)"
    )
    lines.append(f"# output tok/s{'':<31}{'default':>8}{'deterministic':>15}{'ratio':>8}")
    for label, key in (
        ("plain, one at a time", "alone plain"),
        ("speculative, one at a time", "alone spec"),
        (f"plain, batch {n}", "batch plain"),
        (f"speculative, batch {n}", "batch spec"),
    ):
        d, x = rate("default", key), rate("deterministic", key)
        lines.append(f"{label:<44}{d:>8.1f}{x:>15.1f}{x / d:>8.2f}")
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
