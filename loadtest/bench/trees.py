"""Draft trees against chains with the shipped EAGLE-3 head, through the engine, in one process.

1. Tokens per target pass (tau) and tok/s, greedy, for each shape in ``--shapes`` (``K`` a chain
   of K; ``K+L`` the chain plus L of the head's runners-up as leaves, engine/round/draft_tree.py),
   on the same prompts (MT-Bench, HumanEval, the ShareGPT ``e`` bucket), one request at a time
   (c = 1) and ``--batch`` at a time, shapes interleaved (``a``, ``a+L``: the adaptive controller,
   chains or with up to L leaves where it finds they pay); every shape's output is checked equal to
   the first shape's (greedy is exact whatever the shape). Leaf yield: the share of tree rounds
   whose path ended at a leaf. Each shape runs on an engine of its own, built by the builder
   from the config with the shape's drafter settings (its K controller, leaves and top B are
   construction-time choices: nothing is set on an engine after it is built), all over the
   one loaded target.
2. The verify's cost by its tokens N = 1..16 (batch 1 and ``--batch``; compiled, N padded to
   the config's q buckets plus one of 16, and eager), as a causal chain and as a tree of the same
   N (the chain of min(3, N - 1) plus leaves): what a tree's extra queries cost on this machine.

    python -m loadtest.bench.trees --config configs/default.yaml --shapes 3,7,3+2,3+4,2+5,a,a+4
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
import yaml

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.drafters.base import Alternatives
from engine.kcontrol.timing import time_call
from engine.model.loader import load_model
from engine.records.params import SamplingParams, SpecParams
from engine.round.draft_tree import grow
from loadtest.bench.eagle import fitting_prompts

SETS = ("mt-bench", "humaneval", "sharegpt-e")


def set_of(category: str) -> str:
    """The prompt set of a prompt's category (MT-Bench's are writing, coding, ...)."""
    return category if category in ("humaneval", "sharegpt-e") else "mt-bench"


def shape(text: str) -> tuple[int, int, int]:
    """``K``, ``K+L`` or ``K+LxB`` (``a`` for K: the adaptive controller, with up to L
    leaves; ``xB``: the leaves from EAGLE-2's expansion with top B, drafter.tree_topk)."""
    k, _, rest = text.partition("+")
    leaves, _, topk = rest.partition("x")
    return (-1 if k == "a" else int(k)), int(leaves or 0), int(topk or 0)


def shape_config(raw: dict, k: int, leaves: int, topk: int) -> EngineConfig:
    """The engine config ``raw`` with one shape's drafter, as engine/builder.py's
    ``make_controller`` reads it: for K = ``k``, controller ``fixed`` with ``leaves`` leaves;
    for k = -1, ``adaptive``, the builder's controller for the EAGLE-3 head at K_max 7 (its
    leaves up to ``leaves``, an expansion's ``topk`` - 1 extras priced; it keeps K + L <= 7
    itself); ``tree_topk`` the expansion's top B (0: the chain's runners-up)."""
    d = raw["drafter"] | {"tree_leaves": leaves, "tree_topk": topk}
    d |= {"controller": "adaptive", "k_max": 7} if k < 0 else {"controller": "fixed", "k": k}
    return EngineConfig.from_dict(raw | {"drafter": d})


def run_shape(engine, ids, max_tokens, concurrency):
    """The prompts ``concurrency`` at a time on ``engine`` (one shape's); (seconds, sequences)."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    seqs, t0 = [], time.perf_counter()
    for start in range(0, len(ids), concurrency):
        seqs += engine.generate(ids[start : start + concurrency], greedy, SpecParams())
    return time.perf_counter() - t0, seqs


def verify_costs(engine, batch: int, max_n: int) -> list[dict]:
    """Median time of a target verify of N tokens a row, as a chain and as a tree, batch 1 and
    ``batch``: on the compiled path (N padded to its q buckets, as served; ``<name>_fast`` says
    whether the fast path ran it, not where N is past the buckets) and eager (N itself)."""
    target = engine.target
    fast, out = target.fast, []
    for rows in (1, batch):
        slots = list(range(rows))
        for s in slots:
            target.cache.allocate(s)
            target.cache.reserve(s, 300)  # (a paged cache's blocks; a slot has the room)
            target.cache.commit(s, 300)
        for n in range(1, max_n + 1):
            ids = torch.randint(0, min(1000, target.vocab_size), (rows, n), device=target.device)
            counts = [n] * rows
            calls = {"chain": (ids, {})}
            if n > 1:
                k = min(3, n - 1)
                alts = Alternatives(
                    torch.zeros(rows, k, n, dtype=torch.long, device=target.device),
                    torch.rand(rows, k, n, device=target.device),
                )
                t = grow(ids[:, 1 : 1 + k], [k] * rows, None, alts, [n - 1 - k] * rows)
                calls["tree"] = (torch.cat([ids[:, :1], t.tokens], 1), {"tree": t.tree})
            row: dict = {"batch": rows, "n": n}
            for name, (x, kw) in calls.items():
                for path in ("compiled", "eager"):

                    def call(x=x, kw=kw, slots=slots, counts=counts):
                        return target.forward(x, slots, counts, "all", **kw)

                    if path == "eager":
                        with target.eager():
                            ms = 1e3 * time_call(call, target.device, repeats=15, warmup=3)
                    else:
                        calls = fast.calls if fast is not None else 0
                        ms = 1e3 * time_call(call, target.device, repeats=15, warmup=3)
                        if target.fast is not fast:  # dropped after a failure: eager from then on
                            raise RuntimeError(f"the fast path failed on the {name} verify")
                        # outside the q buckets the served forward is eager too
                        row[f"{name}_fast"] = fast is not None and fast.calls > calls
                    row[f"{name}_{path}_ms"] = ms
            out.append(row)
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
    ap.add_argument("--max-n", type=int, default=16, help="verify cost up to N tokens (0: none)")
    ap.add_argument("--json", default="loadtest/results/trees.json")
    args = ap.parse_args(argv)
    raw = yaml.safe_load(Path(args.config).read_text())["engine"]
    shapes = [shape(s) for s in args.shapes.split(",")]
    raw["drafter"] = raw["drafter"] | {"ngram_fallback": 0, "k_max": 16}
    served = raw.get("compile", {}).get("q_buckets") or [1, 2, 4, 8]
    raw["compile"] = raw.get("compile", {}) | {  # the served q buckets, and one for N = max_n
        "q_buckets": sorted(set(served) | {max(args.max_n, 16)}),
        "batch_buckets": sorted({1, args.batch}),
    }
    raw["max_running"] = max(args.batch, 8)
    raw["prefix_cache_tokens"] = 0  # every shape starts from the same state (no earlier run's K/V)
    base = EngineConfig.from_dict(raw)
    m, cache_dir = base.model, Path(base.cache_dir) if base.cache_dir else None
    # loaded once, as build_engine loads it: every shape's engine runs over it (its ``target``)
    target = load_model(m.source, m.dtype, m.device, cache_dir, m.trust_remote_code)
    tok = target[1]
    engines = {}  # shape -> its engine, all built before any is timed (ABBA below)
    for sh in dict.fromkeys(shapes):
        engines[sh] = build_engine(shape_config(raw, *sh), target=target).engine
        engines[sh].warm_up()
    first = engines[shapes[0]]
    room = first.target.max_len - args.max_tokens - 17  # with the answer and a verify of 16
    pairs = fitting_prompts(tok, args.per_category, args.humaneval, args.sharegpt, room)
    sets = [set_of(p.category) for p, _ in pairs]
    ids = [i for _, i in pairs]
    for engine in engines.values():  # an adaptive controller calibrates before its first
        # request (SpecEngine's own step): here, not inside the first timed run
        engine.generate(ids[:1], SamplingParams(temperature=0, max_tokens=1), SpecParams())
    result: dict = {"prompts": {s: sets.count(s) for s in SETS}, "runs": [], "verify": []}
    reference = None
    for rep in range(args.repeat):
        order = shapes if rep % 2 == 0 else shapes[::-1]  # ABBA
        for conc in (1, args.batch):
            for k, leaves, topk in order:
                engine = engines[(k, leaves, topk)]
                secs, seqs = run_shape(engine, ids, args.max_tokens, conc)
                outs = [s.output_ids for s in seqs]
                reference = reference or outs
                by_set = defaultdict(lambda: [0, 0])
                for s, name in zip(seqs, sets):
                    by_set[name][0] += len(s.output_ids)
                    by_set[name][1] += s.target_passes
                trees = sum(s.tree_rounds for s in seqs)
                row = {
                    "shape": f"{'a' if k < 0 else k}"
                    + (f"+{leaves}" if leaves else "")
                    + (f"x{topk}" if topk else ""),
                    "concurrency": conc,
                    "repeat": rep,
                    "tok_s": sum(len(o) for o in outs) / secs,
                    "tau": {n: t / max(p, 1) for n, (t, p) in by_set.items()},
                    "leaf_yield": sum(s.leaf_hits for s in seqs) / trees if trees else None,
                    "tree_rounds": trees / max(sum(s.target_passes for s in seqs), 1),
                    "same_output": outs == reference,
                }
                result["runs"].append(row)
                print(json.dumps(row), flush=True)
    del engine
    engines.clear()  # the other shapes' engines freed: the verify costs need one target
    gc.collect()
    result["verify"] = verify_costs(first, args.batch, args.max_n)
    for v in result["verify"]:
        print(json.dumps(v), flush=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
