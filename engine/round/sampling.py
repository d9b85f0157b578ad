"""Sampling parameters and the logits -> probabilities transform shared by target and draft.

The same transform (temperature, then top-k, then top-p) is applied to the target's and the draft
model's logits, so the rejection rule compares the two distributions the user actually asked for.
Greedy (temperature 0) rows are handled by argmax in the rejection rule; their probabilities are
computed at temperature 1 so that logprobs stay meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Engine-side sampling parameters (the HTTP layer converts its request into these)."""

    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    max_tokens: int = 16  # 0: prefill only (with prompt_logprobs: score the prompt)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: plus the top n
    prompt_logprobs: int | None = None  # the same for every prompt token (the model's own)
    # logit processing before temperature (penalties.py): OpenAI's, and repetition (1 = off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    grammar: str | None = None  # an llguidance grammar the output must match (grammar.py)
    # batch-invariant forwards while this request runs (engine/model/invariant.py; the engine's
    # ``deterministic`` mode must be "request" or "always")
    deterministic: bool = False

    def __post_init__(self):
        if self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")

    @property
    def penalized(self) -> bool:
        """Whether any logit processing (bias, penalties) applies to this request."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def needs_filter(params: list[SamplingParams]) -> bool:
    """Whether any row asks for top-k or top-p: decided on the host, from the request params."""
    return any(p.top_k > 0 or p.top_p < 1 for p in params)


def logits_to_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    filter_rows: bool | None = None,
) -> torch.Tensor:
    """``logits`` [batch, t, vocab]; per-row ``temperature``/``top_p`` float [batch] and ``top_k``
    long [batch] (0 = off). Greedy rows must come with temperature 1. ``filter_rows``: whether
    some row uses top-k / top-p, known on the host (:func:`needs_filter`); ``None`` reads it from
    the tensors, a device sync (tests only). Returns probs [batch, t, vocab]."""
    logits = logits / temperature[:, None, None]
    if filter_rows is None:
        filter_rows = bool((top_k > 0).any()) or bool((top_p < 1).any())
    if filter_rows:
        logits = _top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [batch, t, vocab]
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    remove = ranks[None, None, :] >= k[:, None, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # drop a token when the mass strictly before it already reaches top_p (the first always stays)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A categorical draw per row as an exponential race: ``argmax_i(w_i / E_i)`` with
    ``E_i ~ Exp(1)`` (``noise``, drawn by the round's plan from the request's own generator)
    picks i with probability ``w_i / sum(w)``; ``weights`` need not be normalised.
    ``[..., vocab]`` -> ``[...]``."""
    return (weights / noise).argmax(-1)
