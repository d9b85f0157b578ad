"""The target's features of each training batch, computed on the first epoch and read back on
the later ones.

The target's forward over a batch (the three tapped features, the final hidden states and the
loss mask) is ~45% of a training step in bf16 on 2 Zen 5 cores (4.4 of ~10 s for 4,096 tokens;
it was ~80% in fp32 on Zen 3), and it does not change between epochs: the target is frozen. The
cache stores, per batch, what :func:`~train.batches.target_features` returns (bf16 or fp32, as
the target computed it: ~4.6 KB a token in bf16) in ``<folder>/<tag>/<key>.pt``, where

* ``tag`` names what the features depend on besides the rows: the target, its dtype, whether its
  layers are 4-bit, the device type (other than the CPU) and the tapped layers;
* ``key`` is a hash of the batch's rows (their token ids and where each answer starts).

Invariant: a batch read back is the batch the target would compute again, bit for bit (same
rows, same tag), so the fit is the same with or without the cache; a test checks this. The
draft-vocabulary logits are not stored (8,192 values a token): they are recomputed from the
stored final hidden states by the same matmul (:func:`~train.batches.to_batch`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from engine.model.runner import ModelRunner

from .batches import Batch, Features, Row, target_features, to_batch


def rows_key(rows: list[Row]) -> str:
    """A stable hash of the batch's content: token ids and answer starts, in order."""
    blob = json.dumps([[r.start, r.ids] for r in rows], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class FeatureCache:
    """Features by batch, on disk. ``folder=None`` computes every batch (no cache)."""

    def __init__(self, folder: str | Path | None, tag: str):
        self.dir = Path(folder) / tag if folder else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def features(self, runner: ModelRunner, rows: list[Row], t2d: torch.Tensor) -> Features:
        path = self.dir / f"{rows_key(rows)}.pt" if self.dir is not None else None
        if path is not None and path.exists():  # written whole (below): a kill leaves a .tmp
            self.hits += 1
            return Features(**torch.load(path, weights_only=True))
        f = target_features(runner, rows, t2d, host=self.dir is not None)
        self.misses += 1
        if path is not None:
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            torch.save(vars(f), tmp)
            tmp.replace(path)  # whole files only, so a reader never sees half of one
        return f

    def batch(
        self, runner: ModelRunner, rows: list[Row], draft_ids: torch.Tensor, t2d: torch.Tensor
    ) -> Batch:
        return to_batch(runner, self.features(runner, rows, t2d), draft_ids)


def cache_tag(
    target: str, dtype: str, native_q4: bool, taps: tuple[int, ...], device: str = "cpu"
) -> str:
    """The folder name for features of this target configuration (a GPU's kernels round
    differently from a CPU's: its features are kept apart; CPU names stay as they were)."""
    name = target.rstrip("/").split("/")[-1]
    q = "-q4" if native_q4 else ""
    where = "" if device == "cpu" else f"-{device}"
    return f"{name}-{dtype}{q}{where}-taps{'_'.join(str(t) for t in taps)}"
