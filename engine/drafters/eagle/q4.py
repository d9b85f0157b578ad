"""The EAGLE-3 head's matrices quantized to 4 bits at load (``drafter.head_q4``), for a CPU
draft step bound by reading its weights.

A bf16 head step reads ~17 MB (the layer ~8, its 8,192-row LM head ~9.4); group-wise 4-bit
weights (32 per group, asymmetric: ``w ~ d * q + m``, q in 0..15 rounded to nearest, as GGUF's
Q4_1) read ~4.5 MB through the same 4-bit kernel as the target's Q4_1 layers
(engine/model/q4_matmul.py). Q, K, V and gate, up are fused (one matmul each). The embedding and the
norms stay dense.

Speculation stays lossless whatever the head computes: the rejection rule only needs the q the
drafter sampled from, so quantizing changes acceptance, never the output's distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.model.q4_matmul import GROUP, Q4Weight, pack
from engine.model.weights import LayerWeights

if TYPE_CHECKING:
    from typing import TypeAlias

    from engine.model.weights import Weight

    # the head's matrices: fc [hidden, taps * target_hidden], its layer, lm_head
    # [draft_vocab, hidden]
    Matrices: TypeAlias = tuple[Weight, LayerWeights, Weight]


def quantize(w: torch.Tensor, dtype: torch.dtype, split: tuple[int, ...] | None = None) -> Q4Weight:
    """A dense ``[out, in]`` matrix -> :class:`Q4Weight` (groups of 32 along ``in``)."""
    out, cols = w.shape
    g = w.detach().float().reshape(out, cols // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)  # [out, in/32]
    d = (hi - lo) / 15
    q = torch.where(d[..., None] > 0, ((g - lo[..., None]) / d[..., None]).round(), 0.0)
    levels = q.clamp(0, 15).to(torch.uint8).reshape(out, cols).numpy()  # [out, in] 0..15
    return pack(levels, d.numpy().astype(np.float32), lo.numpy().astype(np.float32), dtype, split)


def dequantize(q: Q4Weight) -> torch.Tensor:
    """The float32 matrix ``[out, in]`` that ``q`` computes with: its product with the identity
    (the kernel's own weights; an identity row survives specd's 8-bit activation rounding
    exactly, so this shows the weights' rounding only, not the activations'; for tests and the
    agreement benchmark)."""
    from engine.model.layer import linear

    eye = torch.eye(q.shape[1], dtype=q.dtype)
    return linear(eye, q).T.float()


def supported(w: Matrices, device: torch.device, dtype: torch.dtype) -> bool:
    """The 4-bit CPU matmuls: every input width a multiple of 32 and output height of 16,
    activations below float32 (with float32 it is far slower than dense, engine/builder.py)."""
    fc, lw, lm_head = w
    mats = [fc, lw.o, lw.down, lm_head, lw.q, lw.k, lw.v, lw.gate, lw.up]
    if device.type != "cpu" or dtype == torch.float32:
        return False
    dense = [m for m in mats if isinstance(m, torch.Tensor)]
    if len(dense) < len(mats) or any(m.shape[1] % GROUP for m in dense):
        return False
    rows = [int(m.shape[0]) for m in dense]  # the fused ones (Q, K, V; gate, up) count as one
    return all(h % 16 == 0 for h in rows[:4] + [sum(rows[4:7]), sum(rows[7:])])


def quantized(w: Matrices, dtype: torch.dtype) -> Matrices:
    """``w`` with its matrices 4-bit (Q, K, V and gate, up fused); biases are not supported."""
    fc, lw, lm_head = w
    assert lw.q is not None and lw.k is not None and lw.v is not None
    assert lw.gate is not None and lw.up is not None
    assert isinstance(lw.o, torch.Tensor) and isinstance(lw.down, torch.Tensor)
    if lw.q_bias is not None or lw.k_bias is not None or lw.v_bias is not None:
        raise ValueError("4-bit EAGLE-3 head: Q/K/V biases are not supported")
    qkv = torch.cat([lw.q, lw.k, lw.v])  # type: ignore[list-item]
    gate_up = torch.cat([lw.gate, lw.up])  # type: ignore[list-item]
    layer = LayerWeights(
        **(
            lw._asdict()
            | {
                "qkv": quantize(qkv, dtype, (lw.q.shape[0], lw.k.shape[0], lw.v.shape[0])),
                "q": None,
                "k": None,
                "v": None,
                "gate_up": quantize(gate_up, dtype, (lw.gate.shape[0], lw.up.shape[0])),
                "gate": None,
                "up": None,
                "o": quantize(lw.o, dtype),
                "down": quantize(lw.down, dtype),
            }
        )
    )
    assert isinstance(fc, torch.Tensor) and isinstance(lm_head, torch.Tensor)
    return quantize(fc, dtype), layer, quantize(lm_head, dtype)
