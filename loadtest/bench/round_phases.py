"""Where a round's time goes, one request at a time: milliseconds a round in each phase.

One engine built from ``--config``; ``--prompts`` real prompts (the ``mixed`` set) are generated
one after another, greedy, ``--max-tokens`` each, with speculation off (``--k 0``) or a fixed K.
The engine runs as built: first unprofiled (the tok/s and ms a round), then the same prompts
under ``cProfile``, whose cumulative time per function gives each phase (the target's forwards,
the drafter's calls, the acceptance rule, the plan, the one sync, the controller). Wall clock of
a CPU run, or CUDA where the phase syncs; the profiler's own cost inflates the Python-heavy
phases; nested phases overlap (the head's step is inside its take-in and its proposal).

    python -m loadtest.bench.round_phases --config configs/cpu-eagle.yaml --k 1
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.records.params import SamplingParams, SpecParams
from prompts.sets import encode, mixed

# phase label -> (file, function): functions whose cumulative time is the phase
PHASES = {
    "round": ("engine/round/speculator.py", "round"),
    "target.forward": ("engine/model/runner.py", "forward"),
    "round.plan": ("engine/round/speculator.py", "_plan"),
    "round.process": ("engine/round/speculator.py", "_process"),
    "round.probs": ("engine/round/speculator.py", "_probs"),
    "round.accept": ("engine/round/rejection.py", "rejection_sample"),
    "round.to_host (the sync)": ("engine/round/output.py", "to_host"),
    "controller.k_for": ("engine/kcontrol/controller.py", "k_for"),
    "controller.observe": ("engine/kcontrol/controller.py", "observe"),
    "controller.end_round": ("engine/kcontrol/controller.py", "end_round"),
    "drafter.propose": ("engine/drafters/guard.py", "propose"),
    "drafter.observe": ("engine/drafters/guard.py", "observe"),
    "drafter.commit": ("engine/drafters/guard.py", "commit"),
    "eagle.ingest": ("engine/drafters/eagle/drafter.py", "_ingest"),
    "eagle.chain_step": ("engine/drafters/eagle/drafter.py", "chain_step"),
}


def phase_seconds(profile: cProfile.Profile) -> dict[str, float]:
    """Cumulative seconds of each phase's function in ``profile`` (absent: not called)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for label, (path, name) in PHASES.items():
        cum = [v[3] for (f, _, fn), v in stats.items() if fn == name and f.endswith(path)]
        if cum:
            out[label] = sum(cum)
    return out


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

    def run() -> tuple[int, int]:
        tokens, passes = 0, 0
        for p in prompts[2:]:
            s = engine.generate([p], params, spec)[0]
            tokens, passes = tokens + len(s.output_ids), passes + s.target_passes
        return tokens, passes

    t0 = time.perf_counter()
    tokens, passes = run()
    wall = time.perf_counter() - t0
    ms = wall / passes * 1e3
    print(
        f"{a.config}, K = {a.k}: {tokens / wall:.1f} tok/s, {passes} rounds, {ms:.2f} ms a "
        f"round, {tokens / passes:.2f} tokens a round"
    )
    profile = cProfile.Profile()
    profile.enable()
    _, passes = run()
    profile.disable()
    print("profiled (target.forward counts the prompts' prefill forwards too):")
    for label, t in sorted(phase_seconds(profile).items(), key=lambda x: -x[1]):
        print(f"  {label:28s} {t / passes * 1e3:7.3f} ms a round")


if __name__ == "__main__":
    main()
