"""Prompts of a step prefilled together or one forward each (engine/requests/prefill.py), side by
side.

The engine groups a step's prompt chunks on CUDA only (``SpecEngine.group_prefill``); this bench
runs both ways on any device. Batches of requests admitted together (4 prefill a step), stepped
to completion, plain and adaptive K (synthetic acceptance 0.8), each batch size in ABBA order:
grouped, one forward a chunk, twice. Llama-3.1-8B shapes with random weights on a GPU by default
(loadtest/bench/gpu.py's options):

    python -m loadtest.bench.gpu_prefill --batches 8,32,64
    python -m loadtest.bench.gpu_prefill --device cpu --dtype float32 --target tiny \
        --draft tiny --max-tokens 16 --batches 1,8
"""

from __future__ import annotations

import statistics
import sys

from engine.records.params import SpecParams
from loadtest.bench import gpu_parts as parts
from loadtest.bench.gpu import K_MAX, PLAIN, Bench


def main(argv: list[str] | None = None) -> list[dict]:
    a = parts.parse_args(["--sections", "0,1", *(sys.argv[1:] if argv is None else argv)], __doc__)
    b = Bench(a)
    b.s0()
    b.s1()
    eng = parts.adaptive_engine(b, 0.8, K_MAX)
    b.load(eng, 1, SpecParams(), 8)  # calibrates the controller
    rows = []
    for batch in [int(x) for x in a.batches.split(",")]:
        b.load(eng, batch, PLAIN, 8)  # warm
        for mode, spec in (("off", PLAIN), ("adaptive", SpecParams())):
            tps: dict[str, list[float]] = {"grouped": [], "one_each": []}
            for name in ("grouped", "one_each", "one_each", "grouped"):
                eng.group_prefill = name == "grouped"
                r = b.load(eng, batch, spec, a.max_tokens)
                tps[name].append(r["tok_s"])
                b.log(f"batch {batch} {mode} prefill {name}: {parts.short(r)}")
            g, o = statistics.mean(tps["grouped"]), statistics.mean(tps["one_each"])
            rows.append(dict(batch=batch, mode=mode, grouped=g, one_each=o, ratio=g / o))
            print(f"== batch {batch} {mode}: grouped {g:.1f} tok/s, one forward a chunk "
                  f"{o:.1f}: x{g / o:.3f}", flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
