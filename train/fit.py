"""Train the EAGLE-3 head on self-distilled data: ``python -m train fit`` (or
``specd train-drafter``).

One step: the target (in ``--dtype``) computes the batch's features and its distribution over
the draft vocabulary (train/batches.py); the head runs ``ttt_steps`` training-time-test steps
(train/ttt.py) in fp32 (or under bf16 autocast, ``--bf16``) on ``--device`` (cpu, or cuda: the
same code), AdamW with warm-up and cosine
decay. A checkpoint (head, optimizer, position in the data) is written every
``checkpoint_every`` steps and at the end; a run started again with the same ``--work`` resumes
from it. The head is written in the EAGLE-3 format to ``--out`` with ``training.json``: data,
steps, tokens, wall time and the per-step agreement with the target on the ``eval`` split.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from engine.drafters.eagle.head import (
    Eagle3Head,
    HeadConfig,
    default_aux_layers,
    load_head,
    save_head,
)

from .acceptance import acceptance_by_step
from .batches import Row, batches, draft_coverage, draft_vocab, read_rows
from .feature_cache import FeatureCache, cache_tag
from .ttt import TTTForward, ttt_loss


def head_for(model, draft_size: int) -> Eagle3Head:
    """A new head for ``model`` (a transformers Llama): its geometry, its final norm and the LM
    head rows of the draft vocabulary as the start."""
    c = model.config
    rope = getattr(c, "rope_parameters", None) or {}
    cfg = HeadConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None),
        vocab_size=c.vocab_size,
        draft_vocab_size=draft_size,
        target_hidden_size=c.hidden_size,
        aux_layers=default_aux_layers(c.num_hidden_layers),
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        max_position_embeddings=c.max_position_embeddings,
    )
    return Eagle3Head(cfg)


def epoch_order(n: int, epoch: int, seed: int) -> list[int]:
    """The batches' order in ``epoch``: as :func:`batches` shuffled them in epoch 0, a
    permutation of its own (fixed by seed and epoch, so a resumed run keeps it) after."""
    order = list(range(n))
    if epoch:
        random.Random(seed * 7919 + epoch).shuffle(order)
    return order


def simulated_tau(agreement: list[float], k: int) -> float:
    """Tokens per target pass that a chain of ``k`` drafts would give if the draft at step j
    were accepted with probability ``agreement[j]`` given the ones before it:
    ``1 + sum_i prod_{j <= i} agreement[j]`` (steps past the measured ones repeat the last)."""
    tau, run = 1.0, 1.0
    for i in range(k):
        run *= agreement[min(i, len(agreement) - 1)]
        tau += run
    return tau


def run(args: argparse.Namespace) -> None:
    from tqdm import tqdm
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from engine.config import DEFAULT_TARGET
    from engine.model.loader import load_model
    from engine.model.quant import native_q4
    from engine.model.runner import ModelRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data, work = Path(args.data), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows_of = {f: read_rows(data / f, args.max_len) for f in args.train_files.split(",")}
    train_rows = [r for rows in rows_of.values() for r in rows]
    eval_rows: list[Row] = []
    if (data / args.eval_file).exists():
        eval_rows = read_rows(data / args.eval_file, args.max_len, args.eval_rows)
    dev = torch.device(args.device)
    model, _ = load_model(DEFAULT_TARGET, args.dtype, args.device)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16)
    groups = batches(train_rows, args.tokens, seed=args.seed)
    slots = max(len(g) for g in groups + batches(eval_rows, args.tokens, 0))
    if args.init:  # warm start from a head already trained (its vocabulary kept)
        head = load_head(args.init, model.config.num_hidden_layers)
        ids = head.draft_to_target
        coverage = draft_coverage(train_rows, ids)
    elif args.vocab_of:  # a new head on another head's draft vocabulary (the ablations)
        ids = load_head(args.vocab_of, model.config.num_hidden_layers).draft_to_target
        coverage = draft_coverage(train_rows, ids)
    else:
        vocab_rows = train_rows
        if args.vocab_from:  # the target's own answers: the tokens it will be asked to draft
            vocab_rows = [
                r
                for f in args.vocab_from.split(",")
                for r in (rows_of[f] if f in rows_of else read_rows(data / f, args.max_len))
            ]
        ids, coverage = draft_vocab(vocab_rows, args.draft_vocab)
    if not args.init:  # a new head: the target's final norm and LM head rows as the start
        head = head_for(model, len(ids))
        head.set_vocab(ids)
        with torch.no_grad():
            head.lm_head.weight.copy_(model.lm_head.weight[ids].float())
            head.norm.weight.copy_(model.model.norm.weight.float())
    head.to(dev)
    runner = ModelRunner(
        model,
        num_slots=slots,
        max_len=args.max_len,
        taps=tuple(head.config.aux_layers),
        weights=native_q4(DEFAULT_TARGET, model) if args.native_q4 else None,
    )
    cache = FeatureCache(
        args.feature_cache or None,
        cache_tag(DEFAULT_TARGET, args.dtype, args.native_q4, head.config.aux_layers, dev.type),
    )
    rotary = LlamaRotaryEmbedding(config=head.config.llama_config()).to(dev)
    fwd = TTTForward(head, model.model.embed_tokens, rotary)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = args.epochs * len(groups)
    if args.max_steps:
        total = min(total, args.max_steps)
    ckpt, step, seconds, seen = work / "checkpoint.pt", 0, 0.0, 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location=dev, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, seconds, seen = state["step"], state["seconds"], state["tokens"]
        total = state.get("total", total)
        print(f"resumed at step {step} / {total}")

    def lr_at(i: int) -> float:
        warm = min(args.warmup, total // 10 + 1)
        if i < warm:
            return args.lr * (i + 1) / warm
        return args.lr * 0.5 * (1 + math.cos(math.pi * (i - warm) / max(1, total - warm)))

    def save_checkpoint() -> None:
        state = {"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "total": total}
        torch.save(state | {"seconds": seconds, "tokens": seen}, work / "checkpoint.tmp")
        (work / "checkpoint.tmp").replace(ckpt)

    eval_steps = args.eval_steps or args.ttt_steps

    def agreement_now() -> list[float]:  # greedy: top-1 agreement per draft step
        got, _ = acceptance_by_step(
            fwd, runner, cache, eval_rows, eval_steps, args.tokens, args.bf16, sampled=False
        )
        return got

    # the starting head on the same rows, same run (a warm start's baseline)
    init_agreement = agreement_now() if args.eval_init and eval_rows and step == 0 else None
    if init_agreement is not None:
        print(f"the starting head's agreement by step: {init_agreement}", flush=True)
    elif args.eval_init:
        print("--eval-init: not measured (a resumed fit, or no eval rows)", flush=True)
    bar = tqdm(total=total, initial=step, desc="train head", unit="step")
    at_3 = 0.0
    t_last = time.perf_counter()
    while step < total:
        epoch, i = divmod(step, len(groups))
        group = groups[epoch_order(len(groups), epoch, args.seed)[i]]
        b = cache.batch(runner, group, ids, head.t2d)
        if args.noise:  # EAGLE's feature noise: uniform, relative to the feature scale
            b.feats = b.feats + (torch.rand_like(b.feats) - 0.5) * args.noise * b.feats.std()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with autocast:
            outs = fwd(b.feats, b.tokens, args.ttt_steps)
            loss, _, accs = ttt_loss(
                head.lm_head, outs, b.target_logits, b.predict, hard=args.loss == "hard"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), args.clip)
        opt.step()
        step += 1
        seen += int(b.tokens.count_nonzero())
        now = time.perf_counter()
        seconds, t_last = seconds + now - t_last, now
        # the schedule's length from the step time (kept on resume): steps 4-8 timed, past the
        # first ones' warm-up (a GPU's first steps plan kernels and grow its allocator)
        if step == 3:
            at_3 = seconds
        if args.minutes and step == 8 and at_3:
            per_step = (seconds - at_3) / 5
            left = max(0.0, args.minutes * 60 - seconds)
            total = max(step + 1, min(total, step + int(left / per_step)))
            bar.total = total
        if args.minutes and seconds > args.minutes * 60:  # the time is the limit, not the guess
            total = step
        bar.update(1)
        acc = " ".join(f"{a:.2f}" for a in accs)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=acc, cached=cache.hits)
        if step % args.checkpoint_every == 0 or step == total:
            save_checkpoint()
    bar.close()
    agreement = agreement_now()
    out = Path(args.out)
    save_head(head, out)
    report = {
        "data": [str(data / f) for f in args.train_files.split(",")],
        "train_sequences": len(train_rows),
        "train_tokens_seen": seen,
        "steps": step,
        "epochs": round(step / len(groups), 3),
        "tokens_per_batch": args.tokens,
        "ttt_steps": args.ttt_steps,
        "lr": args.lr,
        "init": args.init,
        "noise": args.noise,
        "loss": args.loss,
        "draft_vocab": len(ids),
        "draft_vocab_from": (
            f"{args.init} (kept)"
            if args.init
            else f"{args.vocab_of} (its vocabulary, new weights)"
            if args.vocab_of
            else args.vocab_from or args.train_files
        ),
        "draft_vocab_coverage": round(coverage, 4),
        "wall_seconds": round(seconds, 1),
        "eval_data": str(data / args.eval_file),
        "eval_sequences": len(eval_rows),
        "eval_top1_agreement_by_step": [round(a, 4) for a in agreement],
        "init_eval_top1_agreement_by_step": (
            [round(a, 4) for a in init_agreement] if init_agreement is not None else None
        ),
        "device": str(dev),
        # teacher-forced agreement chained as acceptance: an estimate of tau, not a measurement
        "eval_simulated_tau_k3": round(simulated_tau(agreement, 3), 3) if agreement else None,
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data", default=".cache/distill", help="train.jsonl / eval.jsonl folder")
    ap.add_argument("--train-files", default="train.jsonl", help="comma-separated, in --data")
    ap.add_argument("--eval-file", default="eval.jsonl", help="in --data: the e bucket's rows")
    ap.add_argument("--work", default=".cache/train", help="checkpoints (resumable)")
    ap.add_argument(
        "--feature-cache",
        default=".cache/features",
        help="the target's features by batch, kept for later epochs ('' : none; ~4.6 KB a "
        "token in bf16)",
    )
    ap.add_argument("--out", default="models/smollm2-135m-eagle3")
    # 8,192: within ~1% of the best size by coverage and cost (loadtest/results/draft_vocab.txt)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument(
        "--vocab-from",
        default=None,
        help="files (in --data) the draft vocabulary is counted on (default: the training files)",
    )
    ap.add_argument("--init", default=None, help="warm start from this head folder")
    ap.add_argument(
        "--vocab-of", default=None, help="a new head on this head folder's draft vocabulary"
    )
    ap.add_argument(
        "--loss",
        choices=["soft", "hard"],
        default="soft",
        help="cross-entropy against the target's distribution (soft) or its top token",
    )
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many (0: epochs)")
    ap.add_argument(
        "--minutes",
        type=float,
        default=0,
        help="at most this long: the schedule's "
        "steps are set from the first 3 steps' time (0: no limit)",
    )
    ap.add_argument("--tokens", type=int, default=4096, help="padded tokens per batch")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--clip", type=float, default=0.5)
    ap.add_argument("--noise", type=float, default=0.0)
    ap.add_argument("--eval-rows", type=int, default=200)
    ap.add_argument(
        "--eval-steps", type=int, default=0, help="draft steps evaluated (0: --ttt-steps)"
    )
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument(
        "--eval-init",
        action="store_true",
        help="also evaluate the starting head (--init) on the eval rows before training",
    )
    # the target's layers 4-bit as served: the 4-bit matmuls are slower than dense bf16 ones on
    # long training rows, so the features come from the same weights dequantized to bf16
    ap.add_argument("--native-q4", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    # the target's dtype, and bf16 autocast for the head: fast where the CPU has AVX-512 bf16
    # (or on a GPU); on an AVX2-only CPU bf16 matmuls run ~8x slower than fp32
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda where a GPU is lent")
