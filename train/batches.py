"""Training batches: self-distilled sequences, the draft vocabulary, and the target's features.

A record (train/distill.py) is a prompt and the target's own answer. A training row is
``prompt + output`` cut at ``max_len`` tokens; the loss counts positions whose next token is an
output token. Rows are grouped by length into batches of at most ``tokens`` tokens (less
padding). The target (a :class:`~engine.model.runner.ModelRunner`, as served) computes every
row's tapped features and its final hidden states in one prefill-shaped forward, without
committing anything to its cache.
"""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.runner import ModelRunner


@dataclass
class Row:
    ids: list[int]
    start: int  # index of the first output token


def read_rows(path: Path, max_len: int, limit: int = 0, greedy_only: bool = False) -> list[Row]:
    """The records of ``path`` as rows (``greedy_only``: those answered at temperature 0): JSON
    lines, gzipped (``.gz``) or not, or packed rows (``.npz``: train/packed.py, no
    temperatures kept)."""
    if path.suffix == ".npz":
        from .packed import load_rows

        if greedy_only:
            raise ValueError(f"{path}: packed rows keep no temperatures (greedy_only)")
        return load_rows(path, max_len, limit)
    rows = []
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if greedy_only and r.get("temperature", 1.0) != 0:
                continue
            ids = (r["prompt_ids"] + r["output_ids"])[:max_len]
            if len(r["prompt_ids"]) + 1 < len(ids):
                rows.append(Row(ids, len(r["prompt_ids"])))
            if limit and len(rows) >= limit:
                break
    return rows


def _output_counts(rows: list[Row]) -> Counter[int]:
    return Counter(t for r in rows for t in r.ids[r.start :])


def _share(counts: Counter[int], inside: set[int]) -> float:
    return sum(c for t, c in counts.items() if t in inside) / max(1, sum(counts.values()))


def draft_vocab(rows: list[Row], size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent output tokens (sorted ids) and the share of output tokens
    they cover."""
    counts = _output_counts(rows)
    top = [t for t, _ in counts.most_common(size)]
    return torch.tensor(sorted(top)), _share(counts, set(top))


def draft_coverage(rows: list[Row], ids: torch.Tensor) -> float:
    """The share of the rows' output tokens inside the draft vocabulary ``ids``."""
    return _share(_output_counts(rows), set(ids.tolist()))


def batches(rows: list[Row], tokens: int, seed: int) -> list[list[Row]]:
    """Rows grouped by length, at most ``tokens`` (padded) tokens a batch, in shuffled order."""
    order = sorted(rows, key=lambda r: len(r.ids))
    out: list[list[Row]] = []
    cur: list[Row] = []
    for r in order:
        if cur and (len(cur) + 1) * len(r.ids) > tokens:
            out.append(cur)
            cur = []
        cur.append(r)
    if cur:
        out.append(cur)
    random.Random(seed).shuffle(out)
    return out


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S] long, zero-padded
    feats: torch.Tensor  # [B, S, taps * H] the target's tapped features
    target_logits: torch.Tensor  # [B, S, draft_vocab] the target's logits over the draft vocab
    predict: torch.Tensor  # [B, S] bool: position q's next token is a learned output token


@dataclass
class Features:
    """What one target forward gives a batch (train/feature_cache.py stores these)."""

    tokens: torch.Tensor  # [B, S] long, zero-padded
    feats: torch.Tensor  # [B, S, taps * H] the target's tapped features
    hidden: torch.Tensor  # [B, S, H] the target's final-normed hidden states
    predict: torch.Tensor  # [B, S] bool: position q's next token is a learned output token


@torch.no_grad()  # not inference_mode: the head's autograd reads these tensors
def target_features(
    runner: ModelRunner, rows: list[Row], t2d: torch.Tensor, host: bool = True
) -> Features:
    """One forward of the target over ``rows`` (slots 0..B-1, nothing committed). ``predict``
    keeps the answer positions whose target top token is in the draft vocabulary (``t2d``).
    ``host``: the features on the host, for the cache (feature_cache.py); without a cache they
    stay on the runner's device (copies: the runner's buffers are reused by its next forward)."""
    B, S = len(rows), max(len(r.ids) for r in rows)
    h, tapped = runner.hidden([r.ids for r in rows], list(range(B)))  # [B, S, H]
    assert tapped is not None
    where = "cpu" if host else tapped.device
    feats = tapped.to(where, copy=True)
    tokens = torch.zeros(B, S, dtype=torch.long)
    predict = torch.zeros(B, S, dtype=torch.bool)
    for b, r in enumerate(rows):
        tokens[b, : len(r.ids)] = torch.tensor(r.ids)
        predict[b, r.start - 1 : len(r.ids) - 1] = True  # position q predicts t_{q+1}
    flat = h.reshape(B * S, -1)
    top = torch.cat([runner.logits(c).argmax(-1) for c in flat.split(1024)])  # the target's top
    predict &= t2d.cpu()[top.view(B, S).cpu()]
    return Features(tokens, feats, h.to(where, copy=True), predict)


@torch.no_grad()
def to_batch(runner: ModelRunner, f: Features, draft_ids: torch.Tensor) -> Batch:
    """The training batch, on the runner's device: the target's logits over the draft
    vocabulary from its hidden states (the LM head's rows of ``draft_ids``)."""
    dev = runner.device
    w = runner.lm_head.weight[draft_ids.to(dev)]  # [draft_vocab, H]
    target_logits = f.hidden.to(dev, w.dtype) @ w.T  # [B, S, draft_vocab]
    return Batch(f.tokens.to(dev), f.feats.to(dev), target_logits, f.predict.to(dev))


def target_batch(
    runner: ModelRunner, rows: list[Row], draft_ids: torch.Tensor, t2d: torch.Tensor
) -> Batch:
    """One forward of the target over ``rows``: the training batch, uncached."""
    return to_batch(runner, target_features(runner, rows, t2d), draft_ids)
