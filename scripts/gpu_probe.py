"""Where a decode step's time goes on a GPU (issue 21): Llama-3.1-8B layer shapes, bf16, random
weights, batch 1, one query token, keys up to ``--kv``.

For a few decoder layers (``--layers``) it prints, per layer: the CUDA kernels an eager forward
launches (torch.profiler), and the time of a CUDA-graph replay of the stack against the time its
weights take to read at the measured copy bandwidth. Variants, side by side in one run:

- ``old``: the layer as before (separate Q/K/V and gate/up matmuls, SDPA's ``enable_gqa`` with a
  boolean mask, RMSNorm in four kernels);
- ``new``: the layer as it runs on CUDA now (fused matrices, SDPA's GQA on an additive mask
  built once a forward, one-kernel RMSNorm);
- ``inductor``: the new layer compiled by inductor (guards on, static shapes) and then captured
  (the kernels fused inside the graph), last: a failure there cannot spoil the others.

Then SDPA alone for the attention shapes, by variant. ``python scripts/gpu_probe.py`` on the GPU
machine; on CPU ``--device cpu --dtype float32 --layers 2 --kv 64 --reps 2`` checks the plumbing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from collections import Counter

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
import engine.model.layer as layer_mod
import engine.model.runner as runner_mod
from engine.model.cuda_graphs import record
from engine.model.layer import layer_group
from engine.model.runner import ModelRunner
from engine.model.weights import ModelWeights, from_layer, fuse_dense
from loadtest.bench.steps import SHAPES, in_dtype


# the first GPU session's layer, kept here as the baseline the probe compares against
def old_rms_norm(x, weight, eps):
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def old_groups(shape, x):
    return shape.kv_heads != shape.num_heads and x.device.type == "cpu" and x.dtype != torch.float32


@contextlib.contextmanager
def old_path():
    """The layer as it ran on CUDA before (with a runner over unfused weights, from_layer):
    SDPA's GQA on a boolean mask (cast in every layer), RMSNorm in four kernels."""
    saved = (layer_mod.rms_norm, layer_mod.groups_queries)
    saved += (runner_mod.groups_queries, runner_mod.additive_mask)
    layer_mod.rms_norm, layer_mod.groups_queries = old_rms_norm, old_groups
    runner_mod.groups_queries, runner_mod.additive_mask = old_groups, lambda m, d: m
    try:
        yield
    finally:
        layer_mod.rms_norm, layer_mod.groups_queries = saved[:2]
        runner_mod.groups_queries, runner_mod.additive_mask = saved[2:]


def kernels(fn, dev) -> Counter:
    """Names of the device kernels one call of ``fn`` launches (CPU: operators)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    names: Counter = Counter()
    for e in prof.events():
        on_dev = str(getattr(e, "device_type", "")).endswith("CUDA")
        if (dev.type == "cuda" and on_dev) or (dev.type != "cuda" and e.name.startswith("aten::")):
            names[e.name[:90]] += 1
    return names


def timed_replay(fn, dev, reps: int) -> float:
    """Seconds per call of ``fn`` captured as a CUDA graph and replayed (CPU: called)."""
    if dev.type != "cuda":
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps
    _, replay = record(fn)  # as the engine captures its forwards
    for _ in range(3):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def copy_bandwidth(dev) -> float:
    """Bytes read + written per second by a device-to-device copy, measured as the GPU
    benchmark measures the bound (loadtest/bench/gpu_parts.bandwidth: 2 GiB on CUDA)."""
    from loadtest.bench.gpu_parts import bandwidth

    n, t_copy, _ = bandwidth(dev, 2.0 if dev.type == "cuda" else 0.125)
    return 2 * n / t_copy


def sdpa_variants(q, k, v, m, dtype) -> dict:
    """The attention of one decode step three ways: SDPA's GQA on the boolean mask (the old
    CUDA layer), and the query heads grouped by KV head on a boolean or an additive mask."""
    nh, kvh, hd = q.shape[1], k.shape[1], q.shape[-1]
    gm = m.repeat(1, 1, nh // kvh, 1)
    fm = layer_mod.additive_mask(gm, dtype)
    qg = q.reshape(1, kvh, nh // kvh, hd)
    sdpa = F.scaled_dot_product_attention
    return {
        "gqa_bool": lambda: sdpa(q, k, v, attn_mask=m, enable_gqa=True),
        "grouped_bool": lambda: sdpa(qg, k, v, attn_mask=gm),
        "grouped_float": lambda: sdpa(qg, k, v, attn_mask=fm),
    }


def sdpa_rows(dev, dtype, kvs, reps) -> list[dict]:
    rows = []
    nh, kvh, hd = 32, 8, 128
    for L in kvs:
        q = torch.randn(1, nh, 1, hd, device=dev, dtype=dtype)
        k = torch.randn(1, kvh, L, hd, device=dev, dtype=dtype)
        v = torch.randn(1, kvh, L, hd, device=dev, dtype=dtype)
        m = torch.arange(L, device=dev)[None, None, None, :] <= L - 10  # [1, 1, 1, L]
        for name, fn in sdpa_variants(q, k, v, m, dtype).items():
            ks = kernels(fn, dev)
            us = timed_replay(fn, dev, reps) * 1e6
            n = sum(ks.values())
            rows.append(dict(kv=L, variant=name, us=round(us, 2), kernels=n, names=sorted(ks)[:4]))
            print(f"  sdpa kv={L} {name}: {us:.1f} us, {n} kernels {sorted(ks)[:3]}", flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-inductor", dest="inductor", action="store_false")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(SHAPES["llama-8b"], num_hidden_layers=a.layers, vocab_size=1024)
    if dev.type == "cpu":
        shape.update(SHAPES["tiny"], num_hidden_layers=a.layers)
    cfg = LlamaConfig(max_position_embeddings=8192, rope_theta=500000.0, **shape)
    model = in_dtype(dtype, dev, lambda: LlamaForCausalLM(cfg))
    layers = model.model.layers
    # the CUDA rules, as far as they run on CPU: the fused weights
    fused = ModelWeights([fuse_dense(m) for m in layers], None)
    runner = ModelRunner(model, a.batch, a.kv + 8, weights=fused)
    unfused = ModelWeights([from_layer(m) for m in layers], None)
    old = ModelRunner(model, a.batch, a.kv + 8, weights=unfused)
    layer_bytes = (
        sum(p.numel() * p.element_size() for p in model.model.layers.parameters()) / a.layers
    )
    bw = copy_bandwidth(dev)
    ideal_us = layer_bytes / bw * 1e6
    out: dict = dict(
        args=vars(a),
        torch=torch.__version__,
        copy_gbs=bw / 1e9,
        layer_mb=layer_bytes / 1e6,
        ideal_layer_us=ideal_us,
        rows=[],
    )
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    print(
        f"torch {torch.__version__}; copy {bw / 1e9:.0f} GB/s; a layer's weights "
        f"{layer_bytes / 1e6:.1f} MB = {ideal_us:.1f} us at that rate",
        flush=True,
    )
    B = a.batch
    ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
    pos = torch.full((B, 1), a.kv - 1, dtype=torch.long, device=dev)
    write_pos = torch.full((B, 1), runner.cache.max_len, dtype=torch.long, device=dev)  # scratch
    rows = torch.arange(B, device=dev)
    kv_idx = torch.arange(a.kv, device=dev)

    def stack(group_fn=None, runner=runner):
        return lambda: runner.layers_forward(
            ids,
            pos,
            write_pos,
            rows,
            kv_idx,
            0,
            group_fn=group_fn,
            group_size=a.layers if group_fn else None,
        )

    def measure(name, fn):
        with torch.inference_mode():
            fn()
            ks = kernels(fn, dev)
            s = timed_replay(fn, dev, a.reps)
        per = s / a.layers * 1e6
        row = dict(
            variant=name,
            layer_us=round(per, 2),
            of_ideal=round(ideal_us / per, 3),
            kernels_per_layer=round(sum(ks.values()) / a.layers, 1),
            top=ks.most_common(25),
        )
        out["rows"].append(row)
        print(
            f"\n== {name}: {per:.1f} us a layer ({ideal_us / per:.2f} of the weight-read time),"
            f" {row['kernels_per_layer']} kernels a layer",
            flush=True,
        )
        for k, n in ks.most_common(25):
            print(f"   {n:4d}  {k}")

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1, default=str)

    with old_path():
        measure("old", stack(runner=old))
    measure("new", stack())
    save()
    print("\n== SDPA alone (batch 1, 32 query heads, 8 KV heads, head_dim 128)", flush=True)
    try:
        out["sdpa"] = sdpa_rows(dev, dtype, [a.kv, 4096], a.reps)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    save()
    if a.inductor:
        try:
            t = time.perf_counter()
            compiled = torch.compile(layer_group, fullgraph=True, dynamic=False)
            with torch.inference_mode():
                stack(compiled)()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            out["inductor_compile_s"] = time.perf_counter() - t
            print(f"\ninductor compile: {out['inductor_compile_s']:.1f} s", flush=True)
            measure("inductor", stack(compiled))
            with torch.inference_mode():
                ref = stack()()
                got = stack(compiled)()
            out["inductor_max_abs_diff"] = (ref.float() - got.float()).abs().max().item()
            print(f"inductor vs eager max |diff| {out['inductor_max_abs_diff']:.3g}")
        except Exception:  # noqa: BLE001
            out["inductor_error"] = traceback.format_exc()[-2000:]
            traceback.print_exc()
    save()


if __name__ == "__main__":
    main()
