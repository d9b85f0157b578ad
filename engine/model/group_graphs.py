"""The compiled graphs of the fast path (engine/model/compiled.py), one per *graph key*, picked
without Dynamo's guards (:class:`GroupGraphs`), or with them where the graphs are captured as
CUDA graphs (:class:`GuardedGroups`: guards run at capture only).

A graph runs :func:`engine.model.layer.layer_group` (a group of consecutive decoder layers) and is
called with tensors Dynamo never saw at its compile: every group's weights and caches. Dynamo's
guards would check every one of them on every call (a sizeable share of a small model's decode
step: docs/measurements.md), so they are dropped (``skip_all_guards_unsafe``) and
:class:`GroupGraphs` picks the graph itself, by the key of a call:

- the static dimensions: with dynamic shapes whether batch and q are 1 (torch specializes sizes
  1), else the (batch, q) bucket itself;
- whether keys are read as a view (``first_slot``), and whether through a paged cache's block
  tables (``read_idx``); whether the group's first layer is given its attention input (``x0``:
  the EAGLE-3 head's);
- the group's weight structure: per layer and field, None, a dense tensor's shape and dtype, or
  a 4-bit matrix's (a layer whose 4-bit conversion failed keeps dense weights, so its group needs
  a graph of its own), and the group's length.

Invariant: two calls with one key differ only in dimensions that the call compiling the key
marked dynamic (the key length; batch and q above 1 with dynamic shapes), and in tensor values.
Dtypes and devices are the runner's, fixed. Each key's graph is a ``torch.compile`` of its own
(``isolate_recompiles``): its entries are never shared with another key's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.model.layer import layer_group

if TYPE_CHECKING:
    from engine.model.layer import Caches, Group, GroupOut, LayerInputs
    from engine.model.stack import Stack


class GroupGraphs:
    """Callable as :func:`~engine.model.layer.layer_group`; compiles a key's graph on its first
    call."""

    def __init__(
        self,
        backend: str,
        mode: str | None,
        dynamic: bool,
        full_kv: bool,
        eager_numerics: bool = False,
    ):
        """``eager_numerics``: inductor rounds fused bf16 / fp16 intermediates as the eager ops
        do (engine/model/compiled.py's CompileConfig says why)."""
        self.backend, self.mode, self.dynamic, self.full_kv = backend, mode, dynamic, full_kv
        self.eager_numerics = eager_numerics
        self.graphs: dict[tuple, Callable] = {}  # graph key -> its compiled layer_group
        self._structures: dict[tuple, tuple] = {}  # weight ids -> (the weights, structure)

    def __call__(
        self,
        h: torch.Tensor,
        ws: Group,
        kcs: Caches,
        vcs: Caches,
        at: LayerInputs,
        x0: torch.Tensor | None = None,
    ) -> GroupOut:
        B, q = h.shape[0], h.shape[1]
        dims = (B == 1, q == 1) if self.dynamic else (B, q)
        key = (dims, at.first_slot is None, at.read_idx is None, x0 is None, self._structure(ws))
        fn = self.graphs.get(key)
        if fn is None:
            fn = self.graphs[key] = self._compile()
            self._mark(h, at, x0)
        return fn(h, ws, kcs, vcs, at, x0)

    def _structure(self, ws: Group) -> tuple:
        """The weight structure of a group (see the module docstring), cached by the identity of
        its weights (held, so an id is never reused while cached)."""
        ids = tuple(map(id, ws))
        hit = self._structures.get(ids)
        if hit is None:

            def kind(v):
                if v is None:
                    return None
                if isinstance(v, torch.Tensor):
                    return (tuple(v.shape), v.dtype)
                return ("q4", v.shape, v.split, tuple(v.packed.shape), v.kernel, v.dtype)

            hit = self._structures[ids] = (ws, tuple(tuple(kind(v) for v in w) for w in ws))
        return hit[1]

    def _compile(self) -> Callable:
        """A compiled :func:`layer_group` with entries of its own and no guards."""
        return compile_guardless(layer_group, self.backend, self.mode, self.eager_numerics)

    def _mark(self, h: torch.Tensor, at: LayerInputs, x0: torch.Tensor | None = None) -> None:
        """Mark the dynamic dimensions of the call that compiles a key: the key length (unless
        graphs read the whole cache: CUDA graphs), and with dynamic shapes batch and q (only
        sizes above 1: the key holds whether they are 1)."""
        import torch._dynamo as dynamo

        cos, sin, mask, slot_t, write_pos = at.cos, at.sin, at.mask, at.slot_t, at.write_pos
        read_idx = at.read_idx  # [batch, kv_len] with a paged cache
        marks: list[tuple[torch.Tensor, int]] = [] if self.full_kv else [(mask, 3)]
        if read_idx is not None and not self.full_kv:
            marks.append((read_idx, 1))
        if self.dynamic:
            marks += [(h, 0), (h, 1), (cos, 0), (cos, 2), (sin, 0), (sin, 2), (mask, 0)]
            marks += [(mask, 2), (slot_t, 0), (write_pos, 0), (write_pos, 1)]
            marks += [(read_idx, 0)] if read_idx is not None else []
            marks += [(x0, 0), (x0, 1)] if x0 is not None else []
        for t, d in marks:
            if t.shape[d] > 1:
                dynamo.mark_dynamic(t, d)


class StackCall(NamedTuple):
    """One call of a whole one-group stack over slots ``[0, nb)``, causally (:func:`stack_last`)."""

    ids: torch.Tensor  # [nb, qb]
    pos: torch.Tensor  # [nb, qb] each query's position
    write_pos: torch.Tensor  # [nb, qb] the cache column its K/V is written to
    rows: torch.Tensor  # [nb] arange: row r is slot r
    kv_idx: torch.Tensor  # [kv_len] arange: the keys read
    last: torch.Tensor  # [nb] the query whose logits and output are returned
    x: torch.Tensor | None  # [nb, qb, width] the input adapter's other input


def stack_last(
    stack: Stack, c: StackCall
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The whole of a one-group ``stack`` over ``c``'s rows, as the fast path calls it
    (engine/model/compiled.py's ``FastForward.run_last``). Returns, as ``stack.output`` makes
    them at query ``c.last[r]`` of each row: the logits ``[nb, vocab]``, the tapped inputs
    (every query's) and the output fed back ``[nb, hidden]`` (or None)."""
    n = len(stack.weights)
    h, tapped = stack.layers_forward(
        c.ids, c.pos, c.write_pos, c.rows, c.kv_idx, 0, group_fn=layer_group, group_size=n, x=c.x
    )
    f = stack.output(h[c.rows, c.last], tapped)  # at [nb, hidden]
    return f.logits, f.tapped, f.output


class StackGraphs:
    """Callable as :func:`stack_last`; compiles a key's graph on its first call. One runner's
    stack, so the weight structure, the cache's kind, dtypes and the device are fixed; the key is
    the static dimensions (as :class:`GroupGraphs`'s) and the width of x (None: tokens only)."""

    def __init__(self, backend: str, mode: str | None, dynamic: bool, eager_numerics: bool):
        self.backend, self.mode, self.dynamic = backend, mode, dynamic
        self.eager_numerics = eager_numerics
        self.graphs: dict[tuple, Callable] = {}  # graph key -> its compiled stack_last

    def __call__(
        self, stack: Stack, c: StackCall
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        B, q = c.ids.shape
        dims = (B == 1, q == 1) if self.dynamic else (B, q)
        key = (dims, None if c.x is None else c.x.shape[-1])
        fn = self.graphs.get(key)
        if fn is None:
            fn = self.graphs[key] = compile_guardless(
                stack_last, self.backend, self.mode, self.eager_numerics
            )
            import torch._dynamo as dynamo

            # the key length always; batch and q with dynamic shapes (sizes above 1: the key
            # holds whether they are 1)
            marks: list[tuple[torch.Tensor | None, int]] = [(c.kv_idx, 0)]
            if self.dynamic:
                for t in (c.ids, c.pos, c.write_pos, c.x):
                    marks += [(t, 0), (t, 1)]
                marks += [(c.rows, 0), (c.last, 0)]
            for t, d in marks:
                if t is not None and t.shape[d] > 1:
                    dynamo.mark_dynamic(t, d)
        return fn(stack, c)


def compile_guardless(
    fn: Callable, backend: str, mode: str | None = None, eager_numerics: bool = False
) -> Callable:
    """``torch.compile`` of ``fn`` without Dynamo's guards, with entries of its own: the caller
    picks the graph by a key of its own and promises that calls with one key differ only in
    the dimensions it marked dynamic and in tensor values. ``eager_numerics``: inductor's
    ``emulate_precision_casts`` for this graph (fused intermediates rounded as eager rounds
    them)."""
    options: dict = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    if backend == "inductor":
        import torch._inductor as inductor

        if mode is not None:
            options.update(inductor.list_mode_options(mode))  # e.g. CUDA graphs
        # nor the generated wrapper's checks of every input's sizes and strides (about a hundred
        # a graph, paid on every call): the key fixed them
        options.update(size_asserts=False, alignment_asserts=False)
        options["emulate_precision_casts"] = eager_numerics
    import inspect

    extra = {}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:  # torch >= 2.12
        extra["isolate_recompiles"] = True
    # Dynamo keeps its entries on the code object: without guards and without a code object of
    # its own, a second key's call would run the first key's graph (torch before 2.12, without
    # isolate_recompiles: a view of q = 1 given q = 2)
    return torch.compile(  # type: ignore[call-overload]
        own_code(fn), backend=backend, options=options, fullgraph=True, **extra
    )


def own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own (the same code, a new object): Dynamo's compiled
    entries of the copy are apart from every other copy's."""
    import types

    assert isinstance(fn, types.FunctionType)
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


class GuardedGroups(GroupGraphs):
    """:class:`GroupGraphs` whose graphs keep Dynamo's guards and inductor's input checks, for
    the graphs that engine/model/cuda_graphs.py captures (``compile.fuse``): a replay runs no
    Python, so guards cost nothing there, and a call a graph does not fit recompiles instead of
    reading out of bounds. Batch, q and key length are dynamic (a key per whether batch and q are
    1)."""

    def __init__(self, backend: str):
        super().__init__(backend, None, True, False)
        import torch._dynamo as dynamo

        # the graphs of every key, structure and runner are entries of one code object (torch
        # < 2.12 has no isolate_recompiles): room for all of them
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name) and getattr(dynamo.config, name) < 64:
                setattr(dynamo.config, name, 64)

    def _compile(self) -> Callable:
        return torch.compile(layer_group, backend=self.backend, fullgraph=True)
