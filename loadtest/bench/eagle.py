"""The EAGLE-3 head's acceptance and cost, on real prompts, through the engine.

For every fixed K in ``--ks`` the same prompts run greedily (batched; output identical to plain
decoding, so only the rounds differ) and the benchmark prints, per prompt set (MT-Bench by
category, HumanEval, the ShareGPT ``e`` bucket):

  * tau: output tokens per target pass (the bonus / recovered token included);
  * acceptance by draft position i: of the rounds that drafted >= i tokens, the share whose
    first i drafts were all accepted;

and the cost of one draft step (the head's chained step, batch 1) as a fraction of a target
decode step (batch 1), both timed by engine/kcontrol/timing.py after warm-up (the target eager, or
as the config compiles it with ``--compiled``).

    python -m loadtest.bench.eagle --head models/smollm2-135m-eagle3 --ks 1,2,3,4,5,6,7
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.drafters.eagle.drafter import EagleDrafter
from engine.kcontrol.timing import time_call
from engine.records.params import SamplingParams, SpecParams
from prompts.sets import Prompt, encode, human_eval, mt_bench


def prompt_sets(per_category: int, humaneval: int, sharegpt: int) -> list[Prompt]:
    from prompts.sharegpt import EVAL, first_turns

    taken: dict[str, int] = defaultdict(int)
    out = []
    for p in mt_bench():
        if taken[p.category] < per_category:
            taken[p.category] += 1
            out.append(p)
    out += human_eval()[:humaneval]
    for i, (conv_id, text) in enumerate(first_turns(EVAL)):
        if i >= sharegpt:
            break
        out.append(Prompt(conv_id, "sharegpt-e", "chat", text))
    return out


def fitting_prompts(
    tok, per_category: int, humaneval: int, sharegpt: int, room: int
) -> list[tuple[Prompt, list[int]]]:
    """:func:`prompt_sets` encoded, those of at most ``room`` tokens, the first ``sharegpt`` of
    the ShareGPT ones that fit (four times as many are read)."""
    pairs = [(p, encode(tok, p)) for p in prompt_sets(per_category, humaneval, 4 * sharegpt)]
    pairs = [(p, i) for p, i in pairs if len(i) <= room]
    shared = [x for x in pairs if x[0].category == "sharegpt-e"][:sharegpt]
    return [x for x in pairs if x[0].category != "sharegpt-e"] + shared


def acceptance(rounds: list[tuple[int, int]], k: int) -> list[float]:
    """Share of rounds, among those that drafted >= i tokens, whose first i drafts were all
    accepted, for i = 1..k. ``rounds``: (drafted, accepted)."""
    out = []
    for i in range(1, k + 1):
        tried = [a for d, a in rounds if d >= i]
        out.append(sum(a >= i for a in tried) / len(tried) if tried else float("nan"))
    return out


def draft_step_fraction(engine) -> dict:
    """One chained head step and one target decode step, batch 1, ~200 tokens in the cache."""
    d, target = engine.drafter, engine.target
    assert isinstance(d, EagleDrafter)
    slot = target.cache.free_slots()[-1]
    target.cache.allocate(slot)
    target.cache.commit(slot, 200)
    d.cache.allocate(slot)
    d.cache.commit(slot, 200)
    tok = torch.tensor([42], device=target.device)
    out = torch.zeros(1, d.head.config.hidden_size, dtype=d.dtype, device=d.device)

    def draft_step():
        return d.chain_step(tok, out, [slot])[1].argmax(-1)

    t_draft = time_call(draft_step, target.device, repeats=20, warmup=3)
    t_target = time_call(
        lambda: target.forward(tok[:, None], [slot], [1]), target.device, repeats=20, warmup=3
    )
    d.cache.free(slot)
    target.cache.free(slot)
    return {"draft_step_ms": t_draft * 1e3, "target_step_ms": t_target * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.eagle")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--head", default="models/smollm2-135m-eagle3")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7")
    ap.add_argument("--per-category", type=int, default=2, help="MT-Bench prompts per category")
    ap.add_argument("--humaneval", type=int, default=8)
    ap.add_argument("--sharegpt", type=int, default=16, help="ShareGPT e-bucket prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="override the config's (acceptance barely moves)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="keep the config's compile section: the draft step is priced against the compiled "
        "target step, as served (default: eager, no compile wait)",
    )
    ap.add_argument(
        "--head-q4",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the head's matrices 4-bit (default: the config's drafter.head_q4)",
    )
    ap.add_argument("--json", default="loadtest/results/bench_eagle.json")
    args = ap.parse_args(argv)
    import yaml

    raw = yaml.safe_load(Path(args.config).read_text())["engine"]
    q4 = raw.get("drafter", {}).get("head_q4", False) if args.head_q4 is None else args.head_q4
    raw["drafter"] = {"method": "eagle3", "source": args.head, "controller": "fixed", "k_max": 7}
    raw["drafter"]["head_q4"] = q4
    if not args.compiled:
        raw["compile"] = {"enabled": False}
    raw["max_running"] = args.slots
    if args.dtype:
        raw["model"] = raw["model"] | {"dtype": args.dtype, "native_q4": False}
    built = build_engine(EngineConfig.from_dict(raw))
    engine, tok = built.engine, built.tokenizer
    if args.compiled:
        engine.warm_up()  # the target's buckets and the head's graphs, as the server does
    room = engine.target.max_len - args.max_tokens - 1  # prompts that fit with their answer
    pairs = fitting_prompts(tok, args.per_category, args.humaneval, args.sharegpt, room)
    prompts, ids = [p for p, _ in pairs], [i for _, i in pairs]
    cost = draft_step_fraction(engine)
    cost["fraction"] = cost["draft_step_ms"] / cost["target_step_ms"]
    print(
        f"draft step {cost['draft_step_ms']:.2f} ms, target decode step "
        f"{cost['target_step_ms']:.2f} ms: {100 * cost['fraction']:.1f}% of a target step"
    )
    result: dict = {"cost": cost, "prompts": len(prompts), "by_k": {}}
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for k in (int(x) for x in args.ks.split(",")):
        rounds: dict[str, list[tuple[int, int]]] = defaultdict(list)
        by_id = {}

        def on_step(outs, rounds=rounds, by_id=by_id):
            for o in outs:
                if o.stats is not None:
                    rounds[by_id[o.request_id]].append((o.stats.drafted, o.stats.accepted))

        seqs = [
            engine.add_request(f"k{k}-{i}", p, greedy, SpecParams(k=k)) for i, p in enumerate(ids)
        ]
        for s, p in zip(seqs, prompts):
            by_id[s.request_id] = p.category
        while engine.has_work():
            on_step(engine.step())
        row = {}
        for cat in sorted({p.category for p in prompts}):
            mine = [s for s, p in zip(seqs, prompts) if p.category == cat]
            tokens, passes = (
                sum(len(s.output_ids) for s in mine),
                sum(s.target_passes for s in mine),
            )
            row[cat] = {"tau": tokens / passes, "acceptance": acceptance(rounds[cat], k)}
        chat = [s for s, p in zip(seqs, prompts) if p.category not in ("humaneval", "sharegpt-e")]
        row["mt-bench (all)"] = {
            "tau": sum(len(s.output_ids) for s in chat) / sum(s.target_passes for s in chat),
            "acceptance": acceptance([r for c in rounds if c in row and c not in
                                      ("humaneval", "sharegpt-e") for r in rounds[c]], k),
        }  # fmt: skip
        result["by_k"][k] = row
        print(f"\nK = {k}")
        for cat, r in row.items():
            acc = " ".join(f"{a:.2f}" for a in r["acceptance"])
            print(f"  {cat:<16} tau {r['tau']:.2f}   acceptance by position: {acc}")
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
