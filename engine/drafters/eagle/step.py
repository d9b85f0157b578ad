"""The EAGLE-3 head's forward as one pure function, and its compiled graphs without guards.

:func:`head_forward` is the whole head over a batch of rows (engine/drafters/eagle/head.py has the
math): optionally ``fc`` (the ingest of target features), the decoder layer over the head's slot
cache, then the final norm and LM head at one position per row. The drafter
(engine/drafters/eagle/drafter.py) calls it eagerly or through :class:`HeadGraphs`, the same
function compiled, so both paths run the same code.

:class:`HeadGraphs` follows :class:`engine.model.group_graphs.GroupGraphs`: Dynamo's guards are
dropped (they would check every weight and cache on every call, a large part of a short step)
and the graph is picked by a key the caller's shapes decide: whether rows and q are 1 (torch
specializes sizes 1; every other size is marked dynamic, as is the key length) and whether the
call ingests target features (``fc`` runs) and whether it brings its own attention mask (a
draft tree's step). Weights, caches, dtypes and the device are the
drafter's, fixed for its life. Invariant: two calls with one key differ only in the dimensions
marked dynamic and in tensor values.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from engine.model.group_graphs import compile_guardless
from engine.model.layer import (
    LayerInputs,
    LayerShape,
    decoder_layer,
    linear,
    rms_norm,
    varying_shape_attention,
)
from engine.model.weights import LayerWeights

if TYPE_CHECKING:
    from engine.model.weights import Weight

log = logging.getLogger("specd.eagle")


class HeadWeights(NamedTuple):
    """The head's tensors as :func:`head_forward` reads them (a NamedTuple: compile flattens it)."""

    embed: torch.Tensor  # [vocab, hidden] the token embedding (the target's, unless the head's)
    fc: Weight  # [hidden, taps * target_hidden]
    hidden_norm: torch.Tensor  # [hidden]
    layer: LayerWeights
    norm: torch.Tensor  # [hidden] the final norm
    lm_head: Weight  # [draft_vocab, hidden]
    cos: torch.Tensor  # [max_len + 1, head_dim] rotary table by position, in the head's dtype
    sin: torch.Tensor  # [max_len + 1, head_dim]


class HeadStep(NamedTuple):
    """One call's inputs to :func:`head_forward`: its rows, where they are and what they read."""

    ids: torch.Tensor  # [rows, q] the tokens
    # [rows, q, taps * target_hidden] target features when ``ingest`` (``fc`` fuses them), else
    # [rows, q, hidden] fused features or the head's own outputs
    x: torch.Tensor
    last: torch.Tensor  # [rows] the query whose output and logits are returned
    pos: torch.Tensor  # [rows, q] positions
    write_pos: torch.Tensor  # [rows, q] the cache column each token's K/V is written to
    kv_idx: torch.Tensor  # [kv_len] arange: the keys read
    slot_t: torch.Tensor  # [rows] each row's slot in the head's cache
    ingest: bool  # x holds target features
    # [rows, 1, q, kv_len] bool: the keys each query sees (a draft tree's nodes see their own
    # ancestors: engine/drafters/eagle/expand.py); None: causal, the keys at positions <= pos
    mask: torch.Tensor | None = None


def head_forward(
    step: HeadStep, w: HeadWeights, kc: torch.Tensor, vc: torch.Tensor, shape: LayerShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over ``step``'s rows, its layer's cache ``kc`` / ``vc`` ``[slots, kv_heads,
    max_len + 1, head_dim]`` written in place.

    Returns the layer's output (before the final norm) at query ``last[b]`` of each row
    ``[rows, hidden]`` and the float32 logits there over the draft vocabulary
    ``[rows, draft_vocab]``."""
    ids, x, last, pos, write_pos, kv_idx, slot_t, ingest, mask = step
    eps = shape.eps
    g = linear(x, w.fc) if ingest else x  # [rows, q, hidden]
    e = F.embedding(ids, w.embed)  # [rows, q, hidden]
    a = torch.cat([rms_norm(e, w.layer.input_norm, eps), rms_norm(g, w.hidden_norm, eps)], dim=-1)
    # a: the attention's input [rows, q, 2 hidden]
    cos, sin = w.cos[pos].unsqueeze(1), w.sin[pos].unsqueeze(1)  # [rows, 1, q, head_dim]
    if mask is None:
        mask = (kv_idx[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [rows, 1, q, kv_len]
    with varying_shape_attention(g.device):  # on CUDA, eager or captured (layer.py)
        at = LayerInputs(cos, sin, mask, slot_t, write_pos, None, shape)
        out = decoder_layer(g, w.layer, kc, vc, at, a)
    o = out[torch.arange(out.shape[0], device=out.device), last]  # [rows, hidden]
    logits = linear(rms_norm(o, w.norm, eps), w.lm_head).float()  # [rows, draft_vocab]
    return o, logits


class HeadGraphs:
    """Callable as :func:`head_forward`; compiles a key's graph on its first call."""

    def __init__(self, backend: str = "inductor"):
        self.backend = backend
        # (rows == 1, q == 1, ingest, masked) -> its graph
        self.graphs: dict[tuple, Callable] = {}

    def __call__(
        self, step: HeadStep, w: HeadWeights, kc: torch.Tensor, vc: torch.Tensor, shape: LayerShape
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Arguments as :func:`head_forward`'s."""
        key = (step.ids.shape[0] == 1, step.ids.shape[1] == 1, step.ingest, step.mask is not None)
        fn = self.graphs.get(key)
        if fn is None:
            fn = self.graphs[key] = compile_guardless(head_forward, self.backend)
            self._mark(step)
        return fn(step, w, kc, vc, shape)

    def warm_up(
        self,
        run: Callable,
        width: tuple[int, int],
        dtype,
        device,
        scratch_pos: int,
        masked: bool = False,
    ):
        """Compile every key through the drafter's ``run`` (EagleDrafter._run) on the scratch
        column: rows and q each 1 or more, ingest or chain (``width``: ingest's, chain's x), and
        with ``masked`` a tree's masked steps."""
        t0 = time.perf_counter()
        shapes = [(1, True, False), (3, True, False), (1, False, False)]
        shapes += [(1, False, True)] if masked else []
        with torch.inference_mode():
            for rows in (1, 2):
                for q, ingest, tree in shapes:
                    x = torch.zeros(rows, q, width[not ingest], dtype=dtype, device=device)
                    ids = torch.zeros(rows, q, dtype=torch.long, device=device)
                    scratch = torch.full((rows, q), scratch_pos, device=device)
                    run(
                        ids,
                        x,
                        [q - 1] * rows,
                        list(range(rows)),
                        torch.zeros_like(ids),
                        scratch,
                        1,
                        ingest=ingest,
                        visible=(ids[:, 0], torch.ones(rows, 1, dtype=torch.bool, device=device))
                        if tree
                        else None,
                    )
        log.info("compiled the EAGLE-3 head in %.1f s", time.perf_counter() - t0)

    @staticmethod
    def _mark(step: HeadStep) -> None:
        """Mark rows, q (sizes above 1: the key holds whether they are 1) and the key length
        dynamic on the call that compiles a key."""
        import torch._dynamo as dynamo

        ids, x, last, pos, write_pos, kv_idx, slot_t, _, mask = step
        marks = [(ids, 0), (ids, 1), (x, 0), (x, 1), (last, 0), (pos, 0), (pos, 1)]
        marks += [(write_pos, 0), (write_pos, 1), (kv_idx, 0), (slot_t, 0)]
        if mask is not None:
            marks += [(mask, 0), (mask, 2), (mask, 3)]
        for t, d in marks:
            if t.shape[d] > 1:
                dynamo.mark_dynamic(t, d)
