"""Parts of the GPU benchmark (loadtest/bench/gpu.py): a random EAGLE-3 head of a target's shape
(built without a float32 copy), the memory-bandwidth measurement, and the report."""

from __future__ import annotations

import argparse
import statistics

import torch

from engine.builder import make_controller
from engine.config import DrafterConfig
from engine.drafters.eagle.head import Eagle3Head, HeadConfig, default_aux_layers
from engine.engine import SpecEngine
from engine.kcontrol.timing import time_calls
from engine.model.compiled import CompileConfig
from loadtest.bench.steps import SHAPES, in_dtype
from loadtest.bench.synthetic import SyntheticAccept

SGLANG = (
    "SGLang published (Llama-3.1-8B, H100, batch 1): 158 tok/s plain, 373 tok/s EAGLE-3 "
    "(real weights, real acceptance)"
)
med = statistics.median


def short(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def fmt(x, f: str) -> str:
    return "n/a" if x is None else format(x, f)


def table(title: str, rows: list[dict], cols: str) -> None:
    """Print ``rows`` under ``title``; ``cols``: space-separated ``key:format`` (header: key)."""
    spec = [c.split(":") for c in cols.split()]
    cells = [[fmt(r.get(k), f) for k, f in spec] for r in rows]
    width = [max(len(k), *(len(c[i]) for c in cells)) + 2 for i, (k, _) in enumerate(spec)]
    print(title)
    print("  " + "".join(f"{k:>{w}}" for (k, _), w in zip(spec, width)))
    for c in cells:
        print("  " + "".join(f"{x:>{w}}" for x, w in zip(c, width)))


def random_head(model, dtype: torch.dtype, device) -> Eagle3Head:
    """A random EAGLE-3 head of ``model``'s shape: one decoder layer, three taps (low, middle,
    high), a draft vocabulary of min(32000, vocab / 2) random target ids."""
    c = model.config
    n, vocab = c.num_hidden_layers, c.vocab_size
    hc = HeadConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        vocab_size=vocab, draft_vocab_size=min(32000, vocab // 2), target_hidden_size=c.hidden_size,
        aux_layers=default_aux_layers(n) if n > 8 else (0, n // 2, n - 1), rope_theta=500000.0,
    )  # fmt: skip
    head = in_dtype(dtype, device, lambda: Eagle3Head(hc))
    head.set_vocab(torch.randperm(vocab, device=device)[: hc.draft_vocab_size].sort().values)
    return head


def bandwidth(device: torch.device, gib: float) -> tuple[int, float, float]:
    """(bytes, median seconds of a copy into another tensor, of a sum()) over ``gib`` GiB."""
    src = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t_copy = med(time_calls(lambda: dst.copy_(src), device, 20, warmup=3))
    t_sum = med(time_calls(src.sum, device, 20, warmup=3))
    return src.numel() * 2, t_copy, t_sum


def report(r: dict, a, dev) -> None:
    """The human-readable report of the results ``r`` of a run with arguments ``a``."""
    print("\n==== GPU benchmark report (random weights; synthetic acceptance) ====")
    if "s0" in r:
        s = r["s0"]
        print(f"[0] torch {s['torch']}, {s.get('gpu', s['device'])}, SMs {s.get('sms', '-')}"
              f"; bandwidth: copy {s['copy_rw_gbs']:.0f} GB/s (bytes read + written), "
              f"{s['copy_read_gbs']:.0f} GB/s (bytes read only), sum() read "
              f"{s['sum_read_gbs']:.0f} GB/s (the bound: the copy figure)")  # fmt: skip
    if "s1" in r:
        print(f"[1] {short(r['s1'])}")
    if "s2" in r:
        s = r["s2"]
        table("[2] batch 1 step costs (ratio = verify5 / decode, goal <= 1.15)", s["rows"],
              "model:s decode_ms:.2f verify5_ms:.2f ratio:.2f")  # fmt: skip
        print(f"  c = {s['c']:.3f}; forward-only {s['fwd_tok_s']:.1f} tok/s = "
              f"{fmt(s['fwd_of_bound'], '.2f')} of the bound (goal >= 0.8)")  # fmt: skip
    if "s3" in r:
        print(f"[3] engine plain decode, batch 1: {r['s3']['tok_s']:.1f} tok/s = "
              f"{fmt(r['s3']['of_bound'], '.2f')} of the bound (goal >= 0.8)")  # fmt: skip
    rows = [x for k in ("model", "eagle") for x in r.get("s4", {}).get(k, [])]
    if rows:
        table("[4] synthetic acceptance, batch 1 (of_bound goal >= 0.9)", rows,
              "drafter:s alpha:.1f k:d c:.3f plain_tok_s:.1f spec_tok_s:.1f "
              "tok_per_pass:.2f E:.2f speedup:.2f bound:.2f of_bound:.2f")  # fmt: skip
    if "s5" in r:
        table(f"[5] batches, synthetic alpha = {r['s5']['alpha']}, draft {a.draft}",
              r["s5"]["rows"], "batch:d mode:s tok_s:.1f p95_itl_ms:.2f tok_per_pass:.2f "
              "mean_k:.2f step_ms:.2f draft_ms:.2f verify_ms:.2f accept_ms:.2f")  # fmt: skip
    best: dict = {}
    for x in rows:
        if x["alpha"] in (0.8, 0.9):
            key = (x["drafter"], x["alpha"])
            best[key] = max(best.get(key, 0.0), x["spec_tok_s"])
    ours = "; ".join(f"{d} alpha {al}: {v:.1f}" for (d, al), v in best.items())
    plain = fmt(r.get("s3", {}).get("tok_s"), ".1f")
    print(f"\n{SGLANG}\nours ({a.target} on {r.get('s0', {}).get('gpu', dev)}; "
          f"random weights, synthetic acceptance): plain {plain} tok/s; best spec tok/s "
          f"{ours or 'n/a'}")  # fmt: skip
    if r["errors"]:
        print(f"sections that failed: {sorted(r['errors'])} (tracebacks above and in JSON)")


def parse_args(argv, doc: str):
    """The benchmark's options (loadtest/bench/gpu.py)."""
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.gpu", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    for name, default, doc in (
        ("device", "cuda", ""), ("dtype", "bfloat16", ""), ("compile", "cuda-graphs", "or none"),
        ("target", "llama-8b", f"one of {sorted(SHAPES)}"), ("draft", "llama-1b", ""),
        ("batches", "1,8,32,64", ""), ("context", 256, "tokens cached in section 2"),
        ("prompt-tokens", 32, ""), ("max-tokens", 128, ""), ("alphas", "0.6,0.8,0.9", ""),
        ("ks", "2,4", ""), ("repeats", 2, "ABBA plain / spec alternations"),
        ("reps", 20, "timed forwards per step cost"), ("sections", "0,1,2,3,4,5", ""),
        ("bw-gib", 0.0, "copy size (0: 2 GiB on CUDA, 1/8 on CPU)"),
        ("json", "loadtest/results/gpu_bench.json", ""),
        ("fuse", 0, "compile.fuse (inductor's layer groups in the graphs): 1 target, 2 all"),
        ("layers-per-graph", 8, "layers a fused group compiles"),
        ("tree-max-n", 16, "section 6: verify sizes 1..N"),
        ("prefix-tokens", 2000, "section 6: the cached prompt's tokens"),
        ("kv-layout", "slots", "the target's KV cache: slots, or paged (block tables)"),
    ):  # fmt: skip
        ap.add_argument(f"--{name}", default=default, type=type(default), help=doc or None)
    ap.add_argument("--no-eagle", dest="eagle", action="store_false")
    ap.add_argument(
        "--no-model-s4",
        dest="model_s4",
        action="store_false",
        help="section 4 without the draft model's rows: the EAGLE-3 head's only",
    )
    return ap.parse_args(argv)


def compile_config(a, batches: list[int], k_max: int, runner: str) -> CompileConfig:
    """The fast path of the benchmark's options for ``runner`` (``--compile``; ``--fuse``: 1
    the target's graphs fused, 2 every runner's): every batch bucket, q buckets 1 .. k_max + 1."""
    fuse = a.fuse >= 2 or (a.fuse == 1 and runner == "target")
    return CompileConfig(enabled=True, mode=a.compile, batch_buckets=batches,
                         q_buckets=list(range(1, k_max + 2)), fuse=fuse,
                         layers_per_graph=a.layers_per_graph)  # fmt: skip


def graph_counts(runners) -> dict:
    """CUDA graphs captured and forwards replayed so far, per runner with a fast path
    (cuda-graphs mode captures at warm-up only: its count stays the warm-up's)."""
    return {
        r.name: dict(captures=getattr(r.fast, "captures", None), replays=r.fast.calls)
        for r in runners
        if r.fast is not None
    }


def adaptive_engine(bench, alpha: float, k_max: int) -> SpecEngine:
    """An engine over ``bench``'s target and draft runners with the adaptive K controller and
    synthetic acceptance ``alpha`` (speed only: not the exact rule). Its controller calibrates
    at the engine's first step."""
    ctl = make_controller(DrafterConfig(controller="adaptive", k_max=k_max), bench.drafter)
    accept = SyntheticAccept(bench.gen, alpha)
    return SpecEngine(bench.target, bench.drafter, [], controller=ctl, k_max=k_max, accept=accept)
