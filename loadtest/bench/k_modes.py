"""One request at a time, in process: plain decoding against fixed K and the adaptive K.

One engine built from ``--config``; each of ``--prompts`` real prompts (the ``mixed`` set:
MT-Bench first turns and HumanEval) is generated once per mode, greedy, ``--max-tokens`` each
(``ignore_eos``), the modes' order rotated and reversed from prompt to prompt (:func:`orders`) so
that machine noise hits every mode alike. Prints each mode's output tok/s, its ratio to plain,
tokens per target pass and milliseconds per round (prefill included). No server, no HTTP: what
the controller makes of the drafter, against what a fixed K would have made.

    python -m loadtest.bench.k_modes --config configs/cpu-eagle.yaml --ks 1,3
    python -m loadtest.bench.k_modes --config configs/cpu-eagle.yaml --ks 1 --idle-decays 1.0
    python -m loadtest.bench.k_modes --config configs/cpu-eagle.yaml --ks 1 --unpriced-catch-up
"""

from __future__ import annotations

import argparse
import json
import os
import time

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.records import kstate as k_state
from engine.records.params import SamplingParams, SpecParams
from prompts.sets import encode, mixed


def orders(modes: list[str], n: int) -> list[list[str]]:
    """The modes' order for each of ``n`` prompts, in ABBA pairs: prompt 2j runs the modes
    rotated by j, prompt 2j + 1 the same order reversed; every mode runs once per prompt, and
    over 2 x len(modes) prompts each mode leads and closes as often as the others."""
    out = []
    for i in range(n):
        j = (i // 2) % len(modes)
        r = modes[j:] + modes[:j]
        out.append(r[::-1] if i % 2 else r)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.k_modes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--config", default="configs/cpu-eagle.yaml")
    ap.add_argument("--ks", default="1,3", help="fixed K modes besides plain and adaptive")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--idle-decays", default="",
                    help="extra adaptive modes, one per k_state.IDLE_DECAY value")  # fmt: skip
    ap.add_argument("--unpriced-catch-up", action="store_true",
                    help="an adaptive mode that does not price the catch-up")  # fmt: skip
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    built = build_engine(EngineConfig.from_yaml(a.config))
    engine = built.engine
    prompts = [encode(built.tokenizer, p) for p in mixed(1)[: a.prompts + 2]]
    engine.warm_up()
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    modes = {"plain": SpecParams(enabled=False)}
    modes |= {f"K={k}": SpecParams(k=int(k)) for k in a.ks.split(",") if k}
    modes["adaptive"] = SpecParams()
    decay = {"adaptive": k_state.IDLE_DECAY}  # the aging of a K = 0 round's evidence, per mode
    for d in (float(x) for x in a.idle_decays.split(",") if x):
        modes[f"adaptive idle {d}"] = SpecParams()
        decay[f"adaptive idle {d}"] = d
    ctl = engine.controller
    priced = {"adaptive": True}  # kcontrol/controller.py "Catch-up", per mode (fitted either way)
    if a.unpriced_catch_up:
        modes["adaptive, catch-up unpriced"] = SpecParams()
        priced["adaptive, catch-up unpriced"] = False

    def generate(p, m):
        k_state.IDLE_DECAY = decay.get(m, decay["adaptive"])
        ctl.price_catch_up = priced.get(m, True)
        return engine.generate([p], params, modes[m])

    for p in prompts[:2]:  # warm: first calls, the controller's calibration
        for m in modes:
            generate(p, m)
    totals = {m: [0.0, 0, 0] for m in modes}  # seconds, tokens, target passes
    for p, order in zip(prompts[2:], orders(list(modes), a.prompts)):
        for m in order:
            t0 = time.perf_counter()
            s = generate(p, m)[0]
            t = totals[m]
            t[0] += time.perf_counter() - t0
            t[1] += len(s.output_ids)
            t[2] += s.target_passes
    k_state.IDLE_DECAY, ctl.price_catch_up = decay["adaptive"], True
    plain = totals["plain"][1] / totals["plain"][0]
    print(f"{a.config}, c = 1, {a.prompts} prompts x {a.max_tokens} tokens, greedy, interleaved")
    rows = {}
    for m, (sec, tok, passes) in totals.items():
        r = rows[m] = dict(tok_s=tok / sec, x_plain=tok / sec / plain, tok_per_pass=tok / passes,
                           ms_per_round=sec / passes * 1e3)  # fmt: skip
        print(f"  {m:30s} {r['tok_s']:7.1f} tok/s  x plain {r['x_plain']:.3f}  "
              f"tokens/pass {r['tok_per_pass']:.2f}  ms/round {r['ms_per_round']:.2f}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, args=vars(a)), f, indent=1)


if __name__ == "__main__":
    main()
