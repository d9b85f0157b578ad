"""The KV cache's layouts side by side: the slot cache against the paged one, same engine config.

Two engines from ``--config`` over one loaded model, ``kv_layout: slots`` (a slot of
``max_model_len`` positions per sequence; on CPU resident only where written, keys read as
views) and ``paged`` (one pool of blocks, a block table per sequence, keys gathered through it:
engine/kv/paged_kv.py). Each serves the same prompts (MT-Bench first turns and HumanEval, the
``mixed`` set) greedily with the config's drafter, one at a time (c = 1) and all at once
(c = 8), the layouts interleaved ABBA ``--repeats`` times. Prints output tok/s of each, the
ratio paged / slots, tokens per target pass, the KV memory each held (the pool's blocks at
their peak; the slots' written positions) and how many outputs are identical (bf16 outputs may
part at near-ties: the gathered keys go through attention in another memory layout).

    python -m loadtest.bench.kv_layout --config configs/default.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.kv.paged_kv import PagedKVCache
from engine.model.loader import load_model
from engine.records.params import SamplingParams, SpecParams
from prompts.sets import encode, mixed

LAYOUTS = ("slots", "paged")


def run(engine, prompts: list[list[int]], concurrency: int, max_tokens: int, tag: str) -> dict:
    """``prompts`` ``concurrency`` at a time to completion: tok/s, tokens per pass, outputs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    seqs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = [
            engine.add_request(f"{tag}{i + j}", p, params, SpecParams())
            for j, p in enumerate(prompts[i : i + concurrency])
        ]
        while engine.has_work():
            engine.step()
        seqs += batch
    wall = time.perf_counter() - t0
    tokens = sum(len(s.output_ids) for s in seqs)
    return dict(
        tok_s=tokens / wall,
        tok_per_pass=tokens / sum(s.target_passes for s in seqs),
        outputs=[s.output_ids for s in seqs],
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.kv_layout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2, help="ABBA pairs")
    ap.add_argument("--json", default="loadtest/results/kv_layout.json")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base = EngineConfig.from_yaml(a.config)
    m = base.model
    pair = load_model(m.source, m.dtype, m.device, None, m.trust_remote_code)
    engines = {}
    for layout in LAYOUTS:
        t = time.perf_counter()
        cfg = dataclasses.replace(base, kv_layout=layout)
        engines[layout] = e = build_engine(cfg, pair).engine
        e.warm_up()  # compiles every bucket
        print(f"{layout}: built and warmed up in {time.perf_counter() - t:.0f} s", flush=True)
    tok = pair[1]
    prompts = [encode(tok, p) for p in mixed(1)[: a.prompts]]
    for layout, e in engines.items():
        run(e, prompts[:2], 2, 16, f"warm-{layout}-")  # calibrates the controller
    rows: dict[tuple[str, int], list[dict]] = {}
    for r in range(a.repeats):
        order = list(LAYOUTS) if r % 2 == 0 else list(LAYOUTS[::-1])
        for layout in order + order[::-1]:
            for c in (1, 8):
                x = run(engines[layout], prompts, c, a.max_tokens, f"r{r}{layout}{c}-")
                rows.setdefault((layout, c), []).append(x)
                print(f"{layout:5s} c={c} tok/s {x['tok_s']:.1f} tau {x['tok_per_pass']:.2f}",
                      flush=True)  # fmt: skip
    out: dict = {"args": vars(a), "rows": []}
    print(f"\n{a.config}, {a.prompts} prompts x {a.max_tokens} tokens, greedy, drafter "
          f"{base.drafter.method}; {2 * a.repeats} runs of each, ABBA (medians)")  # fmt: skip
    print("layout  c   tok/s  x slots   tau  identical outputs")
    for c in (1, 8):
        ref = statistics.median(x["tok_s"] for x in rows[("slots", c)])
        for layout in LAYOUTS:
            xs = rows[(layout, c)]
            tps = statistics.median(x["tok_s"] for x in xs)
            tau = statistics.median(x["tok_per_pass"] for x in xs)
            same = sum(o == s for o, s in zip(xs[0]["outputs"], rows[("slots", c)][0]["outputs"]))
            n = len(xs[0]["outputs"])
            out["rows"].append(dict(layout=layout, c=c, tok_s=tps, x_slots=tps / ref, tau=tau))
            print(f"{layout:6s} {c:2d} {tps:7.1f} {tps / ref:8.3f} {tau:5.2f}  {same}/{n}")
    for layout, e in engines.items():
        cache = e.target.cache
        if isinstance(cache, PagedKVCache):
            block = cache.bytes / (cache.num_blocks + 1)  # one block of every layer's K and V
            print(f"{layout}: a pool of {cache.bytes / 2**20:.0f} MiB, at most "
                  f"{cache.peak_blocks * block / 2**20:.0f} MiB of blocks held")  # fmt: skip
        else:
            print(
                f"{layout}: {cache.bytes / 2**20:.0f} MiB of slots (on CPU resident where written)"
            )
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
