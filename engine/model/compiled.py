"""The fast forward path: fixed-shape, compiled decode / verify / draft-step forwards.

Like gpt-fast, small forwards run ``torch.compile``d over a small, known set of shapes, which
removes per-operator overhead and, on CUDA, launch overhead (CUDA graphs). On CPU, where a
decode step is mostly matmuls, the gain is small (``python -m loadtest.bench.steps`` measures it
per shape). The shapes:

- **Rows are slots.** A forward over rows in slots ``S`` runs the slot range ``[0, bucket)`` with
  ``bucket`` the smallest batch bucket > max(S) (the cache hands out low slots first, so the range
  stays tight); slots not in the step are padding rows: their tokens write only to the scratch
  column and their outputs are dropped. Keys and values are then read as a *view* of the cache,
  never gathered.
- **Query length** ``q`` (1 for a decode step, K+1 for a verify) is padded to a q bucket.
- **Key length** (the longest row's length) is padded to a multiple of ``kv_align`` and is
  *dynamic* in the compiled graph on CPU (one graph serves every length), or the whole cache
  (``max_len + 1``, static) under CUDA graphs, which record one graph per shape.
- With ``dynamic`` (the CPU default) batch and q are dynamic dimensions too, so the buckets bound
  the shapes while few graphs are compiled (torch specializes sizes of 1: a batch-1 and a q-1
  graph exist apart). With ``dynamic: false`` every (batch, q) bucket is its own graph.

Every (batch, q) bucket is run once at start-up (:meth:`FastForward.warm_up`), before the server
reports ready, so no request ever waits for a compile; compile time is logged. A failed compile
or warm-up logs a warning and the runner stays eager. Prefill chunks (long, ragged) stay eager.

The compiled unit is the one the eager path runs, :func:`engine.model.layer.layer_group`: a group of
``layers_per_graph`` consecutive decoder layers, weights and caches passed in, so one graph serves
every group of the same structure and both paths compute the same thing (the lossless tests run
with compilation on, fp32). Per group of layers, not per layer (Dynamo's per-call cost is paid
per graph, so once per layer and step) nor the whole stack (far longer to compile for little
more speed); the figures are in docs/measurements.md. A stack of one group (the EAGLE-3 head's
one layer: ``CompileConfig.whole_stack``) compiles whole instead, its input adapter and output
with the layer (group_graphs.py's ``stack_last``), for the calls that read each row's last logits.

Graphs are picked by key, without Dynamo's guards (engine/model/group_graphs.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.model.group_graphs import GroupGraphs, StackCall, StackGraphs
from engine.model.stack import Forward
from engine.model.tree_attention import Tree, tree_mask
from engine.transfer import to_device

if TYPE_CHECKING:
    from engine.model.stack import Stack

log = logging.getLogger("specd.fast_forward")


@dataclass
class CompileConfig:
    enabled: bool = False
    # torch.compile mode: "default" | "max-autotune-no-cudagraphs" | "reduce-overhead" (inductor
    # under CUDA-graph trees); or "cuda-graphs": the decoder stack captured as CUDA graphs
    # (engine/model/cuda_graphs.py), the eager layers or with ``fuse`` inductor's groups of them
    mode: str = "default"
    backend: str = "inductor"
    dynamic: bool | None = None  # batch / q / key length dynamic; None: True except CUDA graphs
    batch_buckets: list[int] | None = None  # default: 1, 2, 4, 8, ... up to max_running
    q_buckets: list[int] | None = None  # default: 1, 2, 4, ... and k_max + 1
    kv_align: int = 64  # key length padded to a multiple of this
    warmup: bool = True  # run every bucket at start-up (compiles them before /ready)
    # threads of inductor's generated CPU kernels; 1: no OpenMP region of their own (the small
    # fused kernels of a decode step gain nothing from threads, and a second OpenMP pool
    # spinning beside torch's own slows every matmul on a few cores); None: inductor's default
    cpp_threads: int | None = 1
    layers_per_graph: int = 6  # decoder layers a compiled graph runs (engine/layer.layer_group)
    # cuda-graphs only: capture inductor's compiled layer groups (kernels fused; Dynamo's guards
    # kept, evaluated at capture only) instead of the eager stack
    fuse: bool = False
    # inductor's fused kernels round every bf16 / fp16 intermediate as the eager ops do
    # (inductor's emulate_precision_casts): with the CPU kernels computing each row alone, the
    # compiled graphs of every shape and the eager forward then give a row the same bits, so
    # output does not depend on the batch, the verify's width or a prefix cache hit. False:
    # inductor keeps fused intermediates in float32 (then a 1-row graph and the eager prefill
    # each round differently)
    eager_numerics: bool = True
    # a stack of one layer group (the EAGLE-3 head's) compiles its input adapter, rotary
    # embedding, mask and output (final norm, logits at each row's last query) into the group's
    # graph: its step is one layer, so the eager ops around it would cost a third of it
    whole_stack: bool = False

    @classmethod
    def from_dict(cls, d: dict | None) -> CompileConfig:
        return cls(**(d or {}))


def default_buckets(limit: int, top: int | None = None) -> list[int]:
    """1, 2, 4, ... below ``limit``, then ``limit`` itself (``top``: an extra largest bucket)."""
    out: list[int] = []
    b = 1
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return sorted(set(out + ([top] if top else [])))


def bucket(buckets: list[int], n: int) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


def widths_input(runner: Stack, nb: int, qb: int) -> list[torch.Tensor | None]:
    """A zero input of every width the runner's input adapter reads at ``qb`` tokens a row
    ``[nb, qb, width]`` (None: tokens only), for warm-ups and captures."""
    return [
        None if w is None else torch.zeros(nb, qb, w, dtype=runner.dtype, device=runner.device)
        for w in runner.inputs.widths(qb)
    ]


class Padded(NamedTuple):
    """A forward's rows laid over slots ``[0, nb)`` and ``qb`` queries
    (:meth:`FastForward._pad`)."""

    ids: torch.Tensor  # [nb, qb] on the device
    pos: torch.Tensor  # [nb, qb] host: each query's position
    write_pos: torch.Tensor  # [nb, qb] host: the cache column its K/V is written to
    row_start: list[int]  # [nb] each row's committed length
    kv_len: int  # the key length read, padded
    x: torch.Tensor | None  # [nb, qb, width]: the input adapter's other input
    slot_t: torch.Tensor  # [batch] the forward's rows' slots, on the device


class FastForward:
    """Compiled fixed-shape forward of one :class:`~engine.model.runner.ModelRunner`."""

    # whether a verify of draft trees runs here (a class attribute: GraphForward, whose verify
    # graphs record their mask from static inputs, does not run this __init__)
    takes_trees = True
    # the whole stack's graphs (``CompileConfig.whole_stack``), for calls that read the logits at
    # each row's last query; None: the eager output around the group graphs (GraphForward
    # captures the input adapter with the layers, and replays them without per-op cost)
    whole: StackGraphs | None = None

    def __init__(self, runner: Stack, cfg: CompileConfig, k_max: int):
        self._buckets(runner, cfg, k_max)
        cache = runner.cache
        self.cuda_graphs = cfg.mode == "reduce-overhead"
        self.dynamic = (not self.cuda_graphs) if cfg.dynamic is None else cfg.dynamic
        self.full_kv = self.cuda_graphs  # static key length: the whole cache
        self.takes_trees = not self.full_kv  # inductor's CUDA-graph trees record the causal mask
        import torch._dynamo as dynamo
        import torch._inductor.config as inductor_config

        if cfg.cpp_threads is not None:
            inductor_config.cpp.threads = cfg.cpp_threads
        # shapes change only where marked dynamic: a key's compile never generalizes from the
        # shapes another key's compile of the same function saw. (No recompile limit to raise:
        # a graph without guards compiles once, engine/model/group_graphs.py.)
        dynamo.config.automatic_dynamic_shapes = False
        if self.cuda_graphs:
            for t in cache.k + cache.v:
                dynamo.mark_static_address(t)
        mode = None if cfg.mode == "default" else cfg.mode
        # the compiled layer groups, called as the eager layer_group is
        self.graphs = GroupGraphs(
            cfg.backend, mode, self.dynamic, self.full_kv, eager_numerics=cfg.eager_numerics
        )
        if cfg.whole_stack and len(runner.weights) <= cfg.layers_per_graph and not self.full_kv:
            self.whole = StackGraphs(cfg.backend, mode, self.dynamic, cfg.eager_numerics)

    def _buckets(self, runner: Stack, cfg: CompileConfig, k_max: int) -> None:
        self.runner, self.cfg, self.calls = runner, cfg, 0
        slots = runner.cache.num_slots
        buckets = sorted(cfg.batch_buckets or default_buckets(slots))
        if buckets[-1] > slots:  # e.g. the default's 16 under --max-running 4
            buckets = [b for b in buckets if b < slots] + [slots]
            log.info("batch buckets cut to the cache's %d slots: %s", slots, buckets)
        self.batch_buckets = buckets
        self.q_buckets = sorted(cfg.q_buckets or default_buckets(2, k_max + 1))

    def bucket_shape(self, rows: int, q: int) -> tuple[int, int] | None:
        """(batch bucket, q bucket) of a forward over slots ``[0, rows)`` of ``q`` tokens, or
        None when the shape is outside the buckets (the forward runs eagerly)."""
        nb, qb = bucket(self.batch_buckets, rows), bucket(self.q_buckets, q)
        return None if nb is None or qb is None else (nb, qb)

    # -- one forward ----------------------------------------------------------------------------
    def run(
        self,
        ids: torch.Tensor,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        tree: Tree | None = None,
        x: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Rows ``ids`` ``[batch, q]`` for ``slots`` at ``starts`` with ``counts`` valid tokens
        (``tree``: draft trees, tree_attention.Tree; the graphs take its mask as they take the
        causal one; not under inductor's CUDA-graph trees; ``x`` ``[batch, q, width]``: the
        input adapter's other input); returns their final-normed hidden states
        ``[batch, q, hidden]`` and tapped inputs ``[batch, q, taps * hidden]``, or None when
        the shape is outside the buckets."""
        if tree is not None and not self.takes_trees:
            return None
        padded = self._pad(ids, slots, starts, counts, x)
        if padded is None:
            return None
        p, q = padded, ids.shape[1]
        nb, qb = p.ids.shape
        pos, tree_b = p.pos, None
        rows_at: list[int] | torch.Tensor = p.row_start  # [nb] each row's start
        if tree is not None:
            tree_b = self._tree_rows(tree, p.slot_t, nb, qb, q)
            starts_t = to_device(p.row_start, torch.long, self.runner.device)
            pos, rows_at = starts_t[:, None] + tree_b.depth, starts_t  # pos on the device [nb, qb]
        h, tapped = self._call(p.ids, pos, p.write_pos, p.kv_len, tree_b, rows_at, p.x)
        # the rows of this forward's slots
        return h[p.slot_t, :q], (tapped[p.slot_t, :q] if tapped is not None else None)

    def run_last(
        self,
        ids: torch.Tensor,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        x: torch.Tensor | None = None,
    ) -> Forward | None:
        """:meth:`run`'s rows through the whole stack's graph (``CompileConfig.whole_stack``):
        the :class:`Forward` at each row's last valid query (logits ``[batch, vocab]``), or None
        where there is no such graph or the shape is outside the buckets."""
        if self.whole is None:
            return None
        padded = self._pad(ids, slots, starts, counts, x)
        if padded is None:
            return None
        p, q = padded, ids.shape[1]
        last = [0] * p.ids.shape[0]  # each row's last valid query (padding rows: 0)
        for s, n in zip(slots, counts):
            last[s] = n - 1
        logits, tapped, output = self._call_whole(p.ids, p.pos, p.write_pos, p.kv_len, last, p.x)
        return Forward(
            logits[p.slot_t],
            tapped[p.slot_t, :q] if tapped is not None else None,
            output[p.slot_t] if output is not None else None,
        )

    def _pad(
        self,
        ids: torch.Tensor,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        x: torch.Tensor | None,
    ) -> Padded | None:
        """The forward over slots ``[0, nb)`` that runs :meth:`run`'s rows, or None outside the
        buckets. Padding rows feed zero tokens at position 0."""
        runner, dev = self.runner, self.runner.device
        q = ids.shape[1]
        shape = self.bucket_shape(max(slots) + 1, q)
        if shape is None:
            return None
        nb, qb = shape
        row_start, row_count = [0] * nb, [0] * nb
        for s, st, n in zip(slots, starts, counts):
            row_start[s], row_count[s] = st, n
        pos, write_pos = runner.cache.positions(row_start, row_count, qb)  # [nb, qb]
        slot_t = to_device(slots, torch.long, dev)  # [batch]
        ids_b = torch.zeros(nb, qb, dtype=torch.long, device=dev)  # [nb, qb]
        ids_b[slot_t, :q] = ids
        x_b = None
        if x is not None:  # [nb, qb, width]
            x_b = x.new_zeros(nb, qb, x.shape[-1])
            x_b[slot_t, :q] = x
        kv_len = self._kv_len(max(st + n for st, n in zip(starts, counts)))
        return Padded(ids_b, pos, write_pos, row_start, kv_len, x_b, slot_t)

    def _tree_rows(self, tree: Tree, slot_t: torch.Tensor, nb: int, qb: int, q: int) -> Tree:
        """The rows' tree laid out over slots ``[0, nb)`` and ``qb`` queries (padding rows and
        queries see only themselves, at depth 0)."""
        dev = self.runner.device
        depth = torch.zeros(nb, qb, dtype=torch.long, device=dev)
        depth[slot_t, :q] = tree.depth
        visible = torch.eye(qb, dtype=torch.bool, device=dev).repeat(nb, 1, 1)  # [nb, qb, qb]
        visible[slot_t, :q, :q] = tree.visible
        return Tree(depth, visible)

    def _kv_len(self, kv_len: int) -> int:
        cache = self.runner.cache
        if self.full_kv:
            return cache.max_len + 1
        a = self.cfg.kv_align
        return min(max(a, -(-kv_len // a) * a), cache.max_len + 1)

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
        """The decoder stack over slots ``[0, nb)`` for ids ``[nb, qb]`` (on the device) and
        pos, write_pos ``[nb, qb]`` (host tensors; a tree's pos on the device), keys read up to
        ``kv_len``; ``tree`` (over the ``nb`` rows) and the rows' ``starts`` ``[nb]``: the
        queries attend as the tree says, else causally; ``x`` ``[nb, qb, width]``: the input
        adapter's other input. Returns final-normed hidden states ``[nb, qb, hidden]`` and the
        tapped inputs."""
        dev = self.runner.device
        nb = ids.shape[0]
        rows = torch.arange(nb, device=dev)  # [nb]: row r is slot r
        kv_idx = torch.arange(kv_len, device=dev)  # [kv_len]
        mask = None
        if tree is not None:
            assert starts is not None
            mask = tree_mask(tree.visible, to_device(starts, torch.long, dev), kv_len)
        self.calls += 1
        return self.runner.layers_forward(
            ids,
            to_device(pos, None, dev),
            to_device(write_pos, None, dev),
            rows,
            kv_idx,
            0,
            group_fn=self.graphs,
            group_size=self.cfg.layers_per_graph,
            mask=mask,
            x=x,
        )

    def _call_whole(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        write_pos: torch.Tensor,
        kv_len: int,
        last: list[int],
        x: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The whole stack's graph over slots ``[0, nb)``, as :meth:`_call` runs the group
        graphs: ids ``[nb, qb]`` on the device, pos and write_pos ``[nb, qb]`` host tensors,
        keys read up to ``kv_len``; the logits, tapped inputs and output at query ``last[r]``
        of each row (group_graphs.py's ``stack_last``)."""
        assert self.whole is not None
        dev, nb = self.runner.device, ids.shape[0]
        self.calls += 1
        call = StackCall(
            ids,
            to_device(pos, None, dev),
            to_device(write_pos, None, dev),
            torch.arange(nb, device=dev),
            torch.arange(kv_len, device=dev),
            to_device(last, torch.long, dev),
            x,
        )
        return self.whole(self.runner, call)

    # -- start-up -------------------------------------------------------------------------------
    def _warm(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        write_pos: torch.Tensor,
        kv_len: int,
        x: torch.Tensor | None,
    ) -> None:
        """One scratch forward of a bucket: through the whole stack's graph where there is one
        (the graphs its calls take; its group graphs, for hidden states or every query's logits,
        compile at their first call), else the group graphs."""
        if self.whole is None:
            self._call(ids, pos, write_pos, kv_len, x=x)
        else:
            self._call_whole(ids, pos, write_pos, kv_len, [0] * ids.shape[0], x)

    def warm_up(self) -> None:
        """Run every (batch, q) bucket once on scratch positions (compiles them). Nothing
        committed is touched: every token is written to the scratch column."""
        runner, dev = self.runner, self.runner.device
        t0 = time.perf_counter()
        with torch.inference_mode():
            for nb in self.batch_buckets:
                for qb in self.q_buckets:
                    t = time.perf_counter()
                    ids = torch.zeros(nb, qb, dtype=torch.long, device=dev)
                    pos, write_pos = runner.cache.positions([0] * nb, [0] * nb, qb)
                    for x in widths_input(runner, nb, qb):
                        for kv in (self._kv_len(1), self._kv_len(self.cfg.kv_align + 1)):
                            self._warm(ids, pos, write_pos, kv, x)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    log.info(
                        "compiled %s forward batch=%d q=%d in %.1f s",
                        runner.name,
                        nb,
                        qb,
                        time.perf_counter() - t,
                    )
        log.warning(
            "compiled the %s forward: %d shapes in %.1f s",
            runner.name,
            len(self.batch_buckets) * len(self.q_buckets),
            time.perf_counter() - t0,
        )
