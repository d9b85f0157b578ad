"""What attention costs the compiled decode / verify step on CPU, and a candidate kernel
(``loadtest/bench/attn_op.py``, op ``specd_attn::attend``) against torch's SDPA there.

The bench checks the kernel against SDPA in float32 and times both per call (eager); then it
compiles the target forward three times in one process: attention by SDPA, by the kernel (at
every width), and swapped for an identity (no attention at all: a timing bound, not a model),
and times the three alternately at batch 1 and 8, 1 to 8 query tokens, ~300 tokens of context.

    python -m loadtest.bench.attn_kernel --config configs/default.yaml
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics

import torch

from loadtest.bench import attn_op


def attend(qs, keys, vals, mask, scale) -> torch.Tensor:
    """``engine.model.layer.grouped_sdpa``'s contract on the kernel at any width: qs ``[B, heads, q,
    hd]``, keys / vals ``[B, kv_heads, L, hd]``, a bool mask ``[B, 1, q or group * q, L]``."""
    B, nh, q, hd = qs.shape
    kvh = keys.shape[1]
    o = attn_op.attend(qs.reshape(B, kvh, nh // kvh * q, hd), keys, vals, mask, scale)
    return o.reshape(B, nh, q, hd)


def case(B: int, q: int, ctx: int, L: int, heads=9, kv_heads=3, hd=64, seed=0):
    """Random queries, keys as a view of a bigger slot cache, a causal mask by position."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, B + 2, kv_heads, L + 16, hd, generator=g).bfloat16()
    keys, vals = cache[0, 1 : B + 1, :, :L], cache[1, 1 : B + 1, :, :L]
    qs = torch.randn(B, heads, q, hd, generator=g).bfloat16()
    pos = ctx - q + torch.arange(q)[None].repeat(B, 1)  # [B, q]
    mask = (torch.arange(L)[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [B, 1, q, L]
    return qs, keys, vals, mask


def standalone(shapes, calls: int) -> None:
    from engine.kcontrol.timing import time_calls
    from engine.model.layer import grouped_sdpa

    print("standalone, per call: specd_attn::attend against grouped SDPA (eager), 9 / 3 heads")
    for B, q, ctx in shapes:
        L = -(-ctx // 64) * 64
        qs, keys, vals, mask = case(B, q, ctx, L)
        ours = attend(qs, keys, vals, mask, 0.125).float()
        kvh = keys.shape[1]  # attn_op.reference over the kernel's grouped rows, in float32
        grouped = qs.reshape(B, kvh, qs.shape[1] // kvh * q, qs.shape[3])
        ref = attn_op.reference(grouped, keys, vals, mask, 0.125).reshape(qs.shape)
        sdpa = grouped_sdpa(qs, keys, vals, mask, 0.125).float()
        us = {}
        for name, fn in (("ours", attend), ("sdpa", grouped_sdpa)):
            call = functools.partial(fn, qs, keys, vals, mask, 0.125)
            us[name] = statistics.median(time_calls(call, "cpu", calls, warmup=20)) * 1e6
        err, sdpa_err = (ours - ref).abs().max(), (sdpa - ref).abs().max()
        print(f"  {B}x{q} ctx {ctx}: {us['ours']:6.1f} / {us['sdpa']:6.1f} us  "
              f"max |diff| to fp32: {err:.4f} (SDPA's {sdpa_err:.4f})")  # fmt: skip


def in_graph(config: str, shapes, reps: int) -> None:
    from engine.config import CompileConfig, EngineConfig
    from engine.model import layer
    from engine.model.loader import load_model
    from engine.model.quant import native_q4
    from engine.model.runner import ModelRunner
    from loadtest.bench.steps import time_forward

    cfg = EngineConfig.from_yaml(config)
    model, _ = load_model(cfg.model.source, "bfloat16", "cpu", cfg.cache_dir)
    slots, ctx_len = max(b for b, _ in shapes), 300
    ctx = torch.randint(
        0, model.config.vocab_size, (1, ctx_len), generator=torch.Generator().manual_seed(0)
    )
    ccfg = CompileConfig(
        enabled=True,
        batch_buckets=sorted({b for b, _ in shapes}),
        q_buckets=sorted({q for _, q in shapes}),
        layers_per_graph=cfg.compile.layers_per_graph,
    )

    weights = native_q4(cfg.model.source, model) if cfg.model.native_q4 else None

    def runner() -> ModelRunner:  # traced with whatever layer.grouped_sdpa is now
        k_max = max(q for _, q in shapes) - 1
        r = ModelRunner(model, slots, 1024, weights=weights, compile=ccfg, k_max=k_max)
        for s in range(slots):
            r.forward(ctx, [s], counts=[ctx_len])
            r.cache.commit(s, ctx_len)
        r.warm_up()
        return r

    runners = {"sdpa": runner()}
    kept = layer.grouped_sdpa
    for name, fn in (("ours", attend), ("none", lambda qs, keys, vals, mask, scale: qs * 1.0)):
        layer.grouped_sdpa = fn
        try:
            runners[name] = runner()
        finally:
            layer.grouped_sdpa = kept
    ids = ctx[:, -8:]  # the context's own last tokens again: a verify of 8 real tokens
    with torch.inference_mode():
        a, b = (runners[n].forward(ids, [0], [8], "all").logits for n in ("sdpa", "ours"))
    same = f"{int((a.argmax(-1) == b.argmax(-1)).sum())} of 8"
    times: dict[str, dict] = {n: {s: [] for s in shapes} for n in runners}
    for i in range(4):
        for name in list(runners)[:: 1 if i % 2 == 0 else -1]:
            for b_, q in shapes:
                times[name][b_, q] += time_forward(runners[name], b_, q, reps, warmup=2)
    print(f"\ncompiled target step ({config}, {ctx_len} tokens of context), median ms; the "
          f"kernel's argmax over an 8-token verify is SDPA's at {same} positions")  # fmt: skip
    print(f"{'rows x tokens':>14} {'SDPA':>8} {'kernel':>8} {'none':>8} {'kernel / SDPA':>14} "
          f"{'attention share':>16}")  # fmt: skip
    for s in shapes:
        t = {n: statistics.median(times[n][s]) * 1e3 for n in runners}
        ratio, share = t["ours"] / t["sdpa"], 1 - t["none"] / t["sdpa"]
        print(f"{s[0]:>8} x {s[1]:<3} {t['sdpa']:>8.2f} {t['ours']:>8.2f} {t['none']:>8.2f} "
              f"{ratio:>13.2f}x {share:>15.0%}")  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.attn_kernel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not attn_op.available():
        raise SystemExit("the kernel is not available here (see the log)")
    standalone([(1, 1, 300), (1, 2, 300), (1, 4, 300), (1, 8, 300), (8, 1, 300), (1, 1, 2000)],
               a.calls)  # fmt: skip
    in_graph(a.config, [(1, 1), (1, 2), (1, 4), (1, 8), (8, 1), (8, 2)], a.reps)


if __name__ == "__main__":
    main()
