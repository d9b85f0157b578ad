"""Would a confidence-cut draft length (EAGLE-2's dynamic drafting) beat a fixed K with our head?

One request at a time, in process, greedy, ``--max-tokens`` each (``ignore_eos``), ``--prompts``
real prompts (MT-Bench first turns and HumanEval, the ``mixed`` set). Every prompt is generated
once per mode (plain, then fixed K = 1..``--k-max``, the order rotated from prompt to prompt), and
each round records the head's top probability (softmax over the draft vocabulary, T = 1) at every
position it drafted and how many drafts the target accepted. Prints:

* per mode: tokens per round and milliseconds per round (prefill included), tok/s, x plain;
* calibration, from the K = ``--k-max`` rounds: acceptance of draft position j by the head's top
  probability there, among rounds that reached j (all drafts before it accepted);
* rules that cut a round's chain where the product of the top probabilities so far falls below a
  threshold (the first draft always kept, or cut too). Their rounds are replayed from the K =
  ``--k-max`` rounds (a chain cut at n drafts keeps min(accepted, n) of them) and priced by
  :func:`price`: a fixed-K = n round of this run (n = 0: a plain round) plus, below K =
  ``--k-max``, the one more head step that showed draft n + 1's top probability.

Stopping on the head's top probability is lossless for any threshold (the rule looks only at q,
never at the drafted token itself); this bench measures whether it would pay.

    python -m loadtest.bench.head_confidence --config configs/cpu-eagle.yaml --prompts 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.drafters.eagle.drafter import EagleDrafter
from engine.records.params import SamplingParams, SpecParams
from loadtest.bench.k_modes import orders
from prompts.sets import encode, mixed

BINS = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)


def cut(conf: list[float], threshold: float, keep_first: bool) -> int:
    """Drafts a chain keeps: position j (0-based) while the product of the top probabilities of
    positions 0..j stays at or above ``threshold``; position 0 always when ``keep_first``."""
    n, prod = 0, 1.0
    for j, c in enumerate(conf):
        prod *= c
        if prod < threshold and not (keep_first and j == 0):
            break
        n += 1
    return n


def price(n: int, round_ms: list[float], step_ms: float, k_max: int, cut: bool = True) -> float:
    """Milliseconds of a round that drafted ``n`` tokens: the measured fixed-K = n round
    (``round_ms[0]``: plain) and, for a chain ``cut`` below ``k_max``, one more head step
    (``step_ms``), the one whose top probability ended the chain."""
    return round_ms[n] + (step_ms if cut and n < k_max else 0.0)


def calibration(rounds: list[tuple[list[float], int]], k: int) -> list[str]:
    """Per draft position: acceptance by the head's top-probability bin, as text lines."""
    lines = []
    for j in range(k):
        seen, kept = [0] * (len(BINS) - 1), [0] * (len(BINS) - 1)
        for conf, acc in rounds:
            if len(conf) > j and acc >= j:  # position j was reached
                b = max(i for i in range(len(BINS) - 1) if conf[j] >= BINS[i])
                seen[b], kept[b] = seen[b] + 1, kept[b] + (acc > j)
        cells = [f"{BINS[b]:.1f}+ {kept[b] / n:.2f} ({n})" for b, n in enumerate(seen) if n]
        lines.append(f"  position {j + 1}: " + "  ".join(cells))
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.bench.head_confidence",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default="configs/cpu-eagle.yaml")
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    built = build_engine(EngineConfig.from_yaml(a.config))
    engine = built.engine
    head = engine.drafter
    if not isinstance(head, EagleDrafter):
        raise SystemExit(f"{a.config}: the drafter is not the EAGLE-3 head alone")
    prompts = [encode(built.tokenizer, p) for p in mixed(2)[: a.prompts + 1]]
    engine.warm_up()

    conf: list[float] = []  # this round's top probabilities (row 0: one request at a time)
    choose = head._choose

    def recording(draft_logits, *args):
        conf.append(float(torch.softmax(draft_logits[0].float(), -1).max()))
        return choose(draft_logits, *args)

    head._choose = recording  # type: ignore[method-assign]
    rounds: list[tuple[list[float], int]] = []  # K = k_max rounds: (top probabilities, accepted)
    draft_ms: list[float] = []  # their propose phases' wall time
    spec_round, mode = engine.speculator.round, [""]

    def recorded_round(seqs):
        conf.clear()
        out = spec_round(seqs)
        st = out[0].stats
        if mode[0] == f"K={a.k_max}" and st is not None and st.drafted == a.k_max:
            rounds.append((list(conf), st.accepted))
            draft_ms.append(st.draft_s * 1e3)
        return out

    engine.speculator.round = recorded_round  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    modes = {"plain": SpecParams(enabled=False)}
    modes |= {f"K={k}": SpecParams(k=k) for k in range(1, a.k_max + 1)}
    for m in modes:  # warm: first calls of each shape
        engine.generate([prompts[0]], params, modes[m])
    totals = {m: [0.0, 0, 0] for m in modes}  # seconds, tokens, rounds
    for p, order in zip(prompts[1:], orders(list(modes), a.prompts)):
        for m in order:
            mode[0] = m
            t0 = time.perf_counter()
            s = engine.generate([p], params, modes[m])[0]
            t = totals[m]
            t[0] += time.perf_counter() - t0
            t[1] += len(s.output_ids)
            t[2] += s.target_passes
    ms = {m: sec / n * 1e3 for m, (sec, _, n) in totals.items()}
    plain = totals["plain"][1] / totals["plain"][0]
    print(f"{a.config}, c = 1, {a.prompts} prompts x {a.max_tokens} tokens, greedy, interleaved")
    for m, (sec, tok, n) in totals.items():
        print(f"  {m:8s} tokens/round {tok / n:.2f}  ms/round {ms[m]:6.2f}  "
              f"{tok / sec:6.1f} tok/s  x plain {tok / sec / plain:.3f}")  # fmt: skip
    print(f"calibration over {len(rounds)} K = {a.k_max} rounds: acceptance of draft position j by "
          "the head's top probability there (rounds reaching j)")  # fmt: skip
    print("\n".join(calibration(rounds, a.k_max)))
    print("chains cut where the product of top probabilities falls below a threshold, replayed "
          "from those rounds, priced at this run's fixed-K ms/round plus the head step that "
          "ended the chain")  # fmt: skip
    if not rounds:
        raise SystemExit(f"no K = {a.k_max} round drafted {a.k_max} tokens")
    round_ms = [ms["plain"]] + [ms[f"K={k}"] for k in range(1, a.k_max + 1)]
    step_ms = statistics.median(draft_ms) / a.k_max  # one head step (the ingest counted as one)
    print(f"  (a head step: {step_ms:.2f} ms, the median K = {a.k_max} propose phase / {a.k_max})")
    rules = [(f"fixed K={k}", lambda c, k=k: k, False) for k in range(1, a.k_max + 1)]
    for th in (0.05, 0.1, 0.2, 0.3, 0.4):
        rules.append((f"cut < {th}, first kept", lambda c, th=th: cut(c, th, True), True))
        rules.append((f"cut < {th}", lambda c, th=th: cut(c, th, False), True))
    for name, rule, is_cut in rules:
        ns = [rule(c) for c, _ in rounds]
        tok = sum(min(acc, n) + 1 for (_, acc), n in zip(rounds, ns))
        sec = sum(price(n, round_ms, step_ms, a.k_max, is_cut) for n in ns) / 1e3
        print(f"  {name:24s} tokens/round {tok / len(ns):.2f}  drafts/round "
              f"{sum(ns) / len(ns):.2f}  est. x plain {tok / sec / plain:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
