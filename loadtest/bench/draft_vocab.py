"""The EAGLE-3 head's draft vocabulary: its size by measured coverage and cost.

A draft vocabulary of the N most frequent output tokens of the training answers (train/batches.py's
``draft_vocab``, as the fit picks it), or the shipped head's own (row ``head``, the base the
others are compared with), bounds acceptance: a token outside it is never drafted, so
the share of the held-out answers' tokens inside it (their *coverage*, counted on the ``e``
bucket's self-distilled answers, the greedy ones separately: there every output token is the
target's top token) is a ceiling on the head's top-1 agreement. Its cost is the LM head's rows:
one 4-bit matmul ``[1, hidden] x [N, hidden]`` per draft step (engine/drafters/eagle/q4.py, as
served), timed here beside the base's in the same run, at ``ids`` rows: the vocabulary's actual
size (at most the distinct tokens of the training answers).

The last column is a model, not a measurement: K = 1 speed against the base vocabulary if
agreement scaled with coverage (the new tokens predicted as well as the old, an optimistic bound)
and the round cost grew by the LM head's extra time, with ``--agreement`` and ``--round-ms`` (a
measured K = 1 round: loadtest/results/head_confidence.txt).

    python -m loadtest.bench.draft_vocab
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

SIZES = (2048, 4096, 8192, 16384, 32768)


def lm_head_ms(rows: int, hidden: int, tokens: int = 1, seed: int = 0) -> float:
    """Median time of the head's 4-bit LM-head matmul, ``tokens`` x ``[rows, hidden]`` (rows
    rounded up to a multiple of 32, as the 4-bit packing needs)."""
    from engine.drafters.eagle.q4 import quantize
    from engine.kcontrol.timing import time_calls
    from engine.model.q4_matmul import q4_linear

    rows = -(-rows // 32) * 32
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(rows, hidden, generator=g) * 0.02, torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        return 1e3 * statistics.median(time_calls(lambda: q4_linear(x, w), "cpu", 300, warmup=20))


def k1_speed(agreement: float, coverage: float, base_coverage: float, extra_ms: float, round_ms):
    """Modelled K = 1 speed against the base vocabulary: tau = 1 + agreement, agreement scaled
    by coverage, the round longer by the LM head's extra time."""
    scaled = agreement * coverage / base_coverage
    return (1 + scaled) / (1 + agreement) / (1 + extra_ms / round_ms)


def main(argv: list[str] | None = None) -> int:
    from engine.drafters.eagle.head import load_head
    from train.batches import draft_coverage, draft_vocab, read_rows

    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.draft_vocab", description=__doc__)
    ap.add_argument("--train", default=".cache/distill/train.jsonl")
    ap.add_argument("--eval", default=".cache/distill/eval.jsonl")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument(
        "--head",
        default="models/smollm2-135m-eagle3",
        help="the base: this head's own draft vocabulary ('': the counted --base size)",
    )
    ap.add_argument("--base", type=int, default=8192, help="the base's size without --head")
    ap.add_argument("--agreement", type=float, default=0.49, help="the head's step-1 agreement")
    ap.add_argument("--round-ms", type=float, default=14.8, help="a K = 1 round, measured")
    args = ap.parse_args(argv)
    train = read_rows(Path(args.train), 10**6)
    held = read_rows(Path(args.eval), 10**6)
    greedy = read_rows(Path(args.eval), 10**6, greedy_only=True)
    print(f"# vocabulary counted on {args.train} ({len(train)} answers); coverage on {args.eval}")
    print(f"# ({len(held)} e-bucket answers, {len(greedy)} of them greedy); LM head 4-bit, bf16")
    vocabs = {str(n): draft_vocab(train, int(n))[0] for n in args.sizes.split(",")}
    base = "head" if args.head else str(args.base)
    if args.head:  # the shipped head's own vocabulary (counted on the answers of its fits)
        vocabs[base] = load_head(args.head).draft_to_target
    else:
        vocabs.setdefault(base, draft_vocab(train, args.base)[0])
    ms = {name: lm_head_ms(len(ids), args.hidden) for name, ids in vocabs.items()}
    base_cov = draft_coverage(greedy, vocabs[base])
    head = f"{'size':>7}{'ids':>7}{'cov train':>11}{'cov e':>8}{'cov e greedy':>14}"
    print(head + f"{'LM head ms':>12}{'+ms vs base':>13}{'model K=1 x base':>18}")
    for name, ids in vocabs.items():
        c_g = draft_coverage(greedy, ids)
        c_train, c_e = draft_coverage(train, ids), draft_coverage(held, ids)
        extra = ms[name] - ms[base]
        model = k1_speed(args.agreement, c_g, base_cov, extra, args.round_ms)
        print(
            f"{name:>7}{len(ids):>7}{c_train:>11.3f}{c_e:>8.3f}{c_g:>14.3f}{ms[name]:>12.3f}"
            f"{extra:>+13.3f}{model:>18.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
