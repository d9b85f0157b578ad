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
* ``tools``: a tool-call loop: a shared system prompt with one tool, a task over several files,
  and each step's request holds the calls made so far and their results (HumanEval sources);
  the answer is the next call, in the format of the earlier ones;
* ``docs``: one document (a HumanEval function) edited by several requests, each asking a
  different small edit: every answer repeats most of the document, which the earlier edits'
  outputs hold too;
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

``--modes``: which of off, suffix, suffix-tree (the suffix drafter with draft trees of up to
``--tree-leaves`` leaves where the adaptive controller finds they pay), ngram, suffix-k run.

``--llama-server PATH``: the same requests (the same token ids, greedy, the same max tokens, in
the same order, the earlier request of a workload sent first, untimed) also go to llama.cpp's
``llama-server`` on the config's GGUF (2 threads, one slot), once plain and once with each of
its n-gram speculative modes (``--llama-modes``; ``spec-default`` is ``--spec-default``, the
rest ``--spec-type``, each at llama-server's own defaults), after specd's modes, each with the
same untimed first sweep and fastest of the timed ones. llama-server's tok/s is its own
decoding timing (``timings.predicted_n / predicted_ms``: after the prompt, the first token
included), as specd's is its decoding after the first token: neither counts HTTP or the
prefill (loadtest/results/suffix_llama.txt).

    python -m loadtest.bench.suffix --prompts 4 --max-tokens 128 --modes off,suffix,suffix-tree \
        --llama-server loadtest/envs/llama-server/build/bin/llama-server \
        --out loadtest/results/suffix_llama.txt
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.drafters.hybrid import HybridDrafter
from engine.drafters.ngram import NgramDrafter
from engine.drafters.suffix import SuffixDrafter
from engine.drafters.suffix_index import SuffixIndex
from engine.kcontrol.controller import AdaptiveK
from engine.model.loader import resolve_source
from engine.records.params import SamplingParams, SpecParams
from loadtest.machine import cpu_description
from loadtest.server_proc import HOST, spawn
from prompts.sets import chat_ids, humaneval_file, mt_bench

# off; the suffix and n-gram drafters under the adaptive controller; the suffix drafter asked
# for K_max every round (what it proposes where a copy is there to take, whatever the controller)
MODES = ("off", "suffix", "ngram", "suffix-k")
EVERY_MODE = ("off", "suffix", "suffix-tree", "ngram", "suffix-k")
# llama-server's n-gram speculative modes: name -> its flags (beside plain, no flag)
LLAMA_MODES = {
    "spec-default": ["--spec-default"],
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-map-k": ["--spec-type", "ngram-map-k"],
    "ngram-map-k4v": ["--spec-type", "ngram-map-k4v"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
}
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
    def __init__(self, config: str, max_tokens: int, hybrid: bool = False, leaves: int = 3):
        """``hybrid``: the config's EAGLE-3 head (method eagle3) with a copier, else the suffix
        drafter alone; ``leaves``: the suffix-tree mode's most leaves a tree."""
        self.leaves = leaves
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
        ctl = self.engine.controller  # draft trees in the suffix-tree mode only
        if isinstance(ctl, AdaptiveK):
            ctl.max_leaves = self.leaves if mode == "suffix-tree" else 0

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
    return {
        "rename": rename,
        "as-list": as_list,
        "retry": retry,
        "tools": tool_loop(b, n),
        "docs": edits(b, n),
        "chat": chat,
    }


TOOL_SYSTEM = (
    "You are a coding agent. You can call one tool, read_file, which returns a file's text. "
    'To call it, answer with one JSON object only: {"name": "read_file", "arguments": {"path": '
    '"<path>"}}.'
)


def tool_loop(b: Bench, n: int) -> Requests:
    """One agent loop of ``n`` steps: step i's request holds the task, the i calls made before
    and their results (HumanEval sources), and asks for the next call."""
    files = humaneval_functions(n + 1)
    paths = [f"src/{name}.py" for name, _ in files]
    task = (
        "Read these files one by one, in this order, with read_file: "
        + ", ".join(paths)
        + ". Then summarise what they do."
    )
    out: Requests = []
    for i in range(n):
        msgs = [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": task}]
        for path, (_, src) in zip(paths[:i], files):
            call = {"name": "read_file", "arguments": {"path": path}}
            msgs.append({"role": "assistant", "content": json.dumps(call)})
            msgs.append({"role": "user", "content": f"read_file result for {path}:\n{src}"})
        out.append((None, chat_ids(b.tok, msgs)))
    return out


EDITS = (
    "Add a one-line comment above every return statement.",
    "Rename every local variable to a longer, clearer name.",
    "Add type hints to the function's parameters.",
    "Replace double quotes with single quotes in the code.",
    "Add a line that prints the result before it is returned.",
    "Put a blank line after the docstring.",
)


def edits(b: Bench, n: int) -> Requests:
    """One document (a HumanEval function) and ``n`` requests, each asking a different edit and
    the whole function back."""
    _, src = humaneval_functions(2 * n + 1)[-1]
    return [
        (
            None,
            b.chat(
                f"Here is a Python function:\n\n```python\n{src}```\n\n{EDITS[i % len(EDITS)]} "
                "Answer with the whole edited function only."
            ),
        )
        for i in range(n)
    ]


class Llama:
    """llama.cpp's llama-server on the config's GGUF (2 threads, one slot, started per mode)."""

    def __init__(self, binary: str, config: str, max_tokens: int):
        self.binary, self.max_tokens = binary, max_tokens
        self.gguf = resolve_source(EngineConfig.from_yaml(config).model.source).location

    def argv(self, flags: list[str]) -> list[str]:
        base = [self.binary, "-m", self.gguf, "-t", "2", "-tb", "2", "-c", "8192", "-np", "1"]
        return base + ["--host", HOST, "--port", "0", *flags]

    def run(self, url: str, ids: list[int]) -> tuple[int, int, float, list[int]]:
        """One greedy request: (tokens, target passes or -1 where not reported, seconds of its
        own decoding timing, the output's ids)."""
        body = {
            "prompt": ids,
            "n_predict": self.max_tokens,
            "temperature": 0,
            "top_k": 1,
            "cache_prompt": True,
            "return_tokens": True,
        }
        r = httpx.post(f"{url}/completion", json=body, timeout=600)
        r.raise_for_status()
        res = r.json()
        t = res["timings"]
        made = int(t["predicted_n"])
        accepted = t.get("draft_n_accepted")
        passes = made - int(accepted) if accepted is not None else -1
        return made, passes, float(t["predicted_ms"]) / 1000, list(res.get("tokens") or [])


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
    ap.add_argument("--modes", help=f"specd's modes, of {','.join(EVERY_MODE)} (default: {MODES})")
    ap.add_argument("--tree-leaves", type=int, default=3, help="suffix-tree: most leaves a tree")
    ap.add_argument("--workloads", help="which workloads, comma-separated (default: all)")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary: measured too")
    ap.add_argument(
        "--llama-modes",
        default="spec-default,ngram-simple,ngram-map-k,ngram-cache",
        help=f"llama-server's n-gram modes beside plain, of {','.join(LLAMA_MODES)}",
    )
    ap.add_argument("--out", default=None, help="default loadtest/results/suffix[_hybrid].txt")
    args = ap.parse_args(argv)
    out_path = args.out or f"loadtest/results/suffix{'_hybrid' if args.hybrid else ''}.txt"
    modes: tuple[str, ...] = HYBRID_MODES if args.hybrid else MODES
    if args.modes:
        modes = tuple(args.modes.split(","))
        if "off" not in modes or not set(modes) <= set(EVERY_MODE + HYBRID_MODES):
            raise SystemExit(f"--modes: off and any of {', '.join(EVERY_MODE)}")
    b = Bench(args.config, args.max_tokens, args.hybrid, args.tree_leaves)
    loads = workloads(b, args.prompts)
    if args.workloads:
        loads = {w: loads[w] for w in args.workloads.split(",")}
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
    offs: dict[tuple[str, int], list[int]] = {}  # specd's plain output per request
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
                if mode == "off":
                    offs[(name, i)] = out
        same &= all(outputs[m] == outputs["off"] for m in modes)

    def report(llama_done: list[str], gguf: str = "") -> str:
        """The results so far (specd's modes, and llama-server's ``llama_done``) into
        ``out_path``: a run cut short keeps what it measured."""
        totals: dict[tuple[str, str], list[float]] = {}
        for (name, mode, _), reps in runs.items():
            fastest = min(reps, key=lambda r: r[2])
            tot = totals.setdefault((name, mode), [0.0, 0.0, 0.0, 0.0])
            for j in range(4):
                tot[j] += fastest[j]
        c = b.built.config
        head = (
            "Suffix decoding on repetitive workloads: loadtest/bench/suffix.py, in-process, "
            "greedy, one request at a time"
        )
        command = (
            f"python -m loadtest.bench.suffix --config {args.config} --prompts {args.prompts} "
            f"--max-tokens {args.max_tokens} --repeat {args.repeat}"
            + (" --hybrid" if args.hybrid else "")
            + (f" --modes {args.modes}" if args.modes else "")
            + (f" --tree-leaves {args.tree_leaves}" if "suffix-tree" in modes else "")
            + (f" --workloads {args.workloads}" if args.workloads else "")
            + (
                f" --llama-server {args.llama_server} --llama-modes {args.llama_modes}"
                if llama_done
                else ""
            )
        )
        setup = (
            f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; model {c.model.name} "
            f"({c.model.dtype}), compile {'on' if c.compile.enabled else 'off'}, adaptive K up to "
            f"{c.drafter.k_max}"
        )
        lines = [head, command, f"CPU: {cpu_description()}", setup, ""]
        if llama_done:
            note = (
                f"llama-server: {gguf}, -t 2 -tb 2 -c 8192 -np 1, greedy (temperature 0, "
                "top_k 1); its tok/s from its own timings (decoding after the prompt), tok/pass "
                "where it reports draft_n_accepted; vs llama: / llama-server plain"
            )
            lines += [note, ""]
        lines.append(
            f"{'workload':<10}{'mode':<22}{'tokens':>8}{'tok/pass':>10}{'tok/s':>9}{'vs off':>8}"
            + (f"{'vs llama':>10}" if llama_done else "")
            + f"{'draft ms/pass':>15}"
        )
        for name in loads:
            off = totals[(name, "off")]
            plain_llama = totals.get((name, "llama"))
            for mode in list(modes) + llama_done:
                made, per, spent, drafted_s = totals[(name, mode)]
                rate = made / spent
                ratio = rate / (off[0] / off[2])
                tau = f"{made / per:>10.2f}" if per > 0 else f"{'-':>10}"
                row = f"{name:<10}{mode:<22}{int(made):>8}{tau}{rate:>9.1f}{ratio:>7.2f}x"
                if plain_llama is not None:
                    row += f"{rate / (plain_llama[0] / plain_llama[2]):>9.2f}x"
                ms = (
                    f"{1000 * drafted_s / per:>15.2f}"
                    if per > 0 and mode in modes
                    else f"{'-':>15}"
                )
                lines.append(row + ms)
        lines += ["", f"specd's outputs identical across its modes: {same}"]
        if llama_done:
            n_req = sum(len(r) for r in loads.values())
            lines.append(
                f"llama-server plain's first token equal to specd plain's (or whole output): "
                f"{same_llama} of {n_req} requests (other numerics: the GGUF's Q4_1 in ggml)"
            )
            ours = [m for m in modes if m.startswith("suffix")]
            spec_l = [m for m in llama_done if m != "llama"]
            if ours and spec_l:
                lines += ["", "specd's best suffix mode / llama-server's best n-gram mode, tok/s:"]
            for name in loads if ours and spec_l else []:
                best_s = max(ours, key=lambda m: totals[(name, m)][0] / totals[(name, m)][2])
                best_l = max(spec_l, key=lambda m: totals[(name, m)][0] / totals[(name, m)][2])
                rs = totals[(name, best_s)][0] / totals[(name, best_s)][2]
                rl = totals[(name, best_l)][0] / totals[(name, best_l)][2]
                lines.append(
                    f"  {name:<10}{best_s:<13}{rs:>7.1f} / {best_l:<20}{rl:>7.1f} = {rs / rl:.2f}x"
                )
        text = "\n".join(lines)
        Path(out_path).write_text(text + "\n")
        return text

    report([])  # specd's modes, kept should llama-server's runs be cut short
    llama_modes: list[str] = []
    same_llama = 0  # requests whose llama-server plain output is specd's plain one
    if args.llama_server:
        llama = Llama(args.llama_server, args.config, args.max_tokens)
        llama_modes = ["llama"] + [f"llama {m}" for m in args.llama_modes.split(",")]
        # the last mode's server log, outside the results (a log is no finding)
        log = Path(tempfile.gettempdir()) / "suffix-llama-server.log"
        for mode in llama_modes:
            flags = LLAMA_MODES[mode.split(" ")[1]] if " " in mode else []
            with spawn(
                llama.argv(flags), ready_path="/health", name="llama-server", log=log
            ) as srv:
                for rep, _, name, reqs in sweeps:
                    for i, (first, ids) in enumerate(reqs):
                        if first is not None:
                            llama.run(srv.url, first)
                        n_tok, passes, secs, out = llama.run(srv.url, ids)
                        if rep > 0:
                            runs.setdefault((name, mode, i), []).append((n_tok, passes, secs, 0))
                        if mode == "llama" and rep == 0:
                            # (the first token: the GGUF's numerics may part from specd's later)
                            same_llama += out[:1] == offs[(name, i)][1:2] or out == offs[(name, i)]
            report(llama_modes[: llama_modes.index(mode) + 1], llama.gguf)
    print(report(llama_modes, llama.gguf) if llama_modes else report([]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
