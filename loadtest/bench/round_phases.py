"""Where a round's time goes, one request at a time: milliseconds a round in each phase.

One engine built from ``--config``; ``--prompts`` real prompts (the ``mixed`` set) are generated
one after another, greedy, ``--max-tokens`` each, with speculation off (``--k 0``) or a fixed K.
The target's forwards, the drafter's calls, the acceptance rule, the plan, the one sync and the
controller are timed by wrapping them (wall clock; a CPU run, or CUDA where the phase syncs);
nested phases overlap (``eagle._run`` is inside ``eagle._ingest``, inside ``drafter.propose``).

    python -m loadtest.bench.round_phases --config configs/cpu-eagle.yaml --k 1
"""

from __future__ import annotations

import argparse
import collections
import time

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.requests.sequence import SpecParams
from engine.round import speculator as round_mod
from engine.round.sampling import SamplingParams
from loadtest.datasets import encode, mixed


def timer(totals: dict[str, float], obj, name: str, label: str) -> None:
    """Wrap ``obj.name`` so that its calls add their wall time to ``totals[label]``."""
    inner = getattr(obj, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t

    setattr(obj, name, timed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.round_phases", description=__doc__)
    ap.add_argument("--config", default="configs/cpu-eagle.yaml")
    ap.add_argument("--k", type=int, default=1, help="fixed K (0: speculation off)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    a = ap.parse_args(argv)
    built = build_engine(EngineConfig.from_yaml(a.config))
    engine = built.engine
    prompts = [encode(built.tokenizer, p) for p in mixed(1)[: a.prompts + 2]]
    engine.warm_up()
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    spec = SpecParams(k=a.k) if a.k > 0 else SpecParams(enabled=False)
    for p in prompts[:2]:  # warm: the controller's calibration, first calls
        engine.generate([p], params, spec)
    totals: collections.defaultdict[str, float] = collections.defaultdict(float)
    sp, d = engine.speculator, engine.drafter
    timer(totals, sp, "round", "round")
    timer(totals, engine.target, "forward", "target.forward")
    for m in ("_plan", "_process", "_probs", "accept"):
        timer(totals, sp, m, f"round.{m.lstrip('_')}")
    timer(totals, round_mod, "to_host", "round.to_host (the sync)")
    for m in ("k_for", "observe", "end_round"):
        timer(totals, sp.controller, m, f"controller.{m}")
    if d is not None:
        for m in ("propose", "observe", "commit"):
            timer(totals, d, m, f"drafter.{m}")
        for m in ("_ingest", "chain_step", "_run"):
            if hasattr(d, m):
                timer(totals, d, m, f"eagle.{m}")
    t0, tokens, passes = time.perf_counter(), 0, 0
    for p in prompts[2:]:
        s = engine.generate([p], params, spec)[0]
        tokens, passes = tokens + len(s.output_ids), passes + s.target_passes
    wall = time.perf_counter() - t0
    ms = wall / passes * 1e3
    print(f"{a.config}, K = {a.k}: {tokens / wall:.1f} tok/s, {passes} rounds, {ms:.2f} ms a "
          f"round, {tokens / passes:.2f} tokens a round")  # fmt: skip
    print("(target.forward counts the prompts' prefill forwards too)")
    for label, t in sorted(totals.items(), key=lambda x: -x[1]):
        print(f"  {label:28s} {t / passes * 1e3:7.3f} ms a round")


if __name__ == "__main__":
    main()
