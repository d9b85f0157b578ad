"""One request's state inside the engine.

Invariants of a :class:`Sequence`:
  * ``output_ids`` only grows, through :meth:`Sequence.append`; :meth:`token_array` is then a
    view of prompt + output kept incrementally (no per-round rebuild of the token list).
  * ``slot`` is the KV-cache slot the sequence holds while prefilling or running, -1 otherwise.
  * ``group`` names the client request the sequence belongs to (choices of one request share
    it): the scheduler caps what one group holds at once, so other requests keep flowing.
  * ``prefill_ids`` are the tokens a prefill feeds: the prompt, or, after a preemption (the
    sequence lost its KV and was queued again), the prompt and the output so far, recomputed as
    if they were the prompt; the next token is then sampled from the last one's logits, as a
    new sequence's first token is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.records.kstate import KState
from engine.records.params import SamplingParams, SpecParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
    forced: int = 0  # tokens the grammar forced that were drafted for free and kept (forced.py)
    leaves: int = 0  # a draft tree's leaves verified beside the chain (round/draft_tree.py)
    leaf_hit: int = 0  # 1: the accepted path ended at a leaf (counted in ``accepted``)
    copied: bool = False  # its draft was copied from text (n-gram, suffix), not a model's


@dataclass
class PromptLogprob:
    """One prompt token's log-probability given the tokens before it (the raw model's, no
    temperature or processing), the top alternatives as (token id, logprob), and the token's
    rank among all (1: the most probable; 1 + how many tokens are more probable)."""

    logprob: float
    top: list[tuple[int, float]]
    rank: int = 0  # (0: not computed)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecParams
    generator: torch.Generator | None = None  # a seeded request's own; None: the engine's
    arrival: float = 0.0  # time.perf_counter() when the engine took the request
    admitted: float | None = None  # when it got a KV slot (queue time = admitted - arrival)
    group: str = ""  # the client request it belongs to ("" = its own request_id)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    slot: int = -1
    # a choice whose prompt another choice of its group is prefilling: it takes a copy of that
    # prefill (KV and drafter state) when it completes instead of prefilling again
    lead: Sequence | None = field(default=None, repr=False)
    cached_tokens: int = 0  # prefill positions restored from the prefix cache, not computed
    prefill_ids: list[int] = field(default_factory=list)  # set from the prompt (see above)
    preemptions: int = 0  # times the sequence lost its KV and was recomputed
    # with params.grammar: its llguidance matcher, standing at the committed output (grammar.py)
    matcher: Any = field(default=None, repr=False)
    # running totals, for usage and metrics
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    tree_rounds: int = 0  # rounds verified as a draft tree (round/draft_tree.py)
    leaf_hits: int = 0  # of them, rounds whose accepted path ended at a leaf
    kstate: KState = field(default_factory=KState)  # the K controller's view of this request
    # with params.prompt_logprobs: per prompt token (None for the first) its log-probability
    # under the model and its top alternatives, filled chunk by chunk as the prompt is prefilled
    prompt_logprobs: list[PromptLogprob | None] | None = None
    _buf: np.ndarray = field(init=False, repr=False)  # prompt + output, then spare room
    _len: int = field(init=False, repr=False, default=0)

    def __post_init__(self) -> None:
        self.group = self.group or self.request_id
        self.prefill_ids = self.prefill_ids or self.prompt_ids
        n = len(self.prompt_ids) + len(self.output_ids)
        self._buf = np.empty(max(16, 2 * n), dtype=np.int64)
        self._buf[: len(self.prompt_ids)] = self.prompt_ids
        self._buf[len(self.prompt_ids) : n] = self.output_ids
        self._len = n

    def append(self, tokens: list[int]) -> None:
        """Append emitted tokens to the output (the only way the output grows)."""
        end = self._len + len(tokens)
        if end > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), end), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : end] = tokens
        self._len = end
        self.output_ids += tokens

    def token_array(self) -> np.ndarray:
        """Prompt + output as a read-only int64 view (valid until the next :meth:`append`)."""
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view

    def preempt(self) -> None:
        """Its KV is gone (the scheduler freed its slot): its next prefill recomputes the prompt
        and the output so far."""
        self.prefill_ids = self.prompt_ids + self.output_ids
        if not self.output_ids:  # preempted in its first prefill: that starts over, scores too
            self.prompt_logprobs = None
        self.status, self.slot, self.cached_tokens, self.lead = Status.WAITING, -1, 0, None
        self.preemptions += 1

    @property
    def resumed(self) -> bool:
        """Whether its prefill recomputes output too (preempted after its first token: its
        prompt logprobs, if asked for, were already sent)."""
        return len(self.prefill_ids) > len(self.prompt_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill computes prompt logprobs (asked for, and not yet sent)."""
        return self.params.prompt_logprobs is not None and not self.resumed

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return self._len

    @property
    def last_token(self) -> int:
        return int(self._buf[self._len - 1])

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)
