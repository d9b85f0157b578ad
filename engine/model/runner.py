"""Runs a Llama-family causal LM over the slot KV cache.

We keep transformers for loading (GGUF conversion, safetensors, dtypes, Hub ids) and reuse its
embedding, rotary embedding, final norm and lm_head, but run our own decoder layer (a function of
the layer's weights, :func:`engine.model.layer.decoder_layer`, run in groups of layers so that one
compiled graph serves every group) so that one forward can serve ragged rows: row b feeds
``n_b`` new tokens starting at position ``start_b`` (its committed cache length), writes their
K/V into its slot in place, and attends by position, ``kv_pos <= query_pos``. The same loop
with only the first N layers is the "early-layers self-draft". Supported: llama, mistral, qwen2,
qwen3 (the SmolLM2 default is llama).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model import invariant
from engine.model.compiled import FastForward
from engine.model.fast_path import disable
from engine.model.kv_cache import SlotKVCache
from engine.model.layer import (
    additive_mask,
    config_shape,
    grouped_mask,
    groups_queries,
    layer_group,
    varying_shape_attention,
)
from engine.model.q4_matmul import Q4Weight, q4_linear
from engine.model.weights import LayerWeights, from_layer, fuse_dense
from engine.transfer import to_device

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    pass


class ModelRunner:
    """Our decoder loop over a transformers model's weights and a :class:`SlotKVCache` of
    ``num_slots`` rows of up to ``max_len`` tokens (capped by the model's maximum positions).
    ``num_layers``: run only the first N layers (the early-layers self-draft)."""

    fast: FastForward | None  # the compiled path (engine/model/compiled.py), once attached
    head: Q4Weight | None  # the LM head as a 4-bit Q4Weight over [h, h] (quant.convert_q8_0_head)
    # layers whose *inputs* every forward records (an EAGLE-3 drafter reads them), and what the
    # last forward recorded: [batch, q, len(taps) * hidden], the taps concatenated in order
    taps: tuple[int, ...]
    tapped: torch.Tensor | None

    def __init__(
        self,
        model,
        num_slots: int,
        max_len: int,
        num_layers: int | None = None,
        name: str = "target",
    ):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {cfg.model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        self.model, self.name = model, name
        base = model.model
        self.embed, self.norm, self.rotary = base.embed_tokens, base.norm, base.rotary_emb
        layers = list(base.layers)
        if num_layers is not None:
            if not 1 <= num_layers <= len(layers):
                raise ValueError(f"num_layers must be in 1..{len(layers)}, got {num_layers}")
            layers = layers[:num_layers]
        self.lm_head = model.lm_head
        self.vocab_size = self.lm_head.out_features
        self.shape, max_positions = config_shape(cfg, layers[0].input_layernorm)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # on CUDA, Q/K/V and gate/up as one matrix each: fewer, larger matmuls a layer
        fuse = self.device.type == "cuda"
        self.weights: list[LayerWeights] = [
            fuse_dense(layer) if fuse else from_layer(layer) for layer in layers
        ]
        self.max_len = max_len if max_positions is None else min(max_len, max_positions)
        self.cache = SlotKVCache(
            len(layers),
            num_slots,
            self.shape.kv_heads,
            self.shape.head_dim,
            self.max_len,
            self.dtype,
            self.device,
        )
        self.fast = None
        self.head = None
        self.taps, self.tapped = (), None
        # deterministic mode (engine/model/invariant.py): forwards computed batch-invariantly
        self.invariant = False

    # -- one ragged forward -------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        tokens: list[list[int]] | torch.Tensor,
        slots: list[int],
        counts: list[int] | None = None,
        logits: str = "last",
    ) -> torch.Tensor:
        """Feed each row's new tokens to slot ``slots[b]`` at its committed length.

        ``tokens`` is a host list of lists, or a device tensor ``[batch, q]`` with ``counts`` (host
        ints) giving the valid prefix of each row (so drafted tokens never leave the device).
        Returns ``logits="last"`` -> ``[batch, vocab]`` at each row's last valid token, or
        ``logits="all"`` -> ``[batch, q, vocab]`` (positions past a row's count are garbage), or
        ``logits="hidden"`` -> the final-normed hidden states ``[batch, q, hidden]``.
        Committed lengths are *not* changed: the caller commits what it keeps.

        Small forwards (decode steps, verifies, draft steps) go through the compiled fixed-shape
        path when one is attached (:mod:`engine.model.compiled`); prefill chunks run eagerly. With
        ``invariant`` set every forward is the batch-invariant one
        (:mod:`engine.model.invariant`)."""
        cache, dev = self.cache, self.device
        if isinstance(tokens, torch.Tensor):
            assert counts is not None
            ids, q = tokens, tokens.shape[1]
        else:
            counts = [len(t) for t in tokens]
            q = max(counts)
            ids = to_device([t + [0] * (q - len(t)) for t in tokens], torch.long, dev)  # [batch, q]
        B = len(slots)
        starts = [cache.lengths[s] for s in slots]
        kv_len = max(s + n for s, n in zip(starts, counts))
        if kv_len > cache.max_len:
            raise ValueError("forward past the cache's max_len")
        if self.invariant:  # deterministic mode: the batch-invariant forward
            return invariant.forward(self, ids, slots, starts, counts, logits)
        h = None
        if self.fast is not None:
            try:  # None when the shape is outside the buckets
                h = self.fast.run(ids, slots, starts, counts)  # [batch, q, hidden], normed
            except Exception as e:  # noqa: BLE001 -- a compile failure falls back to eager
                disable(self, e)  # the eager forward below rewrites every position it wrote
        if h is None:
            h = self._eager(ids, slots, starts, counts, kv_len)
        if logits == "hidden":  # the final-normed hidden states (drafter training)
            return h  # [batch, q, hidden]
        if logits == "last":
            last = to_device([n - 1 for n in counts], torch.long, dev)
            h = h[torch.arange(B, device=dev), last]  # [batch, hidden]
        return self.logits(h)  # [batch, vocab] or [batch, q, vocab]

    def _eager(
        self, ids: torch.Tensor, slots: list[int], starts: list[int], counts: list[int], kv_len: int
    ) -> torch.Tensor:
        with varying_shape_attention(self.device):  # shapes vary: no per-shape cuDNN plans
            return self._eager_rows(ids, slots, starts, counts, kv_len)

    def _eager_rows(
        self, ids: torch.Tensor, slots: list[int], starts: list[int], counts: list[int], kv_len: int
    ) -> torch.Tensor:
        """The eager stack over rows in ``slots``. Keys are read as a view of consecutive slots:
        rows that are not consecutive run inside the span of slots they cover, each slot of the
        span a row, the slots outside the batch as idle rows (one token at position 0, K/V
        written to the scratch column, their output dropped), as the fast path runs slots
        ``[0, bucket)``. Gathering the rows' keys instead copies every row's cache in every layer,
        a large share of a decode step at large batches (docs/measurements.md). Spans over twice
        the batch gather."""
        cache, dev, B = self.cache, self.device, len(slots)
        first, span = min(slots), max(slots) - min(slots) + 1
        consecutive = slots == list(range(first, first + B))
        if consecutive or span > 2 * B:
            pos, write_pos = cache.positions(starts, counts, ids.shape[1])
            return self.layers_forward(
                ids,
                to_device(pos, None, dev),
                to_device(write_pos, None, dev),
                to_device(slots, torch.long, dev),
                torch.arange(kv_len, device=dev),
                first if consecutive else None,
            )
        rows = [s - first for s in slots]  # each row's index in the span
        span_ids = ids.new_zeros(span, ids.shape[1])  # [span, q]
        span_ids[to_device(rows, torch.long, dev)] = ids
        span_starts, span_counts = [0] * span, [0] * span  # idle: scratch writes only
        for r, st, n in zip(rows, starts, counts):
            span_starts[r], span_counts[r] = st, n
        pos, write_pos = cache.positions(span_starts, span_counts, ids.shape[1])
        h = self.layers_forward(
            span_ids,
            to_device(pos, None, dev),
            to_device(write_pos, None, dev),
            torch.arange(first, first + span, device=dev),
            torch.arange(kv_len, device=dev),
            first,
        )  # [span, q, hidden]
        pick = to_device(rows, torch.long, dev)
        if self.tapped is not None:
            self.tapped = self.tapped[pick]
        return h[pick]  # [batch, q, hidden]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[..., vocab]`` of final-normed hidden states ``[..., hidden]``."""
        # the file's Q8_0 head as two 4-bit halves (engine/model/quant.py), at every batch size: one
        # model whatever the batch (a dense bf16 head can be faster on many positions, but it is
        # the head's weights rounded to bf16, a slightly different model)
        if self.head is not None:
            return q4_linear(torch.cat([h, h], dim=-1), self.head).float()
        return self.lm_head(h).float()

    def padded_shape(self, batch: int, q: int) -> tuple[int, int]:
        """The (rows, query tokens) that a forward of ``batch`` rows of ``q`` tokens really runs:
        the fast path's buckets when it handles the shape (rows counted as if the batch held the
        lowest slots), else the shape as given. The round cost model (k_control.py) prices
        rounds by it: a verify costs what its padded shape costs."""
        padded = self.fast.bucket_shape(batch, q) if self.fast is not None else None
        return padded or (batch, q)

    def layers_forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        write_pos: torch.Tensor,
        slot_t: torch.Tensor,
        kv_idx: torch.Tensor,
        first_slot: int | None,
        group_fn: Callable[..., tuple[torch.Tensor, list[torch.Tensor]]] | None = None,
        group_size: int | None = None,
    ) -> torch.Tensor:
        """The decoder stack over the slot cache.

        ids, pos, write_pos ``[batch, q]``; slot_t ``[batch]``; kv_idx ``arange(kv_len)``: keys
        are read up to kv_len. ``first_slot``: rows are the consecutive slots from there (keys
        are read as a view), or None (keys gathered by slot_t). ``group_fn``: the compiled
        :func:`~engine.model.layer.layer_group` over groups of ``group_size`` layers
        (engine/model/compiled.py); default: the whole stack as one eager group. Returns the
        final-normed hidden states ``[batch, q, hidden]``; K/V of every query token written in
        place; the inputs of the layers in ``taps`` kept in ``tapped``."""
        cache, tapped = self.cache, []
        h = self.embed(ids)  # [batch, q, hidden]
        cos, sin = self.rotary(h, pos)  # [batch, q, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [batch, 1, q, head_dim]
        mask = (kv_idx[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [batch, 1, q, kv_len]
        # the grouped attention's mask, eager: built once, not once a layer (a compiled graph
        # groups it inside, where it is fused)
        if group_fn is None and groups_queries(self.shape, h):
            mask = grouped_mask(mask, self.shape.num_heads // self.shape.kv_heads)
        if h.device.type == "cuda":  # [batch, 1, q or group * q, kv_len], 0 or -inf
            mask = additive_mask(mask, h.dtype)
        n = len(self.weights)
        size = group_size or n
        run = layer_group if group_fn is None else group_fn
        for g0 in range(0, n, size):
            g = slice(g0, g0 + size)
            h, inputs = run(
                h,
                tuple(self.weights[g]),
                cos,
                sin,
                mask,
                tuple(cache.k[g]),
                tuple(cache.v[g]),
                slot_t,
                write_pos,
                first_slot,
                self.shape,
            )
            tapped += [inputs[i - g0] for i in self.taps if g0 <= i < g0 + size]
        self.tapped = torch.cat(tapped, dim=-1) if tapped else None  # [batch, q, taps * hidden]
        return self.norm(h)
