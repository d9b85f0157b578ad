"""Shared test builders: one tiny random Llama, one engine over in-memory models, and the exact
statistics the distribution tests use (target distributions by enumeration, a chi-square
goodness-of-fit p-value)."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterable

import torch

from engine.drafters import ModelDrafter, NgramDrafter
from engine.drafters.eagle import EagleDrafter
from engine.drafters.hybrid import HybridDrafter
from engine.engine import SpecEngine
from engine.model_runner import ModelRunner
from engine.sampling import logits_to_probs

# the device the tiny models are built on (``SPECD_TEST_DEVICE=cuda pytest ...`` runs the engine
# tests that take a device on a GPU; the default, CPU, is what CI runs)
TEST_DEVICE = torch.device(os.environ.get("SPECD_TEST_DEVICE", "cpu"))


def tiny_llama(
    seed: int,
    layers: int = 2,
    vocab: int = 64,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 512,
    tie: bool = False,
    sharpen: float | None = None,
):
    """A tiny random Llama (no download), in eval mode, float32, on :data:`TEST_DEVICE`. Its
    weights depend only on the arguments: the global torch RNG is left as it was (tests may run
    in any order). ``sharpen`` multiplies the LM head (output distributions far from uniform)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
    if sharpen is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    return model.to(TEST_DEVICE)


def engine_for(
    models,
    drafter: str | None = "model",
    slots: int = 8,
    chunk: int = 512,
    *,
    max_len: int = 256,
    eos: Iterable[int] = (),
    controller=None,
    k_max: int = 8,
    max_prefill: int = 4,
    num_layers: int | None = None,
    draft_dtype: torch.dtype | None = None,
    head=None,
) -> SpecEngine:
    """A :class:`SpecEngine` over in-memory models, built as engine/builder.py builds one.

    ``models``: the target, or a ``(target, draft)`` pair. ``drafter``: ``"model"`` (the pair's
    draft model), ``"self"`` (the target drafts for itself; ``draft_dtype`` casts a copy of it,
    e.g. a bf16 draft of an fp32 target), ``"layers"`` (the target's first ``num_layers``
    layers), ``"eagle3"`` (the EAGLE-3 ``head`` over the target's features; ``"eagle3+ngram"``:
    with the n-gram fallback of drafters/hybrid.py), ``"ngram"``, or
    None / ``"none"`` (plain decoding)."""
    target, draft = models if isinstance(models, tuple | list) else (models, None)
    runner = ModelRunner(target, num_slots=slots, max_len=max_len)
    vocab = runner.vocab_size
    if drafter in (None, "none"):
        d = None
    elif drafter == "ngram":
        d = NgramDrafter(runner.device)
    elif drafter in ("eagle3", "eagle3+ngram"):
        if head is None:
            raise ValueError(f"drafter {drafter!r} needs a head")
        head = head.to(runner.device)
        d = EagleDrafter(head, target.model.embed_tokens, slots, runner.max_len, vocab)
        if drafter == "eagle3+ngram":  # copies where the last 2+ tokens occurred before
            d = HybridDrafter(d, min_match=2, max_n=4)
    elif drafter in ("model", "self", "layers"):
        if drafter == "model":
            if draft is None:
                raise ValueError("drafter 'model' needs a (target, draft) pair")
            dm, layers, name = draft, None, "draft_model"
        else:
            dm = target
            if draft_dtype is not None:
                dm = copy.deepcopy(target).to(draft_dtype)
            layers = num_layers if drafter == "layers" else None
            if drafter == "layers" and not layers:
                raise ValueError("drafter 'layers' needs num_layers")
            name = f"{drafter}{layers or ''}"
        d = ModelDrafter(
            ModelRunner(dm, num_slots=slots, max_len=max_len, num_layers=layers, name="draft"),
            vocab,
            name=name,
        )
    else:
        raise ValueError(f"unknown drafter {drafter!r}")
    return SpecEngine(
        runner,
        d,
        eos_token_ids=list(eos),
        max_prefill_per_step=max_prefill,
        prefill_chunk_tokens=chunk,
        controller=controller,
        k_max=k_max,
    )


def greedy_reference(model, tok, ids: list[int], max_tokens: int) -> list[int]:
    """The target-only greedy continuation of token ids ``ids`` by transformers' own
    ``generate()`` (the independent reference of the lossless tests), stopping at the EOS."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids], device=model.device),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )
    return out[0, len(ids) :].tolist()


# -- exact target distributions ------------------------------------------------------------------
def target_probs(model, ids: list[int], temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The target's processed next-token distribution after ``ids`` (transformers' own forward,
    then temperature / top-k / top-p as engine/sampling.py applies them): [vocab] float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[:, -1:].float().cpu()
    probs = logits_to_probs(
        logits,
        torch.tensor([temperature or 1.0]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
    )
    return probs[0, 0].double()


def exact_joint(
    model,
    prompt: list[int],
    n_tokens: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    stop: Iterable[int] = (),
) -> dict[tuple[int, ...], float]:
    """P(output | prompt) of every possible output of at most ``n_tokens`` tokens, by walking the
    tree of prefixes; an output ends early at a ``stop`` token (included)."""
    stop = set(stop)
    joint: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], pr: float) -> None:
        if len(prefix) == n_tokens or (prefix and prefix[-1] in stop):
            joint[tuple(prefix)] = joint.get(tuple(prefix), 0.0) + pr
            return
        for t, pt in enumerate(target_probs(model, prompt + prefix, temperature, top_k, top_p)):
            if pt > 0:
                walk(prefix + [t], pr * float(pt))

    walk([], 1.0)
    return joint


# -- goodness of fit -----------------------------------------------------------------------------
def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square with ``df`` degrees of freedom."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0).double(), torch.tensor(stat / 2.0)))


def chi_square_gof(
    counts: dict, probs: dict, min_expected: float = 5.0
) -> tuple[float, float, int]:
    """Pearson's chi-square test of observed ``counts`` against exact cell probabilities
    ``probs`` (outcomes absent from ``probs`` have probability 0: any such count fails the test).
    Cells expected to hold fewer than ``min_expected`` draws are pooled into one (and that pool,
    if still under ``min_expected``, into the smallest kept cell), so the chi-square
    approximation holds. Returns (statistic, p-value, degrees of freedom)."""
    n = sum(counts.values())
    if any(c and probs.get(o, 0.0) <= 0.0 for o, c in counts.items()):
        return math.inf, 0.0, 0
    cells = sorted(probs, key=lambda o: -probs[o])
    kept = [o for o in cells if probs[o] * n >= min_expected]
    rare = [o for o in cells if probs[o] * n < min_expected]
    obs = [counts.get(o, 0) for o in kept]
    exp = [probs[o] * n for o in kept]
    if rare:
        pool_obs, pool_exp = sum(counts.get(o, 0) for o in rare), sum(probs[o] * n for o in rare)
        if pool_exp >= min_expected or not kept:
            obs.append(pool_obs)
            exp.append(pool_exp)
        else:
            obs[-1] += pool_obs
            exp[-1] += pool_exp
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    return stat, chi2_sf(stat, df), df


def histogram(outputs: Iterable, key: Callable = tuple) -> dict:
    counts: dict = {}
    for o in outputs:
        k = key(o)
        counts[k] = counts.get(k, 0) + 1
    return counts


# -- device syncs (CUDA) -------------------------------------------------------------------------
def cuda_syncs(fn: Callable[[], object]) -> list[str]:
    """Run ``fn`` under ``torch.cuda.set_sync_debug_mode("warn")``; returns one entry per
    synchronizing CUDA call made with a frame of the ``engine`` package on the stack: the
    innermost frames of the project that made it. (A sync with no such frame is not the
    engine's: on an H200, torch 2.11, the first switch of the mode in a process reported one at
    the switch itself, before ``fn`` ran.)"""
    import os
    import traceback
    import warnings

    import engine

    within = os.path.dirname(os.path.abspath(engine.__file__)) + os.sep
    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = traceback.extract_stack()[:-1]  # (not this hook)
        if not any(os.path.abspath(f.filename).startswith(within) for f in frames):
            return
        ours = [
            f
            for f in frames
            if "site-packages" not in f.filename and "/lib/python" not in f.filename
        ]
        sites.append(
            " < ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno}" for f in ours[::-1][:4])
        )

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites
