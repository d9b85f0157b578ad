"""Captured forwards: the fast path's fixed shapes replayed as CUDA graphs (``compile.mode:
cuda-graphs``).

A decode step of a large model at batch 1 is a few hundred small kernels; launched one by one
from Python they cost more than the weights take to read. :class:`GraphForward` records the
decoder stack (:meth:`engine.model.runner.ModelRunner.layers_forward`: the eager layers, or with
``compile.fuse`` inductor's compiled groups of them, engine/group_graphs.GuardedGroups) once per
bucket into a ``torch.cuda.CUDAGraph`` and replays it: one launch a forward. It runs
the shapes of :class:`~engine.model.compiled.FastForward` (rows are slots ``[0, bucket)``, q padded
to a bucket, padding rows write only to the scratch column), and pads the key length to a
power-of-two bucket (``kv_align``, twice that, ... up to the whole cache): attention never reads
more than twice the keys it needs, whatever ``max_model_len``. Each (batch, q, key length)
bucket is a graph, captured at start-up before the server reports ready: quickly for the eager
stack; with ``compile.fuse`` after inductor compiles a graph per key (whether batch and q are 1),
which for a large model takes far longer than the captures (docs/measurements.md). A verify's
graph (q > 1) builds its mask from each row's start and which of its queries each query sees
(static inputs), so one graph verifies a chain (the lower triangle) or a draft tree (its
ancestors, at positions start + depth): trees replay the same graphs as chains.

Invariants:

- A graph reads its inputs from static buffers (ids, positions, write positions; a verify's
  row starts and query visibility) that each call fills first: ids device-to-device, positions
  and starts from the host through pinned memory without a sync (engine/transfer.py; a tree's
  are on the device already), and from constant ones (rows, key indices, a chain's triangle).
  :class:`Captured` holds every one of them: a graph reads memory by address, and a freed
  buffer's memory is soon another tensor's. Weights and caches are read and written in place.
- All graphs share one memory pool, so a replay may overwrite any graph's outputs: a call's
  outputs are read (copied by :meth:`FastForward.run`'s row pick) before the next replay is
  queued, and nothing keeps them.
- A graph holds the taps (EAGLE-3 features) of its runner, fixed at the runner's construction.
- The same arithmetic as the eager path for every query a row counts (the same kernels, minus
  launches; with ``compile.fuse``, inductor's fused kernels of the same layer functions), so the
  lossless tests hold through it (a padding query past a row's count sees the row's triangle
  up to its own column, where eager sees up to the row's last token: its output is dropped);
  on a machine without CUDA the recorder re-runs the forward on the static buffers, which tests
  the buffer plumbing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from engine.fallback import warn_fallback
from engine.model.compiled import CompileConfig, FastForward, bucket
from engine.model.group_graphs import GuardedGroups
from engine.model.layer import varying_shape_attention
from engine.model.tree_attention import Tree, tree_mask
from engine.transfer import copy_into

if TYPE_CHECKING:
    from engine.model.stack import Stack

log = logging.getLogger("specd.cuda_graphs")
T = TypeVar("T")
Outs = TypeVar("Outs", bound=tuple)  # a forward's outputs: tensors, or None where it has none


@dataclass
class Captured:
    """One bucket's graph: its static inputs and outputs, and how to replay it."""

    ids: torch.Tensor  # [nb, qb] long
    pos: torch.Tensor  # [nb, qb] long
    write_pos: torch.Tensor  # [nb, qb] long
    rows: torch.Tensor  # [nb]: slots 0 .. nb-1 (constant; held: the graph reads it)
    kv_idx: torch.Tensor  # [kv_len]: arange (constant; held: the graph reads it)
    out: torch.Tensor  # [nb, qb, hidden]: final-normed hidden states
    tapped: torch.Tensor | None  # [nb, qb, taps * hidden]
    replay: Callable[[], None]
    # qb > 1 (a verify, a chain's or a tree's): the mask is recorded from each row's start and
    # which of the row's queries each query sees (tree_attention.tree_mask); None at qb = 1
    starts: torch.Tensor | None = None  # [nb] long
    visible: torch.Tensor | None = None  # [nb, qb, qb] bool
    chain: torch.Tensor | None = None  # [nb, qb, qb] lower-triangular: a chain's (constant)
    holds_tree: bool = False  # visible holds a tree's, not the chain's
    x: torch.Tensor | None = None  # [nb, qb, width]: the input adapter's other input


class GraphForward(FastForward):
    """:class:`FastForward` whose buckets are CUDA graphs of the decoder stack."""

    def __init__(self, runner: Stack, cfg: CompileConfig, k_max: int):
        self._buckets(runner, cfg, k_max)
        self.kv_buckets = kv_buckets(cfg.kv_align, runner.cache.max_len + 1)
        # (nb, qb, key length, the input adapter's width) -> its graph
        self.captured: dict[tuple[int, int, int, int | None], Captured] = {}
        self.captures = 0  # graphs recorded (warm-up only); ``calls``: replays
        self.pool = torch.cuda.graph_pool_handle() if runner.device.type == "cuda" else None
        # compile.fuse: the captured forward runs inductor's layer groups, not the eager stack
        self.groups = GuardedGroups(cfg.backend) if cfg.fuse else None

    def _call(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        write_pos: torch.Tensor,
        kv_len: int,
        tree: Tree | None = None,
        starts: list[int] | torch.Tensor | None = None,
        x: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`FastForward._call` (``kv_len`` a key-length bucket): fill the bucket's
        static inputs, replay its graph (captured on first use), return its static outputs. A
        verify's graph (q > 1) sees by its static ``visible``: the chain's lower triangle, or
        the tree's, whose positions (start + depth) come in ``pos``."""
        nb, qb = ids.shape
        key = (nb, qb, kv_len, None if x is None else x.shape[-1])
        g = self.captured.get(key)
        if g is None:
            g = self.captured[key] = self._capture(*key)
        g.ids.copy_(ids)
        if g.x is not None:
            assert x is not None
            g.x.copy_(x)
        copy_into(g.pos, pos)
        copy_into(g.write_pos, write_pos)
        if g.visible is not None:
            assert starts is not None and g.starts is not None and g.chain is not None
            copy_into(
                g.starts, starts if isinstance(starts, torch.Tensor) else torch.tensor(starts)
            )
            if tree is not None or g.holds_tree:
                g.visible.copy_(tree.visible if tree is not None else g.chain)
                g.holds_tree = tree is not None
        else:
            assert tree is None, "a tree has more than one query"
        g.replay()
        self.calls += 1
        return g.out, g.tapped

    def _kv_len(self, kv_len: int) -> int:
        return bucket(self.kv_buckets, kv_len) or self.kv_buckets[-1]

    def warm_up(self) -> None:
        """Capture every (batch, q, key length) bucket (nothing committed is touched). Where
        inductor's groups fail (``compile.fuse``), the eager stack is captured instead."""
        t0 = time.perf_counter()
        try:
            self._capture_all()
        except Exception as e:
            if self.groups is None:
                raise
            warn_fallback(log, f"fused {self.runner.name} forward", e, "capturing the eager stack")
            self.groups, self.captured, self.captures = None, {}, 0
            self._capture_all()
        log.warning(
            "captured the %s forward: %d CUDA graphs in %.1f s",
            self.runner.name,
            len(self.captured),
            time.perf_counter() - t0,
        )

    def _capture_all(self) -> None:
        with torch.inference_mode():
            for nb in self.batch_buckets:
                for qb in self.q_buckets:
                    for kv in self.kv_buckets:
                        for width in self.runner.inputs.widths(qb):
                            key = (nb, qb, kv, width)
                            if key not in self.captured:
                                self.captured[key] = self._capture(*key)

    def _capture(self, nb: int, qb: int, kv_len: int, width: int | None = None) -> Captured:
        """Record the decoder stack over slots ``[0, nb)`` at ``qb`` tokens a row, keys read up to
        ``kv_len``, with the input adapter's other input ``width`` wide (None: tokens only). The
        recording runs on scratch positions (every row's count is 0): nothing committed is
        written. A stack that feeds its output back (the EAGLE-3 head) is recorded attending as
        forwards of varying shapes do (engine/model/layer.py's varying_shape_attention: no cuDNN
        plan a bucket, for its many small buckets)."""
        runner, dev = self.runner, self.runner.device
        pos, write_pos = runner.cache.positions([0] * nb, [0] * nb, qb)  # [nb, qb]
        ids = torch.zeros(nb, qb, dtype=torch.long, device=dev)
        x = None
        if width is not None:
            x = torch.zeros(nb, qb, width, dtype=runner.dtype, device=dev)
        pos, write_pos = pos.to(dev), write_pos.to(dev)
        rows = torch.arange(nb, device=dev)  # [nb]: row r is slot r
        kv_idx = torch.arange(kv_len, device=dev)  # [kv_len]
        starts = visible = chain = None
        if qb > 1:  # recorded at start 0 seeing the chain's triangle (the scratch positions')
            starts = torch.zeros(nb, dtype=torch.long, device=dev)
            chain = torch.ones(qb, qb, dtype=torch.bool, device=dev).tril().repeat(nb, 1, 1)
            visible = chain.clone()

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            groups = self.groups
            size = self.cfg.layers_per_graph if groups is not None else None
            mask = None if visible is None or starts is None else tree_mask(visible, starts, kv_len)
            shapes = varying_shape_attention(dev) if runner.feeds_back else nullcontext()
            with shapes:
                return runner.layers_forward(
                    ids, pos, write_pos, rows, kv_idx, 0, group_fn=groups, group_size=size,
                    mask=mask, x=x,
                )  # fmt: skip

        (out, tapped), replay = record_on(dev, forward, self.pool)
        self.captures += 1
        log.info("captured %s forward batch=%d q=%d keys=%d", runner.name, nb, qb, kv_len)
        return Captured(
            ids, pos, write_pos, rows, kv_idx, out, tapped, replay, starts, visible, chain, x=x
        )


def record(fn: Callable[[], T], pool=None) -> tuple[T, Callable[[], None]]:
    """``fn`` (CUDA work) recorded into a ``torch.cuda.CUDAGraph`` (in memory pool ``pool``):
    its outputs, the graph's static ones, and the graph's replay. ``fn`` runs twice first on a
    side stream, so that lazy library set-up (cuBLAS workspaces, cuDNN plans) is not recorded."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
    finally:
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return out, graph.replay


def record_on(
    device: torch.device, fn: Callable[[], Outs], pool=None
) -> tuple[Outs, Callable[[], None]]:
    """:func:`record` on CUDA; elsewhere ``fn`` run once and a replay that runs it again into
    the same outputs (None outputs skipped), which tests the static buffers' plumbing."""
    if device.type == "cuda":
        return record(fn, pool)
    outs = fn()

    def replay() -> None:
        for out, new in zip(outs, fn()):
            if out is not None and new is not None:
                out.copy_(new)

    return outs, replay


def kv_buckets(align: int, whole: int) -> list[int]:
    """Key-length buckets: ``align``, doubling, then ``whole`` (the cache's length)."""
    out, b = [], align
    while b < whole:
        out.append(b)
        b *= 2
    return out + [whole]
