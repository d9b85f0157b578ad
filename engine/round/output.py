"""A step's output per request (engine/records/output.py), and the round's one device->host
transfer.

Invariant: a round reads the device once. :func:`to_host` packs the acceptance result (accepted
count, next token, drafted tokens) and, when a row asked for them, the log-probabilities of the
emitted tokens and their top alternatives into one float64 tensor (token ids are exact in float64)
and reads it with a single ``tolist()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.records.output import StepOutput
from engine.records.sequence import RoundStats, Sequence, Status


@dataclass
class HostRow:
    """One row of the round's result, on the host."""

    accepted: int  # leading drafted tokens kept
    next_token: int  # the recovered or bonus token
    drafts: list[int]  # [K] drafted tokens (padded)
    chosen: list[float] | None  # [K+1] log-prob of the emitted token at each verified position
    top_ids: list[list[int]] | None  # [K+1][n]
    top_lps: list[list[float]] | None  # [K+1][n]
    leaves: int = 0  # a draft tree's leaves verified (round/draft_tree.py)
    leaf_hit: int = 0  # 1: its path ended at one


def to_host(
    probs: torch.Tensor | None,  # [batch, K+1, vocab] processed target probabilities (read
    # for logprobs only: None with top_n None)
    drafts: torch.Tensor,  # [batch, K] long
    num_acc: torch.Tensor,  # [batch] long
    next_tok: torch.Tensor,  # [batch] long
    top_n: int | None,  # the most top alternatives any row asked for; None: no row wants logprobs
    tree_stats: torch.Tensor | None = None,  # [batch, 2] long: a tree round's (draft_tree.settle)
) -> list[HostRow]:
    """The round's single device->host read (see the module docstring)."""
    batch, k = drafts.shape
    k1 = k + 1
    if tree_stats is None:
        tree_stats = num_acc.new_zeros(batch, 2)
    parts = [num_acc[:, None], next_tok[:, None], tree_stats, drafts]
    n = max(top_n or 0, 1)
    if top_n is not None:
        assert probs is not None
        rows = torch.arange(batch, device=drafts.device)
        pad = torch.zeros(batch, 1, dtype=drafts.dtype, device=drafts.device)
        ids = torch.cat([drafts, pad], 1)  # [batch, K+1]
        ids[rows, num_acc] = next_tok  # the emitted token at each verified position
        logp = torch.log(probs).clamp_min(-9999.0)  # [batch, K+1, vocab]; -inf -> -9999 (JSON)
        chosen = logp.gather(-1, ids[..., None]).squeeze(-1)  # [batch, K+1]
        top = logp.topk(n, dim=-1)  # [batch, K+1, n]
        parts += [chosen, top.indices.flatten(1), top.values.flatten(1)]
    packed = torch.cat([p.to(torch.float64) for p in parts], dim=1).tolist()  # the one sync
    out = []
    for row in packed:
        a, tok, leaves, hit, rest = int(row[0]), int(row[1]), int(row[2]), int(row[3]), row[4:]
        drafted = [int(t) for t in rest[:k]]
        chosen_l = top_ids = top_lps = None
        if top_n is not None:
            chosen_l = rest[k : k + k1]
            flat_ids, flat_lp = rest[k + k1 : k + k1 + k1 * n], rest[k + k1 + k1 * n :]
            top_ids = [[int(t) for t in flat_ids[j * n : (j + 1) * n]] for j in range(k1)]
            top_lps = [flat_lp[j * n : (j + 1) * n] for j in range(k1)]
        out.append(HostRow(a, tok, drafted, chosen_l, top_ids, top_lps, leaves, hit))
    return out


def make_output(
    s: Sequence, emitted: list[int], stats: RoundStats | None, row: HostRow
) -> StepOutput:
    """The output of one row: its emitted tokens, and their logprobs if the request asked."""
    out = StepOutput(s.request_id, emitted, s.status is Status.FINISHED, s.finish_reason, stats, s)
    if s.params.logprobs is not None and row.chosen is not None:
        n, k = len(emitted), s.params.logprobs
        assert row.top_ids is not None and row.top_lps is not None
        out.logprobs = row.chosen[:n]
        out.top_logprobs = [list(zip(row.top_ids[j][:k], row.top_lps[j][:k])) for j in range(n)]
    return out
