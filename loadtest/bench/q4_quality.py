"""What each 4-bit kernel does to the model: the served target against the dense float32 model
of the same GGUF, teacher-forced over the same text.

Three runners over SmolLM2 (the config's GGUF): the dense model in float32 (transformers'
dequantized weights: the reference), its Q4_1 layers kept 4-bit in bf16 through specd's kernel
(8-bit activations, engine/model/csrc/q4_avx512.cpp) and through torch's
``_weight_int4pack_mm_for_cpu`` (bf16 activations). Over the answer tokens of ``--rows`` rows of
``--data`` (default: the ``e`` bucket's self-distilled rows, ``.cache/distill/eval.jsonl``, written
by ``specd train-drafter``), each 4-bit runner's next-token distribution is compared with the
reference's: top-1 agreement and mean KL(reference || runner). The two 4-bit runners against each
other give the scale: how far 8-bit activations move the model compared with what 4-bit weights in
bf16 already do.

    python -m loadtest.bench.q4_quality --rows 40
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.model.loader import load_model
from engine.model.q4_matmul import kernel_available, only_torch_kernel
from engine.model.quant import native_q4
from engine.model.runner import ModelRunner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.q4_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--data", default=".cache/distill/eval.jsonl")
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=512)
    args = ap.parse_args(argv)
    from train.batches import read_rows

    if not Path(args.data).exists():
        print(f"{args.data} is missing: `specd train-drafter` writes it (its distill stage)")
        return 1
    if not kernel_available():
        print("specd's 4-bit kernel is not available on this machine")
        return 1
    rows = read_rows(Path(args.data), args.max_len, args.rows)
    cfg = EngineConfig.from_yaml(args.config)
    src = cfg.model.source
    dense, _ = load_model(src, "float32", "cpu", cfg.cache_dir)
    ref_runner = ModelRunner(dense, 1, args.max_len + 8)
    runners = {}
    kernels = {
        "specd (8-bit activations)": nullcontext,
        "torch (bf16 activations)": only_torch_kernel,
    }
    for name, packing in kernels.items():  # the 4-bit weights packed for that kernel
        model, _ = load_model(src, "bfloat16", "cpu", cfg.cache_dir)
        with packing():
            weights = native_q4(src, model)
        runners[name] = ModelRunner(model, 1, args.max_len + 8, weights=weights)

    def logprobs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            out = runner.forward([ids], [0], logits="all").logits[0]  # [q, vocab]
        return out.float().log_softmax(-1)

    names = list(runners)
    pairs = [("reference", n) for n in names] + [(names[1], names[0])]
    stats = {p: [0.0, 0.0] for p in pairs}  # top-1 agreements, KL sum
    n = 0
    for r in rows:
        lp = {"reference": logprobs(ref_runner, r.ids)}
        lp.update({name: logprobs(run, r.ids) for name, run in runners.items()})
        sl = slice(r.start - 1, len(r.ids) - 1)  # positions that predict an answer token
        for a, b in pairs:
            pa, pb = lp[a][sl], lp[b][sl]
            stats[(a, b)][0] += float((pa.argmax(-1) == pb.argmax(-1)).sum())
            stats[(a, b)][1] += float((pa.exp() * (pa - pb)).sum())
        n += sl.stop - sl.start
    print(f"{len(rows)} rows of {args.data}, {n} answer positions, teacher-forced")
    print(f"  {'against':<28}{'runner':<28}{'top-1 agree':>12}{'mean KL':>10}")
    for (a, b), (agree, kl) in stats.items():
        print(f"  {a:<28}{b:<28}{agree / n:>12.4f}{kl / n:>10.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
