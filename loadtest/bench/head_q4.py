"""What 4-bit weights cost the EAGLE-3 head in agreement (drafter.head_q4).

The held-out top-1 agreement with the target at each of the fit's draft steps
(train/acceptance.py's ``acceptance_by_step``, greedy, teacher-forced, on the ``e`` bucket's rows
of ``.cache/distill/eval.jsonl``) for the head as stored and with the matrices rounded as
engine/drafters/eagle/q4.py rounds them:
all of them, the layer's and ``fc`` only, the LM head only.

    python -m loadtest.bench.head_q4 --head models/smollm2-135m-eagle3
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def rounded(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[out, in]`` as its 4-bit form computes (engine/drafters/eagle/q4.py)."""
    from engine.drafters.eagle.q4 import dequantize, quantize

    return dequantize(quantize(w, torch.bfloat16))


def main(argv: list[str] | None = None) -> int:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from engine.config import DEFAULT_TARGET
    from engine.drafters.eagle.head import load_head
    from engine.model.loader import load_model
    from engine.model.runner import ModelRunner
    from train.acceptance import acceptance_by_step
    from train.batches import read_rows
    from train.feature_cache import FeatureCache, cache_tag
    from train.ttt import TTTForward

    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.head_q4")
    ap.add_argument("--head", default="models/smollm2-135m-eagle3")
    ap.add_argument("--eval", default=".cache/distill/eval.jsonl")
    ap.add_argument("--rows", type=int, default=160)
    ap.add_argument("--feature-cache", default=".cache/features")
    args = ap.parse_args(argv)
    model, _ = load_model(DEFAULT_TARGET, "bfloat16")
    rows = read_rows(Path(args.eval), 640, args.rows)
    head = load_head(args.head, model.config.num_hidden_layers)
    taps = tuple(head.config.aux_layers)
    runner = ModelRunner(model, num_slots=64, max_len=640, taps=taps)
    tag = cache_tag(DEFAULT_TARGET, "bfloat16", False, head.config.aux_layers)
    cache = FeatureCache(args.feature_cache or None, tag)
    rotary = LlamaRotaryEmbedding(config=head.config.llama_config())
    stored = {k: v.clone() for k, v in head.state_dict().items()}
    variants = {
        "as stored": lambda name: False,
        "all matrices 4-bit": lambda name: True,
        "layer + fc 4-bit": lambda name: name != "lm_head",
        "LM head 4-bit": lambda name: name == "lm_head",
    }
    print("held-out top-1 agreement by draft step (teacher-forced)")
    for label, pick in variants.items():
        head.load_state_dict(stored)
        with torch.no_grad():
            for name, m in head.named_modules():
                if isinstance(m, torch.nn.Linear) and pick(name):
                    m.weight.copy_(rounded(m.weight))
        fwd = TTTForward(head, model.model.embed_tokens, rotary)
        acc, _ = acceptance_by_step(fwd, runner, cache, rows, 4, 4096, True, sampled=False)
        print(f"  {label:<20} " + " ".join(f"{a:.4f}" for a in acc), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
