"""One-shot GPU benchmark: bandwidth bound, step costs, plain and speculative decoding, batching.

Sections (each guarded: a failure prints its traceback and the next one runs; the JSON of all
results so far is rewritten after every section, so a kill keeps what finished):
  0 device facts and measured memory bandwidth      3 engine plain decode, batch 1
  1 models (random weights) + engine, compile       4 synthetic acceptance vs the bound, batch 1
  2 step costs at batch 1 on a filled cache         5 batches: tok/s, ITL, phases; K off/4/adaptive
                                                    6 tree verify vs decode; prefix-cache TTFT
Random weights and synthetic acceptance (loadtest/bench/synthetic.py): outputs are not the
target's; the figures are the engine's speed at a given acceptance rate. A GPU run:
``python -m loadtest.bench.gpu`` (llama-8b, llama-1b draft, CUDA graphs); a CPU check of the
plumbing: ``--device cpu --dtype float32 --target tiny --draft tiny --max-tokens 8``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
import traceback

import numpy as np
import torch

from engine.builder import head_runner
from engine.drafters import ModelDrafter
from engine.drafters.eagle.drafter import EagleDrafter
from engine.engine import SpecEngine
from engine.kcontrol.controller import FixedK
from engine.kcontrol.timing import time_call, time_calls
from engine.model.runner import ModelRunner
from engine.records.params import SamplingParams, SpecParams
from loadtest.bench import gpu_parts as parts
from loadtest.bench.steps import random_model, time_forward
from loadtest.bench.synthetic import SyntheticAccept, bound

K_MAX = 4
med = statistics.median
PLAIN = SpecParams(enabled=False)


class Bench:
    def __init__(self, a):
        self.a, self.dev, self.dtype = a, torch.device(a.device), getattr(torch, a.dtype)
        self.r: dict = {"args": vars(a), "errors": {}, "section_s": {}}
        self.t0, self.nreq, self.bound_tps = time.perf_counter(), 0, None
        self.sections: list[int] = []  # main() sets the sections run
        self.gen = torch.Generator(device=self.dev).manual_seed(2)  # synthetic acceptance draws
        self.params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=a.max_tokens)

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def save(self) -> None:
        if self.dev.type == "cuda":
            self.r["max_memory_gib"] = torch.cuda.max_memory_allocated(self.dev) / 2**30
        os.makedirs(os.path.dirname(self.a.json) or ".", exist_ok=True)
        with open(self.a.json, "w") as f:
            json.dump(self.r, f, indent=1, default=str)

    def prompt(self, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.vocab, (self.a.prompt_tokens,), generator=g).tolist()

    def s0(self) -> None:
        d, cuda = self.dev, self.dev.type == "cuda"
        out = {"torch": torch.__version__, "device": str(d)}
        if cuda:
            p = torch.cuda.get_device_properties(d)
            out |= {"gpu": p.name, "sms": p.multi_processor_count, "gib": p.total_memory / 2**30}
        gib = self.a.bw_gib or (2.0 if cuda else 0.125)
        n, t_copy, t_sum = parts.bandwidth(d, gib)
        if cuda:
            torch.cuda.empty_cache()
        out |= dict(bw_gib=gib, copy_ms=t_copy * 1e3, copy_rw_gbs=2 * n / t_copy / 1e9)
        out |= dict(copy_read_gbs=n / t_copy / 1e9, sum_read_gbs=n / t_sum / 1e9)
        self.r["s0"] = out
        self.log(f"device facts and bandwidth (GB/s): {parts.short(out)}")

    def s1(self) -> None:
        a, t = self.a, time.perf_counter()
        self.tmodel = random_model(a.target, self.dtype, self.dev)
        dmodel = random_model(a.draft, self.dtype, self.dev)
        build_s = time.perf_counter() - t
        emb, head = self.tmodel.model.embed_tokens.weight, self.tmodel.lm_head.weight
        wbytes = sum(p.numel() * p.element_size() for p in self.tmodel.parameters())
        wbytes -= emb.numel() * emb.element_size() * (head is not emb)  # a lookup reads a row
        bw = self.r.get("s0", {}).get("copy_rw_gbs")
        self.bound_tps = bw * 1e9 / wbytes if bw else None
        batches = [int(b) for b in a.batches.split(",")]
        lens = [a.prompt_tokens + a.max_tokens, a.context]
        if 6 in self.sections:  # trees verified after 300 cached tokens; a cached prompt and a turn
            lens += [300 + a.tree_max_n, a.prefix_tokens + 64]
        max_len = max(lens) + K_MAX + 32  # (more key-length buckets to capture only when asked)
        self.batches = batches
        pool = max(batches) * max_len if a.kv_layout == "paged" else None
        self.target = ModelRunner(
            self.tmodel,
            max(batches),
            max_len,
            compile=self.fast("target"),
            k_max=K_MAX,
            pool_tokens=pool,
        )
        draft = ModelRunner(
            dmodel, max(batches), max_len, name="draft", compile=self.fast("draft"), k_max=K_MAX
        )
        self.vocab = min(self.target.vocab_size, draft.vocab_size)
        self.drafter = ModelDrafter(draft, self.vocab)
        self.accept = SyntheticAccept(self.gen)  # alpha set per run (generate)
        self.engine = SpecEngine(
            self.target, self.drafter, [], controller=FixedK(0), k_max=K_MAX, accept=self.accept
        )
        out = dict(build_s=build_s, weight_bytes=wbytes, bound_tok_s=self.bound_tps)
        self.r["s1"] = out | dict(max_len=max_len, compile=a.compile)
        self.warm_up(self.engine, self.r["s1"])
        self.r["s1"]["graphs_after_warm_up"] = parts.graph_counts(self.engine.runners())
        self.log(f"models and engine: {parts.short(self.r['s1'])}")

    def fast(self, name: str):
        """The fast path (--compile mode) of the runner named ``name``, or None (eager)."""
        if self.a.compile == "none":
            return None
        return parts.compile_config(self.a, self.batches, K_MAX, name)

    def warm_up(self, eng: SpecEngine, out: dict) -> None:
        """Every runner of ``eng`` with a fast path warmed up (timed)."""
        for r in eng.runners():
            if r.fast is not None:
                out[f"warm_up_s_{r.name}"] = time_call(r.warm_up, self.dev)
                out[f"fast_path_{r.name}"] = r.fast is not None  # False: it fell back to eager

    def s2(self) -> None:
        a, rows = self.a, []
        for r in self.engine.runners():
            r.cache.allocate(0)
            try:  # slot 0 holds `context` tokens; the timed forwards write past them uncommitted
                ctx = torch.randint(0, r.vocab_size, (1, a.context), device=self.dev)
                r.forward(ctx, [0], counts=[a.context])
                r.cache.commit(0, a.context)
                dec = med(time_forward(r, 1, 1, a.reps, warmup=3)) * 1e3
                ver = med(time_forward(r, 1, K_MAX + 1, a.reps, warmup=3)) * 1e3
            finally:
                r.cache.free(0)
            rows.append(dict(model=r.name, decode_ms=dec, verify5_ms=ver, ratio=ver / dec))
            self.log(f"step costs: {parts.short(rows[-1])}")
        t, d = rows
        out = dict(rows=rows, c=d["decode_ms"] / t["decode_ms"], fwd_tok_s=1e3 / t["decode_ms"])
        out["fwd_of_bound"] = out["fwd_tok_s"] / self.bound_tps if self.bound_tps else None
        self.r["s2"] = out

    def generate(self, eng: SpecEngine, spec: SpecParams, alpha: float | None, seed: int):
        """tok/s of one SpecEngine.generate at batch 1 (synthetic acceptance ``alpha``, or the real
        rule), and its tokens per target pass."""
        self.accept.alpha = alpha or None  # alpha 0 / None: the exact rule
        seqs, p = [], self.prompt(seed)
        dt = time_call(lambda: seqs.extend(eng.generate([p], self.params, spec)), eng.device)
        n = sum(len(s.output_ids) for s in seqs)
        return n / dt, n / sum(s.target_passes for s in seqs)

    def s3(self) -> None:
        self.generate(self.engine, PLAIN, None, 0)  # warm
        runs = [self.generate(self.engine, PLAIN, None, 0)[0] for _ in range(3)]
        b = self.bound_tps
        self.r["s3"] = dict(tok_s=med(runs), runs=runs, of_bound=med(runs) / b if b else None)
        # the graphs replay the eager path's kernels: greedy output must be the eager one's
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=48)
        prompts = [self.prompt(7 + i) for i in range(3)]
        out = [s.output_ids for s in self.engine.generate(prompts, params, SpecParams(k=3))]
        with contextlib.ExitStack() as eager:
            for r in self.engine.runners():
                eager.enter_context(r.eager())
            ref = [s.output_ids for s in self.engine.generate(prompts, params, PLAIN)]
        self.r["s3"]["greedy_spec_graphs_equals_plain_eager"] = out == ref
        self.log(f"engine plain decode, batch 1: {parts.short(self.r['s3'])}")

    def spec_rows(self, eng: SpecEngine, c: float, label: str) -> list[dict]:
        a, rows = self.a, []
        self.generate(eng, PLAIN, None, 1)  # warm both paths
        self.generate(eng, SpecParams(k=K_MAX), 0.8, 1)
        for alpha in [float(x) for x in a.alphas.split(",")]:
            for k in [int(x) for x in a.ks.split(",")]:
                plain, spec, tpp = [], [], []
                for i in range(a.repeats):  # ABBA
                    for name in ("plain", "spec") if i % 2 == 0 else ("spec", "plain"):
                        if name == "plain":
                            plain.append(self.generate(eng, PLAIN, None, 1)[0])
                        else:
                            s, per_pass = self.generate(eng, SpecParams(k=k), alpha, 1)
                            spec.append(s)
                            tpp.append(per_pass)
                p, s, e = med(plain), med(spec), (1 - alpha ** (k + 1)) / (1 - alpha)
                row = dict(drafter=label, alpha=alpha, k=k, c=c, plain_tok_s=p, spec_tok_s=s)
                row |= dict(tok_per_pass=statistics.mean(tpp), E=e, speedup=s / p)
                row |= dict(bound=bound(alpha, k, c), of_bound=s / p / bound(alpha, k, c))
                row["drafter_failures"] = eng.drafter_failures  # > 0: rounds fell back to plain
                rows.append(row)
                self.log(f"synthetic acceptance: {parts.short(row)}")
        self.accept.alpha = None  # the exact rule again
        return rows

    def s4(self) -> None:
        if "s2" not in self.r:
            self.s2()
        model = self.a.model_s4  # the draft model's rows (--no-model-s4: the head's only)
        self.r["s4"] = {"model": self.spec_rows(self.engine, self.r["s2"]["c"], self.a.draft)
                        if model else []}  # fmt: skip
        self.save()
        if not self.a.eagle:
            return
        # its own target runner (one slot), tapping the head's layers
        dev, k = self.dev, self.r["s4"]
        head = parts.random_head(self.tmodel, self.dtype, dev)
        self.batches = [1]
        t = ModelRunner(
            self.tmodel,
            1,
            self.target.max_len,
            name="target_eagle",
            taps=tuple(head.config.aux_layers),
            compile=self.fast("target_eagle"),
            k_max=K_MAX,
        )
        embed = self.tmodel.model.embed_tokens
        eager = EagleDrafter(head, head_runner(head, embed, 1, t.max_len), t.vocab_size)
        # as the builder: the head's runner with the target's fast path (captured on CUDA, every
        # bucket), chosen as the drafter is built; the eager step is timed on a second, eager one
        captured = self.a.compile != "none"
        d = eager
        if captured:
            own = head_runner(head, embed, 1, t.max_len, compile=self.fast("eagle3"))
            d = EagleDrafter(head, own, t.vocab_size)
        eng = SpecEngine(t, d, [], controller=FixedK(0), k_max=K_MAX, accept=self.accept)
        self.warm_up(eng, k)
        # c: one chained head step / one target decode step, batch 1, `context` tokens cached
        ctx = min(self.a.context, t.max_len - K_MAX - 2)
        caches = [t.cache] + [x.cache for x in ([eager, d] if captured else [eager])]
        for cache in caches:
            cache.allocate(0)
            cache.reserve(0, ctx)
            cache.commit(0, ctx)
        try:
            tok = torch.tensor([42], device=dev)
            o = torch.zeros(1, head.config.hidden_size, dtype=self.dtype, device=dev)

            def step_of(x: EagleDrafter):
                return lambda: x.chain_step(tok, o, [0])[1].argmax(-1)

            k["eagle_eager_step_ms"] = (
                med(time_calls(step_of(eager), dev, self.a.reps, warmup=3)) * 1e3
            )
            if captured:
                k["eagle_capture_s"] = time_call(d.warm_up, dev)
            k["eagle_step_ms"] = med(time_calls(step_of(d), dev, self.a.reps, warmup=3)) * 1e3
            fwd = lambda: t.forward(tok[:, None], [0], [1])  # noqa: E731
            k["eagle_target_ms"] = med(time_calls(fwd, dev, self.a.reps, warmup=3)) * 1e3
        finally:
            for cache in caches:
                cache.free(0)
        k["eagle_c"] = k["eagle_step_ms"] / k["eagle_target_ms"]
        k["eagle_graphs"] = getattr(d.forward, "captures", None)  # None: the head ran eagerly
        self.log(f"EAGLE-3 head: {parts.short({x: v for x, v in k.items() if x != 'model'})}")
        k["eagle"] = self.spec_rows(eng, k["eagle_c"], "eagle3")

    def load(self, eng: SpecEngine, batch: int, spec: SpecParams, max_tokens: int) -> dict:
        """``batch`` requests at once, stepped to completion: tok/s, p95 inter-token latency
        (each emission's gap since the request's previous one, per token), tokens per pass."""
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
        seqs = []
        for i in range(batch):
            self.nreq += 1
            seqs.append(eng.add_request(f"r{self.nreq}", self.prompt(100 + i), params, spec))
        last: dict[str, float] = {}
        itl, ks, ph = [], [], np.zeros(5)  # ph: steps, ms of step / draft / verify / accept
        t0 = time.perf_counter()
        while eng.has_work():
            t, outs = time.perf_counter(), eng.step()
            now, st = time.perf_counter(), next((o.stats for o in outs if o.stats), None)
            if st is not None:  # a round's phases (CUDA events on a GPU: engine/kcontrol/timing.py)
                ph += [1, now - t, st.draft_s, st.verify_s, st.accept_s]
            for o in outs:
                n = len(o.new_token_ids)
                ks += [o.stats.k] if o.stats is not None else []
                if n and o.request_id in last:
                    itl += [(now - last[o.request_id]) / n] * n
                last[o.request_id] = now if n else last.get(o.request_id, now)
        wall = time.perf_counter() - t0
        tokens = sum(len(s.output_ids) for s in seqs)
        p95 = float(np.percentile(itl, 95)) * 1e3 if itl else None
        out = dict(batch=batch, tok_s=tokens / wall, p95_itl_ms=p95, wall_s=wall)
        passes = sum(s.target_passes for s in seqs)
        names = ("step_ms", "draft_ms", "verify_ms", "accept_ms")
        out |= dict(zip(names, ph[1:] / max(ph[0], 1) * 1e3))  # means over the rounds
        return out | dict(tok_per_pass=tokens / passes, mean_k=statistics.mean(ks or [0]))

    def s5(self) -> None:
        eng = parts.adaptive_engine(self, 0.8, K_MAX)
        t = time.perf_counter()
        self.load(eng, 1, SpecParams(), 8)  # the engine calibrates the controller here
        self.r["s5"] = dict(alpha=0.8, calibrate_warm_s=time.perf_counter() - t, rows=[])
        modes = [("off", PLAIN), (f"K={K_MAX}", SpecParams(k=K_MAX)), ("adaptive", SpecParams())]
        for b in [int(x) for x in self.a.batches.split(",")]:
            self.load(eng, b, PLAIN, 8)  # warm this batch size
            for mode, spec in modes:
                row = {"mode": mode} | self.load(eng, b, spec, self.a.max_tokens)
                self.r["s5"]["rows"].append(row)
                self.log(f"batch: {parts.short(row)}")
            self.save()
        self.r["s5"]["graphs"] = parts.graph_counts(self.engine.runners())

    def s6(self) -> None:
        """Draft trees and the prefix cache on the device: the verify of N tokens a row as a chain
        and as a tree (a chain of min(3, N - 1) and leaves, under the tree mask) against a decode,
        batch 1 and 32, through the fast path and eager (loadtest/bench/trees.py); a prompt's
        time to its first token cold, and grown by a turn with the rest in the prefix cache."""
        from loadtest.bench.trees import verify_costs

        a = self.a
        rows = verify_costs(self.engine, min(32, max(self.batches)), a.tree_max_n)
        decode = {r["batch"]: r["chain_compiled_ms"] for r in rows if r["n"] == 1}
        for r in rows:
            for k in [k for k in r if k.endswith("_ms")]:
                r[k.replace("_ms", "_x_decode")] = r[k] / decode[r["batch"]]
        cols = "batch:d n:d chain_compiled_ms:.2f tree_compiled_ms:.2f tree_compiled_x_decode:.2f"
        parts.table("verify of N tokens a row (ms; x decode: over the batch's decode)", rows, cols)
        out: dict = {"verify": rows}
        self.r["s6"] = out
        self.save()
        eng = SpecEngine(
            self.target, None, [], controller=FixedK(0), prefix_cache_tokens=4 * a.prefix_tokens
        )
        first = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)

        def ttft(prompt: list[int]):  # ms to the first token, and the sequence
            seqs: list = []
            ms = 1e3 * time_call(
                lambda: seqs.extend(eng.generate([prompt], first, PLAIN)), self.dev
            )
            return ms, seqs[0]

        g = torch.Generator().manual_seed(5)
        hits = []
        for _ in range(3):  # the first run warms the prefill's shapes up
            history = torch.randint(0, self.vocab, (a.prefix_tokens,), generator=g).tolist()
            turn = torch.randint(0, self.vocab, (64,), generator=g).tolist()
            cold, _ = ttft(history)
            hit, seq = ttft(history + turn)
            hits.append(dict(cold_ms=cold, hit_ms=hit, cached=seq.cached_tokens))
        out["prefix"] = dict(prompt_tokens=a.prefix_tokens, turn_tokens=64, runs=hits)
        out["prefix"] |= {k: med(h[k] for h in hits[1:]) for k in ("cold_ms", "hit_ms")}
        self.log(f"prefix cache: {parts.short(out['prefix'])}")

    def report(self) -> None:
        parts.report(self.r, self.a, self.dev)


def main(argv=None) -> None:
    a = parts.parse_args(argv, __doc__)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    sections = sorted({int(s) for s in a.sections.split(",")})
    if any(s >= 2 for s in sections):
        sections = sorted({*sections, 1})  # the models and engine
    b = Bench(a)
    b.sections = sections
    for n in sections:
        b.log(f"== section {n}")
        t = time.perf_counter()
        try:
            getattr(b, f"s{n}")()
        except Exception:  # noqa: BLE001 -- one section's failure must not lose the others
            traceback.print_exc()
            b.r["errors"][n] = traceback.format_exc(limit=-4)
        b.r["section_s"][n] = time.perf_counter() - t
        b.save()
        b.log(f"section {n} done in {b.r['section_s'][n]:.1f} s; results in {a.json}")
    b.report()


if __name__ == "__main__":
    main()
