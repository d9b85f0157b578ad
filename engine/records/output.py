"""What a step hands back per request (made by engine/round/output.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.records.sequence import PromptLogprob, RoundStats, Sequence


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stats: RoundStats | None = None  # None for the token sampled from the prefill
    seq: Sequence | None = field(default=None, repr=False)
    # target log-probabilities (after temperature / top-k / top-p) of each new token, and the
    # top-n alternatives as (token id, logprob), when the request asked for logprobs
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    passes: int = 1  # target passes this output covers (more when a reader's buffer merged)
    # the prompt's log-probabilities (SamplingParams.prompt_logprobs), on a sequence's first output
    prompt_logprobs: list[PromptLogprob | None] | None = None
