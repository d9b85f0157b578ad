"""One Llama-family decoder layer as a function of its weights, over the slot KV cache.

:func:`decoder_layer` takes the layer's weights (:class:`~engine.model.weights.LayerWeights`) and
its geometry (:class:`LayerShape`) as arguments, and :func:`layer_group` runs a group of
consecutive layers the same way, so one compiled graph serves every group; the eager path
(:class:`~engine.model.runner.ModelRunner`, the whole stack as one group) and the compiled path
(:mod:`engine.model.compiled`, groups of ``layers_per_graph``) run these same functions. Queries
attend by position (``kv_pos <= query_pos``, the mask built by the caller), so rows of one batch
may be ragged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from engine.model import attention
from engine.model.q4_matmul import q4_linear
from engine.model.weights import LayerWeights

if TYPE_CHECKING:
    from engine.model.weights import Weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm, as a function (in float32, scaled in the input dtype), with
    torch's one-kernel ``F.rms_norm`` for its five float32 steps. On CUDA below float32 the
    weight is applied inside that kernel too (one kernel instead of four; rounded once, where
    transformers rounds the normed input and then its product with the weight)."""
    if x.device.type == "cuda" and x.dtype != torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@dataclass(frozen=True)
class LayerShape:
    num_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    act: str  # "silu" | "gelu_pytorch_tanh" | ...


def config_shape(cfg, norm) -> tuple[LayerShape, int | None]:
    """The layer geometry of a transformers config, and its maximum positions (None: no limit).

    The one place that reads fields optional in HF configs; their defaults:
    ``num_key_value_heads`` -> ``num_attention_heads`` (no GQA); ``head_dim`` ->
    ``hidden_size // num_attention_heads``; ``hidden_act`` -> ``"silu"``;
    ``max_position_embeddings`` -> None. The RMSNorm epsilon is read from the norm module
    ``norm`` (``variance_epsilon``, else ``eps``), default 1e-6."""
    heads = cfg.num_attention_heads
    shape = LayerShape(
        heads,
        getattr(cfg, "num_key_value_heads", None) or heads,
        getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))),
        getattr(cfg, "hidden_act", "silu"),
    )
    return shape, getattr(cfg, "max_position_embeddings", None)


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or the 4-bit matmul for a GGUF Q4_1 weight kept as stored
    (engine/model/quant.py)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    y = q4_linear(x, w)
    return y if b is None else y + b


def qkv_split(w: LayerWeights, shape: LayerShape) -> tuple[int, int, int]:
    """The output sizes of Q, K and V in ``w.qkv`` (a 4-bit matrix carries them)."""
    if isinstance(w.qkv, torch.Tensor):
        kv = shape.kv_heads * shape.head_dim
        return (shape.num_heads * shape.head_dim, kv, kv)
    assert w.qkv is not None and w.qkv.split is not None
    qs, ks, vs = w.qkv.split
    return qs, ks, vs


def project_qkv(
    x: torch.Tensor, w: LayerWeights, shape: LayerShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K and V of ``x`` ``[batch, q, hidden]``: ``[batch, q, heads or kv_heads * head_dim]``."""
    if w.qkv is not None:  # one fused matrix (4-bit: engine/model/quant.py; dense: weights.py)
        qs, ks, vs = linear(x, w.qkv).split(qkv_split(w, shape), dim=-1)
        return qs, ks, vs
    assert w.q is not None and w.k is not None and w.v is not None
    return linear(x, w.q, w.q_bias), linear(x, w.k, w.k_bias), linear(x, w.v, w.v_bias)


def _qk_v(x: torch.Tensor, w: LayerWeights, shape: LayerShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys side by side ``[batch, q, (heads + kv_heads) * head_dim]`` (qwen3: after
    their per-head norms) and values ``[batch, q, kv_heads * head_dim]`` of ``x``
    ``[batch, q, hidden]``: slices of the fused matrix's output, else Q and K concatenated."""
    if w.qkv is not None and w.q_norm is None:
        y = linear(x, w.qkv)  # [batch, q, q_out + k_out + v_out]
        nv = qkv_split(w, shape)[2]
        return y[..., :-nv], y[..., -nv:]
    qs, ks, vs = project_qkv(x, w, shape)
    if w.q_norm is not None and w.k_norm is not None:  # qwen3
        B, q, hd = x.shape[0], x.shape[1], shape.head_dim
        qs = rms_norm(qs.reshape(B, q, -1, hd), w.q_norm, shape.eps).flatten(2)
        ks = rms_norm(ks.reshape(B, q, -1, hd), w.k_norm, shape.eps).flatten(2)
    return torch.cat([qs, ks], dim=-1), vs


def project_gate_up(x: torch.Tensor, w: LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up projections of ``x`` ``[batch, q, hidden]``: ``[batch, q, intermediate]``."""
    if isinstance(w.gate_up, torch.Tensor):  # one fused dense matrix: gate rows, then up rows
        g, u = linear(x, w.gate_up).chunk(2, dim=-1)
        return g, u
    if w.gate_up is not None:  # one fused 4-bit matrix
        g, u = linear(x, w.gate_up).split(w.gate_up.split, dim=-1)
        return g, u
    assert w.gate is not None and w.up is not None
    return linear(x, w.gate), linear(x, w.up)


# set while a forward of varying shapes runs on CUDA (:func:`varying_shape_attention`; the
# engine runs forwards on one thread)
_varying_shapes = [False]


def groups_queries(shape: LayerShape, x: torch.Tensor) -> bool:
    """Whether :func:`decoder_layer` runs grouped-query attention as :func:`grouped_sdpa` for
    activations like ``x``: on CPU below float32, and on CUDA inside
    :func:`varying_shape_attention`. torch's CPU SDPA with ``enable_gqa`` is several times
    slower for 1-token queries in bf16, while in float32 its 1-token path is the faster one. The
    runners' captured CUDA graphs keep SDPA's own GQA (the EAGLE-3 head's captured steps do not:
    see :func:`varying_shape_attention`): its cuDNN kernel is several times faster than the
    grouped form over thousands of keys. Figures: docs/measurements.md."""
    if shape.kv_heads == shape.num_heads or attention.uses_kernel(x, shape.head_dim):
        return False
    if x.device.type == "cuda":
        return _varying_shapes[0]
    return x.device.type == "cpu" and x.dtype != torch.float32


class _VaryingShapes:
    """:func:`varying_shape_attention` on CUDA: SDPA without cuDNN, query heads grouped."""

    def __enter__(self) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        self.kernels = sdpa_kernel(backends)
        self.kernels.__enter__()
        self.was, _varying_shapes[0] = _varying_shapes[0], True

    def __exit__(self, *exc) -> None:
        _varying_shapes[0] = self.was
        self.kernels.__exit__(*exc)


def varying_shape_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """Attention for forwards whose shapes vary from call to call (prefill chunks, draft
    catch-ups, the EAGLE-3 head on CUDA; not the runners' captured buckets). On CUDA:
    SDPA without cuDNN, and the query heads grouped by KV head (:func:`grouped_sdpa`: equal head
    counts, which the memory-efficient kernel takes with a mask; with unequal ones only the
    math kernel would be left). torch 2.11 tries cuDNN first for a masked SDPA on Hopper, and
    cuDNN builds an execution plan for each new shape, a large fraction of a second each (sglang
    #4650, FunASR #3704): the adaptive controller's rare probe rounds, whose draft catch-ups come
    in new shapes, then made a large batch far slower than plain decoding though K stayed near 0
    (docs/measurements.md). The runners' captured graphs keep cuDNN: their plans are built once,
    before capture. The EAGLE-3 head's captured steps (engine/model/cuda_graphs.py records a
    stack that feeds its output back so) keep this form: hundreds of buckets would each build a
    plan at warm-up, and over the few hundred keys a head attends to, the grouped form is no
    slower. Elsewhere, and inside a compiled
    function (Dynamo cannot trace the kernel choice's context), a no-op."""
    if device.type == "cuda" and not torch.compiler.is_compiling():
        return _VaryingShapes()
    return contextlib.nullcontext()


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: attend) as SDPA's additive float mask (0 or -inf) in
    ``dtype``: built once a forward, where SDPA on CUDA converts a boolean mask in every layer
    (extra kernels in every layer)."""
    return torch.full(mask.shape, -torch.inf, dtype=dtype, device=mask.device).masked_fill_(mask, 0)


def grouped_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """``mask`` ``[batch, 1, q, kv_len]`` -> ``[batch, 1, group * q, kv_len]``: the mask of
    :func:`grouped_sdpa`'s query rows (the eager forward builds it once, not once a layer)."""
    return mask.repeat(1, 1, group, 1)


def grouped_sdpa(
    qs: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA's grouped-query attention run as multi-head attention: each KV head's query heads
    become its rows, ``[batch, kv_heads, group * q, head_dim]``; the same attention, to rounding.
    qs ``[batch, heads, q, head_dim]``; keys/vals ``[batch, kv_heads, kv_len, head_dim]``; mask
    ``[batch, 1, q, kv_len]`` or already :func:`grouped_mask`. Returns ``[batch, heads, q,
    head_dim]``."""
    B, nh, q, hd = qs.shape
    kvh = keys.shape[1]
    if mask.shape[-2] == q:  # not grouped by the caller (the compiled path: q is dynamic there)
        mask = grouped_mask(mask, nh // kvh)
    o = F.scaled_dot_product_attention(
        qs.reshape(B, kvh, nh // kvh * q, hd), keys, vals, attn_mask=mask, scale=scale
    )
    return o.reshape(B, nh, q, hd)  # a copy where the kernel's output is laid out by row


class LayerInputs(NamedTuple):
    """What every decoder layer of one forward reads besides its own weights and cache."""

    cos: torch.Tensor  # [batch, 1, q, head_dim] the rotary embedding of each query position
    sin: torch.Tensor  # [batch, 1, q, head_dim]
    # [batch, 1, q, kv_len] (or already grouped_mask'ed): which keys a query attends to, bool or
    # additive (0 / -inf)
    mask: torch.Tensor
    slot_t: torch.Tensor  # [batch] each row's slot
    # [batch, q] the cache column each query token's K/V is written to (a paged cache: the
    # pool position)
    write_pos: torch.Tensor
    # keys are read as a view of slots first_slot .. when the rows are consecutive slots from
    # there; None: gathered by slot_t
    first_slot: int | None
    shape: LayerShape
    # a paged cache (engine/kv/paged_kv.py): [batch, kv_len] the pool position of each row's
    # keys, which are gathered through it; None: the slot cache
    read_idx: torch.Tensor | None = None


Group = tuple[LayerWeights, ...]  # the weights of consecutive layers
Caches = tuple[torch.Tensor, ...]  # their K (or V) caches, [slots, kv_heads, max_len+1, head_dim]
GroupOut = tuple[torch.Tensor, list[torch.Tensor]]  # the output, and each layer's input


def layer_group(
    h: torch.Tensor,
    ws: Group,
    kcs: Caches,
    vcs: Caches,
    at: LayerInputs,
    x0: torch.Tensor | None = None,
) -> GroupOut:
    """Consecutive decoder layers (weights ``ws``, their caches ``kcs`` / ``vcs``), the unit
    that the compiled path compiles (engine/model/compiled.py: one graph serves every group of
    the same structure; a graph per layer pays Dynamo's per-call cost once per layer, one of
    the whole stack compiles far longer). Arguments as :func:`decoder_layer`'s; ``x0``: the
    group's first layer's attention input (a stack whose input adapter gives one, the EAGLE-3
    head's: engine/model/stack.py). Returns the group's output ``[batch, q, hidden]`` and each
    layer's input (the EAGLE-3 taps)."""
    inputs = []
    for w, kc, vc in zip(ws, kcs, vcs):
        inputs.append(h)
        h, x0 = decoder_layer(h, w, kc, vc, at, x0), None
    return h, inputs


def decoder_layer(
    h: torch.Tensor,
    w: LayerWeights,
    kc: torch.Tensor,
    vc: torch.Tensor,
    at: LayerInputs,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Llama-family decoder layer over the slot cache, weights passed in, so one compiled
    graph serves every layer. h ``[batch, q, hidden]`` (the residual stream); ``x`` the
    attention's input (default ``rms_norm(h)``; the EAGLE-3 head's layer attends over
    [normed token embedding, normed feature] ``[batch, q, 2 hidden]``,
    engine/drafters/eagle/head.py); kc/vc this layer's cache ``[slots, kv_heads, max_len+1,
    head_dim]`` (paged: ``[pool positions, kv_heads, head_dim]``, ``at.read_idx`` set), written
    in place at ``at.write_pos``. Returns h ``[batch, q, hidden]``."""
    cos, sin, mask, slot_t, write_pos, first_slot, shape, read_idx = at
    B, q, _ = h.shape
    nh, kvh, hd = shape.num_heads, shape.kv_heads, shape.head_dim
    kv_len = mask.shape[-1]
    if x is None:
        x = rms_norm(h, w.input_norm, shape.eps)
    qk, vs = _qk_v(x, w, shape)
    vs = vs.reshape(B, q, kvh, hd)  # [batch, q, kv_heads, head_dim]
    # RoPE on queries and keys as one tensor (the same elementwise arithmetic, half the calls)
    qk = qk.view(B, q, nh + kvh, hd).transpose(1, 2)
    qk = qk * cos + rotate_half(qk) * sin  # [batch, heads + kv_heads, q, head_dim]
    qs, ks = qk[:, :nh], qk[:, nh:]  # [batch, heads | kv_heads, q, head_dim]
    if read_idx is not None:  # paged: kc/vc [pool positions, kv_heads, head_dim]
        kc[write_pos] = ks.transpose(1, 2)  # [batch, q, kv_heads, head_dim]
        vc[write_pos] = vs
    else:
        kc[slot_t[:, None], :, write_pos] = ks.transpose(1, 2)  # [batch, q, kv_heads, head_dim]
        vc[slot_t[:, None], :, write_pos] = vs
    if attention.uses_kernel(qs, hd) and mask.dtype == torch.bool and mask.shape[-2] == q:
        # specd's CPU kernel, reading the cache where it lies (a boolean mask a query: an
        # additive or grouped one, which callers build for SDPA, runs there)
        o = attention.attend(qs, kc, vc, mask, slot_t, read_idx)  # [batch, q, heads * head_dim]
    else:
        if read_idx is not None:  # [batch, kv_heads, kv_len, head_dim]: gathered, transposed
            keys, vals = kc[read_idx].transpose(1, 2), vc[read_idx].transpose(1, 2)
        elif first_slot is not None:  # views: [batch, kv_heads, kv_len, head_dim]
            keys = kc[first_slot : first_slot + B, :, :kv_len]
            vals = vc[first_slot : first_slot + B, :, :kv_len]
        else:
            keys, vals = kc[slot_t, :, :kv_len], vc[slot_t, :, :kv_len]
        if groups_queries(shape, qs):
            o = grouped_sdpa(qs, keys, vals, mask, hd**-0.5)
        else:
            o = F.scaled_dot_product_attention(
                qs, keys, vals, attn_mask=mask, scale=hd**-0.5, enable_gqa=kvh != nh
            )  # [batch, heads, q, head_dim]
        o = o.transpose(1, 2).reshape(B, q, nh * hd)
    h = h + linear(o, w.o)
    x = rms_norm(h, w.post_norm, shape.eps)
    g, u = project_gate_up(x, w)
    g = F.silu(g) if shape.act == "silu" else ACT2FN[shape.act](g)
    return h + linear(g * u, w.down)
