"""``python -m train ablate``: which of the sources' training tricks the head needs, measured
on the ``e`` bucket.

Each arm trains a new head from the same start (the target's final norm and LM-head rows over
the shipped head's draft vocabulary), on the same batches in the same order, with the same
schedule, and changes one thing against the recipe (``base``: soft labels, training-time test
over 4 draft steps, no feature noise):

* ``hard``: cross-entropy against the target's top token instead of its distribution;
* ``ttt1``: one draft step in training (no training-time test): the head never sees its own
  outputs as input;
* ``noise``: EAGLE-1's uniform feature noise (±0.1 of the features' std).

Every arm is evaluated over 4 chained draft steps on the same held-out ``e`` rows, teacher-
forced (train/acceptance.py): greedy acceptance (top-1 agreement with the target), sampled
acceptance at T = 1 (the overlap of the target's and the head's distributions), and τ at K = 3
simulated from the greedy one. Features
come from the fit's cache when an earlier fit with the same rows, batch size and seed wrote it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import fit
from .acceptance import acceptance_by_step
from .fit import simulated_tau

ARMS: dict[str, dict[str, Any]] = {
    "base": {},
    "hard": {"loss": "hard"},
    "ttt1": {"ttt_steps": 1},
    "noise": {"noise": 0.2},
}


def arm_args(arm: str, args: argparse.Namespace) -> argparse.Namespace:
    """The fit's options for ``arm``: the shared recipe with the arm's one change."""
    ap = argparse.ArgumentParser()
    fit.add_arguments(ap)
    base = ap.parse_args([])
    shared = {
        "data": args.data,
        "train_files": args.train_files,
        "eval_file": args.eval_file,
        "eval_rows": args.eval_rows,
        "eval_steps": 4,
        "feature_cache": args.feature_cache,
        "vocab_of": args.vocab_of,
        "work": str(Path(args.work) / arm),
        "out": str(Path(args.work) / arm / "head"),
        "max_steps": args.steps,
        "tokens": args.tokens,
        "max_len": args.max_len,
        "lr": args.lr,
        "warmup": args.warmup,
        "checkpoint_every": 10,
        "seed": args.seed,
        "dtype": args.dtype,
        "bf16": args.bf16,
    }
    return argparse.Namespace(**(vars(base) | shared | ARMS[arm]))


def held_out(args: argparse.Namespace, arms: list[argparse.Namespace]):
    """(greedy, sampled) acceptance per draft step of each arm's head on the held-out rows
    (train/acceptance.py), the target loaded once."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from engine.config import DEFAULT_TARGET
    from engine.drafters.eagle.head import load_head
    from engine.model.loader import load_model
    from engine.model.runner import ModelRunner

    from .batches import batches, read_rows
    from .feature_cache import FeatureCache, cache_tag
    from .ttt import TTTForward

    rows = read_rows(Path(args.data) / args.eval_file, args.max_len, args.eval_rows)
    model, _ = load_model(DEFAULT_TARGET, args.dtype)
    slots = max(len(g) for g in batches(rows, args.tokens, 0))
    out = []
    for ns in arms:
        head = load_head(ns.out, model.config.num_hidden_layers)
        taps = tuple(head.config.aux_layers)
        runner = ModelRunner(model, num_slots=slots, max_len=args.max_len, taps=taps)
        # the runner is dense, as every arm's fit (no arm sets native_q4)
        tag = cache_tag(DEFAULT_TARGET, ns.dtype, False, head.config.aux_layers)
        cache = FeatureCache(args.feature_cache or None, tag)
        rotary = LlamaRotaryEmbedding(config=head.config.llama_config())
        fwd = TTTForward(head, model.model.embed_tokens, rotary)
        out.append(acceptance_by_step(fwd, runner, cache, rows, 4, args.tokens, args.bf16))
    return out


def run(args: argparse.Namespace) -> None:
    arms = args.arms.split(",")
    fits = [arm_args(arm, args) for arm in arms]
    reports = []
    for arm, ns in zip(arms, fits):
        report_file = Path(ns.out) / "training.json"
        if not report_file.exists():  # an arm already trained is read back (resumable)
            print(f"[ablate] {arm}: {ARMS[arm] or 'the recipe'}", flush=True)
            fit.run(ns)
        reports.append(json.loads(report_file.read_text()))
    measured = held_out(args, fits)
    print(f"\narms from a new head, {args.steps} steps of {args.tokens} tokens, lr {args.lr}")
    print(f"held-out acceptance by draft step ({args.eval_rows} e-bucket rows, teacher-forced):")
    print("greedy = top-1 agreement; T=1 = sum min(p, q); tau3 = simulated tau at K = 3 (greedy)")
    print(f"{'arm':<6} {'greedy by step':<31} {'T=1 by step':<31} {'tau3':>5} {'s':>5}")
    for arm, r, (greedy, sampled) in zip(arms, reports, measured):
        g = " ".join(f"{x:.4f}" for x in greedy)
        t = " ".join(f"{x:.4f}" for x in sampled)
        print(f"{arm:<6} {g:<31} {t:<31} {simulated_tau(greedy, 3):5.3f} {r['wall_seconds']:5.0f}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated of {list(ARMS)}")
    ap.add_argument("--steps", type=int, default=60, help="training steps per arm")
    ap.add_argument("--work", default=".cache/ablate", help="one folder per arm (resumable)")
    ap.add_argument("--data", default=".cache/distill")
    ap.add_argument("--train-files", default="train.jsonl")
    ap.add_argument("--eval-file", default="eval.jsonl")
    ap.add_argument("--eval-rows", type=int, default=160)
    # the eighth fit's batches (rows <= 640 tokens, 4,096 a batch, seed 4): its feature cache
    ap.add_argument("--feature-cache", default=".cache/features8")
    ap.add_argument("--vocab-of", default="models/smollm2-135m-eagle3")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=640)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
