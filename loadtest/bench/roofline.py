"""Where the target's compiled CPU step spends its time, against the step's roofline.

The roofline of a step is the time its bytes take at the memory bandwidth measured in the same
run: the weights read once (the 4-bit layers and LM head as packed, the norms), plus the K/V
every row attends over. A step bound by memory, as a decode step of a small batch should be,
costs about that whatever its rows and queries; every millisecond above it is overhead to find.

For each shape (rows x query tokens a row x tokens in each row's cache) the benchmark times the
served forward (the target's compiled path, logits included) and profiles it op by op
(torch.profiler, self time), sorting the ops into parts:

- ``matmul``: the layers' 4-bit matmuls; ``head``: the LM head's; each beside the time its
  weight bytes take at the measured bandwidth;
- ``attention``: the attention op, beside the time its K/V bytes take;
- ``fused``: inductor's generated kernels (norms, rope, activations, cache writes, residuals);
- ``graph``: the compiled graphs' call wrappers;
- ``other ops``: every other op (the eager inputs: embedding, rotary tables, masks, copies);
- ``python``: the step's wall time under the profiler less the ops' self times (the runner's
  and the fast path's Python, the profiler's own cost).

The cache holds random K/V at every position a row attends over (memory really read, not the
zero pages of an untouched mapping); nothing is prefilled.

    python -m loadtest.bench.roofline --config configs/default.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine.builder import use_inductor_cache
from engine.config import EngineConfig
from engine.kcontrol.timing import time_calls
from engine.model import attention
from engine.model.compiled import CompileConfig
from engine.model.loader import default_cache_dir, load_model
from engine.model.q4_matmul import Q4Weight
from engine.model.quant import native_q4
from engine.model.runner import ModelRunner
from loadtest.machine import cpu_description

MATMUL_OPS = ("specd_q4::mm", "specd::q4_mm", "aten::_weight_int4pack_mm_for_cpu", "aten::mm")
GRAPH_OPS = ("## Call CompiledFxGraph", "Torch-Compiled Region", "AOTDispatcher", "Pregraph")
PARTS = ("matmul", "head", "attention", "fused", "graph", "other ops", "python")


def read_bandwidth(mib: int = 1024, repeats: int = 7) -> float:
    """Bytes a second read from memory by torch's threads: the best of ``repeats`` sums over a
    float32 tensor of ``mib`` MiB (far larger than the caches; a sum reads each byte once)."""
    x = torch.rand(mib * 2**18)
    x.sum()
    best = min(time_calls(x.sum, "cpu", repeats, 1))
    return x.numel() * 4 / best


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def weight_bytes(w) -> int:
    if isinstance(w, Q4Weight):
        return tensor_bytes(w.packed) + tensor_bytes(w.scale_zero)
    return tensor_bytes(w) if isinstance(w, torch.Tensor) else 0


def step_bytes(runner: ModelRunner, rows: int, q: int, context: int) -> dict[str, int]:
    """The bytes a step must read: each weight once, and each row's K/V of its context and its
    own queries, in every layer."""
    layers = sum(weight_bytes(w) for lw in runner.weights for w in lw)
    head = (
        weight_bytes(runner.head)
        if runner.head is not None
        else weight_bytes(runner.lm_head.weight)
    )
    sh, cache = runner.shape, runner.cache
    per_token = 2 * sh.kv_heads * sh.head_dim * cache.k[0].element_size()  # K and V, one layer
    kv = len(runner.weights) * rows * (context + q) * per_token
    return {"matmul": layers, "head": head, "attention": kv}


def part_of(name: str, shapes: list, head_shape: tuple) -> str:
    if name in MATMUL_OPS:
        return "head" if any(tuple(s) == head_shape for s in shapes) else "matmul"
    if "scaled_dot_product" in name or name.startswith("specd_attention"):
        return "attention"
    if "cpp_fused" in name or "cpp_kernel" in name:
        return "fused"
    if name.startswith(GRAPH_OPS):
        return "graph"
    return "other ops"


def profile_parts(runner: ModelRunner, call, steps: int) -> dict[str, float]:
    """Milliseconds a step of each part, from ``steps`` profiled calls."""
    from torch.profiler import ProfilerActivity, profile

    head_shape = tuple(runner.head.packed.shape) if runner.head is not None else ()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            call()
        wall = time.perf_counter() - t0
    parts: dict[str, float] = defaultdict(float)
    for e in prof.events():
        parts[part_of(e.name, e.input_shapes or [], head_shape)] += e.self_cpu_time_total
    ms = {k: v / 1e3 / steps for k, v in parts.items()}  # us -> ms a step
    ms["python"] = max(0.0, wall * 1e3 / steps - sum(ms.values()))
    return ms


def fill_cache(runner: ModelRunner, rows: int, context: int, q: int) -> None:
    """Rows 0..rows-1 hold ``context`` committed tokens of random K/V (and random values where
    their queries write)."""
    cache = runner.cache
    for s in range(rows):
        if s not in cache.free_slots():
            cache.free(s)
        cache.allocate(s)
        cache.reserve(s, context + q)
        cache.commit(s, context)
    for t in cache.k + cache.v:
        t[:rows, :, : context + q].normal_()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.roofline", description=__doc__)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--qs", default="1,4,8,16", help="query tokens a row (1: decode)")
    ap.add_argument("--contexts", default="256,6000", help="tokens in each row's cache")
    ap.add_argument("--reps", type=int, default=20, help="timed steps a shape, each round")
    ap.add_argument("--rounds", type=int, default=3, help="sweeps over the shapes (medians)")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument(
        "--compare",
        choices=["sdpa", "fused-numerics"],
        help="time a second runner beside the config's: attention on torch's SDPA, or inductor"
        " keeping fused intermediates in float32 (compile.eager_numerics false)",
    )
    ap.add_argument("--out", default="loadtest/results/roofline.txt")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # each generated kernel named in a profile
    cfg = EngineConfig.from_yaml(args.config)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    batches = [int(b) for b in args.batches.split(",")]
    qs = [int(q) for q in args.qs.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    use_inductor_cache(Path(cfg.cache_dir or default_cache_dir()) / "inductor")
    model, _ = load_model(cfg.model.source, cfg.model.dtype, cfg.model.device, cfg.cache_dir)
    weights = native_q4(cfg.model.source, model) if cfg.model.native_q4 else None
    compile_cfg = CompileConfig.from_dict(
        {**cfg.compile.__dict__, "enabled": True, "batch_buckets": batches, "q_buckets": qs}
    )

    def make_runner(cc: CompileConfig) -> ModelRunner:
        r = ModelRunner(
            model,
            max(batches),
            max(contexts) + max(qs) + cc.kv_align,
            weights=weights,
            compile=cc,
            k_max=max(qs) - 1,
        )
        r.warm_up()
        return r

    t0 = time.perf_counter()
    runners = {"specd": make_runner(compile_cfg)}
    if args.compare == "sdpa":  # the same forward with torch's SDPA for attention
        with attention.only_sdpa():
            runners["other"] = make_runner(compile_cfg)
    elif args.compare == "fused-numerics":
        runners["other"] = make_runner(dataclasses.replace(compile_cfg, eager_numerics=False))
    runner = runners["specd"]
    print(f"compiled in {time.perf_counter() - t0:.0f} s; path {runner.path()}", flush=True)
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    shapes = [(b, q, c) for c in contexts for b in batches for q in qs]
    times: dict[tuple, list[float]] = defaultdict(list)
    parts: dict[tuple, dict[str, float]] = {}
    for rnd in range(args.rounds):
        for b, q, c in shapes if rnd % 2 == 0 else shapes[::-1]:
            ids = torch.randint(0, 1000, (b, q))
            for name, r in runners.items():
                fill_cache(r, b, c, q)

                def call(ids=ids, b=b, q=q, r=r):
                    return r.forward(ids, list(range(b)), [q] * b, "all" if q > 1 else "last")

                sdpa = name == "other" and args.compare == "sdpa"
                with attention.only_sdpa() if sdpa else contextlib.nullcontext():
                    times[(name, b, q, c)] += time_calls(call, "cpu", args.reps, 3)
                    if rnd == 0 and name == "specd":
                        parts[(b, q, c)] = profile_parts(r, call, args.profile_steps)
            line = ", ".join(
                f"{n} {statistics.median(times[(n, b, q, c)]) * 1e3:.2f} ms" for n in runners
            )
            print(f"round {rnd} {b}x{q}x{c}: {line}", flush=True)
    lines = report(runner, args, bandwidth, shapes, times, parts)
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


def report(runner, args, bandwidth, shapes, times, parts) -> list[str]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gbs = bandwidth / 1e9
    med = {s[1:]: statistics.median(t) * 1e3 for s, t in times.items() if s[0] == "specd"}
    other = {s[1:]: statistics.median(t) * 1e3 for s, t in times.items() if s[0] == "other"}
    out = [
        (
            "# The target's compiled CPU step against its roofline (bytes it must read /"
            " measured read bandwidth)"
        ),
        f"# {now}, {cpu_description()}; path {runner.path()}, attention "
        + (f"specd's kernel ({attention.isa()})" if attention.kernel_available() else "SDPA"),
        f"# python -m loadtest.bench.roofline --config {args.config} --batches {args.batches}"
        f" --qs {args.qs} --contexts {args.contexts} --reps {args.reps} --rounds {args.rounds}"
        + (f" --compare {args.compare}" if args.compare else ""),
        (
            f"# read bandwidth {gbs:.1f} GB/s (sum of a 1 GiB float32 tensor, best of 7);"
            " step: median of the rounds' timed steps; parts: torch.profiler self time of one"
            f" round's {args.profile_steps} steps (the profiler's cost lands in python)"
        ),
        "# matmul / head / attention: ms (its bytes' time at the bandwidth)",
        "",
        f"{'rows x q x ctx':>16} {'step ms':>8} {'roofline':>8} {'ratio':>6}  "
        + " ".join(f"{p:>15}" for p in PARTS)
        + (f"  {args.compare} step ms (ratio)" if other else ""),
    ]
    for s in shapes:
        nbytes = step_bytes(runner, *s)
        roof = sum(nbytes.values()) / bandwidth * 1e3
        cells = []
        for p in PARTS:
            v = parts[s].get(p, 0.0)
            floor = f" ({nbytes[p] / bandwidth * 1e3:.2f})" if p in nbytes else ""
            cells.append(f"{v:.2f}{floor}".rjust(15))
        name = "x".join(map(str, s))
        beside = f"  {other[s]:8.2f} ({med[s] / other[s]:.2f}x)" if s in other else ""
        head = f"{name:>16} {med[s]:8.2f} {roof:8.2f} {med[s] / roof:5.2f}x  "
        out.append(head + " ".join(cells) + beside)
    out += ["", "## the issue's ratios (same run)"]
    contexts = sorted({c for _, _, c in shapes})
    for c in contexts:
        dec = med.get((1, 1, c))
        if dec is None:
            continue
        for q in sorted({q for _, q, cc in shapes if cc == c and q > 1}):
            if (1, q, c) in med:
                out.append(f"ctx {c}: verify of {q} / decode, batch 1: {med[(1, q, c)] / dec:.2f}x")
        for b in sorted({b for b, _, cc in shapes if cc == c and b > 1}):
            if (b, 1, c) in med:
                ratio = med[(b, 1, c)] / dec
                out.append(f"ctx {c}: batch-{b} decode / batch-1 decode: {ratio:.2f}x")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
