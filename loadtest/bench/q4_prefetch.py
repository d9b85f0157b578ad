"""specd's 4-bit kernel with and without its software prefetch, side by side in one process.

``specd_q4::mm`` asks the cache for the weights ``kAhead`` groups of 32 inputs before it reads
them (engine/model/csrc/q4_avx512.cpp); ``specd_q4::mm_ahead`` takes the distance as an argument, 0
meaning none. Two measurements, the distances interleaved ``--rounds`` times:

* **matmuls**: every 4-bit matrix of the config's target (30 layers and the LM head), in forward
  order, over ``M`` rows of random bf16 input: what a step's matmuls read, cold-ish (~100 MB
  packed for SmolLM2, more than the caches keep);
* **steps**: the target's eager forward of ``q`` tokens in one row (256 tokens in its cache),
  its 4-bit matmuls routed through ``mm_ahead`` at each distance.

Results are identical at every distance (a prefetch changes no arithmetic: the test suite checks
it bit for bit); only time differs.

    python -m loadtest.bench.q4_prefetch
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.model import q4_matmul
from engine.model.loader import load_model
from engine.model.quant import native_q4
from engine.model.runner import ModelRunner
from loadtest.bench.steps import time_forward


def weights_of(runner: ModelRunner) -> list[q4_matmul.Q4Weight]:
    """The runner's 4-bit matrices for specd's kernel, in forward order (layers, then the head)."""
    out = [w for lw in runner.weights for w in lw if isinstance(w, q4_matmul.Q4Weight)]
    if runner.head is not None:
        out.append(runner.head)
    return [w for w in out if w.kernel == "specd"]


def pass_seconds(weights: list[q4_matmul.Q4Weight], m: int, ahead: int) -> float:
    xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=torch.bfloat16) for w in weights}
    t = time.perf_counter()
    for w in weights:
        torch.ops.specd_q4.mm_ahead(xs[w.shape[1]], w.packed, ahead)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.q4_prefetch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--aheads", default="0,8,16,32", help="distances in groups; 0 = no prefetch")
    ap.add_argument("--rows", default="1,2,4,8", help="M of the matmul passes")
    ap.add_argument("--qs", default="1,2,4", help="tokens of the eager steps")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    if not q4_matmul.kernel_available():
        print("specd's 4-bit kernel is not available here (AVX-512 VNNI + BF16, a compiler)")
        return 1
    aheads = [int(a) for a in args.aheads.split(",")]
    rows, qs = [int(m) for m in args.rows.split(",")], [int(q) for q in args.qs.split(",")]
    cfg = EngineConfig.from_yaml(args.config)
    target, _ = load_model(cfg.model.source, "bfloat16", "cpu", cfg.cache_dir)
    runner = ModelRunner(target, 1, 400, weights=native_q4(cfg.model.source, target))
    weights = weights_of(runner)
    mb = sum(w.packed.numel() for w in weights) / 1e6
    ctx = torch.randint(0, runner.vocab_size, (1, 256))
    runner.forward(ctx, [0], counts=[256])
    runner.cache.commit(0, 256)

    mats: dict[tuple[int, int], list[float]] = {(a, m): [] for a in aheads for m in rows}
    steps: dict[tuple[int, int], list[float]] = {(a, q): [] for a in aheads for q in qs}
    plain_mm = q4_matmul.q4_mm
    try:
        for _ in range(args.rounds):
            for a in aheads:
                for m in rows:
                    mats[(a, m)] += [pass_seconds(weights, m, a) for _ in range(5)]

                def routed(x, w, a=a):
                    if w.scale_zero is None:
                        return torch.ops.specd_q4.mm_ahead(x, w.packed, a)
                    return plain_mm(x, w)

                q4_matmul.q4_mm = routed  # q4_linear looks it up on each call (eager only)
                for q in qs:
                    steps[(a, q)] += time_forward(runner, 1, q, 8, warmup=2)
                q4_matmul.q4_mm = plain_mm
    finally:
        q4_matmul.q4_mm = plain_mm

    def table(title, res, keys, unit):
        print(title)
        print(f"  {'ahead':>6}" + "".join(f"{f'{unit}={k} ms':>10}{'x none':>8}" for k in keys))
        for a in aheads:
            cells = ""
            for k in keys:
                ms, base = statistics.median(res[(a, k)]), statistics.median(res[(aheads[0], k)])
                cells += f"{ms * 1e3:>10.2f}{base / ms:>7.2f}x"
            print(f"  {a:>6}" + cells)

    print(f"{len(weights)} matrices, {mb:.1f} MB packed; {torch.get_num_threads()} threads; "
          f"medians of {args.rounds} interleaved rounds; 'x none' = speed against ahead "
          f"{aheads[0]}")  # fmt: skip
    table("every 4-bit matmul of a step, M input rows:", mats, rows, "M")
    table("the target's eager forward, q tokens in one row:", steps, qs, "q")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
