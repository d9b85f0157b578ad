"""Draft trees against chains with the shipped EAGLE-3 head, through the engine, in one process.

1. Tokens per target pass (tau) and tok/s, greedy, for each shape in ``--shapes`` (``K`` a chain
   of K; ``K+L`` the chain plus L of the head's runners-up as leaves, engine/round/draft_tree.py),
   on the same prompts (MT-Bench, HumanEval, the ShareGPT ``e`` bucket), one request at a time
   (c = 1) and ``--batch`` at a time, shapes interleaved; every shape's output is checked equal to
   the first shape's (greedy is exact whatever the shape). Leaf yield: the share of tree rounds
   whose path ended at a leaf.
2. The verify's cost by its tokens N = 1..16 (compiled, batch 1 and ``--batch``), as a causal
   chain and as a tree of the same N (the chain of min(3, N - 1) plus leaves): what a tree's
   extra queries cost on this machine.

    python -m loadtest.bench.trees --config configs/default.yaml --shapes 3,7,3+2,3+4,2+5
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
import yaml

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.drafters.base import Alternatives
from engine.kcontrol.controller import FixedK
from engine.kcontrol.timing import time_call
from engine.requests.sequence import SpecParams
from engine.round.draft_tree import grow
from engine.round.sampling import SamplingParams
from loadtest.bench.eagle import prompt_sets
from prompts.sets import encode

SETS = ("mt-bench", "humaneval", "sharegpt-e")


def shape(text: str) -> tuple[int, int]:
    k, _, leaves = text.partition("+")
    return int(k), int(leaves or 0)


def run_shape(engine, ids, k, leaves, max_tokens, concurrency):
    """The prompts ``concurrency`` at a time at this shape; (seconds, sequences)."""
    engine.controller = engine.speculator.controller = FixedK(k, leaves)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    seqs, t0 = [], time.perf_counter()
    for start in range(0, len(ids), concurrency):
        seqs += engine.generate(ids[start : start + concurrency], greedy, SpecParams())
    return time.perf_counter() - t0, seqs


def verify_costs(engine, batch: int, max_n: int) -> list[dict]:
    """Median time of a target verify of N tokens a row, chain and tree, batch 1 and ``batch``."""
    target = engine.target
    out = []
    for rows in (1, batch):
        slots = list(range(rows))
        for s in slots:
            target.cache.allocate(s)
            target.cache.commit(s, 300)
        for n in range(1, max_n + 1):
            ids = torch.randint(0, 1000, (rows, n), device=target.device)
            counts = [n] * rows
            chain = time_call(
                lambda: target.forward(ids, slots, counts, "all"),  # noqa: B023
                target.device,
                repeats=15,
                warmup=3,
            )
            tree_ms = None
            if n > 1:
                k = min(3, n - 1)
                drafts = ids[:, 1 : 1 + k]
                alts = Alternatives(
                    torch.zeros(rows, k, n, dtype=torch.long, device=target.device),
                    torch.rand(rows, k, n, device=target.device),
                )
                t = grow(drafts, [k] * rows, None, alts, [n - 1 - k] * rows)
                t_ids = torch.cat([ids[:, :1], t.tokens], 1)
                tree_ms = 1e3 * time_call(
                    lambda: target.forward(t_ids, slots, counts, "all", tree=t.tree),  # noqa: B023
                    target.device,
                    repeats=15,
                    warmup=3,
                )
            out.append({"batch": rows, "n": n, "chain_ms": 1e3 * chain, "tree_ms": tree_ms})
        for s in slots:
            target.cache.free(s)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.trees", description=__doc__)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--shapes", default="3,7,3+2,3+4")
    ap.add_argument("--per-category", type=int, default=1, help="MT-Bench prompts per category")
    ap.add_argument("--humaneval", type=int, default=8)
    ap.add_argument("--sharegpt", type=int, default=16, help="ShareGPT e-bucket prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-n", type=int, default=16, help="verify cost up to N tokens")
    ap.add_argument("--json", default="loadtest/results/trees.json")
    args = ap.parse_args(argv)
    raw = yaml.safe_load(Path(args.config).read_text())["engine"]
    raw["drafter"] = raw["drafter"] | {"ngram_fallback": 0, "controller": "fixed", "k_max": 16}
    raw["compile"] = raw.get("compile", {}) | {
        "q_buckets": list(range(1, args.max_n + 1)),
        "batch_buckets": sorted({1, args.batch}),
    }
    raw["max_running"] = max(args.batch, 8)
    built = build_engine(EngineConfig.from_dict(raw))
    engine, tok = built.engine, built.tokenizer
    engine.warm_up()
    prompts = prompt_sets(args.per_category, args.humaneval, 4 * args.sharegpt)
    room = engine.target.max_len - args.max_tokens - 17
    pairs = [(p, encode(tok, p)) for p in prompts]
    pairs = [(p, i) for p, i in pairs if len(i) <= room]
    shared = [x for x in pairs if x[0].category == "sharegpt-e"][: args.sharegpt]
    pairs = [x for x in pairs if x[0].category != "sharegpt-e"] + shared
    sets = [
        "sharegpt-e" if p.category == "sharegpt-e" else
        "humaneval" if p.category == "humaneval" else "mt-bench"
        for p, _ in pairs
    ]  # fmt: skip
    ids = [i for _, i in pairs]
    shapes = [shape(s) for s in args.shapes.split(",")]
    result: dict = {"prompts": {s: sets.count(s) for s in SETS}, "runs": [], "verify": []}
    reference = None
    for rep in range(args.repeat):
        order = shapes if rep % 2 == 0 else shapes[::-1]  # ABBA
        for conc in (1, args.batch):
            for k, leaves in order:
                secs, seqs = run_shape(engine, ids, k, leaves, args.max_tokens, conc)
                outs = [s.output_ids for s in seqs]
                reference = reference or outs
                by_set = defaultdict(lambda: [0, 0])
                for s, name in zip(seqs, sets):
                    by_set[name][0] += len(s.output_ids)
                    by_set[name][1] += s.target_passes
                trees = sum(s.tree_rounds for s in seqs)
                row = {
                    "shape": f"{k}+{leaves}" if leaves else str(k),
                    "concurrency": conc,
                    "repeat": rep,
                    "tok_s": sum(len(o) for o in outs) / secs,
                    "tau": {n: t / max(p, 1) for n, (t, p) in by_set.items()},
                    "leaf_yield": sum(s.leaf_hits for s in seqs) / trees if trees else None,
                    "same_output": outs == reference,
                }
                result["runs"].append(row)
                print(json.dumps(row), flush=True)
    result["verify"] = verify_costs(engine, args.batch, args.max_n)
    for v in result["verify"]:
        print(json.dumps(v), flush=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
