"""Does a prefix-cache hit cost the drafter acceptance? Multi-turn conversations served in
process by two engines of one config, prefix cache on and off, with a fixed K (every round
drafts, so acceptance is measured on every round, not only where the adaptive controller
chose to speculate). Greedy: both engines must give the same output (checked); the drafter
sees a different history on a hit (the EAGLE-3 head has no state for cached positions), so
drafted and accepted tokens may differ.

Conversations: ShareGPT's evaluation bucket (prompts/sharegpt.py, never the reserved ``f``),
the data set's own answers in the history, as in loadtest/bench/multiturn.py. Counts only, no
timing: the figures do not depend on the machine's load.

    python -m loadtest.bench.prefix_acceptance --config configs/default.yaml
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.model.loader import load_model
from engine.records.params import SamplingParams, SpecParams
from loadtest.bench.multiturn import dialogues


def run(engine, tok, convs, max_tokens: int, k: int) -> list[dict]:
    """Per turn (index) totals of drafted / accepted / cached tokens, and every output."""
    turns: list[dict] = []
    for conv in convs:
        messages: list[dict] = []
        for i, (user, answer) in enumerate(conv):
            messages.append({"role": "user", "content": user})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
            [seq] = engine.generate(
                [list(ids["input_ids"])],
                SamplingParams(max_tokens=max_tokens, temperature=0.0),
                SpecParams(k=k),
            )
            if len(turns) <= i:
                turns.append({"drafted": 0, "accepted": 0, "cached": 0, "outputs": []})
            t = turns[i]
            t["drafted"] += seq.drafted
            t["accepted"] += seq.accepted
            t["cached"] += seq.cached_tokens
            t["outputs"].append(seq.output_ids)
            messages.append({"role": "assistant", "content": answer})
    return turns


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.prefix_acceptance")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3, help="draft length of every round")
    ap.add_argument("--out", default="loadtest/results/prefix_acceptance.txt")
    args = ap.parse_args(argv)

    cfg = EngineConfig.from_yaml(args.config)
    cfg.compile.enabled = False  # counts only: the eager path drafts and verifies the same
    m = cfg.model
    target = load_model(m.source, m.dtype, m.device, None, m.trust_remote_code)
    tok = target[1]
    convs = dialogues(args.conversations, args.turns)
    result: dict[str, list[dict]] = {}
    for name, tokens in (("cache", cfg.prefix_cache_tokens or 16384), ("nocache", 0)):
        cfg.prefix_cache_tokens = tokens
        engine = build_engine(cfg, target=target).engine
        result[name] = run(engine, tok, convs, args.max_tokens, args.k)
    pairs = [
        (a, b)
        for ta, tb in zip(result["cache"], result["nocache"])
        for a, b in zip(ta["outputs"], tb["outputs"])
    ]
    same = sum(a == b for a, b in pairs)
    cmd = f"--config {args.config} --conversations {args.conversations} --k {args.k}"
    head = (
        f"# {len(convs)} e-bucket conversations x {args.turns} turns, {args.max_tokens} greedy "
        f"tokens a turn, K = {args.k} every round, {cfg.model.dtype}; outputs identical with "
        f"and without the cache in {same} of {len(pairs)} turns (below float32, K/V computed "
        "in other shapes round differently: exactness is tested in float32)"
    )
    lines = [f"# python -m loadtest.bench.prefix_acceptance {cmd}", head]
    for name, turns in result.items():
        acc = [round(t["accepted"] / max(1, t["drafted"]), 3) for t in turns]
        lines.append(
            f"{name:8s} acceptance by turn {acc}; drafted {[t['drafted'] for t in turns]}; "
            f"cached tokens {[t['cached'] for t in turns]}"
        )
    tot = {
        n: sum(t["accepted"] for t in ts[1:]) / max(1, sum(t["drafted"] for t in ts[1:]))
        for n, ts in result.items()
    }
    lines.append(
        f"turns 2+: acceptance with the cache {tot['cache']:.3f}, without {tot['nocache']:.3f} "
        f"({tot['cache'] / max(tot['nocache'], 1e-9):.3f}x)"
    )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    Path(args.out).write_text(text)
    print(json.dumps({"identical_turns": same, "turns": len(pairs)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
