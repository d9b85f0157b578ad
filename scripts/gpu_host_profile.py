"""Where a batch-64 round's host time goes on a GPU (issue 21): cProfile of the engine's steps
at batch 64, plain and adaptive (synthetic alpha 0.8), Llama-3.1-8B shapes, CUDA graphs; and
the device syncs a step makes (torch's sync debug mode). ``python scripts/gpu_host_profile.py``
on a lent GPU; ``--device cpu --dtype float32 --target tiny --draft tiny`` checks the plumbing."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import warnings

import torch

from engine.records.params import SpecParams
from loadtest.bench import gpu_parts as parts
from loadtest.bench.gpu import K_MAX, PLAIN, Bench


def main(argv: list[str]) -> None:
    a = parts.parse_args(["--sections", "0,1", "--batches", "1,64", *argv], __doc__)
    b = Bench(a)
    b.s0()
    b.s1()
    eng = parts.adaptive_engine(b, 0.8, K_MAX)
    b.load(eng, 1, SpecParams(), 8)  # calibrates
    b.load(eng, 64, PLAIN, 8)  # warm
    for mode, spec in (("off", PLAIN), ("adaptive", SpecParams()), ("off", PLAIN)):
        pr = cProfile.Profile()
        pr.enable()
        row = b.load(eng, 64, spec, a.max_tokens)
        pr.disable()
        print(f"\n==== batch 64 {mode} (profiled): {parts.short(row)}")
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
        print(s.getvalue()[-9000:])
    if b.dev.type == "cuda":
        torch.cuda.set_sync_debug_mode(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            b.load(eng, 64, PLAIN, 4)
        torch.cuda.set_sync_debug_mode(0)
        print(f"\n==== syncs in a batch-64 plain request set of 4 tokens: {len(caught)}")
        seen: dict[str, int] = {}
        for w in caught:
            key = f"{w.filename}:{w.lineno}"
            seen[key] = seen.get(key, 0) + 1
        for k, n in sorted(seen.items(), key=lambda x: -x[1])[:15]:
            print(f"  {n:5d}  {k}")


if __name__ == "__main__":
    main(sys.argv[1:])
