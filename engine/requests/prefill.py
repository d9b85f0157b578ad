"""The target forwards of one step's prompt chunks, several chunks to one.

A step prefills up to ``max_prefill_per_step`` chunks. One forward a chunk made a step that
admits 4 short prompts cost 4 eager forwards: on a GPU an eager forward of a large model is
weight-bound, costing about the same for 1 or 128 tokens, so at a large batch those admissions
delayed every round (docs/measurements.md). :func:`prefill_groups` puts chunks into ragged
groups, one forward each (``ModelRunner.forward`` pads a group to its longest chunk):

  * chunks are grouped shortest first, so that similar lengths pad each other;
  * a group's padded size (rows x its longest chunk) stays within ``cap`` tokens, and its
    padding within a quarter of its real tokens or ``SLACK`` tokens: on a CPU, where a forward
    is compute-bound, padding is paid for in full;
  * a chunk for which ``alone`` holds (a scored prompt: it needs every position's logits; a
    deterministic request: its forward must not depend on its neighbours) has a forward of its
    own.

Invariant: every chunk is in exactly one group, and a group never exceeds ``cap`` padded
tokens unless it is one chunk (a chunk is at most the step's budget, which ``cap`` is).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.drafters.guard import GuardedDrafter
from engine.model.runner import ModelRunner
from engine.records.sequence import Sequence
from engine.requests.prompt_logprobs import add_prompt_logprobs
from engine.requests.scheduler import PrefillChunk

SLACK = 64  # padded tokens a group may carry whatever its size


def prefill_groups(
    chunks: list[PrefillChunk], cap: int, alone: Callable[[PrefillChunk], bool]
) -> list[list[PrefillChunk]]:
    """``chunks`` in groups that share one forward (see the module's docstring)."""
    groups: list[list[PrefillChunk]] = [[c] for c in chunks if alone(c)]
    group: list[PrefillChunk] = []
    real = 0
    for c in sorted((c for c in chunks if not alone(c)), key=lambda c: len(c.tokens)):
        n = len(c.tokens)  # the longest so far: the group pads to it
        padded = n * (len(group) + 1)
        if group and (padded > cap or padded - (real + n) > max(SLACK, (real + n) // 4)):
            groups.append(group)
            group, real = [], 0
        group.append(c)
        real += n
    if group:
        groups.append(group)
    return groups


def run_chunks(
    target: ModelRunner,
    guard: GuardedDrafter | None,
    chunks: list[PrefillChunk],
    cap: int,
    solo: bool,
    invariant: Callable[[list[Sequence]], bool],
) -> dict[int, torch.Tensor]:
    """Feed every chunk to the target (and its features to the drafter), a group a forward;
    a scored chunk's prompt logprobs are added to its sequence. Returns each chunk's last logits
    ``[1, vocab]`` by ``id(chunk)``. Commits nothing: the scheduler commits each chunk.
    ``solo``: every chunk alone (deterministic mode); a scored chunk always is."""
    last: dict[int, torch.Tensor] = {}
    alone = lambda c: solo or c.seq.scores_prompt  # noqa: E731
    for group in prefill_groups(chunks, cap, alone):
        seqs = [c.seq for c in group]
        scores = seqs[0].scores_prompt  # then a group of one
        f = target.forward(
            [c.tokens for c in group],
            [s.slot for s in seqs],
            logits="all" if scores else "last",
            invariant=invariant(seqs),  # the deterministic mode's forward, if a row asks for it
        )
        logits, tapped = f.logits, f.tapped  # [rows, vocab], or [1, chunk, vocab] when scored
        if scores:
            add_prompt_logprobs(seqs[0], group[0].start, logits[0])
            logits = logits[:, -1]
        if guard is not None:  # the drafter's features of these positions (EAGLE-3)
            starts, counts = [c.start for c in group], [len(c.tokens) for c in group]
            guard.observe(seqs, tapped, starts, counts)
        last |= {id(c): logits[i : i + 1] for i, c in enumerate(group)}
    return last
