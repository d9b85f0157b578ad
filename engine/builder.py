"""Build a :class:`SpecEngine` (target runner + drafter) from an :class:`EngineConfig`."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.drafters import Drafter, ModelDrafter, NgramDrafter
from engine.drafters.eagle.drafter import EagleDrafter, cache_len, step_buckets
from engine.drafters.eagle.head import load_head
from engine.drafters.eagle.stack import head_stack
from engine.drafters.hybrid import HybridDrafter
from engine.drafters.model import check_same_vocab
from engine.drafters.suffix import SuffixDrafter
from engine.engine import SpecEngine
from engine.kcontrol.controller import AdaptiveK, FixedK, HeuristicK, KController
from engine.model import invariant
from engine.model.compiled import CompileConfig
from engine.model.loader import default_cache_dir, load_model
from engine.model.quant import native_q4
from engine.model.runner import ModelRunner
from engine.model.weights import ModelWeights
from engine.round.rejection import rejection_sample
from engine.round.speculator import AcceptRule
from engine.sampling.grammar import GrammarCompiler

log = logging.getLogger("specd.builder")


@dataclass
class Built:
    engine: SpecEngine
    tokenizer: object
    config: EngineConfig


def eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in (gen_eos if isinstance(gen_eos, list) else [gen_eos]) + [tokenizer.eos_token_id]:
        if e is not None:
            ids.add(int(e))
    return sorted(ids)


def tree_topk(d) -> int:
    """The top-k the EAGLE-3 head's trees expand with: ``drafter.tree_topk`` where the head
    drafts (``method: eagle3``) and trees are on (``tree_leaves``), else 0 (the suffix drafter's
    trees are its index's branches: no head rows to price)."""
    return d.tree_topk if d.tree_leaves and d.method == "eagle3" else 0


def make_controller(d, drafter) -> KController:
    if drafter is None:
        return FixedK(0)
    if d.controller == "adaptive":
        return AdaptiveK(
            d.k_max,
            drafter.steps,
            min_gain=d.min_gain,
            probe_interval=d.probe_interval,
            probe_k=d.probe_k,
            probe_budget=d.probe_budget,
            always_drafts=drafter.samples,  # a model (head, draft model) proposes whenever asked
            max_leaves=d.tree_leaves if drafter.trees else 0,
            # an expanding head's extras: drafters/eagle/expand.py
            expand_rows=max(tree_topk(d) - 1, 0) if drafter.trees else 0,
        )
    if d.controller == "heuristic":
        return HeuristicK(min(d.k, d.k_max), d.k_max)
    if d.controller == "fixed":
        k = min(d.k, d.k_max)
        return FixedK(k, min(d.tree_leaves, d.k_max - k) if drafter.trees else 0)
    raise ValueError(f"unknown drafter.controller {d.controller!r} (adaptive, heuristic, fixed)")


# what a head's Hub repository must give: its config and weights in either format
# (drafters/eagle/head.py)
HEAD_FILES = ["config.json", "*.safetensors", "pytorch_model*.bin"]


def head_folder(source: str) -> Path:
    """An EAGLE-3 head's folder, looked up in this order:

    1. ``source`` as a path (``~`` expanded);
    2. relative to the repository (the heads this project trains live under ``models/``);
    3. a Hub id, only for a bare ``owner/name`` whose ``owner`` is no local folder (e.g.
       ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): read through the Hugging Face cache as the
       target is, which is the only step that may use the network (``HF_HUB_OFFLINE=1``: the
       cache only). A mistyped local path never reaches the Hub."""
    root = Path(__file__).resolve().parent.parent
    here, repo = Path(source).expanduser(), root / source
    for p in (here, repo):
        if (p / "config.json").exists():
            return p
    owner, _, name = source.partition("/")
    hub = bool(owner and name) and "/" not in name and not source.startswith((".", "/", "~"))
    if hub and not Path(owner).is_dir() and not (root / owner).is_dir():
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(source, allow_patterns=HEAD_FILES))
        except Exception as e:  # offline and not cached, no such repository, gated, no network
            why = (str(e).strip().splitlines() or [""])[0][:200]
            raise FileNotFoundError(
                f"no EAGLE-3 head at {source!r}: no folder with config.json at {here} or "
                f"{repo}, and the Hub gave {type(e).__name__}: {why}"
            ) from e
    raise FileNotFoundError(
        f"no EAGLE-3 head at {source!r}: no folder with config.json at {here} or {repo} "
        f"(a published head is named by its Hub id, owner/name)"
    )


def eagle_head(source: str | None, model):
    """The EAGLE-3 head at ``source`` (a folder or Hub id, :func:`head_folder`) for the target
    ``model``, in its dtype and on its device."""
    if not source:
        raise ValueError("drafter.method 'eagle3' needs drafter.source (an EAGLE-3 head folder)")
    p = next(model.parameters())
    return load_head(head_folder(source), model.config.num_hidden_layers, p.dtype, p.device)


def eagle_drafter(
    source: str | None,
    model,
    runner: ModelRunner,
    head=None,
    topk: int = 0,
    k_max: int = 0,
    *,
    q4: bool = False,
    compile: CompileConfig | None = None,
) -> EagleDrafter:
    """The EAGLE-3 drafter of the head at ``source`` for ``runner``'s target (in its dtype), or
    of ``head``, an already loaded one (tests build theirs in memory; moved to the device);
    ``topk`` >= 2: its trees expand (``drafter.tree_topk``) for chains up to ``k_max``. The
    head's stack (drafters/eagle/stack.py: its matrices 4-bit with ``q4``) is served by a runner
    of its own, whose fast path ``compile`` chooses as it does the target's (compiled on CPU,
    captured on CUDA; None: eager), over the query lengths the head's calls take."""
    if head is not None:
        head = head.to(runner.device)
        source = source or "(in memory)"
    else:
        head = eagle_head(source, model)
    c, hidden = head.config, model.config.hidden_size
    if c.vocab_size != runner.vocab_size or c.target_hidden_size != hidden:
        raise ValueError(
            f"the EAGLE-3 head at {source!r} is for a target with vocabulary {c.vocab_size} and "
            f"hidden size {c.target_hidden_size}, not {runner.vocab_size} and {hidden}"
        )
    if max(c.aux_layers) >= len(runner.weights):
        raise ValueError(f"the head taps layers {c.aux_layers}: the target has fewer")
    embed, slots = model.model.embed_tokens, runner.cache.num_slots
    own = head_runner(head, embed, slots, cache_len(runner.max_len, topk, k_max), q4, compile)
    return EagleDrafter(head, own, runner.vocab_size, topk)


def head_runner(
    head,
    embed,
    num_slots: int,
    max_len: int,
    q4: bool = False,
    compile: CompileConfig | None = None,
) -> ModelRunner:
    """The runner of an EAGLE-3 head's stack (drafters/eagle/stack.py; ``embed``: the target's
    embedding, unless the head has its own): a cache of ``num_slots`` slots of ``max_len``
    positions, the head's matrices 4-bit with ``q4``, and ``compile``'s fast path over the query
    lengths the head's calls take (None: eager)."""
    if compile is not None:
        compile = dataclasses.replace(compile, q_buckets=step_buckets(), whole_stack=True)
    return ModelRunner(head_stack(head, embed, q4), num_slots, max_len, compile=compile)


def use_inductor_cache(folder: Path) -> None:
    """Point inductor's cache at ``folder`` unless the user named one
    (``TORCHINDUCTOR_CACHE_DIR``). Importing ``torch._dynamo`` sets that variable to torch's
    default (``/tmp/torchinductor_<user>``, gone at a reboot) where it is unset, so that value
    counts as unset here."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or current == torch_default():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def suffix_drafter(d, device: torch.device) -> SuffixDrafter:
    """The suffix drafter of drafter config ``d`` (its ``suffix_*`` knobs)."""
    return SuffixDrafter(
        device,
        d.suffix_max_tree_depth,
        d.suffix_max_cached_requests,
        d.suffix_max_spec_factor,
        d.suffix_min_token_prob,
        d.suffix_max_cached_tokens,
    )


def make_drafter(
    cfg: EngineConfig, model, tok, runner: ModelRunner, draft=None, head=None
) -> Drafter | None:
    """``cfg.drafter``'s drafter for the target ``model`` (tokenizer ``tok``) in ``runner``.
    A model it names (``source``, or ``dtype`` for the target's copy) is loaded, unless given in
    memory: ``draft`` (the draft model of method ``model``, or the target's copy of ``self`` /
    ``layers``) and ``head`` (the EAGLE-3 head; tests build theirs)."""
    m, d = cfg.model, cfg.drafter
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None
    vocab = runner.vocab_size
    drafter: Drafter
    if d.method == "none":
        return None
    if d.method == "ngram":
        return NgramDrafter(runner.device, d.ngram_min, d.ngram_max)
    if d.method == "suffix":
        return suffix_drafter(d, runner.device)
    if d.method in ("self", "layers"):
        layers = d.num_layers if d.method == "layers" else None
        if d.method == "layers" and not layers:
            raise ValueError("drafter.method 'layers' needs drafter.num_layers")
        draft_model = model if draft is None else draft
        if draft is None and d.dtype and d.dtype != m.dtype:
            draft_model, _ = load_model(m.source, d.dtype, m.device, cache_dir, m.trust_remote_code)
        shared = runner.model_weights() if draft_model is model else None  # e.g. 4-bit
        drunner = ModelRunner(
            draft_model,
            cfg.max_running,
            runner.max_len,
            layers,
            name="draft",
            weights=shared,
            compile=cfg.compile,
            k_max=d.k_max,
        )
        return ModelDrafter(drunner, vocab, name=f"{d.method}{layers or ''}")
    if d.method == "model":
        if draft is None:
            if not d.source:
                raise ValueError("drafter.method 'model' needs drafter.source")
            draft, dtok = load_model(
                d.source, d.dtype or m.dtype, m.device, cache_dir, m.trust_remote_code
            )
            check_same_vocab(tok, dtok)
        drunner = ModelRunner(
            draft, cfg.max_running, runner.max_len, name="draft", compile=cfg.compile, k_max=d.k_max
        )
        return ModelDrafter(drunner, min(vocab, drunner.vocab_size), name="draft_model")
    if d.method == "eagle3":
        drafter = eagle_drafter(
            d.source,
            model,
            runner,
            head,
            tree_topk(d),
            d.k_max,
            q4=d.head_q4,
            compile=cfg.compile,
        )
        if d.ngram_fallback and d.suffix_fallback:
            raise ValueError("drafter.ngram_fallback and drafter.suffix_fallback: one copier")
        if d.suffix_fallback:
            suffix = suffix_drafter(d, runner.device)
            drafter = HybridDrafter(drafter, d.suffix_fallback, suffix=suffix)
        elif d.ngram_fallback:
            drafter = HybridDrafter(drafter, d.ngram_fallback, max(d.ngram_max, d.ngram_fallback))
        return drafter
    raise ValueError(
        f"unknown drafter method {d.method!r} (eagle3, ngram, suffix, model, self, layers, none)"
    )


def make_engine(
    cfg: EngineConfig,
    runner: ModelRunner,
    drafter: Drafter | None,
    eos: list[int],
    grammars: GrammarCompiler | None = None,
    controller: KController | None = None,
    accept: AcceptRule = rejection_sample,
) -> SpecEngine:
    """The engine ``cfg`` describes over ``runner`` and ``drafter`` (``controller``: default
    ``cfg.drafter``'s, :func:`make_controller`; ``accept``: the acceptance rule, the exact one
    but in tests of the checks that catch a wrong one)."""
    d = cfg.drafter
    return SpecEngine(
        runner,
        drafter,
        eos,
        max_prefill_per_step=cfg.max_prefill_per_step,
        prefill_chunk_tokens=cfg.prefill_chunk_tokens,
        controller=controller if controller is not None else make_controller(d, drafter),
        k_max=d.k_max,
        max_slots_per_request=cfg.max_slots_per_request,
        grammars=grammars,
        deterministic=cfg.deterministic,
        accept=accept,
        prefix_cache_tokens=cfg.prefix_cache_tokens,
        prefix_block_size=cfg.prefix_block_size,
        kv_cache_tokens=cfg.kv_cache_tokens,
        bulk_slots=cfg.bulk_slots,
        seed=cfg.seed,
    )


def target_runner(
    cfg: EngineConfig, model, taps: tuple[int, ...] = (), weights: ModelWeights | None = None
) -> ModelRunner:
    """The target's runner ``cfg`` describes, tapping ``taps`` for the drafter, over
    ``weights`` (default: the model's dense ones), with ``cfg.compile``'s fast path unless every
    forward is the batch-invariant one (deterministic "always")."""
    always = cfg.deterministic == "always"
    pool = None  # "slots"
    if cfg.kv_layout == "paged":  # the scheduler's budget (its default: every slot full), and
        # the prefix cache's positions, which over a paged cache are the pool's free blocks
        pool = cfg.kv_cache_tokens or cfg.max_running * cfg.max_model_len
        pool += cfg.prefix_cache_tokens
    return ModelRunner(
        model,
        cfg.max_running,
        cfg.max_model_len,
        taps=taps,
        weights=weights,
        compile=None if always else cfg.compile,
        k_max=cfg.drafter.k_max if cfg.drafter.method != "none" else 0,  # verifies of K + 1
        pool_tokens=pool,
        block_size=cfg.prefix_block_size,
    )


def build_engine(cfg: EngineConfig, target=None) -> Built:
    """``target`` may pass an already loaded (model, tokenizer) pair (tests share one)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    m = cfg.model
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None
    model, tok = target or load_model(m.source, m.dtype, m.device, cache_dir, m.trust_remote_code)
    weights = None
    if m.native_q4 and model.dtype == torch.float32 and model.device.type == "cpu":
        # torch's CPU int4 matmul with float32 activations is far slower than with bf16 and
        # than a dense float32 matmul: the GGUF's dequantized weights run dense instead
        log.info("model.native_q4: dense weights in float32 (no fast float32 int4 matmul on CPU)")
    elif m.native_q4:
        weights = native_q4(m.source, model)
    if cfg.compile.enabled:  # inductor's kernels kept beside the model cache, not in /tmp: a
        # restart loads them (a cold warm-up compiles for minutes, a warm one takes seconds)
        use_inductor_cache((cache_dir or default_cache_dir()) / "inductor")
    head = eagle_head(cfg.drafter.source, model) if cfg.drafter.method == "eagle3" else None
    taps = tuple(head.config.aux_layers) if head is not None else ()
    runner = target_runner(cfg, model, taps, weights)
    drafter = make_drafter(cfg, model, tok, runner, head=head)
    grammars = GrammarCompiler(tok, runner.vocab_size)
    engine = make_engine(cfg, runner, drafter, eos_ids(model, tok), grammars)
    if cfg.deterministic != "off":
        invariant.check(runner)  # RuntimeError where this machine's kernels are not invariant
    return Built(engine, tok, cfg)
