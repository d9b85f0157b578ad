"""GGUF Q4_1 layers run as stored: 4-bit weights through torch's int4 weight-only matmul.

The CPU default target is a Q4_1 GGUF. Loading it through transformers dequantizes every weight to
a dense float copy, and a decode step then streams ~4x more bytes than the file holds (on this
2-core machine the dense bf16 matrix-vector products are ~75% of an eager decode step). With
``model.native_q4: true`` each Q4_1 projection of the decoder layers is kept 4-bit instead:

- Q4_1 block (32 weights): ``w = d * q + m``, ``q`` in 0..15, ``d`` and ``m`` fp16.
- torch's ``_weight_int4pack_mm_for_cpu`` computes with ``w = (q - 8) * scale + zero`` per group
  of 32 along the input dimension, so ``scale = d`` and ``zero = m + 8 d``: the same weights (the
  scales held in the activation dtype).
- transformers permutes the rows of the Q and K projections when it reads a llama GGUF (rotary
  layout); the same row permutation is applied to the 4-bit rows.

It is the model of the GGUF file (the one llama.cpp serves), not a further quantization: at load
every converted matrix is checked against transformers' dequantized weight (tolerance of the
activation dtype) and a mismatch keeps the dense weights. Speculation stays lossless: the target
is this model whichever drafter runs. Embeddings, norms and the LM head stay dense.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("specd.quant")

GROUP = 32
_NAMES = {"attn_q": 1, "attn_k": 3, "attn_v": 5, "attn_output": 7, "ffn_gate": 9, "ffn_up": 10,
          "ffn_down": 11}  # GGUF tensor -> index in model_runner.layer_weights()


class Q4Weight:
    """A 4-bit matrix ``[out, in]`` for ``_weight_int4pack_mm_for_cpu``."""

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, shape: tuple[int, int]):
        self.packed, self.scale_zero, self.shape = packed, scale_zero, shape

    def __repr__(self):
        return f"Q4Weight{self.shape}"


@torch.library.custom_op("specd::q4_mm", mutates_args=())
def q4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """``x [tokens, in] @ W.T -> [tokens, out]``. An opaque op, so that inductor calls this
    kernel as it is (its own lowering of the aten op re-packs the weight on every call)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zero)


@q4_mm.register_fake
def _q4_mm_fake(x, packed, scale_zero):
    return x.new_empty(x.shape[0], scale_zero.shape[1])


def q4_linear(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ W.T`` for a packed Q4 weight; returns ``[..., out]``."""
    y = q4_mm(x.reshape(-1, x.shape[-1]), packed, scale_zero)
    return y.view(*x.shape[:-1], y.shape[-1])


def _blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 rows ``[rows, cols/32 * 20]`` uint8 -> q ``[rows, cols]`` (0..15), d, m ``[rows, cols/32]``."""
    b = raw.reshape(rows, cols // GROUP, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element j: low nibble of byte j, j+16: high
    return q.reshape(rows, cols), d, m


def _row_perm(rows: int, n_head: int) -> np.ndarray:
    """transformers' reverse permutation of llama Q/K rows (modeling_gguf_pytorch_utils)."""
    dim = rows // n_head // 2
    return np.arange(rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(rows)


def _same(deq: torch.Tensor, dense: torch.Tensor) -> bool:
    """``deq`` (float32, from the file) equals ``dense`` up to the rounding of dense's dtype."""
    err = (deq.to(dense.dtype).float() - dense.float()).abs_().amax().item()
    return err <= 1e-6 * max(1.0, dense.float().abs().amax().item())


def use_native_q4(spec: str, runner, *sharing) -> int:
    """``model.native_q4``: keep the Q4_1 layers of the GGUF ``spec`` 4-bit in ``runner``, and
    in each runner of ``sharing`` that runs the same model (the self / first-N-layers drafter).
    Returns the number of matrices converted."""
    from .loader import resolve_spec
    r = resolve_spec(spec)
    if r.kind != "gguf":
        log.warning("model.native_q4 needs a GGUF model spec; keeping dense weights")
        return 0
    n = convert_q4_1(r.location, runner)
    log.info("native_q4: %d Q4_1 matrices kept 4-bit", n)
    for other in sharing:
        if n and other is not None and other.model is runner.model:
            other.weights = runner.weights[:len(other.weights)]
    return n


def convert_q4_1(gguf_path: str | Path, runner) -> int:
    """Replace ``runner``'s dense Q4_1 projections by :class:`Q4Weight` (CPU only; scales in the
    runner's dtype). Returns the number of matrices converted (0 when the file has none, or on
    any mismatch)."""
    import gguf

    if runner.device.type != "cpu":
        log.warning("native_q4 runs on CPU only; keeping dense weights")
        return 0
    reader = gguf.GGUFReader(str(gguf_path))
    cfg = runner.config
    heads, kv_heads = cfg.num_attention_heads, runner.kv_heads
    new = [list(w) for w in runner.weights]
    count = 0
    for t in reader.tensors:
        parts = t.name.split(".")  # blk.<i>.<name>.weight
        if parts[0] != "blk" or parts[2] not in _NAMES or t.tensor_type.name != "Q4_1":
            continue
        i, slot = int(parts[1]), _NAMES[parts[2]]
        if i >= len(new):
            continue
        cols, rows = (int(x) for x in t.shape)  # GGUF lists the inner dimension first
        q, d, m = _blocks(np.asarray(t.data), rows, cols)
        if parts[2] in ("attn_q", "attn_k"):
            perm = _row_perm(rows, heads if parts[2] == "attn_q" else kv_heads)
            q, d, m = q[perm], d[perm], m[perm]
        dense = new[i][slot]
        deq = torch.from_numpy(np.repeat(d, GROUP, 1) * q + np.repeat(m, GROUP, 1))
        if tuple(dense.shape) != (rows, cols) or not _same(deq, dense):
            log.warning("GGUF tensor %s does not match the loaded weights; keeping dense", t.name)
            return 0
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(q.astype(np.int32)), 1)
        dt, mt = torch.from_numpy(d), torch.from_numpy(m)
        scale_zero = torch.stack([dt, mt + 8 * dt], -1).transpose(0, 1).contiguous().to(runner.dtype)  # [in/32, out, 2]
        new[i][slot] = Q4Weight(packed, scale_zero, (rows, cols))
        count += 1
    runner.weights = [tuple(w) for w in new]
    return count
