"""Suffix decoding on repetitive workloads, in-process on one engine: tokens per target pass and
output tok/s with the suffix drafter, the n-gram drafter and speculation off, in one run.

Workloads (greedy, one request at a time, chat template):

* ``rename``: a HumanEval function (prompt + canonical solution) given in the prompt, asked back
  with the function renamed: the answer copies the request's own prompt;
* ``as-list``: an MT-Bench question, the model's own answer to it (generated first, untimed) as
  the assistant turn, then "rewrite your answer as a list": copies an earlier answer of the
  conversation;
* ``retry``: an MT-Bench question asked a second time by another request (a retry, a second
  user): the timed request's answer repeats the first request's output, which is not in its
  prompt -- only the suffix drafter's shared index of recent outputs can copy it;
* ``chat``: MT-Bench questions, each once: open text, where a copying drafter finds little (its
  cost shows here).

Every mode runs on the same engine (the config's target and compile settings, the suffix
drafter's knobs from ``drafter.suffix_*``, no prefix cache: every mode prefills alike), warmed
up as the server's worker does (every compiled shape) before the controller calibrates: off is
``speculation.enabled = false``, n-gram swaps the n-gram drafter in; K is the adaptive
controller's (suffix-k: the suffix drafter asked for K_max every round). Timed: each request's
decoding after its first token (tok/s, tokens per target pass, the drafter's time per pass),
the part speculation changes; a first sweep of every workload is untimed (compiles,
calibration), then of ``--repeat`` timed sweeps each request's fastest counts. The suffix
drafter's shared index is emptied before each workload of each mode, so a mode sees only the
traffic the workload sends it. Modes are interleaved workload by workload (in order, then the
reverse), so machine noise hits all alike.

    python -m loadtest.bench.suffix --config configs/default.yaml --prompts 4 --max-tokens 128

``--hybrid``: the config's EAGLE-3 head (method eagle3) with the suffix drafter as its copier
(``drafter.suffix_fallback``, default the config's ``ngram_fallback``) against the n-gram lookup
as its copier (the same minimum match), and off (loadtest/results/suffix_hybrid.txt).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import time
from pathlib import Path
from typing import Any

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.drafters.hybrid import HybridDrafter
from engine.drafters.ngram import NgramDrafter
from engine.drafters.suffix import SuffixDrafter
from engine.drafters.suffix_index import SuffixIndex
from engine.records.params import SamplingParams, SpecParams
from loadtest.machine import cpu_description
from prompts.sets import chat_ids, humaneval_file, mt_bench

# off; the suffix and n-gram drafters under the adaptive controller; the suffix drafter asked
# for K_max every round (what it proposes where a copy is there to take, whatever the controller)
MODES = ("off", "suffix", "ngram", "suffix-k")
# --hybrid: the config's EAGLE-3 head with the suffix drafter or the n-gram lookup as its copier
HYBRID_MODES = ("off", "eagle3+suffix", "eagle3+ngram")
# open questions whose answers are prose (writing, roleplay, stem, humanities)
PROSE = ("writing", "roleplay", "stem", "humanities")


def humaneval_functions(n: int) -> list[tuple[str, str]]:
    """The first ``n`` HumanEval tasks as (function name, full source)."""
    with gzip.open(humaneval_file(), "rt") as f:
        tasks = [json.loads(line) for line in f][:n]
    out = []
    for t in tasks:
        m = re.search(r"def (\w+)\(", t["prompt"])
        out.append((m.group(1) if m else "f", t["prompt"] + t["canonical_solution"]))
    return out


def questions(n: int, skip: int = 0) -> list[str]:
    """``n`` MT-Bench first turns of the prose categories, round-robin, after ``skip``."""
    by_cat: dict[str, list[str]] = {}
    for p in mt_bench():
        if p.category in PROSE:
            by_cat.setdefault(p.category, []).append(p.text)
    order = [qs[i] for i in range(10) for qs in by_cat.values() if i < len(qs)]
    return order[skip : skip + n]


class Bench:
    def __init__(self, config: str, max_tokens: int, hybrid: bool = False):
        """``hybrid``: the config's EAGLE-3 head (method eagle3) with a copier, else the suffix
        drafter alone."""
        cfg = EngineConfig.from_yaml(config)
        d = cfg.drafter
        if hybrid:
            if d.method != "eagle3":
                raise SystemExit(f"--hybrid needs an EAGLE-3 config; {config} drafts {d.method}")
            d.suffix_fallback = d.suffix_fallback or d.ngram_fallback or 3
            d.ngram_fallback = 0
        else:
            d.method = "suffix"
            d.ngram_fallback = d.suffix_fallback = 0
        cfg.prefix_cache_tokens = 0  # every mode prefills every prompt alike
        self.built = build_engine(cfg)
        self.engine = self.built.engine
        self.tok: Any = self.built.tokenizer
        self.engine.warm_up()  # as the server's worker does first: every compiled shape
        self.k_max = d.k_max
        assert self.engine.guard is not None
        self.hybrid = self.engine.guard.inner if hybrid else None
        if isinstance(self.hybrid, HybridDrafter):
            assert self.hybrid.suffix is not None
            self.suffix = self.hybrid.suffix
            self.hybrid.max_n = max(d.ngram_max, d.suffix_fallback)  # the n-gram copier's, as built
        else:
            self.suffix = self.engine.guard.inner  # type: ignore[assignment]
        assert isinstance(self.suffix, SuffixDrafter)
        self.fresh_shared = lambda: SuffixIndex(
            d.suffix_max_cached_requests, d.suffix_max_cached_tokens
        )
        self.ngram = NgramDrafter(self.suffix.device, d.ngram_min, d.ngram_max)
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens)

    def mode(self, mode: str) -> None:
        """Speculation as ``mode`` says from the next request on, the shared index empty."""
        guard = self.engine.guard
        assert guard is not None
        self.suffix.shared = self.fresh_shared()
        if isinstance(self.hybrid, HybridDrafter):  # the copier: the suffix drafter or n-gram
            self.hybrid.suffix = None if mode == "eagle3+ngram" else self.suffix
            return
        guard.inner = self.ngram if mode == "ngram" else self.suffix
        self.engine.drafter = guard.inner

    def run(self, ids: list[int], mode: str) -> tuple[int, int, float, float, list[int]]:
        """One request alone, its decoding after the first token (what speculation changes; the
        prefill is the same in every mode): (tokens, target passes, seconds, seconds drafting,
        the whole output)."""
        spec = SpecParams(enabled=mode != "off", k=self.k_max if mode == "suffix-k" else None)
        drafting: list[float] = []
        first: list[float] = []

        def step(outs) -> None:
            if not first and any(o.new_token_ids for o in outs):
                first.append(time.perf_counter())
            drafting.extend(o.stats.draft_s for o in outs if o.stats)

        s = self.engine.generate([ids], self.params, spec, on_step=step)[0]
        secs = time.perf_counter() - first[0]
        # the prefill's pass gave the first token
        return len(s.output_ids) - 1, s.target_passes - 1, secs, sum(drafting), s.output_ids

    def chat(self, *turns: str) -> list[int]:
        roles = ["user", "assistant"]
        msgs = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
        return chat_ids(self.tok, msgs)


Requests = list[tuple[list[int] | None, list[int]]]


def workloads(b: Bench, n: int) -> dict[str, Requests]:
    """Per workload, its requests: (an untimed request sent first or None, the timed one)."""
    rename: Requests = [
        (
            None,
            b.chat(
                f"Here is a Python function:\n\n```python\n{src}```\n\nRepeat this function "
                f"exactly, with `{name}` renamed to `{name}_v2`. Answer with the code only."
            ),
        )
        for name, src in humaneval_functions(n)
    ]
    b.mode("off")
    as_list: Requests = []
    for q in questions(n):  # the model's own answer, generated once, then rewritten
        answer = b.tok.decode(b.run(b.chat(q), "off")[4], skip_special_tokens=True)
        as_list.append(
            (
                None,
                b.chat(
                    q,
                    answer,
                    "Rewrite your answer as a list: every sentence on its own line, "
                    "starting with '- ', the words unchanged.",
                ),
            )
        )
    retry: Requests = [(b.chat(q), b.chat(q)) for q in questions(n, skip=n)]
    chat: Requests = [(None, b.chat(q)) for q in questions(n, skip=2 * n)]
    return {"rename": rename, "as-list": as_list, "retry": retry, "chat": chat}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.suffix", description=__doc__)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--prompts", type=int, default=3, help="requests per workload")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument(
        "--repeat", type=int, default=2, help="timed sweeps (after an untimed one): the fastest"
    )
    ap.add_argument(
        "--hybrid",
        action="store_true",
        help="the config's EAGLE-3 head with the suffix drafter vs the n-gram lookup as copier",
    )
    ap.add_argument("--out", default=None, help="default loadtest/results/suffix[_hybrid].txt")
    args = ap.parse_args(argv)
    out_path = args.out or f"loadtest/results/suffix{'_hybrid' if args.hybrid else ''}.txt"
    modes = HYBRID_MODES if args.hybrid else MODES
    b = Bench(args.config, args.max_tokens, args.hybrid)
    loads = workloads(b, args.prompts)
    # runs[(workload, mode, request)]: (tokens, passes, seconds, seconds drafting) of each timed
    # repeat; a request's fastest repeat counts (other work on a shared machine only slows)
    runs: dict[tuple[str, str, int], list[tuple[int, int, float, float]]] = {}
    same = True
    # the first sweep is untimed: it compiles the shapes these contexts need and calibrates
    # the controller
    sweeps = [
        (rep, w_i, name, reqs)
        for rep in range(args.repeat + 1)
        for w_i, (name, reqs) in enumerate(loads.items())
    ]
    for rep, w_i, name, reqs in sweeps:
        order = modes if (w_i + rep) % 2 == 0 else modes[::-1]
        outputs: dict[str, list[list[int]]] = {}
        for mode in order:
            b.mode(mode)
            for i, (first, ids) in enumerate(reqs):
                if first is not None:
                    b.run(first, mode)  # the earlier request (untimed)
                n_tok, passes, secs, drafting, out = b.run(ids, mode)
                if rep > 0:
                    runs.setdefault((name, mode, i), []).append((n_tok, passes, secs, drafting))
                outputs.setdefault(mode, []).append(out)
        same &= all(outputs[m] == outputs["off"] for m in modes)
    totals: dict[tuple[str, str], list[float]] = {}
    for (name, mode, _), reps in runs.items():
        fastest = min(reps, key=lambda r: r[2])
        tot = totals.setdefault((name, mode), [0.0, 0.0, 0.0, 0.0])
        for j in range(4):
            tot[j] += fastest[j]
    c = b.built.config
    head = (
        "Suffix decoding on repetitive workloads: loadtest/bench/suffix.py, in-process, greedy, "
        "one request at a time"
    )
    command = (
        f"python -m loadtest.bench.suffix --config {args.config} --prompts {args.prompts} "
        f"--max-tokens {args.max_tokens} --repeat {args.repeat}{' --hybrid' if args.hybrid else ''}"
    )
    setup = (
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; model {c.model.name} "
        f"({c.model.dtype}), compile {'on' if c.compile.enabled else 'off'}, adaptive K up to "
        f"{c.drafter.k_max}"
    )
    lines = [head, command, f"CPU: {cpu_description()}", setup, ""]
    lines.append(
        f"{'workload':<10}{'mode':<15}{'tokens':>8}{'tok/pass':>10}{'tok/s':>9}{'vs off':>8}"
        f"{'draft ms/pass':>15}"
    )
    for name in loads:
        off = totals[(name, "off")]
        for mode in modes:
            made, per, spent, drafted_s = totals[(name, mode)]
            rate = made / spent
            ratio = rate / (off[0] / off[2])
            row = f"{name:<10}{mode:<15}{int(made):>8}{made / per:>10.2f}{rate:>9.1f}"
            lines.append(f"{row}{ratio:>7.2f}x{1000 * drafted_s / per:>15.2f}")
    lines += ["", f"outputs identical across modes: {same}"]
    text = "\n".join(lines)
    print(text)
    Path(out_path).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
