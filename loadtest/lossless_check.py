"""Lossless check over every real prompt: 80 MT-Bench first turns + 164 HumanEval completions.

For each prompt, transformers' own greedy generate() (target only, fp32) is the reference; specd
runs the same prompts with speculation (the drafters given, batched ``--batch`` at a time, so the
ragged batch path is checked too) and every output must be token-for-token identical. Prints the
number of mismatches per drafter (the product's requirement: 0).

    python -m loadtest.lossless_check --drafters ngram,self,layers15 --max-tokens 48
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.loader import load_model
from engine.sampling import SamplingParams
from engine.sequence import SpecParams
from loadtest.datasets import encode, mixed

DRAFTERS = {
    "ngram": {"method": "ngram"},
    "self": {"method": "self"},
    "layers15": {"method": "layers", "num_layers": 15},
    "layers8": {"method": "layers", "num_layers": 8},
}


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only")
    ap.add_argument("--drafters", default="ngram")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = EngineConfig()
    pair = load_model(cfg.model.source, args.dtype)
    model, tok = pair
    prompts = mixed()[: args.limit]
    encoded = [encode(tok, p) for p in prompts]
    t0 = time.perf_counter()
    reference = []
    for i, ids in enumerate(encoded):
        with torch.inference_mode():
            g = model.generate(
                torch.tensor([ids]),
                max_new_tokens=args.max_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        reference.append(g[0, len(ids) :].tolist())
        if (i + 1) % 20 == 0:
            print(f"reference {i + 1}/{len(encoded)} ({time.perf_counter() - t0:.0f}s)", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    summary = []
    for name in args.drafters.split(","):
        ecfg = EngineConfig.from_dict(
            {
                "model": {"dtype": args.dtype},
                "max_running": args.batch,
                "max_prefill_per_step": args.batch,
                "drafter": DRAFTERS[name],
            }
        )
        engine = build_engine(ecfg, pair).engine
        mismatches, drafted, accepted, t1 = [], 0, 0, time.perf_counter()
        for start in range(0, len(encoded), args.batch):
            chunk = encoded[start : start + args.batch]
            seqs = engine.generate(chunk, params, SpecParams(k=args.k))
            for j, s in enumerate(seqs):
                drafted, accepted = drafted + s.drafted, accepted + s.accepted
                if s.output_ids != reference[start + j]:
                    mismatches.append(prompts[start + j].id)
        line = (
            f"{name}: {len(mismatches)} mismatches of {len(encoded)} prompts "
            f"(K={args.k}, batch {args.batch}, {args.dtype}, max_tokens {args.max_tokens}; "
            f"acceptance {accepted / max(drafted, 1):.2f}; {time.perf_counter() - t1:.0f}s)"
        )
        if mismatches:
            line += f" -- mismatched: {', '.join(mismatches)}"
        print(line, flush=True)
        summary.append(line)
        assert engine.target.cache.used_tokens() == 0
    print("\nSUMMARY\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
