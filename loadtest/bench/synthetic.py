"""Achieved speedup against the speculative-decoding bound, at a synthetic acceptance rate.

Benchmark only. Each drafted token is accepted with probability α (independently, given the ones
before it were), whatever the target says: the output is NOT the target's. The engine's acceptance
rule is swapped for this one in this process only (``SpecEngine.accept``); the server never
builds such an engine, and :class:`engine.worker.worker.EngineWorker` refuses to serve one.

With a draft model whose step costs c target decode steps, K drafts per round, and a verify that
costs one decode step, a round emits E = (1 - α^(K+1)) / (1 - α) tokens in 1 + K·c decode-step
times (Leviathan et al. 2023), so the speedup over plain decoding is at most

    bound(α, K) = (1 - α^(K+1)) / ((1 - α)(1 + K·c)).

For α in {0.6, 0.8, 0.9} and a few K, the script measures plain decoding and speculation (a fixed
K, the draft model proposing, synthetic acceptance) on the same prompts with ``ignore_eos``,
reports tokens per target pass (should be E), the achieved speedup, the bound with the measured
c, and their ratio. The gap is what the engine loses to a verify costing more than a decode step,
draft catch-up feeds, sampling and bookkeeping.

    # GPU: real-shape models with random weights (no download), CUDA graphs
    python -m loadtest.bench.synthetic --random-config llama-8b --draft-config llama-1b \
        --device cuda --compile cuda-graphs
    # CPU: a SmolLM2-shaped random target, its first 4 layers as the draft
    python -m loadtest.bench.synthetic --random-config smollm2-135m --draft-layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from engine.drafters import ModelDrafter
from engine.engine import SpecEngine
from engine.kcontrol.controller import FixedK
from engine.kcontrol.timing import time_call
from engine.model.compiled import CompileConfig
from engine.model.runner import ModelRunner
from engine.records.params import SamplingParams, SpecParams
from engine.round.rejection import rejection_sample
from loadtest.bench.steps import SHAPES, random_model, time_forward


class SyntheticAccept:
    """An acceptance rule with the signature of :func:`engine.round.rejection.rejection_sample`
    that accepts each drafted token with probability ``alpha``; the next token is the target's
    argmax at the first rejected position (or the bonus position). ``alpha`` None: the exact rule.
    A benchmark builds its engine with one (``SpecEngine(accept=...)``) and sets ``alpha`` between
    runs; such an engine is not lossless, and the worker refuses to serve it."""

    def __init__(self, gen: torch.Generator, alpha: float | None = None):
        self.gen, self.alpha = gen, alpha

    def __call__(self, target_probs, draft_tokens, num_draft, draft_probs, greedy, uniforms, noise):
        if self.alpha is None:
            args = (draft_probs, greedy, uniforms, noise)
            return rejection_sample(target_probs, draft_tokens, num_draft, *args)
        batch, k = draft_tokens.shape
        dev, gen = target_probs.device, self.gen
        ok = torch.rand(batch, k, generator=gen, device=gen.device).to(dev) < self.alpha
        ok &= torch.arange(k, device=dev)[None, :] < num_draft[:, None]  # [batch, K]
        num_acc = ok.long().cumprod(dim=1).sum(dim=1)  # [batch] leading accepted drafts
        rows = torch.arange(batch, device=dev)
        return num_acc, target_probs[rows, num_acc].argmax(dim=-1)  # [batch], [batch]


def bound(alpha: float, k: int, c: float) -> float:
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (1 + k * c))


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.bench.synthetic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--random-config", default="smollm2-135m", help=f"one of {sorted(SHAPES)}")
    ap.add_argument("--draft-config", default=None, help="draft model shape (random weights)")
    ap.add_argument(
        "--draft-layers",
        type=int,
        default=4,
        help="without --draft-config: the target's first N layers as the draft",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--compile",
        default="none",
        help="none, or a fast-path mode (default; cuda-graphs on a GPU)",
    )
    ap.add_argument("--alphas", default="0.6,0.8,0.9")
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="plain / speculative alternations")
    ap.add_argument("--json", default="loadtest/results/bench_synthetic.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    dtype, dev = getattr(torch, args.dtype), torch.device(args.device)
    alphas = [float(a) for a in args.alphas.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    B, max_len = args.batch, args.prompt_tokens + args.max_tokens + max(ks) + 16

    ccfg = None
    if args.compile != "none":
        ccfg = CompileConfig(
            enabled=True,
            mode=args.compile,
            batch_buckets=[B],
            q_buckets=sorted({1, 2} | {k + 1 for k in ks}),
        )
    fast = dict(compile=ccfg, k_max=max(ks))
    target_model = random_model(args.random_config, dtype, args.device)
    target = ModelRunner(target_model, B, max_len, **fast)
    if args.draft_config:
        draft_model = random_model(args.draft_config, dtype, args.device)
        draft_runner = ModelRunner(draft_model, B, max_len, name="draft", **fast)
        draft_desc = f"{args.draft_config} (random weights)"
    else:
        draft_runner = ModelRunner(
            target_model, B, max_len, args.draft_layers, name="draft", **fast
        )
        draft_desc = f"the target's first {args.draft_layers} layers"
    vocab = min(target.vocab_size, draft_runner.vocab_size)
    accept = SyntheticAccept(torch.Generator(device=dev).manual_seed(2))  # alpha set per run
    engine = SpecEngine(
        target,
        ModelDrafter(draft_runner, vocab),
        eos_token_ids=[],
        controller=FixedK(0),
        k_max=max(ks),
        accept=accept,
    )
    for r in engine.runners():
        r.warm_up()

    # c: a draft step in target decode steps, on a filled cache
    for r in engine.runners():
        for s in range(B):
            r.cache.allocate(s)
            r.forward([[1] * args.prompt_tokens], [s])
            r.cache.commit(s, args.prompt_tokens)
    t_ms, d_ms = (
        statistics.median(time_forward(r, B, 1, 20, warmup=2)) * 1e3 for r in (target, draft_runner)
    )
    for r in engine.runners():
        for s in range(B):
            r.cache.free(s)
    c = d_ms / t_ms
    print(f"target decode step {t_ms:.2f} ms, draft step {d_ms:.2f} ms: c = {c:.3f}", flush=True)

    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(B)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(spec: SpecParams, alpha: float | None) -> tuple[float, float]:
        """tok/s over the whole generate (prefill included: short prompts) and tokens per pass."""
        accept.alpha = alpha
        seqs = []
        dt = time_call(lambda: seqs.extend(engine.generate(prompts, params, spec)), dev)
        tokens = sum(len(s.output_ids) for s in seqs)
        return tokens / dt, tokens / sum(s.target_passes for s in seqs)

    run(SpecParams(enabled=False), None)  # warm
    rows = []
    for alpha in alphas:
        for k in ks:
            plain, spec, tpp = [], [], []
            for i in range(args.repeats):  # ABBA
                order = (
                    [("plain", None), ("spec", alpha)]
                    if i % 2 == 0
                    else [("spec", alpha), ("plain", None)]
                )
                for name, a in order:
                    if name == "plain":
                        plain.append(run(SpecParams(enabled=False), None)[0])
                    else:
                        tps, per_pass = run(SpecParams(k=k), a)
                        spec.append(tps)
                        tpp.append(per_pass)
            p, s_ = statistics.median(plain), statistics.median(spec)
            row = {
                "alpha": alpha,
                "k": k,
                "plain_tok_s": p,
                "spec_tok_s": s_,
                "tokens_per_pass": statistics.mean(tpp),
                "expected_tokens": (1 - alpha ** (k + 1)) / (1 - alpha),
                "speedup": s_ / p,
                "bound": bound(alpha, k, c),
            }
            row["of_bound"] = row["speedup"] / row["bound"]
            rows.append(row)
            print(
                f"alpha {alpha:.1f} K {k}: plain {p:.1f} tok/s, spec {s_:.1f} tok/s, "
                f"speedup {row['speedup']:.2f}x, bound {row['bound']:.2f}x",
                flush=True,
            )

    desc = f"{args.random_config} target (random weights), draft {draft_desc}, {args.dtype}, {dev}"
    if dev.type == "cpu":
        desc += f", {torch.get_num_threads()} threads"
    print(
        f"\nSynthetic acceptance ({desc}; batch {B}, {args.max_tokens} tokens, compile "
        f"{args.compile}; c = {c:.3f}; median of {args.repeats})"
    )
    print(
        f"{'alpha':>6}{'K':>4}{'plain tok/s':>13}{'spec tok/s':>12}{'tok/pass':>10}{'E':>7}"
        f"{'speedup':>9}{'bound':>8}{'of bound':>10}"
    )
    for r in rows:
        print(
            f"{r['alpha']:>6.1f}{r['k']:>4}{r['plain_tok_s']:>13.1f}{r['spec_tok_s']:>12.1f}"
            f"{r['tokens_per_pass']:>10.2f}{r['expected_tokens']:>7.2f}{r['speedup']:>8.2f}x"
            f"{r['bound']:>7.2f}x{r['of_bound']:>10.2f}"
        )
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "device": str(dev),
                    "c": c,
                    "target_ms": t_ms,
                    "draft_ms": d_ms,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
