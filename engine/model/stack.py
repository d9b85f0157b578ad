"""What a forward strategy reads of the model it runs: the fast paths (compiled.py, cuda_graphs.py,
fast_path.py) and the batch-invariant forward (invariant.py) are given the runner's stack of
weights, cache and input adapters through :class:`Stack`, never the runner's class, so imports
in this package point one way: the runner builds its strategies, they know only this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from engine.kv.paged_kv import KVCache
    from engine.model.layer import LayerShape
    from engine.model.tree_attention import Tree
    from engine.model.weights import LayerWeights


class Forward(NamedTuple):
    """What one forward returns."""

    logits: torch.Tensor  # float32 [batch, vocab] ("last") or [batch, q, vocab] ("all")
    # the inputs of the layers in ``taps``, concatenated in order: [batch, q, len(taps) * hidden]
    # (positions past a row's count are garbage); None when the runner taps no layer
    tapped: torch.Tensor | None


class Stack(Protocol):
    """A decoder stack over a KV cache (engine/model/runner.py's ``ModelRunner`` is one)."""

    name: str
    device: torch.device
    vocab_size: int
    taps: tuple[int, ...]  # the layers whose inputs a forward returns
    cache: KVCache
    shape: LayerShape
    weights: list[LayerWeights]
    embed: Callable[..., torch.Tensor]  # token ids -> embeddings
    norm: Callable[..., torch.Tensor]  # the final norm
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, positions) -> (cos, sin)

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...
