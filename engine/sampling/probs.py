"""The logits -> probabilities transform shared by target and draft (its parameters:
engine/records/params.py).

The same transform (temperature, then top-k, then top-p) is applied to the target's and the draft
model's logits, so the rejection rule compares the two distributions the user actually asked for.
Greedy (temperature 0) rows are handled by argmax in the rejection rule; their probabilities are
computed at temperature 1 so that logprobs stay meaningful.
"""

from __future__ import annotations

import torch

from engine.records.params import SamplingParams


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
