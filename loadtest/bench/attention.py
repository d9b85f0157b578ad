"""Grouped-query attention on CPU: torch's SDPA with ``enable_gqa`` against the same attention run
as multi-head attention over each KV head's query heads as rows
(``engine.model.layer.grouped_sdpa``, which the decoder layer runs on CPU below float32).

With ``enable_gqa``, queries ``[B, heads, q, hd]`` attend to keys ``[B, kv_heads, L, hd]``; query
head ``h`` reads KV head ``h // group``. Grouped: queries reshaped to ``[B, kv_heads, group*q, hd]``
and the mask repeated ``group`` times along the query rows, no GQA flag. The script prints both
times per call and how far apart the outputs are (the same attention: rounding apart, often the
same bits), for the default target's geometry (SmolLM2-135M: 9 query heads, 3 KV heads,
head_dim 64) unless told otherwise; masks are causal by each query's position.

    python -m loadtest.bench.attention
    python -m loadtest.bench.attention --shapes 1x1x300,8x1x300 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from engine.kcontrol.timing import time_calls
from engine.model.layer import grouped_sdpa


def per_call_us(fn, calls: int) -> float:
    """Median microseconds of ``calls`` timed calls (engine/kcontrol/timing.py), after a tenth as
    many."""
    return statistics.median(time_calls(fn, "cpu", calls, warmup=max(3, calls // 10))) * 1e6


def compare(B: int, q: int, L: int, heads: int, kv_heads: int, hd: int, dtype, calls: int) -> dict:
    """One shape: SDPA with enable_gqa and grouped, us per call; same bits?; max difference."""
    gen = torch.Generator().manual_seed(0)
    qs = torch.randn(B, heads, q, hd, generator=gen).to(dtype)
    k = torch.randn(B, kv_heads, L, hd, generator=gen).to(dtype)
    v = torch.randn(B, kv_heads, L, hd, generator=gen).to(dtype)
    pos = torch.randint(L - q, L, (B, q), generator=gen)  # each query's position
    mask = (torch.arange(L)[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [B, 1, q, L]

    def gqa():
        return F.scaled_dot_product_attention(
            qs, k, v, attn_mask=mask, scale=hd**-0.5, enable_gqa=True
        )

    def grouped():
        return grouped_sdpa(qs, k, v, mask, hd**-0.5)

    return {
        "gqa_us": per_call_us(gqa, calls),
        "grouped_us": per_call_us(grouped, calls),
        "same_bits": torch.equal(gqa(), grouped()),
        "max_diff": (gqa().float() - grouped().float()).abs().max().item(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.attention", description=__doc__)
    ap.add_argument("--shapes", default="1x1x100,1x1x300,1x4x300,8x1x300,8x4x300,16x1x300")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    heads, kv_heads, hd = (int(x) for x in args.heads.split(","))
    print(
        f"# python -m loadtest.bench.attention --shapes {args.shapes} --dtypes {args.dtypes} "
        f"--heads {args.heads}; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'dtype':<10}{'batch':>6}{'q':>4}{'keys':>6}{'gqa us':>9}{'grouped us':>12}"
        f"{'speedup':>9}  same bits"
    )
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for shape in args.shapes.split(","):
            B, q, L = (int(x) for x in shape.split("x"))
            r = compare(B, q, L, heads, kv_heads, hd, dtype, args.calls)
            same = "yes" if r["same_bits"] else f"no (max diff {r['max_diff']:.1e})"
            print(
                f"{name:<10}{B:>6}{q:>4}{L:>6}{r['gqa_us']:>9.0f}{r['grouped_us']:>12.0f}"
                f"{r['gqa_us'] / r['grouped_us']:>8.2f}x  {same}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
