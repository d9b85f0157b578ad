"""GGUF Q4_1 layers run as stored: 4-bit weights through a 4-bit matmul (engine/model/q4_matmul.py).

The CPU default target is a Q4_1 GGUF. Loading it through transformers dequantizes every weight to
a dense float copy, and a decode step, which is bound by reading the weights from memory, then
streams several times more bytes than the file holds. With ``model.native_q4: true`` each Q4_1
projection of the decoder layers is kept 4-bit instead, in the fields of
:class:`~engine.model.weights.LayerWeights` (a layer's Q, K, V and its gate, up may be fused):

- Q4_1 block (32 weights): ``w = d * q + m``, ``q`` in 0..15, ``d`` and ``m`` fp16; specd's
  kernel holds d and m as stored, torch's holds ``scale = d`` and ``zero = m + 8 d`` in the
  activation dtype (engine/model/q4_matmul.py).
- transformers permutes the rows of the Q and K projections when it reads a llama GGUF (rotary
  layout); the same row permutation is applied to the 4-bit rows.

It is the model of the GGUF file (the one llama.cpp serves; specd's kernel rounds the activations
to 8 bits per group of 32 as llama.cpp's does), not a further quantization of the weights: at load
every converted matrix is checked against transformers' dequantized weight (tolerance of the
activation dtype) and a mismatch keeps the dense weights. Speculation stays lossless: the target
is this model whichever drafter runs. The LM head runs from the file's Q8_0 blocks as 4-bit
halves (:func:`convert_q8_0_head`); embeddings and norms stay dense.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.model.q4_matmul import GROUP, Q4Weight, dequantized, pack
from engine.model.weights import BIAS, FUSED, LayerWeights, ModelWeights, check_fields, from_layer

if TYPE_CHECKING:
    import gguf

log = logging.getLogger("specd.quant")

# GGUF layer tensor (blk.<i>.<name>.weight) -> the LayerWeights field it replaces
_FIELDS = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}
check_fields(_FIELDS.values())  # a renamed LayerWeights field fails here, at import

_Blocks = tuple[np.ndarray, np.ndarray, np.ndarray]  # q [out, in] 0..15; d, m [out, in/32]


def _blocks(raw: np.ndarray, rows: int, cols: int) -> _Blocks:
    """Q4_1 rows ``[rows, cols/32 * 20]`` uint8 -> q ``[rows, cols]`` (0..15), d and m
    ``[rows, cols/32]``."""
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


def native_q4(source: str, model) -> ModelWeights | None:
    """``model.native_q4``: the weights of ``model`` with the Q4_1 layers of the GGUF ``source``
    kept 4-bit and its Q8_0 LM head as two 4-bit halves, for
    :class:`~engine.model.runner.ModelRunner`'s ``weights`` (a self-draft of the first N layers
    shares them); None (dense weights) when the source is no GGUF or nothing converts."""
    from engine.model.loader import resolve_source

    r = resolve_source(source)
    if r.kind != "gguf":
        log.warning("model.native_q4 needs a GGUF model source; keeping dense weights")
        return None
    import gguf

    reader = gguf.GGUFReader(str(r.location))  # parsed once for both conversions (seconds)
    layers, n = convert_q4_1(reader, model)
    if not n:
        return None
    head = convert_q8_0_head(reader, model)
    log.info(
        "native_q4: %d Q4_1 matrices kept 4-bit%s",
        n,
        ", Q8_0 LM head as two 4-bit halves" if head is not None else "",
    )
    return ModelWeights(layers, head)


def _reader(gguf_file) -> gguf.GGUFReader:
    """A ``gguf.GGUFReader`` for a path, or the reader itself."""
    import gguf

    return gguf_file if isinstance(gguf_file, gguf.GGUFReader) else gguf.GGUFReader(str(gguf_file))


def convert_q4_1(gguf_file, model, fuse: bool = True) -> tuple[list[LayerWeights], int]:
    """The decoder layers' weights of ``model`` with its dense Q4_1 projections replaced by
    :class:`Q4Weight` (CPU only; scales in the model's dtype), and the number of file matrices
    converted (0, and the dense weights, when the file has none or on any mismatch).
    ``gguf_file``: a path or a ``GGUFReader``. ``fuse``: a layer's Q, K and V become one matrix
    ``qkv`` (one matmul instead of three) and so do gate and up (``gate_up``), when all of them
    are Q4_1 and there are no biases."""
    weights = [from_layer(layer) for layer in model.model.layers]
    p = next(model.parameters())
    if p.device.type != "cpu":
        log.warning("native_q4 runs on CPU only; keeping dense weights")
        return weights, 0
    reader = _reader(gguf_file)
    heads = model.config.num_attention_heads
    kv_heads = getattr(model.config, "num_key_value_heads", None) or heads
    blocks: dict[tuple[int, str], _Blocks] = {}  # (layer, field) -> (q, d, m) as in the file
    for t in reader.tensors:
        parts = t.name.split(".")  # blk.<i>.<name>.weight
        if parts[0] != "blk" or parts[2] not in _FIELDS or t.tensor_type.name != "Q4_1":
            continue
        i, field = int(parts[1]), _FIELDS[parts[2]]
        if i >= len(weights):
            continue
        cols, rows = (int(x) for x in t.shape)  # GGUF lists the inner dimension first
        q, d, m = _blocks(np.asarray(t.data), rows, cols)
        if parts[2] in ("attn_q", "attn_k"):
            perm = _row_perm(rows, heads if parts[2] == "attn_q" else kv_heads)
            q, d, m = q[perm], d[perm], m[perm]
        dense = getattr(weights[i], field)
        deq = dequantized(q, d, m)  # d, m are the file's fp16 values: exact
        if tuple(dense.shape) != (rows, cols) or not _same(deq, dense):
            log.warning("GGUF tensor %s does not match the loaded weights; keeping dense", t.name)
            return weights, 0
        blocks[i, field] = (q, d, m)
    count = len(blocks)
    new = []
    for i, w in enumerate(weights):
        fields: dict[str, Any] = {}  # field name -> Q4Weight, or None (in a fused matrix)
        for fused, group in FUSED.items() if fuse else ():
            biases = [getattr(w, BIAS[f]) for f in group if f in BIAS]
            if all((i, f) in blocks for f in group) and all(b is None for b in biases):
                members = [blocks.pop((i, f)) for f in group]
                q, d, m = (np.concatenate(x) for x in zip(*members))
                split = tuple(b[0].shape[0] for b in members)
                fields[fused] = pack(q, d, m, p.dtype, split=split)
                fields.update(dict.fromkeys(group))  # computed by the fused matrix
        for field in _FIELDS.values():
            if (i, field) in blocks:
                fields[field] = pack(*blocks.pop((i, field)), p.dtype)
        new.append(w._replace(**fields))  # an unknown field name raises here
    return new, count


def _q8_0_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows ``[rows, cols/32 * 34]`` uint8 -> q ``[rows, cols]`` int8, d
    ``[rows, cols/32]``."""
    b = raw.reshape(rows, cols // GROUP, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:34].copy().view(np.int8)
    return q.reshape(rows, cols), d


def convert_q8_0_head(gguf_file, model) -> Q4Weight | None:
    """Run the LM head from the file's Q8_0 blocks (``output.weight``, or ``token_embd.weight``
    when the embeddings are tied) as one 4-bit matmul: each 8-bit weight ``q`` (+128, 0..255)
    is its high and low nibble, ``d·q = 16d·(hi - 8) + d·(lo - 8) + 8d``, so the head is
    ``[x, x] @ [W_hi | W_lo].T`` over 2x the input width, groups of 32 with (scale, zero) =
    (16d, 0) on the high half and (d, 8d) on the low half: half the bytes of a bf16 head, which a
    decode step reads whole from memory. Checked against the dense head like every layer
    matrix; returns None (the head stays dense) when the file has no Q8_0 head or it differs.
    ``gguf_file``: a path or a ``GGUFReader``."""
    if next(model.parameters()).device.type != "cpu":
        return None
    tensors = {t.name: t for t in _reader(gguf_file).tensors}
    t = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if t is None or t.tensor_type.name != "Q8_0":
        return None
    cols, rows = (int(x) for x in t.shape)
    dense = model.lm_head.weight
    q, d = _q8_0_blocks(np.asarray(t.data), rows, cols)
    step = 4096  # rows per check (float copies of the whole head would be ~450 MB at once)
    if tuple(dense.shape) != (rows, cols) or not all(
        _same(
            torch.from_numpy(np.repeat(d[i : i + step], GROUP, 1) * q[i : i + step]),
            dense.detach()[i : i + step],
        )
        for i in range(0, rows, step)
    ):
        log.warning("GGUF tensor %s does not match the LM head; keeping it dense", t.name)
        return None
    u = q.view(np.uint8) ^ np.uint8(0x80)  # q + 128, 0..255
    nib = np.concatenate([u >> 4, u & 15], axis=1)  # [rows, 2 cols]: high half, then low half
    scale = np.concatenate([16 * d, d], axis=1)  # [rows, 2 cols / 32]
    offset = np.concatenate([-128 * d, np.zeros_like(d)], axis=1)  # pack's m: w = d'·n + m
    return pack(nib, scale, offset, dense.dtype)
