"""Start-up calibration of the round-cost model: timed forwards on free KV slots.

Contract: :func:`calibrate` uses only the ``free_slots`` it is given (the lowest ``max_batch`` at
most), allocates them in the target's (and the draft model's) cache, and frees them again
whatever happens, so every slot that was free before is free after. Every timed forward goes
through ``engine.kcontrol.timing.time_call``, which synchronises the device around it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.kcontrol import timing

if TYPE_CHECKING:
    from engine.kcontrol.cost import CostModel
    from engine.model.runner import ModelRunner


def shapes(target: ModelRunner, slots: int, k_max: int) -> tuple[list[int], list[int]]:
    """The batches and draft widths to time: one per verify shape the target's fast path runs
    (its row buckets up to ``slots`` rows, its q buckets up to K_max + 1 query tokens, a width
    being q - 1), so the cost model reads every round's forward off a timing of that very shape
    (engine/kcontrol/cost.py ``ForwardTable``); without buckets, powers of two and the ends."""
    buckets = target.buckets()
    if buckets is not None:
        # every bucket above the slots timed: the rows there are, padded to the smallest one
        rows = [b for b in buckets[0] if b <= slots] or [slots]
        widths = [q - 1 for q in buckets[1] if q <= k_max + 1]
    else:
        rows = [b for b in (1, 2, 4, 8, 16) if b <= slots] + [slots]
        widths = [w for w in (0, 1, 3, 7) if w <= k_max] + [k_max]
    return sorted(set(rows)) if slots else [], sorted(set(widths) | {0})


def calibrate(
    cost: CostModel,
    target: ModelRunner,
    draft: ModelRunner | None = None,
    free_slots: Sequence[int] = (),
    *,
    prefix: int = 256,
    widths: Sequence[int] | None = None,
    repeats: int = 2,
    invariant: bool = False,
    max_batch: int = 16,
    k_max: int = 7,
) -> None:
    """Time the target's forward at every (B, w) of :func:`shapes` (B rows of w + 1 query tokens
    after a ``prefix``-token context, B up to the ``max_batch`` lowest free slots) and the draft
    model's step (one token a row, and eight: a catch-up of seven, at one row and at the largest
    batch), and add them to ``cost`` as fixed pseudo-observations (the best of ``repeats`` after
    one warm-up forward). ``widths`` overrides the widths :func:`shapes` picks. ``invariant``:
    the target's forwards are the batch-invariant ones (deterministic mode "always" runs no other).

    Every shape is timed, not a few read off a line: a forward's time is not linear in its rows
    and queries (bound by reading the weights at a few of them, by compute past that), and a
    line through narrow verifies at one row prices a wide verify at eight rows far too cheap."""
    # the lowest slots: the compiled path runs a forward over the row bucket of slots
    # [0, max slot] (engine/model/compiled.py), so slot 15 alone is priced as 16 rows
    slots = sorted(free_slots)[:max_batch]
    if not slots:
        return
    batches, chosen = shapes(target, len(slots), k_max)
    runners = [target] + ([draft] if draft is not None else [])
    room = min(r.max_len for r in runners)
    widths = [w for w in (chosen if widths is None else widths) if w + 2 <= room]
    # the context leaves room for the widest verify and a draft model's catch-up step
    prefix = max(1, min(prefix, room - max(max(widths) + 1, 8 if draft is not None else 0)))
    for r in runners:
        for s in slots:
            r.cache.allocate(s)
    try:
        for r in runners:  # one slot's context, copied to the others (a prefill each would cost)
            r.forward([[1] * prefix], [slots[0]], invariant=invariant and r is target)
            r.cache.commit(slots[0], prefix)
            for s in slots[1:]:
                r.cache.copy(slots[0], s, prefix)

        def timed(runner: ModelRunner, batch: int, q: int) -> float:
            rows, row_slots = [[1] * q for _ in range(batch)], slots[:batch]
            return timing.time_call(
                lambda: runner.forward(
                    rows, row_slots, logits="all", invariant=invariant and runner is target
                ),
                runner.device,
                repeats=repeats,
                warmup=1,
            )

        for b in batches:
            for w in widths:
                cost.add_calibration(b, w, timed(target, b, w + 1))
        if draft is not None:  # a draft step, and one that first catches up 7 tokens a row
            for b in sorted({1, batches[-1]}):
                cost.add_step_calibration(b, timed(draft, b, 1))
                cost.add_step_calibration(b, timed(draft, b, 8), catch_up=7 * b)
    finally:
        for r in runners:
            for s in slots:
                r.cache.free(s)
