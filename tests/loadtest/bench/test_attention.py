"""loadtest/bench/attention.py: grouped-query attention run as multi-head attention over each KV
head's query rows (engine.model.layer.grouped_sdpa, which the decoder layer runs on CPU in bf16) is
torch SDPA's enable_gqa attention, to
bf16 rounding, for decode steps and verifies with causal masks at ragged positions; a mask or
head order got wrong would be off by the size of the values."""

import torch

from loadtest.bench.attention import compare


def test_grouped_attention_is_sdpa_gqa_to_rounding():
    for dtype, tol in [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)]:
        for B, q, L in [(1, 1, 40), (3, 4, 70), (2, 8, 33)]:
            r = compare(B, q, L, heads=9, kv_heads=3, hd=64, dtype=dtype, calls=1)
            assert r["max_diff"] < tol, (dtype, B, q, L, r["max_diff"])
            assert r["gqa_us"] > 0 and r["grouped_us"] > 0
