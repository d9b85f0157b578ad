"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .k_control import KState
from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SpecParams:
    """Per-request speculation settings (already validated and capped by the server config)."""

    enabled: bool = True
    k: int | None = (
        None  # a fixed draft length for every round; None: the engine's controller decides
    )
    k_max: int | None = (
        None  # cap on the controller's K for this request (None: the engine's k_max)
    )


@dataclass
class RoundStats:
    """What one speculative round did for one row."""

    k: int  # draft length asked for
    drafted: int  # tokens the drafter actually proposed (n-gram may find fewer than k)
    accepted: int
    emitted: int  # tokens appended to the output (after stop conditions)
    draft_s: float  # wall time of the batch's propose phase
    verify_s: float  # wall time of the batch's verify forward (and target probabilities)
    width: int = 0  # the batch's padded draft width (the verify fed width + 1 tokens per row)
    accept_s: float = 0.0  # wall time of the batch's accept phase (rejection rule + host sync)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecParams
    generator: torch.Generator | None = None
    arrival: float = 0.0  # time.perf_counter() when the engine took the request
    admitted: float | None = None  # when it got a KV slot (queue time = admitted - arrival)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    slot: int = -1
    # running totals, for usage and metrics
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    kstate: KState = field(default_factory=KState)  # the K controller's view of this request

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)
