"""The EAGLE-3 head as a decoder stack (engine/model/stack.py's ``StackSpec``), so the runner that
serves the target serves it too: its one layer over a KV cache of its own, the fast path
(compiled on CPU, captured on CUDA) chosen for it when that runner is built.

The head's math is head.py's; as a stack:

* **input adapter** (:class:`HeadInput`): a call's other input ``x`` is either the target's
  features ``[rows, q, taps * target_hidden]`` (an *ingest*: ``g = fc(x)``) or the head's own
  earlier outputs ``[rows, q, hidden]`` (a chained step: ``g = x``), told apart by their width
  (the two differ: :class:`HeadInput` refuses a head where they would not). The residual
  stream is g and the layer's attention input ``[input_layernorm(embed(ids)), hidden_norm(g)]``
  ``[rows, q, 2 hidden]``;
* **output**: the layer's output before the final norm (``Forward.output``: a chained step's
  next x) and the logits ``lm_head(norm(.))`` over the draft vocabulary.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.drafters.eagle.head import Eagle3Head
from engine.model.layer import LayerShape, linear, rms_norm
from engine.model.stack import StackSpec
from engine.model.weights import from_layer

if TYPE_CHECKING:
    from engine.model.weights import Weight

log = logging.getLogger("specd.eagle")


class HeadInput:
    """The EAGLE-3 head's input adapter (module docstring)."""

    def __init__(
        self,
        embed: torch.Tensor,
        fc: Weight,
        hidden_norm: torch.Tensor,
        input_norm: torch.Tensor,
        eps: float,
    ):
        """``embed`` ``[vocab, hidden]`` the token embedding (the target's, unless the head has
        its own); ``fc`` ``[hidden, taps * target_hidden]``; the two norms' weights ``[hidden]``."""
        self.embed, self.fc, self.eps = embed, fc, eps
        self.hidden_norm, self.input_norm = hidden_norm, input_norm
        self.features, self.hidden = int(fc.shape[1]), int(embed.shape[1])
        if self.features == self.hidden:
            raise ValueError("an EAGLE-3 head whose fc keeps the width: ingest and chain alike")

    def __call__(
        self, ids: torch.Tensor, x: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids ``[rows, q]``, x ``[rows, q, features or hidden]`` -> g ``[rows, q, hidden]`` and
        the attention input ``[rows, q, 2 hidden]``."""
        assert x is not None, "the EAGLE-3 head reads features or its own outputs"
        g = linear(x, self.fc) if x.shape[-1] == self.features else x
        e = F.embedding(ids, self.embed)  # [rows, q, hidden]
        eps = self.eps
        a = torch.cat([rms_norm(e, self.input_norm, eps), rms_norm(g, self.hidden_norm, eps)], -1)
        return g, a

    def widths(self, q: int) -> tuple[int, ...]:
        """An ingest takes any number of positions; a chained step one."""
        return (self.features, self.hidden) if q == 1 else (self.features,)


def head_stack(head: Eagle3Head, embed: torch.nn.Module, q4: bool = False) -> StackSpec:
    """The stack of ``head`` (``embed``: the target's embedding, used unless the head has its
    own). ``q4``: its matrices 4-bit (q4.py) where the int4 kernel applies, else kept dense
    (with a warning)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from engine.drafters.eagle.q4 import quantized, supported

    c = head.eval().config
    p = next(head.parameters())
    own = head.embed_tokens if head.embed_tokens is not None else embed
    embed_w = own.weight
    assert isinstance(embed_w, torch.Tensor)
    fc: Weight = head.fc.weight
    lm_head: Weight = head.lm_head.weight
    layer = from_layer(head.midlayer)
    if q4:
        if supported((fc, layer, lm_head), p.device, p.dtype):
            fc, layer, lm_head = quantized((fc, layer, lm_head), p.dtype)
        else:
            log.warning("drafter.head_q4: needs a CPU head below float32; kept dense")
    eps = c.rms_norm_eps
    norm_w = head.norm.weight

    def norm(h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, norm_w, eps)

    def logits(h: torch.Tensor) -> torch.Tensor:
        return linear(h, lm_head).float()  # [..., draft_vocab]

    shape = LayerShape(
        c.num_attention_heads, c.num_key_value_heads, c.dim, c.rms_norm_eps, c.hidden_act
    )
    return StackSpec(
        name="eagle3",
        shape=shape,
        weights=[layer],
        inputs=HeadInput(embed_w, fc, head.midlayer.hidden_norm.weight, layer.input_norm, eps),
        norm=norm,
        logits=logits,
        rotary=LlamaRotaryEmbedding(config=c.llama_config()).to(p.device),
        vocab_size=c.draft_vocab_size,
        device=p.device,
        dtype=p.dtype,
        feeds_back=True,
    )
