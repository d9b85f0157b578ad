"""The EAGLE-3 draft head: its weights, its geometry, and its files.

The head (Li et al., EAGLE-3) reads the target's hidden states at three depths. For position p
of a sequence t_0 t_1 ...:

  * feature  f_p = the inputs of the target's layers ``aux_layers`` at p, concatenated
    ``[3 target_hidden]``; ``g_p = fc(f_p)`` ``[hidden]``;
  * one Llama decoder layer whose attention input is
    ``[input_layernorm(embed(t_{p+1})), hidden_norm(g_p)]`` ``[2 hidden]`` and whose residual
    stream is g_p, attending over the head's own K/V of positions <= p (rotary position p);
  * its output (before the final norm) ``o_p``; ``lm_head(norm(o_p))`` -> logits over the draft
    vocabulary ``[draft_vocab]``, the head's guess of t_{p+2}; draft id i is target id
    ``i + d2t[i]``.

Drafting a chain, step j >= 2 feeds ``(o_prev, d_{j-1})`` at the next position in place of
``(g_p, t_{p+1})``: the head's own output stands in for the target's feature.

Files: the format SpecForge, vLLM and SGLang read (``LlamaForCausalLMEagle3``): a
``config.json`` (a Llama config with ``num_hidden_layers: 1``, ``draft_vocab_size``, optional
``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
``model.safetensors`` (or EAGLE's ``pytorch_model.bin``) with ``fc.weight``, ``midlayer.*`` (or
``layers.0.*``), ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 offsets, ``[draft_vocab]``),
``t2d`` (bool, ``[vocab]``) and, optionally, ``embed_tokens.weight`` (absent: the target's
embedding is used). Without ``d2t`` the head must draft over the whole vocabulary
(``draft_vocab_size == vocab_size``); without ``t2d`` it is rebuilt from ``d2t``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(target_layers: int) -> tuple[int, int, int]:
    """vLLM's and SGLang's default taps for a Llama target: low, middle, high."""
    return (2, target_layers // 2, target_layers - 3)


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    head_dim: int | None = None
    hidden_act: str = "silu"
    rope_scaling: dict | None = None
    extra: dict = field(default_factory=dict)  # other config.json keys, written back unchanged

    def __post_init__(self):
        # a forward records each tapped layer once, in layer order (as vLLM and SGLang do)
        self.aux_layers = tuple(sorted(self.aux_layers))
        if len(set(self.aux_layers)) != len(self.aux_layers):
            raise ValueError(f"the head's aux layers repeat: {self.aux_layers}")

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def llama_config(self):
        """A transformers LlamaConfig of the head's layer (for its rotary embedding)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.dim,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", **(self.rope_scaling or {})}
            | {"rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
        )

    def to_json(self) -> dict:
        d = asdict(self)
        extra, aux = d.pop("extra"), d.pop("aux_layers")
        d = {k: v for k, v in d.items() if v is not None}
        eagle = dict(extra.pop("eagle_config", {}))
        eagle["eagle_aux_hidden_state_layer_ids"] = list(aux)
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            **extra,
            **d,
            "eagle_config": eagle,
        }

    @classmethod
    def from_json(cls, d: dict, target_layers: int | None = None) -> HeadConfig:
        d = dict(d)
        arch = d.get("architectures") or [ARCHITECTURE]
        if not any("Eagle3" in a for a in arch):
            raise ValueError(f"not an EAGLE-3 head: architectures {arch}")
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError("only one-layer EAGLE-3 heads are supported")
        eagle = d.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            if target_layers is None:
                raise ValueError("the head names no aux layers: give the target's layer count")
            aux = default_aux_layers(target_layers)
        rope = d.pop("rope_parameters", None)  # transformers >= 5 writes these instead
        if rope:
            d.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default":
                d.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
        names = {f for f in cls.__dataclass_fields__ if f not in ("aux_layers", "extra")}
        kw = {k: d.pop(k) for k in list(d) if k in names}
        kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
        kw.setdefault("draft_vocab_size", kw["vocab_size"])
        kw.setdefault("target_hidden_size", kw["hidden_size"])
        for k in ("architectures", "model_type", "num_hidden_layers", "tie_word_embeddings"):
            d.pop(k, None)
        return cls(**kw, aux_layers=tuple(aux), extra=d)


class RMSNorm(nn.Module):
    """A norm weight with transformers' attribute names (``weight``, ``variance_epsilon``)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        q_out, kv_out = c.num_attention_heads * c.dim, c.num_key_value_heads * c.dim
        self.q_proj = nn.Linear(2 * c.hidden_size, q_out, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, kv_out, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class MidLayer(nn.Module):
    """The head's decoder layer, with transformers' attribute names (so
    :func:`engine.model.weights.from_layer` reads it) plus ``hidden_norm``."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn, self.mlp = _Attention(c), _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Head(nn.Module):
    """The head's parameters under the file's names (``state_dict()`` is the file's content)."""

    d2t: torch.Tensor  # [draft_vocab] long: target id of draft id i is i + d2t[i]
    t2d: torch.Tensor  # [vocab] bool: the target ids in the draft vocabulary

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None  # the target's, unless the file has one

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """The draft vocabulary: ``draft_to_target[i]`` is the target id of draft id i."""
        ids = draft_to_target.to(torch.long)
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError("the draft vocabulary needs draft_vocab_size distinct target ids")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """``[draft_vocab]`` target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)


def save_head(head: Eagle3Head, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``config.json`` and ``model.safetensors`` (floats in ``dtype``)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.config.to_json() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu()
        for k, v in head.state_dict().items()
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's weight files: ``*.safetensors``, else EAGLE's
    ``pytorch_model*.bin`` (read with ``weights_only``: tensors, no pickled code)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        state.update(load_file(str(f)))
    if not files:
        files = sorted(folder.glob("pytorch_model*.bin"))
        for f in files:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    if not files:
        raise FileNotFoundError(f"no .safetensors or pytorch_model.bin file in {folder}")
    return state


def load_head(
    folder: str | Path,
    target_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Eagle3Head:
    """Read a head written in the EAGLE-3 format (ours or SpecForge's / EAGLE's)."""
    folder = Path(folder)
    cfg = HeadConfig.from_json(json.loads((folder / "config.json").read_text()), target_layers)
    state = {
        k.removeprefix("model.").replace("layers.0.", "midlayer."): v
        for k, v in read_weights(folder).items()
    }
    head = Eagle3Head(cfg)
    embed = state.pop("embed_tokens.weight", None)
    if "d2t" not in state:  # a head over the whole vocabulary, draft id = target id
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(
                f"EAGLE-3 head {folder}: draft_vocab_size {cfg.draft_vocab_size} < vocab_size "
                f"{cfg.vocab_size} and no d2t map in its weights"
            )
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state:  # vLLM reads d2t alone: t2d marks the target ids d2t reaches
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[state["d2t"] + torch.arange(state["d2t"].numel())] = True
        state["t2d"] = t2d
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"EAGLE-3 head {folder}: missing {missing}, unexpected {unexpected}")
    if embed is not None:
        head.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
    return head.to(device=device, dtype=dtype)
