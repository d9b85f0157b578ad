"""In-process throughput of ``c`` requests at once, speculation on against off, same engine.

One engine built from ``--config`` (its drafter and K controller); ``c`` real prompts (MT-Bench
first turns and HumanEval, the ``mixed`` set) are added together and stepped to completion,
greedy, ``--max-tokens`` each, alternately with speculation off (every request plain) and on
(the config's controller), in ABBA order ``--repeats`` times so that machine noise hits both
alike. Prints output tok/s of each, their ratio, tokens per target pass, the mean K asked and
the share of rounds that drafted. No server, no HTTP: the engine's own cost of speculating.

    python -m loadtest.bench.batch_speed --config configs/cpu-eagle.yaml --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.records.params import SamplingParams, SpecParams
from prompts.sets import encode, mixed


def run(engine, prompts: list[list[int]], spec: SpecParams, max_tokens: int, tag: str) -> dict:
    """Every prompt at once to completion: tok/s, tokens per target pass, K asked per row-round
    (mean) and the share of row-rounds that drafted."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(f"{tag}{i}", p, params, spec) for i, p in enumerate(prompts)]
    ks: list[int] = []
    t0 = time.perf_counter()
    while engine.has_work():
        ks += [o.stats.k for o in engine.step() if o.stats is not None]
    wall = time.perf_counter() - t0
    tokens = sum(len(s.output_ids) for s in seqs)
    return dict(
        tok_s=tokens / wall,
        tok_per_pass=tokens / sum(s.target_passes for s in seqs),
        mean_k=statistics.mean(ks) if ks else 0.0,
        drafting=sum(k > 0 for k in ks) / len(ks) if ks else 0.0,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.batch_speed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--config", default="configs/cpu-eagle.yaml")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="ABBA pairs")
    ap.add_argument("--json", default="loadtest/results/bench_batch_speed.json")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = EngineConfig.from_yaml(a.config)
    cfg.max_running = max(cfg.max_running, a.concurrency)
    built = build_engine(cfg)
    engine, tok = built.engine, built.tokenizer
    prompts = [encode(tok, p) for p in mixed(1)[: a.concurrency]]
    modes = {"plain": SpecParams(enabled=False), "spec": SpecParams()}
    engine.warm_up()  # compiles every bucket
    run(engine, prompts, modes["spec"], 16, "warm")  # calibrates the controller
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(a.repeats):
        order = ["plain", "spec"] if r % 2 == 0 else ["spec", "plain"]
        for m in order + order[::-1]:
            rows[m].append(run(engine, prompts, modes[m], a.max_tokens, f"r{r}{m}"))
            print(f"{m:6s} {json.dumps({k: round(v, 3) for k, v in rows[m][-1].items()})}")
    out = {m: {k: statistics.mean(x[k] for x in rs) for k in rs[0]} for m, rs in rows.items()}
    out["spec_over_plain"] = out["spec"]["tok_s"] / out["plain"]["tok_s"]
    out["args"] = vars(a)
    print(f"\nc = {a.concurrency}, {a.config}, drafter {cfg.drafter.method} "
          f"({cfg.drafter.controller}); {2 * a.repeats} runs of each, ABBA")  # fmt: skip
    for m in modes:
        print(f"  {m:6s} " + "  ".join(f"{k} {v:.3f}" for k, v in out[m].items()))
    print(f"  spec / plain: {out['spec_over_plain']:.3f}")
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
