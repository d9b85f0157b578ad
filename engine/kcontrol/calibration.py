"""Start-up calibration of the round-cost model: timed forwards on free KV slots.

Contract: :func:`calibrate` uses only the ``free_slots`` it is given (the lowest four at
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


def calibrate(
    cost: CostModel,
    target: ModelRunner,
    draft: ModelRunner | None = None,
    free_slots: Sequence[int] = (),
    prefix: int = 32,
    widths: Sequence[int] = (0, 1, 3, 7),
    repeats: int = 2,
    invariant: bool = False,
) -> None:
    """Time the target's forward at a few (B, w) (B = 1 and up to 4 free slots; w + 1 query
    tokens after a ``prefix``-token context) and the draft model's step (one token a row, and
    eight: a catch-up of seven), and add them
    to ``cost`` as fixed pseudo-observations (best of ``repeats`` after one warm-up forward).

    The default widths are one per verify shape of the configs' fast path (q buckets 1, 2, 4
    and 8 query tokens): the cost of the cheapest draft, w = 1, is measured rather than read off
    a line through wider verifies, which priced it too dear where it decides whether K = 1 pays
    (docs/measurements.md). ``invariant``: the target's forwards are the batch-invariant ones
    (deterministic mode "always" runs no other)."""
    # the lowest slots: the compiled path runs a forward over the row bucket of slots
    # [0, max slot] (engine/model/compiled.py), so slot 15 alone is priced as 16 rows
    slots = sorted(free_slots)[:4]
    runners = [target] + ([draft] if draft is not None else [])
    room = min(r.max_len for r in runners)
    widths = [w for w in widths if w + 2 <= room]
    prefix = max(1, min(prefix, room - max(widths) - 1))
    if not slots:
        return
    for r in runners:
        for s in slots:
            r.cache.allocate(s)
    try:
        for r in runners:
            for s in slots:
                r.forward([[1] * prefix], [s], invariant=invariant and r is target)  # context
                r.cache.commit(s, prefix)

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

        for b in sorted({1, len(slots)}):
            for w in widths:
                cost.add_calibration(b, w, timed(target, b, w + 1))
            if draft is not None:  # a draft step, and one that first catches up 7 tokens a row
                cost.add_step_calibration(b, timed(draft, b, 1))
                cost.add_step_calibration(b, timed(draft, b, 8), catch_up=7 * b)
    finally:
        for r in runners:
            for s in slots:
                r.cache.free(s)
