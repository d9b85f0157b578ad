"""Shared test builders: one tiny random Llama, one engine over in-memory models, the check that
speculation ran, and the device-sync recorder (the distribution test: tests/distribution.py)."""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import torch

from engine.builder import eagle_drafter, make_drafter, make_engine, target_runner
from engine.builder import tree_topk as expand_topk
from engine.config import EngineConfig
from engine.engine import SpecEngine
from engine.model.compiled import CompileConfig
from engine.model.runner import ModelRunner

# the device the tiny models are built on (``SPECD_TEST_DEVICE=cuda pytest ...`` runs the engine
# tests that take a device on a GPU; the default, CPU, is what CI runs)
TEST_DEVICE = torch.device(os.environ.get("SPECD_TEST_DEVICE", "cpu"))


def repo_files(under: str = ".") -> list[str]:
    """The repository's files under ``under`` that git keeps or would (tracked, and untracked but
    not ignored), relative to the root, that exist in the work tree."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", under],
        cwd=root, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [f for f in run.stdout.split() if (root / f).exists()]


@contextmanager
def one_torch_thread():
    """torch on one thread inside, the previous count restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


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


def sharp_tiny(seed: int, vocab: int = 8, layers: int = 2):
    """The distribution tests' tiny Llama: a vocabulary small enough to enumerate outputs over,
    the LM head sharpened x8 so that output distributions are far from uniform."""
    return tiny_llama(
        seed,
        layers=layers,
        vocab=vocab,
        hidden=32,
        heads=2,
        kv_heads=1,
        max_positions=64,
        sharpen=8.0,
    )


KV_LAYOUT = "slots"  # engine_for's default layout of the target's KV cache
PAGED_ENGINES: list[SpecEngine] = []  # the engines engine_for built over a paged cache


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
    compile: CompileConfig | None = None,
    accept=None,
    prefix_cache: int = 0,
    kv_budget: int | None = None,
    bulk_slots: int | None = None,
    tree_topk: int = 0,
    kv_layout: str | None = None,
    seed: int | None = None,
    head_q4: bool = False,
    head_compile: CompileConfig | None = None,
) -> SpecEngine:
    """A :class:`SpecEngine` over in-memory models, built by engine/builder.py's own pieces
    (``make_drafter``, ``make_engine``: the drafter, the K controller and the engine the shipped
    builder makes from a config), from configs/default.yaml's drafter settings (n-gram sizes,
    the hybrid's ``ngram_fallback``, the adaptive controller's) with the method, ``k_max`` and
    the sizes given here; no 4-bit head, no grammar compiler; eager unless ``compile`` gives the
    runners (the target's, a draft model's) a fast path. ``accept``: a wrong acceptance rule
    (the controls of the checks that must catch one). ``prefix_cache``: the prefix cache's
    positions (0: off; tests/engine/test_prefix_caching.py turns it on); ``kv_budget``: the KV
    positions the running sequences may hold (None: every slot its ``max_len``); ``bulk_slots``:
    what a request of many sequences holds beside a smaller one (None: no cap); ``tree_topk``:
    the EAGLE-3 head's trees expand EAGLE-2's way (drafter.tree_topk; leaves from the
    controller given); ``kv_layout``: the target's KV cache, ``"slots"`` or ``"paged"``
    (default :data:`KV_LAYOUT`, which tests/engine/test_paged_kv.py sets to run other modules'
    tests over a paged cache; the engines it built are listed in :data:`PAGED_ENGINES`);
    ``seed``: the engine's generator's (config ``seed``; None: from the OS). ``head_q4``: the
    EAGLE-3 head's matrices 4-bit (config ``drafter.head_q4``: test_eagle_q4.py).
    ``head_compile``: the fast path of the EAGLE-3 head's runner, chosen as the drafter is built
    (engine/builder.py's ``eagle_drafter``), for drafter ``"eagle3"`` only; None: the one
    ``compile`` gives the target.

    ``models``: the target, or a ``(target, draft)`` pair. ``drafter``: ``"model"`` (the pair's
    draft model), ``"self"`` (the target drafts for itself; ``draft_dtype`` casts a copy of it,
    e.g. a bf16 draft of an fp32 target), ``"layers"`` (the target's first ``num_layers``
    layers), ``"eagle3"`` (the EAGLE-3 ``head`` over the target's features; ``"eagle3+ngram"``:
    with the n-gram fallback of drafters/hybrid.py, as configs/default.yaml ships it;
    ``"eagle3+suffix"``: with the suffix drafter as the fallback, its config's ``suffix_fallback``
    or 3),
    ``"ngram"``, ``"suffix"`` (configs/default.yaml's suffix settings: the shared index of recent
    outputs on), or None / ``"none"`` (plain decoding). ``controller``: default the one the
    builder makes for the drafter (adaptive K)."""
    target, draft = models if isinstance(models, tuple | list) else (models, None)
    method = "none" if drafter is None else drafter
    if method in ("eagle3+ngram", "eagle3+suffix"):
        method = "eagle3"
    if method not in ("none", "ngram", "suffix", "model", "self", "layers", "eagle3"):
        raise ValueError(f"unknown drafter {drafter!r}")
    if method == "model" and draft is None:
        raise ValueError("drafter 'model' needs a (target, draft) pair")
    if method == "eagle3" and head is None:
        raise ValueError(f"drafter {drafter!r} needs a head")
    if method in ("self", "layers"):  # the target's copy in another dtype, else the target
        draft = copy.deepcopy(target).to(draft_dtype) if draft_dtype is not None else target
    shipped = EngineConfig.from_yaml(Path(__file__).parents[1] / "configs" / "default.yaml").drafter
    cfg = EngineConfig(
        drafter=dataclasses.replace(
            shipped,
            method=method,
            source=None,
            dtype=None,
            num_layers=num_layers,
            head_q4=head_q4,  # False: the head given is the one tested; True: its 4-bit form
            ngram_fallback=shipped.ngram_fallback if drafter == "eagle3+ngram" else 0,
            suffix_fallback=(shipped.suffix_fallback or 3) if drafter == "eagle3+suffix" else 0,
            k_max=k_max,
            tree_topk=tree_topk,
            tree_leaves=shipped.tree_leaves or (4 if tree_topk else 0),
        ),
        max_running=slots,
        max_model_len=max_len,
        max_prefill_per_step=max_prefill,
        prefill_chunk_tokens=chunk,
        compile=compile or CompileConfig(),
        prefix_cache_tokens=prefix_cache,
        kv_cache_tokens=kv_budget,
        bulk_slots=bulk_slots,
        kv_layout=kv_layout or KV_LAYOUT,
        seed=seed,
    )
    taps = tuple(head.config.aux_layers) if method == "eagle3" else ()
    runner = target_runner(cfg, target, taps)
    if head_compile is not None and drafter != "eagle3":
        raise ValueError(f"head_compile: for drafter 'eagle3', not {drafter!r}")
    if head_compile is not None:
        d = eagle_drafter(
            None, target, runner, head, expand_topk(cfg.drafter), k_max, q4=head_q4,
            compile=head_compile,
        )  # fmt: skip
    else:
        d = make_drafter(cfg, target, None, runner, draft=draft, head=head)
    rule = {} if accept is None else {"accept": accept}
    engine = make_engine(cfg, runner, d, list(eos), controller=controller, **rule)
    if cfg.kv_layout == "paged":
        PAGED_ENGINES.append(engine)
    return engine


def fed_prompt_tokens(engine) -> list[int]:
    """Prompt tokens the target is fed from now on (prefill chunks come as host lists)."""
    fed: list[int] = []
    real = engine.target.forward

    def forward(tokens, slots, *args, **kwargs):
        if isinstance(tokens, list):
            fed.extend(len(t) for t in tokens)
        return real(tokens, slots, *args, **kwargs)

    engine.target.forward = forward
    return fed


def assert_speculated(runs, can_reject: bool = True, min_drafted: int = 1) -> tuple[int, int]:
    """Speculation really ran: ``runs`` (sequences, or ``(drafted, accepted)`` pairs, e.g. from
    an HTTP response's ``usage.speculation``) drafted at least ``min_drafted`` tokens in all, and
    for a drafter that can be wrong (``can_reject``), accepted some and rejected some
    (0 < accepted < drafted): a comparison with plain decoding then proves something of both
    paths. Returns (drafted, accepted). Every speculation-vs-plain test calls it."""
    pairs = [r if isinstance(r, tuple) else (r.drafted, r.accepted) for r in runs]
    drafted, accepted = sum(d for d, _ in pairs), sum(a for _, a in pairs)
    assert drafted >= max(1, min_drafted), f"speculation never ran: drafted = {drafted}"
    assert 0 <= accepted <= drafted, (drafted, accepted)
    if can_reject:
        assert 0 < accepted < drafted, (
            f"a drafter that can be wrong should accept some and reject some: "
            f"{accepted} of {drafted} accepted"
        )
    return drafted, accepted


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


class Paths:
    """``runner``'s forwards from now on, by path: ``fast`` (its fast path's calls) and
    ``eager`` (the eager stack's)."""

    def __init__(self, runner: ModelRunner):
        assert runner.fast is not None
        self.runner, self.fast0, self.eager = runner, runner.fast.calls, 0
        real = runner._eager_rows

        def eager(*args, **kwargs):
            self.eager += 1
            return real(*args, **kwargs)

        runner._eager_rows = eager  # type: ignore[method-assign]

    @property
    def fast(self) -> int:
        assert self.runner.fast is not None, "the fast path was dropped"
        return self.runner.fast.calls - self.fast0


def long_prompts(ps, q_max):
    """Prompts whose one-chunk prefill is longer than the largest q bucket (eager forwards)."""
    return sum(len(p) > q_max for p in ps)


def float32_q4_engine(cfg: EngineConfig, target) -> SpecEngine:
    """The engine ``build_engine`` makes of ``cfg`` over the loaded ``target`` (model,
    tokenizer), its runners on the GGUF's 4-bit weights in float32, which ``build_engine``
    keeps dense (torch's float32 int4 matmul is slow) and the lossless checks want (exact)."""
    from engine.builder import eagle_head, eos_ids
    from engine.model.quant import native_q4

    model, tok = target
    weights = native_q4(cfg.model.source, model)
    assert weights is not None, "the GGUF's Q4_1 layers did not convert"
    head = eagle_head(cfg.drafter.source, model) if cfg.drafter.method == "eagle3" else None
    taps = tuple(head.config.aux_layers) if head is not None else ()
    runner = target_runner(cfg, model, taps, weights)
    drafter = make_drafter(cfg, model, tok, runner, head=head)
    return make_engine(cfg, runner, drafter, eos_ids(model, tok))


def spy_deep_paths(monkeypatch) -> list[int]:
    """Count, per tree round, the accepted nodes hanging below a non-chain node (only EAGLE-2's
    expansion makes one: engine/drafters/eagle/expand.py); returns the list it appends to."""
    from engine.round import speculator

    deep: list[int] = []
    settle = speculator.settle

    def spy(t, path, num_acc, *rest, **kw):
        i = torch.arange(path.shape[1], device=path.device)[None]
        on = (i < num_acc[:, None]) & (path >= 0)
        node = torch.where(on, path, 0)
        par = t.parents.gather(1, node)
        deep.append(int((on & (node >= t.chain) & (par >= t.chain)).sum()))
        return settle(t, path, num_acc, *rest, **kw)

    monkeypatch.setattr(speculator, "settle", spy)
    return deep
