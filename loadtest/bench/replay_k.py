"""Offline replay of K controllers at batch 1 with the n-gram drafter: exact, noise-free
comparison of draft-length policies on real prompts.

Greedy decoding is deterministic, and so is n-gram lookup: given a prompt's greedy output, the
draft proposed at every position and how many of its tokens the target accepts (the common prefix
with the greedy continuation) are known for every K. So a controller's rounds can be replayed
without running the model, and a round's time taken from a table of this machine's measured
verify times T(w) (target forward of w + 1 tokens after the prompt, batch 1). The controllers see
exactly what they would see in the engine (their ``k_for`` / ``observe`` / ``end_round`` calls
with measured-like times), so the replay ranks policies with none of the run-to-run noise of
timing whole generations. It does not replace the end-to-end benchmark (engine_speed): it
guides it.

    python -m loadtest.bench.replay_k --per-category 3 --max-tokens 96
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.drafters.ngram import ngram_lookup
from engine.kcontrol.controller import AdaptiveK, FixedK, HeuristicK
from engine.kcontrol.cost import RoundCost
from engine.kcontrol.timing import time_call
from engine.model.loader import load_model
from engine.records.kstate import KState
from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import RoundStats
from prompts.sets import encode, mixed

LOOKUP_S = 2e-4  # one n-gram lookup


def measure_verify(runner, widths, prefix: int, repeats: int = 5) -> dict[int, float]:
    """T(w): the best of ``repeats`` + 1 timed target forwards (engine.kcontrol.timing) of w + 1
    query tokens after a ``prefix``-token context, in seconds."""
    slot = 0
    runner.cache.allocate(slot)
    try:
        runner.forward([[1] * prefix], [slot])
        runner.cache.commit(slot, prefix)
        return {
            w: time_call(
                lambda w=w: runner.forward([[1] * (w + 1)], [slot], logits="all"),
                runner.device,
                repeats=repeats + 1,
            )
            for w in widths
        }
    finally:
        runner.cache.free(slot)


def trace(prompt: list[int], output: list[int], k_max: int) -> list[tuple[int, ...]]:
    """For each output position t: the accepted-token count of the draft proposed there for
    every K = 0..k_max, and the draft's length (n-gram may find fewer than K)."""
    rows = []
    for t in range(len(output)):
        ctx = np.asarray(prompt + output[:t])
        draft = ngram_lookup(ctx, k_max)
        truth = output[t : t + len(draft)]
        a = 0
        while a < len(draft) and a < len(truth) and draft[a] == truth[a]:
            a += 1
        rows.append((len(draft), a))
    return rows


def replay(ctrl, tr: list[tuple[int, int]], cost_table: dict[int, float], k_max: int):
    """Seconds and rounds to emit the whole output under ``ctrl``."""
    seq = SimpleNamespace(kstate=KState(), spec=SpecParams(), params=SamplingParams(temperature=0))
    t, seconds, rounds = 0, 0.0, 0
    n = len(tr)
    while t < n:
        cap = min(k_max, n - t - 1) if n - t > 1 else 0
        k = ctrl.k_for(seq, cap)
        found, acc_max = tr[t]
        drafted = min(k, found)
        accepted = min(drafted, acc_max)
        width = drafted
        rest = cost_table[width]
        draft_s = LOOKUP_S if k > 0 else 0.0
        seconds += rest + draft_s
        rounds += 1
        emitted = accepted + 1
        t += emitted
        stats = RoundStats(k, drafted, accepted, emitted, draft_s, rest, width)
        ctrl.observe(seq, k, stats, None if t >= n else min(k_max, max(0, n - t - 1)))
        ctrl.end_round(1, width, 1 if k > 0 else 0, rest, draft_s)
    return seconds, rounds


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.bench.replay_k",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument(
        "--cache",
        help="JSON file keeping the greedy outputs and measured times "
        "between runs (to compare controller changes quickly)",
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base = EngineConfig.from_yaml(args.config)
    base.model.dtype = args.dtype
    pair = load_model(base.model.source, args.dtype, base.model.device, base.cache_dir)
    cfg = EngineConfig.from_dict(
        {
            "model": vars(base.model),
            "max_running": 4,
            "max_model_len": base.max_model_len,
            "drafter": {"method": "none"},
        }
    )
    engine = build_engine(cfg, pair).engine
    prompts = mixed(args.per_category)
    encoded = [encode(pair[1], p) for p in prompts]
    cached = (
        json.loads(Path(args.cache).read_text()) if args.cache and Path(args.cache).exists() else {}
    )
    key = f"{args.dtype}/{args.per_category}/{args.max_tokens}"
    if key in cached:
        outs, table = cached[key]["outs"], {int(w): t for w, t in cached[key]["table"].items()}
    else:
        t0 = time.perf_counter()
        outs = [
            s.output_ids
            for s in engine.generate(
                encoded, SamplingParams(temperature=0, max_tokens=args.max_tokens)
            )
        ]
        print(
            f"greedy outputs of {len(prompts)} prompts: {time.perf_counter() - t0:.0f}s", flush=True
        )
        table = measure_verify(engine.target, list(range(args.k_max + 1)), prefix=160)
        if args.cache:
            cached[key] = {"outs": outs, "table": table}
            Path(args.cache).write_text(json.dumps(cached))
    print(
        "measured T(w) ms: " + " ".join(f"{w}:{1000 * s:.1f}" for w, s in table.items()), flush=True
    )
    traces = [trace(p, o, args.k_max) for p, o in zip(encoded, outs)]

    cost0 = RoundCost()  # the engine's start-up calibration points, at batch 1
    for w in (0, 2, 6):
        cost0.add_calibration(1, w, table[w])
    policies = {f"K={k}": (lambda k=k: FixedK(k)) for k in range(args.k_max + 1)}
    policies["heuristic"] = lambda: HeuristicK(1, args.k_max)
    policies["adaptive"] = lambda: AdaptiveK(
        args.k_max, steps_per_width=lambda w: 1 if w else 0, cost=_copy(cost0)
    )
    totals = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0]))
    for p, o, tr in zip(prompts, outs, traces):
        for name, make in policies.items():
            seconds, rounds = replay(make(), tr, table, args.k_max)
            for g in (p.category, "ALL"):
                x = totals[name][g]
                x[0] += len(o)
                x[1] += seconds
                x[2] += rounds
    groups = list(dict.fromkeys(p.category for p in prompts)) + ["ALL"]

    def tps(name: str, g: str) -> float:
        return totals[name][g][0] / totals[name][g][1]

    def per_pass(name: str, g: str) -> float:
        return totals[name][g][0] / totals[name][g][2]

    print("\nreplayed tok/s (tokens per pass)")
    print("policy".ljust(12) + "".join(g[:10].rjust(13) for g in groups))
    for name in policies:
        print(
            name.ljust(12)
            + "".join(f"{tps(name, g):7.1f} ({per_pass(name, g):.2f})".rjust(13) for g in groups)
        )
    best = max((n for n in policies if n.startswith("K=")), key=lambda n: tps(n, "ALL"))
    for name in ("heuristic", "adaptive"):
        print(
            f"{name} / best fixed ({best}): "
            + ", ".join(f"{g}: {tps(name, g) / tps(best, g):.3f}" for g in groups)
        )


def _copy(cost: RoundCost) -> RoundCost:
    return copy.deepcopy(cost)


if __name__ == "__main__":
    main()
