"""The EAGLE-3 head's forward replayed as CUDA graphs (``compile.mode: cuda-graphs`` on CUDA).

On CUDA the head otherwise runs eagerly (inductor's guardless graphs are not used there,
engine/model/fast_path.fast_mode): one chained draft step of a head shaped for a large target is
dozens of kernel launches, which take far longer than reading its weights
(docs/measurements.md). :class:`HeadCapture` is callable as
:func:`~engine.drafters.eagle.step.head_forward` and replays one recorded graph per key
(rows bucket, q bucket, key-length bucket, ingest or chain, masked); a call outside the buckets
(a prompt's ingest at admission, longer than the largest q bucket) runs the eager function.
A draft tree's step (expand.py: the chain rows and the tree rows' extras in one call, each
seeing its committed prefix and its own ancestors) brings its mask: its graphs read it from a
static buffer, with rows buckets up to every slot's row and its extras.

Invariants:

- A call's rows are rows ``[0, rows)`` of its bucket. Padding writes only the scratch column:
  past a row's own q the caller's ``write_pos`` already names it, and the write positions are
  rewritten whole on every call, padding included, so a stale row of an earlier, larger call
  never writes into another row's cache. The padding's other inputs (ids, features, positions,
  slots, ``last``) may hold an earlier call's values, all valid indices: they feed only
  outputs that are dropped. Keys past a row's position are masked, so a longer key bucket reads
  more keys but attends to the same ones.
- Weights, caches, the layer shape and the dtype are those of the first call, fixed for the
  drafter's life (a graph reads memory by address).
- The graphs of one (rows, q, ingest, masked) shape share their static inputs, whatever their key
  length (a masked graph reads the first key-length columns of its shape's mask buffer).
- A masked call fills its rows' mask whole (False past its own key length); padding rows see
  every key (a stale row of an earlier call, read through a shorter key bucket, might see none:
  its softmax would be NaN, harmless in a dropped row, kept out all the same).
- The head's graphs share a memory pool of their own, so a replay may overwrite any of the head's
  graphs' outputs, never the target's or the draft model's: a call returns copies.
- Attention as in the eager head on CUDA: SDPA without cuDNN, query heads grouped by KV head
  (engine/layer.varying_shape_attention), so no bucket builds a cuDNN plan at warm-up.
- The same function as the eager path (drafts are proposals: the verify keeps output exact
  whatever rounding a bucket's shapes give). Without CUDA, a replay re-runs the function on the
  static buffers, which tests the padding.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.drafters.eagle.step import HeadStep, HeadWeights, head_forward
from engine.fallback import warn_fallback
from engine.model.compiled import bucket, default_buckets
from engine.model.cuda_graphs import kv_buckets, record_on
from engine.model.layer import LayerShape

log = logging.getLogger("specd.eagle")


@dataclass
class _Graph:
    """One key's recorded forward: its static inputs and outputs, and its replay."""

    ids: torch.Tensor  # [nb, qb] long
    x: torch.Tensor  # [nb, qb, width]: target features (ingest) or the head's outputs (chain)
    last: torch.Tensor  # [nb] long: the query each row's output is read at
    pos: torch.Tensor  # [nb, qb] long
    write_pos: torch.Tensor  # [nb, qb] long
    slot_t: torch.Tensor  # [nb] long
    kv_idx: torch.Tensor  # [kv] arange (constant; held: the graph reads it)
    out: torch.Tensor  # [nb, hidden] the layer's output at ``last``
    logits: torch.Tensor  # [nb, draft_vocab] float32
    replay: object
    mask: torch.Tensor | None = None  # [nb, 1, 1, kv] bool: a tree step's (masked keys only)


class HeadCapture:
    """Callable as ``head_forward``; records a key's graph on its first call (or at
    :meth:`capture_all`, the drafter's warm-up)."""

    def __init__(
        self,
        scratch_pos: int,
        slots: int,
        kv_align: int,
        max_len: int,
        q_max: int,
        extras: int = 0,
    ):
        """``extras``: a tree row's extras a step (expand.py's E; 0: the drafter grows no
        trees, no masked graphs)."""
        self.scratch_pos = scratch_pos
        self.row_buckets = default_buckets(slots)
        # a tree step's rows: each slot's chain row and its extras
        self.masked_buckets = default_buckets(slots * (1 + extras)) if extras else []
        self.q_buckets = default_buckets(q_max)  # an ingest's q; a chained step has q = 1
        self.kv_buckets = kv_buckets(kv_align, max_len + 1)
        self.graphs: dict[tuple[int, int, int, bool, bool], _Graph] = {}
        # (nb, qb, ingest, masked) -> static inputs
        self.inputs: dict[tuple[int, int, bool, bool], tuple[torch.Tensor, ...]] = {}
        self.pool: Any = None  # the head's own memory pool, made at the first capture on CUDA
        self.captures = self.calls = self.eager_calls = 0
        self.eager = False  # a capture at warm-up failed: every call runs the eager function

    def key(self, rows: int, q: int, kv_len: int, ingest: bool, masked: bool = False):
        """(rows bucket, q bucket, key-length bucket, ingest, masked), or None: the call runs
        eagerly."""
        nb = bucket(self.masked_buckets if masked else self.row_buckets, rows)
        kv = bucket(self.kv_buckets, kv_len)
        qb = bucket(self.q_buckets, q) if ingest else (1 if q == 1 else None)
        if nb is None or qb is None or kv is None or (masked and ingest):
            return None
        return (nb, qb, kv, ingest, masked)

    def __call__(
        self, step: HeadStep, w: HeadWeights, kc: torch.Tensor, vc: torch.Tensor, shape: LayerShape
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Arguments as :func:`head_forward`'s; outputs ``[rows, hidden]``, logits
        ``[rows, draft_vocab]``."""
        ids, x, last, pos, write_pos, kv_idx, slot_t, ingest, mask = step
        rows, q = ids.shape
        kv_len, masked = kv_idx.shape[0], mask is not None
        key = None if self.eager else self.key(rows, q, kv_len, ingest, masked)
        if key is None:
            self.eager_calls += 1
            return head_forward(step, w, kc, vc, shape)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(key, x.shape[-1], w, kc, vc, shape)
        g.write_pos.fill_(self.scratch_pos)  # padding writes the scratch column, whatever it held
        g.ids[:rows, :q].copy_(ids)
        g.x[:rows, :q].copy_(x)
        g.last[:rows].copy_(last)
        g.pos[:rows, :q].copy_(pos)
        g.write_pos[:rows, :q].copy_(write_pos)
        g.slot_t[:rows].copy_(slot_t)
        if g.mask is not None:
            assert mask is not None
            g.mask[rows:].fill_(True)
            g.mask[:rows, ..., kv_len:].fill_(False)
            g.mask[:rows, ..., :kv_len].copy_(mask)
        g.replay()  # type: ignore[operator]
        self.calls += 1
        return g.out[:rows].clone(), g.logits[:rows].clone()

    def capture_all(self, w: HeadWeights, kc, vc, shape: LayerShape, widths: tuple[int, int]):
        """Record every key (``widths``: the features' width for an ingest, the head's hidden
        size for a chained step). Nothing committed is written: every write goes to the
        scratch column. Where a capture fails, the head runs eagerly from then on (no capture
        is attempted while serving)."""
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                keys = [
                    (nb, qb, kv, ingest, False)
                    for nb in self.row_buckets
                    for kv in self.kv_buckets
                    for qb, ingest in [(q, True) for q in self.q_buckets] + [(1, False)]
                ]
                keys += [
                    (nb, 1, kv, False, True) for nb in self.masked_buckets for kv in self.kv_buckets
                ]
                for key in keys:
                    if key not in self.graphs:
                        width = widths[0] if key[3] else widths[1]
                        self.graphs[key] = self._capture(key, width, w, kc, vc, shape)
        except Exception as e:  # noqa: BLE001 -- drafting goes on, eagerly
            self.eager, self.graphs, self.inputs = True, {}, {}
            warn_fallback(log, "capturing the EAGLE-3 head", e, "it runs eagerly")
            return
        log.warning(
            "captured the EAGLE-3 head: %d graphs in %.1f s",
            len(self.graphs),
            time.perf_counter() - t0,
        )

    def _capture(self, key, width: int, w: HeadWeights, kc, vc, shape: LayerShape) -> _Graph:
        nb, qb, kv, ingest, masked = key
        dev = kc.device
        ins = self.inputs.get((nb, qb, ingest, masked))
        if ins is None:  # one set of static inputs serves every key-length bucket of a shape
            longs = lambda *s: torch.zeros(*s, dtype=torch.long, device=dev)  # noqa: E731
            x = torch.zeros(nb, qb, width, dtype=kc.dtype, device=dev)  # the head's dtype
            whole = self.kv_buckets[-1]
            ins = self.inputs[(nb, qb, ingest, masked)] = (
                longs(nb, qb),
                x,
                longs(nb),
                longs(nb, qb),
                longs(nb, qb),
                longs(nb),
                torch.ones(nb, 1, qb, whole if masked else 0, dtype=torch.bool, device=dev),
            )
        ids, x, last, pos, write_pos, slot_t, masks = ins
        write_pos.fill_(self.scratch_pos)  # the runs before the recording write the scratch column
        kv_idx = torch.arange(kv, device=dev)

        mask = masks[..., :kv] if masked else None  # [nb, 1, 1, kv]: the shape's buffer's
        step = HeadStep(ids, x, last, pos, write_pos, kv_idx, slot_t, ingest, mask)

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            return head_forward(step, w, kc, vc, shape)

        if dev.type == "cuda" and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        (out, logits), replay = record_on(dev, forward, self.pool)
        self.captures += 1
        return _Graph(ids, x, last, pos, write_pos, slot_t, kv_idx, out, logits, replay, mask)
