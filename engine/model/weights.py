"""The weights of one decoder layer, as :func:`engine.model.layer.decoder_layer` reads them.

:class:`LayerWeights` is the declared seam between the model runner (which builds it from a
transformers layer and computes with it) and :mod:`engine.model.quant` (which swaps projections for
4-bit :class:`~engine.model.quant.Q4Weight` matrices by field name). A ``typing.NamedTuple``:
torch.compile flattens it like a tuple, so one compiled graph serves every layer.

Invariants:

- Attention projections are either separate (``q``, ``k``, ``v`` set, ``qkv`` None) or one fused
  matrix (``qkv`` set; ``q``, ``k``, ``v`` and their biases None): 4-bit, its ``split`` the
  output sizes of Q, K and V, or dense (:func:`fuse_dense`), its rows Q's, K's, V's, sized by
  the layer's heads. The same holds for ``gate`` / ``up`` and ``gate_up`` (dense: gate's rows,
  then up's, the same number).
- A linear weight is a dense ``[out, in]`` tensor or a ``Q4Weight`` of that shape.
- ``q_norm`` / ``k_norm`` (per-head RMSNorm weights ``[head_dim]``, qwen3) are both set or both
  None.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import torch

if TYPE_CHECKING:
    from engine.model.q4_matmul import Q4Weight

    Weight: TypeAlias = torch.Tensor | Q4Weight  # a linear weight [out, in]


class LayerWeights(NamedTuple):
    input_norm: torch.Tensor  # [hidden]
    qkv: Weight | None  # fused [q_out + 2 kv_out, hidden]
    q: Weight | None  # [heads * head_dim, hidden]
    q_bias: torch.Tensor | None
    k: Weight | None  # [kv_heads * head_dim, hidden]
    k_bias: torch.Tensor | None
    v: Weight | None  # [kv_heads * head_dim, hidden]
    v_bias: torch.Tensor | None
    o: Weight  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Weight | None  # fused [2 intermediate, hidden]
    gate: Weight | None  # [intermediate, hidden]
    up: Weight | None  # [intermediate, hidden]
    down: Weight  # [hidden, intermediate]
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]


class ModelWeights(NamedTuple):
    """What a :class:`~engine.model.runner.ModelRunner` computes with: every decoder layer's
    weights and the LM head when it is not the model's dense one."""

    layers: list[LayerWeights]
    head: Q4Weight | None  # the LM head as a 4-bit Q4Weight over [h, h]; None: the dense head


# fused field -> the separate fields it replaces, in the order of its output columns
FUSED: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
# projection field -> its bias field (projections absent here have no bias)
BIAS: dict[str, str] = {"q": "q_bias", "k": "k_bias", "v": "v_bias"}


def check_fields(names: Iterable[str]) -> None:
    """Raise ``TypeError`` unless every name in ``names`` is a field of :class:`LayerWeights`:
    modules that address fields by name check their tables with it at import."""
    unknown = sorted(set(names) - set(LayerWeights._fields))
    if unknown:
        raise TypeError(f"not fields of LayerWeights: {', '.join(unknown)}")


check_fields([*FUSED, *(f for group in FUSED.values() for f in group), *BIAS, *BIAS.values()])


def from_layer(layer) -> LayerWeights:
    """The dense weights of a transformers Llama-family decoder layer (shared, not copied)."""
    a, m = layer.self_attn, layer.mlp
    qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)  # qwen3 only
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv=None,
        q=a.q_proj.weight,
        q_bias=a.q_proj.bias,
        k=a.k_proj.weight,
        k_bias=a.k_proj.bias,
        v=a.v_proj.weight,
        v_bias=a.v_proj.bias,
        o=a.o_proj.weight,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=None,
        gate=m.gate_proj.weight,
        up=m.up_proj.weight,
        down=m.down_proj.weight,
        q_norm=qn.weight if qn is not None else None,
        k_norm=kn.weight if kn is not None else None,
    )


def dense_weights(model) -> ModelWeights:
    """The dense weights of every decoder layer of a transformers model. On CUDA, Q/K/V and
    gate/up as one matrix each (:func:`fuse_dense`): fewer, larger matmuls a layer."""
    fuse = next(model.parameters()).device.type == "cuda"
    layers = [fuse_dense(layer) if fuse else from_layer(layer) for layer in model.model.layers]
    return ModelWeights(layers, None)


def fuse_dense(layer) -> LayerWeights:
    """:func:`from_layer` with gate and up as one dense matrix, and Q, K and V as another where
    they have no biases (qwen2's stay separate): one matmul each instead of two and three. The
    module's own weights become views of the fused matrices (no second copy; the transformers
    module computes as before), and a layer fused once is not fused again (an early-layers
    draft over the target's own layers shares them)."""
    w = from_layer(layer)
    a, m = layer.self_attn, layer.mlp
    w = w._replace(gate_up=_fuse([m.gate_proj, m.up_proj]), gate=None, up=None)
    if any(b is not None for b in (w.q_bias, w.k_bias, w.v_bias)):
        return w
    return w._replace(qkv=_fuse([a.q_proj, a.k_proj, a.v_proj]), q=None, k=None, v=None)


def _fuse(linears: list) -> torch.Tensor:
    """The weights of ``linears`` (``nn.Linear``) stacked by rows ``[sum out, in]``, each module's
    weight made a view of its rows; the stacked matrix kept on the first module."""
    held = getattr(linears[0], "_specd_fused", None)
    if held is not None and all(
        lin.weight.data_ptr() == held[i].data_ptr() for i, lin in enumerate(linears)
    ):
        return held[-1]
    with torch.no_grad():
        fused = torch.cat([lin.weight for lin in linears])
        views, r = [], 0
        for lin in linears:
            n = lin.weight.shape[0]
            lin.weight = torch.nn.Parameter(fused[r : r + n], requires_grad=False)
            views.append(lin.weight)
            r += n
    linears[0]._specd_fused = (*views, fused)
    return fused
