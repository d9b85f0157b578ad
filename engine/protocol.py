"""What the engine worker drives: the :class:`Engine` protocol. engine/engine.py's
:class:`~engine.engine.SpecEngine` implements it; the worker's tests drive fakes through it.
Only the worker's engine thread calls these methods."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.records.output import StepOutput
from engine.records.params import SamplingParams, SpecParams


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of what the engine holds (read by the worker for metrics and admission)."""

    running: int  # sequences holding a KV slot (prefilling or decoding)
    waiting: int  # sequences queued for a slot
    kv_used_tokens: int
    kv_free_slots: int
    kv_slots: int
    drafter_failures: int
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache so far
    prefix_hits: int = 0  # of them, restored from it (not computed)
    prefix_cache_tokens: int = 0  # the prefix cache's size in positions (0: off)
    kv_budget_tokens: int = 0  # the KV positions running sequences may hold in all
    preemptions: int = 0  # sequences preempted (KV freed, recomputed later) so far


class Engine(Protocol):
    """What the worker drives (engine/engine.py's SpecEngine). ``lossless`` is false when a
    benchmark built it with another acceptance rule; ``num_slots``: sequences that can hold a
    KV slot."""

    @property
    def lossless(self) -> bool: ...
    @property
    def num_slots(self) -> int: ...

    def forward_paths(self) -> dict[str, str]: ...  # component -> the path its forward takes

    def add_request(  # (request_id, prompt_ids, params, spec, group)
        self, rid: str, ids: list[int], p: SamplingParams, s: SpecParams | None, g: str | None, /
    ) -> object: ...

    def abort(self, request_id: str) -> bool: ...
    def step(self) -> list[StepOutput]: ...
    def has_work(self) -> bool: ...
    def needs_warm_up(self) -> bool: ...
    def warm_up(self) -> None: ...
    def load(self) -> EngineLoad: ...
    def held_ids(self) -> list[str]: ...  # requests holding a KV slot
    def waiting_ids(self) -> list[str]: ...  # requests queued for one
