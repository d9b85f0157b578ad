"""JSON-schema generation with speculation on and off (issue 19), in-process on one engine.

The same chat prompts, each asking for JSON under a real schema (``response_format``
json_schema, compact JSON), greedy, one request at a time, speculation on (the config's drafter,
adaptive K) and off interleaved prompt by prompt (ABBA), so machine noise hits both alike.
Prints output tok/s of each and their ratio, tokens per target pass, the grammar's cost per
emitted token (the verify masks and the drafter's masks: the cumulative time of
engine/sampling/grammar.py's ``apply_grammar`` and ``DraftGrammar.mask`` in a profile of each
generate call, so the engine runs as built, nothing patched into it; every mode's calls are
profiled alike), and the share of emitted tokens the grammar forced (a mask that allows one
token).

    python -m loadtest.bench.structured --config configs/default.yaml --repeat 2
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import llguidance
import llguidance.torch as llt

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.records.params import SamplingParams, SpecParams
from engine.sampling.grammar import DraftGrammar, apply_grammar
from server.structured import schema_json

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer"},
            "email": {"type": "string", "format": "email"},
            "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["name", "age", "email", "skills"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            },
        },
        "required": ["id", "status", "items"],
        "additionalProperties": False,
    },
}
PROMPTS = [
    ("person", "Give the profile of a software engineer named Alice as JSON."),
    ("person", "Describe a chef called Marco, 41, as JSON."),
    ("order", "Write an example order for two books as JSON."),
    ("order", "Create a JSON record of a delivered order of three shirts."),
]


# what the grammar's cost counts: the verify's masks and the drafter's, by their code (pstats'
# key of a function: its file, first line and name)
GRAMMAR_FUNCTIONS = [
    (f.__code__.co_filename, f.__code__.co_firstlineno, f.__code__.co_name)
    for f in (apply_grammar, DraftGrammar.mask)
]


def grammar_seconds(profile: cProfile.Profile) -> float:
    """Seconds ``profile`` spent inside :data:`GRAMMAR_FUNCTIONS` (their cumulative time: what
    they call included)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return sum(stats[f][3] for f in GRAMMAR_FUNCTIONS if f in stats)


def forced_share(tokenizer, grammar: str, outputs: list[list[int]]) -> float:
    """Share of emitted tokens whose mask allowed exactly that one token."""
    forced = total = 0
    for out in outputs:
        m = llguidance.LLMatcher(tokenizer, grammar)
        bits = llt.allocate_token_bitmask(1, tokenizer.vocab_size)
        for t in out:
            if m.is_stopped():
                break
            llt.fill_next_token_bitmask(m, bits, 0)
            forced += int(sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in bits[0]) == 1)
            total += 1
            m.consume_tokens([t])
    return forced / max(total, 1)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.structured", description=__doc__)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", default="loadtest/results/structured.txt")
    args = ap.parse_args(argv)
    built = build_engine(EngineConfig.from_yaml(args.config))
    engine, tok = built.engine, built.tokenizer
    jobs = []
    for schema, ask in PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        jobs.append((list(ids), schema_json(SCHEMAS[schema])))
    stats = {m: {"tokens": 0, "seconds": 0.0, "passes": 0, "grammar_s": 0.0} for m in ("on", "off")}
    outputs: dict[str, list[list[int]]] = {}
    engine.generate([jobs[0][0]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    for rep in range(args.repeat):
        for i, (ids, grammar) in enumerate(jobs):
            order = ("on", "off") if (rep + i) % 2 == 0 else ("off", "on")
            for mode in order:
                p = SamplingParams(temperature=0, max_tokens=args.max_tokens, grammar=grammar)
                profile = cProfile.Profile(builtins=False)  # (Python calls only: less overhead)
                t0 = time.perf_counter()
                with profile:
                    (s,) = engine.generate([ids], p, SpecParams(enabled=mode == "on"))
                st = stats[mode]
                st["seconds"] += time.perf_counter() - t0
                st["grammar_s"] += grammar_seconds(profile)
                st["tokens"] += len(s.output_ids)
                st["passes"] += s.target_passes
                outputs.setdefault(f"{mode}{i}", s.output_ids)
    ll_tok = engine.grammars.tokenizer
    share = sum(
        forced_share(ll_tok, g, [outputs[f"on{i}"]]) for i, (_, g) in enumerate(jobs)
    ) / len(jobs)
    valid = f"{sum(_parses(tok.decode(o, skip_special_tokens=True)) for o in outputs.values())}"
    valid += f" of {len(outputs)} (the rest hit max_tokens)"
    on, off = stats["on"], stats["off"]
    lines = [
        (
            f"# python -m loadtest.bench.structured --config {args.config} "
            f"--repeat {args.repeat} --max-tokens {args.max_tokens}"
        ),
        (
            f"# {len(PROMPTS)} chat prompts x {args.repeat} repeats, JSON schema (compact), "
            "greedy, batch 1, speculation on / off interleaved (ABBA); every output parsed as "
            f"JSON: {valid}"
        ),
        f"{'mode':<6}{'tokens':>8}{'tok/s':>9}{'tok/pass':>10}{'grammar ms/token':>18}",
    ]
    for mode, st in stats.items():
        lines.append(
            f"{mode:<6}{st['tokens']:>8}{st['tokens'] / st['seconds']:>9.1f}"
            f"{st['tokens'] / max(st['passes'], 1):>10.2f}"
            f"{1000 * st['grammar_s'] / max(st['tokens'], 1):>18.3f}"
        )
    ratio = (on["tokens"] / on["seconds"]) / (off["tokens"] / off["seconds"])
    lines.append(
        f"speculation on / off: {ratio:.2f}x; tokens forced by the grammar (one allowed token): "
        f"{100 * share:.0f}%"
    )
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
