"""Engine benchmark at batch 1, greedy, on real prompts (MT-Bench by category + HumanEval).

For each drafter, prints tok/s of plain decoding (same engine, K=0), speculation at fixed K in
1..8, with K chosen per round by transformers' +2/-1 heuristic schedule and by specd's adaptive
goodput controller (engine/kcontrol/controller.py), and transformers' own generate() plain and with
prompt lookup, all measured in the same run, interleaved prompt by prompt so machine noise hits
every configuration alike; plus speedup over our plain decoding, acceptance rate and mean tokens per
target pass, and the adaptive controller's ratios to plain and to the best fixed K in hindsight.

    python -m loadtest.bench.engine_speed --per-category 2 --max-tokens 96 --drafters ngram
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.kcontrol.timing import time_call
from engine.model.loader import load_model
from engine.records.params import SamplingParams, SpecParams
from prompts.sets import encode, mixed

DRAFTERS = {
    "ngram": {"method": "ngram"},
    "self": {"method": "self"},
    "layers15": {"method": "layers", "num_layers": 15},
}


class Tally:
    def __init__(self):
        self.tokens = self.seconds = self.drafted = self.accepted = self.passes = 0

    def add(self, tokens, seconds, drafted=0, accepted=0, passes=0):
        self.tokens += tokens
        self.seconds += seconds
        self.drafted += drafted
        self.accepted += accepted
        self.passes += passes

    @property
    def tps(self):
        return self.tokens / self.seconds if self.seconds else 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.bench.engine_speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--drafters", default="ngram", help=f"comma list of {sorted(DRAFTERS)}")
    ap.add_argument(
        "--controllers",
        default="heuristic,adaptive",
        help="K controllers to run besides fixed K (heuristic, adaptive; '' for none)",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate() rows")
    ap.add_argument("--json", default="loadtest/results/bench_engine.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    base = EngineConfig.from_yaml(args.config)
    base.model.dtype = args.dtype
    base.max_running = 1
    pair = load_model(base.model.source, args.dtype, base.model.device, base.cache_dir)
    model, tok = pair
    prompts = mixed(args.per_category)
    encoded = [encode(tok, p) for p in prompts]
    ks = [int(k) for k in args.ks.split(",")]
    drafters = args.drafters.split(",")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    controllers = [c for c in args.controllers.split(",") if c]
    engines = {}
    for d in ["none"] + drafters:
        for ctl in ["fixed"] + (controllers if d != "none" else []):
            drafter = dict(DRAFTERS.get(d, {"method": "none"}), controller=ctl, k_max=max(ks))
            cfg = EngineConfig.from_dict(
                {
                    "model": vars(base.model),
                    "max_running": 1,
                    "max_model_len": base.max_model_len,
                    "drafter": drafter,
                }
            )
            engines[d if ctl == "fixed" else f"{d} {ctl}"] = build_engine(cfg, pair).engine

    configs = [("specd plain", "none", 0)]
    if not args.no_hf:
        configs += [("hf generate", "hf", 0), ("hf prompt-lookup", "hf-pl", 10)]
    configs += [(f"{d} K={k}", d, k) for d in drafters for k in ks]
    configs += [(f"{d} {c}", f"{d} {c}", None) for d in drafters for c in controllers]
    tallies: dict[str, dict[str, Tally]] = defaultdict(lambda: defaultdict(Tally))

    device = base.model.device

    def run(kind, k, ids):
        """(tokens, seconds, drafted, accepted, target passes) of one prompt
        (engine.kcontrol.timing)."""
        out: list = []
        if kind in ("hf", "hf-pl"):
            kw = {"prompt_lookup_num_tokens": k} if kind == "hf-pl" else {}

            def hf():
                with torch.inference_mode():
                    out.append(
                        model.generate(
                            torch.tensor([ids], device=model.device),
                            max_new_tokens=args.max_tokens,
                            do_sample=False,
                            eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.eos_token_id,
                            **kw,
                        )
                    )

            seconds = time_call(hf, device)
            return out[0].shape[1] - len(ids), seconds, 0, 0, 0
        spec = SpecParams() if k is None else SpecParams(enabled=k > 0, k=k)  # None: controller
        seconds = time_call(lambda: out.extend(engines[kind].generate([ids], params, spec)), device)
        s = out[0]
        return len(s.output_ids), seconds, s.drafted, s.accepted, s.target_passes

    for _, kind, k in configs:  # warm-up
        run(kind, k, encoded[0][:64])
    t_start = time.perf_counter()
    for i, (p, ids) in enumerate(zip(prompts, encoded)):
        for name, kind, k in configs:
            r = run(kind, k, ids)
            tallies[name][p.category].add(*r)
            tallies[name]["ALL"].add(*r)
        print(
            f"[{i + 1}/{len(prompts)}] {p.id} ({p.category}) {time.perf_counter() - t_start:.0f}s",
            flush=True,
        )

    groups = list(dict.fromkeys(p.category for p in prompts)) + ["ALL"]
    width = max(len(n) for n, _, _ in configs) + 2
    print(
        f"\nspecd engine benchmark: batch 1, greedy, {args.dtype}, "
        f"{torch.get_num_threads()} threads, max_tokens {args.max_tokens}, {len(prompts)} prompts "
        f"({args.per_category} per category)"
    )
    print("\noutput tok/s")
    print("config".ljust(width) + "".join(g[:10].rjust(11) for g in groups))
    for name, _, _ in configs:
        print(name.ljust(width) + "".join(f"{tallies[name][g].tps:11.1f}" for g in groups))
    plain = tallies["specd plain"]
    for d in drafters:
        print(f"\ndrafter {d}: speedup over specd plain / acceptance / tokens per target pass")
        print("K".ljust(width) + "".join(g[:14].rjust(15) for g in groups))
        for name in [f"{d} K={k}" for k in ks] + [f"{d} {c}" for c in controllers]:
            t = tallies[name]
            row = []
            for g in groups:
                x = t[g]
                row.append(
                    f" {x.tps / plain[g].tps:.2f}/{x.accepted / max(x.drafted, 1):.2f}/"
                    f"{x.tokens / max(x.passes, 1):.1f}".rjust(15)
                )
            print(name.ljust(width) + "".join(row))
        if "adaptive" in controllers:
            ad = tallies[f"{d} adaptive"]
            best_k = max(
                ks, key=lambda k: tallies[f"{d} K={k}"]["ALL"].tps
            )  # in hindsight, whole set
            best = tallies[f"{d} K={best_k}"]
            worst = min(ad[g].tps / plain[g].tps for g in groups)
            print(
                f"ratios: {d} adaptive / specd plain = "
                + ", ".join(f"{g}: {ad[g].tps / plain[g].tps:.2f}" for g in groups)
                + f"  (target >= 0.97 everywhere; min {worst:.2f})"
            )
            print(
                f"ratios: {d} adaptive / best fixed K over the whole set (K={best_k}) = "
                + ", ".join(f"{g}: {ad[g].tps / best[g].tps:.2f}" for g in groups)
                + "  (target ALL >= 1.00)"
            )
            if "heuristic" in controllers:
                he = tallies[f"{d} heuristic"]
                print(
                    f"ratios: {d} adaptive / heuristic +2/-1 = "
                    + ", ".join(f"{g}: {ad[g].tps / he[g].tps:.2f}" for g in groups)
                )
    if not args.no_hf:
        hf = tallies["hf generate"]
        print(
            "\nratios: specd plain / hf generate = "
            + ", ".join(f"{g}: {plain[g].tps / hf[g].tps:.2f}" for g in groups)
        )
        for d in drafters:
            best = {g: max((tallies[f"{d} K={k}"][g].tps, k) for k in ks) for g in groups}
            print(
                f"ratios: best fixed-K {d} / hf prompt-lookup = "
                + ", ".join(
                    f"{g}: {best[g][0] / tallies['hf prompt-lookup'][g].tps:.2f} (K={best[g][1]})"
                    for g in groups
                )
            )
    out = {
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "results": {
            n: {g: vars(t) | {"tok_s": t.tps} for g, t in v.items()} for n, v in tallies.items()
        },
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
