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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, TypeVar

import torch

from engine.fallback import warn_fallback
from engine.kv.kv_cache import SlotKVCache
from engine.kv.paged_kv import KVCache, PagedKVCache, pool_blocks
from engine.model import attention
from engine.model import invariant as batch_invariant
from engine.model.compiled import CompileConfig, FastForward
from engine.model.fast_path import log as fast_log
from engine.model.fast_path import make_fast, path_of
from engine.model.layer import (
    LayerInputs,
    additive_mask,
    config_shape,
    grouped_mask,
    groups_queries,
    layer_group,
    varying_shape_attention,
)
from engine.model.q4_matmul import Q4Weight, q4_linear
from engine.model.stack import Forward, StackSpec, TokenInput
from engine.model.tree_attention import Tree, tree_inputs
from engine.model.weights import LayerWeights, ModelWeights, dense_weights
from engine.transfer import to_device

T = TypeVar("T")  # what a fast path call returns (ModelRunner._on_fast)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    pass


class Hidden(NamedTuple):
    """:meth:`ModelRunner.hidden`'s result (drafter training)."""

    states: torch.Tensor  # the final-normed hidden states [batch, q, hidden]
    tapped: torch.Tensor | None  # as Forward.tapped


def model_stack(
    model, num_layers: int | None = None, name: str = "target", weights: ModelWeights | None = None
) -> tuple[StackSpec, ModelWeights]:
    """The stack of a transformers causal LM (its first ``num_layers`` layers): its embedding in,
    its final norm and LM head out, over ``weights`` (default: the model's dense ones). Returns
    the stack and the weights it computes with (another runner of the same model shares them:
    the first-N-layers self-draft)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {cfg.model_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    base = model.model
    layers = list(base.layers)
    if num_layers is not None:
        if not 1 <= num_layers <= len(layers):
            raise ValueError(f"num_layers must be in 1..{len(layers)}, got {num_layers}")
        layers = layers[:num_layers]
    shape, max_positions = config_shape(cfg, layers[0].input_layernorm)
    p = next(model.parameters())
    if weights is None:
        weights = dense_weights(model)
    # the LM head as a 4-bit Q4Weight over [h, h] (quant.convert_q8_0_head), or None: dense
    head, lm_head = weights.head, model.lm_head

    def logits(h: torch.Tensor) -> torch.Tensor:
        # the file's Q8_0 head as two 4-bit halves (engine/model/quant.py), at every batch size:
        # one model whatever the batch (a dense bf16 head can be faster on many positions, but
        # it is the head's weights rounded to bf16, a slightly different model)
        if head is not None:
            return q4_linear(torch.cat([h, h], dim=-1), head).float()
        return lm_head(h).float()

    spec = StackSpec(
        name=name,
        shape=shape,
        weights=weights.layers[: len(layers)],
        inputs=TokenInput(base.embed_tokens),
        norm=base.norm,
        logits=logits,
        rotary=base.rotary_emb,
        vocab_size=lm_head.out_features,
        device=p.device,
        dtype=p.dtype,
        max_positions=max_positions,
    )
    return spec, ModelWeights(spec.weights, head)


class ModelRunner:
    """Our decoder loop over a stack (:class:`~engine.model.stack.StackSpec`: a transformers
    model's, or the EAGLE-3 head's) and a :class:`SlotKVCache` of ``num_slots`` rows of up to
    ``max_len`` tokens (capped by the model's maximum positions).

    Chosen once, here:

    - ``model``: a transformers causal LM (its stack, :func:`model_stack`), or a stack;
    - ``num_layers``: run only the first N layers (the early-layers self-draft);
    - ``taps``: the layers whose *inputs* every forward returns (an EAGLE-3 drafter reads them);
    - ``weights``: the layer weights and LM head (:func:`engine.model.quant.native_q4`'s 4-bit
      ones; default: the model's dense weights); a runner of the first N layers takes the
      first N of them, so a self-draft shares the target's;
    - ``compile``: the fast path of small forwards (compiled or graph-captured,
      engine/model/fast_path.py), built for drafts of up to ``k_max`` tokens; None: eager.
      A fast path that fails is dropped, with a warning, and the runner runs eagerly after;
    - ``pool_tokens``: the cache is paged (engine/kv/paged_kv.py), a pool of blocks for this
      many positions (the scheduler's budget and the prefix cache's) in blocks of
      ``block_size``; None: a slot of ``max_len`` positions per sequence
      (engine/kv/kv_cache.py).

    Per forward: ``invariant`` runs the batch-invariant forward of deterministic mode
    (engine/model/invariant.py)."""

    def __init__(
        self,
        model,
        num_slots: int,
        max_len: int,
        num_layers: int | None = None,
        name: str = "target",
        *,
        taps: tuple[int, ...] = (),
        weights: ModelWeights | None = None,
        compile: CompileConfig | None = None,
        k_max: int = 0,
        pool_tokens: int | None = None,
        block_size: int = 16,
    ):
        if isinstance(model, StackSpec):
            spec, self.model = model, None
            self.head: Q4Weight | None = None
        else:
            spec, weights = model_stack(model, num_layers, name, weights)
            self.model, self.head = model, weights.head
            self.lm_head = model.lm_head
        self.spec, self.name = spec, spec.name
        self.inputs, self.feeds_back = spec.inputs, spec.feeds_back
        # token ids -> embeddings (the batch-invariant forward embeds itself)
        self.embed = getattr(spec.inputs, "embed", None)
        self.norm, self.rotary, self.logits = spec.norm, spec.rotary, spec.logits
        self.vocab_size, self.shape = spec.vocab_size, spec.shape
        self.device, self.dtype = spec.device, spec.dtype
        self.weights: list[LayerWeights] = spec.weights
        if any(not 0 <= t < len(self.weights) for t in taps):
            raise ValueError(f"taps {taps}: the runner has {len(self.weights)} layers")
        self.taps = tuple(taps)
        max_positions = spec.max_positions
        self.max_len = max_len if max_positions is None else min(max_len, max_positions)
        geometry = (len(self.weights), num_slots, self.shape.kv_heads, self.shape.head_dim)
        self.cache: KVCache
        if pool_tokens is None:
            self.cache = SlotKVCache(*geometry, self.max_len, self.dtype, self.device)
        else:
            blocks = pool_blocks(pool_tokens, num_slots, block_size)
            self.cache = PagedKVCache(
                *geometry,
                self.max_len,
                self.dtype,
                self.device,
                num_blocks=blocks,
                block_size=block_size,
            )
        if self.device.type == "cpu":
            attention.kernel_available()  # probed (built) once, before any graph is compiled
        self._fast: FastForward | None = None
        if compile is not None and compile.enabled:
            self._fast = make_fast(self, compile, k_max)
        self._eager_only = False  # inside :meth:`eager`

    def model_weights(self) -> ModelWeights:
        """The weights this runner computes with (another runner of the same model shares
        them: the first-N-layers self-draft)."""
        return ModelWeights(self.weights, self.head)

    @property
    def fast(self) -> FastForward | None:
        """The fast path small forwards take (None: eager; dropped after a failure)."""
        return self._fast

    def path(self) -> str:
        """The path its small forwards take now (:func:`~engine.model.fast_path.path_of`)."""
        return path_of(self._fast, self.weights)

    def warm_up(self) -> None:
        """Compile (or capture) every bucket of the fast path, if any and ``warmup`` is set, so
        no request waits for a compile; on any failure warn and run eagerly from then on."""
        fast = self._fast
        if fast is None or not fast.cfg.warmup:
            return
        try:
            fast.warm_up()
        except Exception as e:  # noqa: BLE001 -- a compile failure must never kill the server
            self._drop_fast(e)

    def _drop_fast(self, err: Exception) -> None:
        warn_fallback(fast_log, f"compiled {self.name} forward", err, "running eagerly from now on")
        self._fast = None

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Forwards inside run the eager path (reference computations of tests and benchmarks
        against the fast path, over the same cache)."""
        was, self._eager_only = self._eager_only, True
        try:
            yield
        finally:
            self._eager_only = was

    # -- one ragged forward -------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        tokens: list[list[int]] | torch.Tensor,
        slots: list[int],
        counts: list[int] | None = None,
        logits: str = "last",
        invariant: bool = False,
        tree: Tree | None = None,
        *,
        x: torch.Tensor | None = None,
    ) -> Forward:
        """Feed each row's new tokens to slot ``slots[b]`` at its committed length.

        ``tokens`` is a host list of lists, or a device tensor ``[batch, q]`` with ``counts`` (host
        ints) giving the valid prefix of each row (so drafted tokens never leave the device).
        ``logits="last"``: logits ``[batch, vocab]`` at each row's last valid token;
        ``logits="all"``: ``[batch, q, vocab]`` (positions past a row's count are garbage).
        Committed lengths are *not* changed: the caller commits what it keeps.

        Small forwards (decode steps, verifies, draft steps) go through the fast path when the
        runner has one (:mod:`engine.model.compiled`); prefill chunks run eagerly.
        ``invariant``: the batch-invariant forward (:mod:`engine.model.invariant`); ``tree``:
        the rows' tokens are draft trees (:class:`Tree`; not with ``invariant``); ``x``
        ``[batch, q, width]``: the rows' other inputs, for a stack whose input adapter reads
        them (the EAGLE-3 head's features)."""
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {logits!r}")
        ids, counts = self._ids(tokens, counts)
        if invariant:
            if tree is not None or x is not None:
                raise ValueError("the batch-invariant forward verifies a model's chains")
            starts = self._starts(slots)
            self._reserve(slots, starts, counts)
            return Forward(*batch_invariant.forward(self, ids, slots, starts, counts, logits))
        starts = self._place(slots, counts)
        if logits == "last" and tree is None:  # the whole stack's graph, where there is one
            whole = self._on_fast(lambda f: f.run_last(ids, slots, starts, counts, x))
            if whole is not None:
                return whole
        h, tapped = self._stack(ids, slots, starts, counts, tree, x)  # [batch, q, hidden]
        if logits == "last":
            B, dev = len(slots), self.device
            last = to_device([n - 1 for n in counts], torch.long, dev)
            h = h[torch.arange(B, device=dev), last]  # [batch, hidden]
        return self.output(h, tapped)

    def output(self, h: torch.Tensor, tapped: torch.Tensor | None) -> Forward:
        """Logits ``[..., vocab]`` of the stack's hidden states ``h`` ``[..., hidden]`` (final-
        normed, or for a stack that feeds its output back the output itself, normed here)."""
        if self.feeds_back:
            return Forward(self.logits(self.norm(h)), tapped, h)
        return Forward(self.logits(h), tapped)

    @torch.inference_mode()
    def forward_at(
        self,
        ids: torch.Tensor,
        slots: list[int],
        pos: torch.Tensor,
        write_pos: torch.Tensor,
        mask: torch.Tensor,
        *,
        x: torch.Tensor | None = None,
    ) -> Forward:
        """Rows placed by the caller, eagerly: ids ``[rows, q]`` of slots ``slots`` (a slot may
        hold several rows) at positions ``pos`` ``[rows, q]``, their K/V written at cache columns
        ``write_pos`` ``[rows, q]``, each query seeing the keys ``mask`` ``[rows, 1, q, kv_len]``
        says (an EAGLE-3 head's draft tree step: engine/drafters/eagle/expand.py); ``x`` as
        :meth:`forward`'s. Committed lengths are not changed. Returns the logits at every
        query ``[rows, q, vocab]``."""
        dev = self.device
        slot_t = to_device(slots, torch.long, dev)
        kv_idx = torch.arange(mask.shape[-1], device=dev)
        with varying_shape_attention(dev):
            h, tapped = self.layers_forward(
                ids, pos, write_pos, slot_t, kv_idx, None, mask=mask, x=x
            )
        return self.output(h, tapped)

    @torch.inference_mode()
    def hidden(self, tokens: list[list[int]], slots: list[int], invariant: bool = False) -> Hidden:
        """:meth:`forward` of host token lists, returning the final-normed hidden states
        ``[batch, q, hidden]`` instead of logits (drafter training reads them)."""
        ids, counts = self._ids(tokens, None)
        if invariant:
            starts = self._starts(slots)
            self._reserve(slots, starts, counts)
            return Hidden(*batch_invariant.forward(self, ids, slots, starts, counts, "hidden"))
        return Hidden(*self._stack(ids, slots, self._place(slots, counts), counts))

    def _ids(
        self, tokens: list[list[int]] | torch.Tensor, counts: list[int] | None
    ) -> tuple[torch.Tensor, list[int]]:
        """Token ids ``[batch, q]`` on the device and each row's count; checks the rows fit."""
        if isinstance(tokens, torch.Tensor):
            assert counts is not None
            ids = tokens
        else:
            counts = [len(t) for t in tokens]
            q = max(counts)
            ids = to_device([t + [0] * (q - len(t)) for t in tokens], torch.long, self.device)
        return ids, counts

    def _starts(self, slots: list[int]) -> list[int]:
        return [self.cache.lengths[s] for s in slots]

    def _reserve(self, slots: list[int], starts: list[int], counts: list[int]) -> None:
        """Room in each row's slot for the positions this forward writes (a paged cache takes
        blocks as a sequence grows)."""
        for s, st, n in zip(slots, starts, counts):
            self.cache.reserve(s, st + n)

    def _place(self, slots: list[int], counts: list[int]) -> list[int]:
        """Each row's start (its committed length), with room reserved in its slot for the
        ``counts`` positions the forward writes; refuses a forward past the cache's max_len."""
        starts = self._starts(slots)
        if max(s + n for s, n in zip(starts, counts)) > self.cache.max_len:
            raise ValueError("forward past the cache's max_len")
        self._reserve(slots, starts, counts)
        return starts

    def _on_fast(self, call: Callable[[FastForward], T | None]) -> T | None:
        """``call`` on the fast path, or None where there is none (eager only, or dropped), the
        shape is outside its buckets, or it fails (then it is dropped, with a warning, and the
        eager forward the caller runs instead rewrites every position it wrote)."""
        if self._fast is None or self._eager_only:
            return None
        try:
            return call(self._fast)
        except Exception as e:  # noqa: BLE001 -- a compile failure falls back to eager
            self._drop_fast(e)
            return None

    def _stack(
        self,
        ids: torch.Tensor,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        tree: Tree | None = None,
        x: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack over rows placed at ``starts`` (:meth:`_place`), through the fast
        path when it takes the shape: final-normed hidden states ``[batch, q, hidden]`` (a stack
        that feeds its output back: the output) and the tapped inputs."""
        out = self._on_fast(lambda f: f.run(ids, slots, starts, counts, tree, x))
        if out is not None:
            return out
        kv_len = max(s + n for s, n in zip(starts, counts))
        with varying_shape_attention(self.device):  # shapes vary: no per-shape cuDNN plans
            return self._eager_rows(ids, slots, starts, counts, kv_len, tree, x)

    def _eager_rows(
        self,
        ids: torch.Tensor,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        kv_len: int,
        tree: Tree | None = None,
        x: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eager stack over rows in ``slots``. Keys are read as a view of consecutive slots:
        rows that are not consecutive run inside the span of slots they cover, each slot of the
        span a row, the slots outside the batch as idle rows (one token at position 0, K/V
        written to the scratch column, their output dropped), as the fast path runs slots
        ``[0, bucket)``. Gathering the rows' keys instead copies every row's cache in every layer,
        a large share of a decode step at large batches (docs/measurements.md). Spans over twice
        the batch gather, and so do trees and a paged cache (whose keys are always gathered)."""
        cache, dev, B = self.cache, self.device, len(slots)
        first, span = min(slots), max(slots) - min(slots) + 1
        consecutive = slots == list(range(first, first + B))
        if consecutive or span > 2 * B or tree is not None or cache.paged:
            pos, write_pos = cache.positions(starts, counts, ids.shape[1])
            pos_t, mask = to_device(pos, None, dev), None
            if tree is not None:
                pos_t, mask = tree_inputs(tree, to_device(starts, torch.long, dev), kv_len)
            return self.layers_forward(
                ids,
                pos_t,
                to_device(write_pos, None, dev),
                to_device(slots, torch.long, dev),
                torch.arange(kv_len, device=dev),
                first if consecutive else None,
                mask=mask,
                x=x,
            )
        rows = [s - first for s in slots]  # each row's index in the span
        span_ids = ids.new_zeros(span, ids.shape[1])  # [span, q]
        span_ids[to_device(rows, torch.long, dev)] = ids
        span_x = None
        if x is not None:  # [span, q, width]
            span_x = x.new_zeros(span, *x.shape[1:])
            span_x[to_device(rows, torch.long, dev)] = x
        span_starts, span_counts = [0] * span, [0] * span  # idle: scratch writes only
        for r, st, n in zip(rows, starts, counts):
            span_starts[r], span_counts[r] = st, n
        pos, write_pos = cache.positions(span_starts, span_counts, ids.shape[1])
        h, tapped = self.layers_forward(
            span_ids,
            to_device(pos, None, dev),
            to_device(write_pos, None, dev),
            torch.arange(first, first + span, device=dev),
            torch.arange(kv_len, device=dev),
            first,
            x=span_x,
        )  # [span, q, hidden]
        pick = to_device(rows, torch.long, dev)
        return h[pick], (tapped[pick] if tapped is not None else None)  # [batch, q, ...]

    def buckets(self) -> tuple[list[int], list[int]] | None:
        """The fast path's (row buckets, q buckets), or None where forwards run eagerly."""
        fast = self._fast
        return None if fast is None else (list(fast.batch_buckets), list(fast.q_buckets))

    def padded_shape(self, batch: int, q: int) -> tuple[int, int]:
        """The (rows, query tokens) that a forward of ``batch`` rows of ``q`` tokens really runs:
        the fast path's buckets when it handles the shape (rows counted as if the batch held the
        lowest slots), else the shape as given. The round cost model (engine/kcontrol) prices
        rounds by it: a verify costs what its padded shape costs."""
        padded = self._fast.bucket_shape(batch, q) if self._fast is not None else None
        return padded or (batch, q)

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack over the slot cache.

        ids, pos, write_pos ``[batch, q]``; slot_t ``[batch]``; kv_idx ``arange(kv_len)``: keys
        are read up to kv_len. ``first_slot``: rows are the consecutive slots from there (keys
        are read as a view), or None (keys gathered by slot_t). ``group_fn``: the compiled
        :func:`~engine.model.layer.layer_group` over groups of ``group_size`` layers
        (engine/model/compiled.py); default: the whole stack as one eager group. ``mask``
        ``[batch, 1, q, kv_len]`` bool: which keys each query sees (a tree's, :func:`tree_mask`);
        default: by position, ``kv_pos <= pos``. ``x``: the input adapter's other input
        (:meth:`forward`). Returns the final-normed hidden states ``[batch, q, hidden]`` (a stack
        that feeds its output back: the last layer's output) and the inputs of the layers in
        ``taps`` ``[batch, q, len(taps) * hidden]`` (None without taps); K/V of every query token
        written in place. A paged cache's positions are translated here, once a forward, to
        the pool's (``read_idx``: each row's keys; a captured graph records the translation)."""
        cache, tapped = self.cache, []
        read_idx = None
        if isinstance(cache, PagedKVCache):
            rows = slot_t[:, None]  # [batch, 1]
            read_idx = cache.physical(rows, kv_idx[None, :])  # [batch, kv_len]
            write_pos = cache.physical(rows, write_pos)  # [batch, q]
        h, x0 = self.inputs(ids, x)  # [batch, q, hidden]; the first layer's attention input
        cos, sin = self.rotary(h, pos)  # [batch, q, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [batch, 1, q, head_dim]
        if mask is None:  # [batch, 1, q, kv_len]
            mask = (kv_idx[None, None, :] <= pos[:, :, None]).unsqueeze(1)
        # the grouped attention's mask, eager: built once, not once a layer (a compiled graph
        # groups it inside, where it is fused)
        if group_fn is None and groups_queries(self.shape, h):
            mask = grouped_mask(mask, self.shape.num_heads // self.shape.kv_heads)
        if h.device.type == "cuda":  # [batch, 1, q or group * q, kv_len], 0 or -inf
            mask = additive_mask(mask, h.dtype)
        n = len(self.weights)
        size = group_size or n
        run = layer_group if group_fn is None else group_fn
        at = LayerInputs(cos, sin, mask, slot_t, write_pos, first_slot, self.shape, read_idx)
        for g0 in range(0, n, size):
            g = slice(g0, g0 + size)
            ws, kcs, vcs = tuple(self.weights[g]), tuple(cache.k[g]), tuple(cache.v[g])
            h, inputs = run(h, ws, kcs, vcs, at, x0)
            x0 = None
            tapped += [inputs[i - g0] for i in self.taps if g0 <= i < g0 + size]
        out = h if self.feeds_back else self.norm(h)
        return out, (torch.cat(tapped, dim=-1) if tapped else None)
