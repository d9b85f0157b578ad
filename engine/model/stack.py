"""A decoder stack as the runner serves it, and what a forward strategy reads of it.

:class:`StackSpec` is a stack of weights with its input adapter and its output: the target's and
a draft model's (:func:`engine.model.runner.model_stack`: token embeddings in, final norm and LM
head out) and the EAGLE-3 head's (engine/drafters/eagle/head.py's ``head_stack``: the target's
features fused with the next token's embedding in, its layer's output fed back). One runner
(engine/model/runner.py) serves each of them over a KV cache of its own, with the fast path
(compiled, captured) chosen for it at construction.

The fast paths (compiled.py, cuda_graphs.py, fast_path.py) and the batch-invariant forward
(invariant.py) are given the runner's stack of weights, cache and input adapter through
:class:`Stack`, never the runner's class, so imports in this package point one way: the
runner builds its strategies, they know only this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from engine.model.layer import LayerShape

if TYPE_CHECKING:
    from engine.kv.paged_kv import KVCache
    from engine.model.tree_attention import Tree
    from engine.model.weights import LayerWeights


class Forward(NamedTuple):
    """What one forward returns."""

    logits: torch.Tensor  # float32 [batch, vocab] ("last") or [batch, q, vocab] ("all")
    # the inputs of the layers in ``taps``, concatenated in order: [batch, q, len(taps) * hidden]
    # (positions past a row's count are garbage); None when the runner taps no layer
    tapped: torch.Tensor | None
    # a stack that feeds its output back (``StackSpec.feeds_back``): the last layer's output
    # before the final norm where the logits are read ([batch, hidden] or [batch, q, hidden]);
    # else None
    output: torch.Tensor | None = None


class InputAdapter(Protocol):
    """What a stack's first layer reads: ``(ids [batch, q], x)`` -> the residual stream
    ``[batch, q, hidden]`` and the first layer's attention input (None: the layer norms the
    residual stream itself, as a language model's does). ``x`` ``[batch, q, width]``: the rows'
    other inputs, of one of the widths :meth:`widths` names for q tokens a row (None: the stack
    reads tokens only)."""

    def __call__(
        self, ids: torch.Tensor, x: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def widths(self, q: int) -> tuple[int | None, ...]: ...


class TokenInput:
    """A language model's input adapter: the tokens' embeddings."""

    def __init__(self, embed: Callable[..., torch.Tensor]):
        self.embed = embed

    def __call__(
        self, ids: torch.Tensor, x: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        if x is not None:
            raise ValueError("a language model's stack reads tokens only")
        return self.embed(ids), None

    def widths(self, q: int) -> tuple[None]:
        return (None,)


@dataclass(kw_only=True)
class StackSpec:
    """A decoder stack's parts (weights, input adapter, output), for a runner to serve."""

    name: str  # in logs and paths: "target", "draft", "eagle3"
    shape: LayerShape
    weights: list[LayerWeights]
    inputs: InputAdapter
    norm: Callable[..., torch.Tensor]  # the final norm
    # final-normed hidden states [..., hidden] -> float32 logits [..., vocab]
    logits: Callable[[torch.Tensor], torch.Tensor]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, positions) -> (cos, sin)
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    max_positions: int | None = None  # the model's limit on positions; None: none
    # forwards return the last layer's output before the final norm (``Forward.output``): the
    # EAGLE-3 head drafts its next token from its own output
    feeds_back: bool = False


class Stack(Protocol):
    """A decoder stack over a KV cache, as a runner serves it (engine/model/runner.py's
    ``ModelRunner``)."""

    name: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    taps: tuple[int, ...]  # the layers whose inputs a forward returns
    cache: KVCache
    shape: LayerShape
    weights: list[LayerWeights]
    inputs: InputAdapter
    feeds_back: bool  # StackSpec.feeds_back
    embed: Callable[..., torch.Tensor] | None  # token ids -> embeddings (a language model's)
    norm: Callable[..., torch.Tensor]  # the final norm
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, positions) -> (cos, sin)

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def output(self, h: torch.Tensor, tapped: torch.Tensor | None) -> Forward: ...

    def forward(
        self,
        tokens: list[list[int]] | torch.Tensor,
        slots: list[int],
        counts: list[int] | None = None,
        logits: str = "last",
        invariant: bool = False,
        tree: Tree | None = None,
    ) -> Forward: ...

    def layers_forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        write_pos: torch.Tensor,
        slot_t: torch.Tensor,
        kv_idx: torch.Tensor,
        first_slot: int | None,
        *,
        group_fn: Callable[..., tuple[torch.Tensor, list[torch.Tensor]]] | None = None,
        group_size: int | None = None,
        mask: torch.Tensor | None = None,
        x: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...
