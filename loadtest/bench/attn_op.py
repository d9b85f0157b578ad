"""A candidate CPU attention kernel for short queries (``loadtest/bench/csrc/attn_avx512.cpp``,
op ``specd_attn::attend``), built and measured by ``python -m loadtest.bench.attn_kernel``; the
engine does not run it.

Why it exists: inside the compiled target step, attention (torch's SDPA) takes a quarter of a
batch-1 decode step and ~40% of an 8-row one at ~300 tokens of context. The kernel computes each
query row alone (float32 scores, softmax and weighted sum over the keys its mask allows, bf16
out), so a row's output is the same bits alone, in a batch, or as one token of a wider query.
In the compiled step it ran 0.84-1.02x SDPA's time at one decode row and 0.89-1.05x at eight,
and slower at 4-8 tokens a row (one query row at a time re-reads every key). Used at decode
only, decode and verify round attention differently, and bf16 greedy text with and without
speculation parted where it had agreed (``loadtest/results/attn_kernel.txt``). Built on first
use by torch's C++ extension loader (a compiler and ninja; ~10 s once, cached) and checked
against a float32 reference.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.q4_matmul import build_extension, probe_kernel

log = logging.getLogger("specd.bench.attention")
_SRC = Path(__file__).with_name("csrc") / "attn_avx512.cpp"
_FLAGS = ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma"]


def attend(
    qs: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Queries ``[B, kv_heads, rows, head_dim]`` (row r: query token r % T of a grouped query
    head), keys / vals ``[B, kv_heads, L, head_dim]`` (views with the last dim contiguous), a
    bool mask ``[B, 1, T, L]`` (or already one row per query row) -> ``[B, kv_heads, rows,
    head_dim]``."""
    return torch.ops.specd_attn.attend(qs, keys, vals, mask, scale)


@functools.cache
def available() -> bool:
    """The kernel is built, loaded and agrees with :func:`reference` (probed once per process)."""
    return probe_kernel("specd's CPU attention", _FLAGS, load, _self_test, log)


def load() -> None:
    """Build and load the op (engine/model/q4_matmul.py's :func:`build_extension`), once."""
    if hasattr(torch.ops.specd_attn, "attend"):
        return
    build_extension("specd_attn_avx512", _SRC, _FLAGS)
    torch.library.register_fake("specd_attn::attend")(
        lambda q, k, v, mask, scale: torch.empty_like(q, memory_format=torch.contiguous_format)
    )


def reference(
    qs: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`attend`'s attention by SDPA in float32 (every row with at least one key)."""
    rows, t = qs.shape[2], mask.shape[2]
    m = mask if t == rows else mask.repeat(1, 1, rows // t, 1)
    return F.scaled_dot_product_attention(
        qs.float(), keys.float(), vals.float(), attn_mask=m, scale=scale
    )


def _self_test() -> bool:
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 3, 2, 40, 64, generator=g).bfloat16()  # [k/v, slots, kv_heads, L, hd]
    keys, vals = cache[0, 1:], cache[1, 1:]  # views of slots 1..2
    qs = torch.randn(2, 2, 6, 64, generator=g).bfloat16()
    mask = torch.arange(40)[None, None, None, :] <= torch.tensor([[[[20], [21]]], [[[5], [39]]]])
    got = attend(qs, keys, vals, mask, 0.125).float()
    return bool((got - reference(qs, keys, vals, mask, 0.125)).abs().max() < 0.02)
