"""Runs a Llama-family causal LM over the slot KV cache.

We keep transformers for loading (GGUF conversion, safetensors, dtypes, Hub ids) and reuse its
modules (projections, norms, MLP, rotary embedding, lm_head), but run our own decoder-layer loop
so that one forward can serve ragged rows: row b feeds ``n_b`` new tokens starting at position
``start_b`` (its committed cache length), writes their K/V into its slot in place, and attends by
position, ``kv_pos <= query_pos``. The same loop with only the first N layers is the
"early-layers self-draft". Supported: llama, mistral, qwen2, qwen3 (the SmolLM2 default is llama).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_cache import SlotKVCache

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    pass


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ModelRunner:
    def __init__(self, model, num_slots: int, max_len: int, num_layers: int | None = None):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {cfg.model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        self.model = model
        self.config = cfg
        base = model.model
        self.embed, self.norm, self.rotary = base.embed_tokens, base.norm, base.rotary_emb
        layers = list(base.layers)
        if num_layers is not None:
            if not 1 <= num_layers <= len(layers):
                raise ValueError(f"num_layers must be in 1..{len(layers)}, got {num_layers}")
            layers = layers[:num_layers]
        self.layers = layers
        self.lm_head = model.lm_head
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.vocab_size = self.lm_head.out_features
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_len = min(max_len, getattr(cfg, "max_position_embeddings", max_len))
        self.cache = SlotKVCache(len(layers), num_slots, self.kv_heads, self.head_dim,
                                 self.max_len, self.dtype, self.device)

    # -- one ragged forward -------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: list[list[int]] | torch.Tensor, slots: list[int],
                counts: list[int] | None = None, logits: str = "last") -> torch.Tensor:
        """Feed each row's new tokens to slot ``slots[b]`` at its committed length.

        ``tokens`` is a host list of lists, or a device tensor ``[batch, q]`` with ``counts`` (host
        ints) giving the valid prefix of each row (so drafted tokens never leave the device).
        Returns ``logits="last"`` -> ``[batch, vocab]`` at each row's last valid token, or
        ``logits="all"`` -> ``[batch, q, vocab]`` (positions past a row's count are garbage).
        Committed lengths are *not* changed: the caller commits what it keeps."""
        cache, dev = self.cache, self.device
        if isinstance(tokens, torch.Tensor):
            assert counts is not None
            ids, q = tokens, tokens.shape[1]
        else:
            counts = [len(t) for t in tokens]
            q = max(counts)
            ids = torch.tensor([t + [0] * (q - len(t)) for t in tokens], device=dev)  # [batch, q]
        B = len(slots)
        starts = [cache.lengths[s] for s in slots]
        kv_len = max(s + n for s, n in zip(starts, counts))
        if kv_len > cache.max_len:
            raise ValueError("forward past the cache's max_len")
        # host-built index tensors (no device sync): positions and write positions per token
        pos = torch.tensor([[s + min(j, n - 1) for j in range(q)] for s, n in zip(starts, counts)])
        valid = torch.tensor([[j < n for j in range(q)] for n in counts])
        write_pos = torch.where(valid, pos, torch.full_like(pos, cache.scratch_pos))
        pos, write_pos = pos.to(dev), write_pos.to(dev)  # [batch, q]
        slot_t = torch.tensor(slots, device=dev)  # [batch]
        contiguous = slots == list(range(slots[0], slots[0] + B))

        h = self.embed(ids)  # [batch, q, hidden]
        cos, sin = self.rotary(h, pos)  # [batch, q, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [batch, 1, q, head_dim]
        kv_idx = torch.arange(kv_len, device=dev)
        mask = (kv_idx[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [batch, 1, q, kv_len]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            qs = attn.q_proj(x).view(B, q, self.num_heads, self.head_dim)
            ks = attn.k_proj(x).view(B, q, self.kv_heads, self.head_dim)
            vs = attn.v_proj(x).view(B, q, self.kv_heads, self.head_dim)  # [batch, q, kv_heads, head_dim]
            if hasattr(attn, "q_norm"):  # qwen3
                qs, ks = attn.q_norm(qs), attn.k_norm(ks)
            qs, ks = qs.transpose(1, 2), ks.transpose(1, 2)  # [batch, heads, q, head_dim]
            qs = qs * cos + _rotate_half(qs) * sin
            ks = ks * cos + _rotate_half(ks) * sin
            kc, vc = cache.k[i], cache.v[i]  # [slots, kv_heads, max_len+1, head_dim]
            kc[slot_t[:, None], :, write_pos] = ks.transpose(1, 2)  # rows of [batch, q, kv_heads, head_dim]
            vc[slot_t[:, None], :, write_pos] = vs
            if contiguous:
                keys = kc[slots[0]:slots[0] + B, :, :kv_len]  # view: [batch, kv_heads, kv_len, head_dim]
                vals = vc[slots[0]:slots[0] + B, :, :kv_len]
            else:
                keys, vals = kc[slot_t, :, :kv_len], vc[slot_t, :, :kv_len]
            o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask,
                                               scale=self.head_dim ** -0.5,
                                               enable_gqa=self.kv_heads != self.num_heads)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(B, q, self.num_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if logits == "last":
            last = torch.tensor([n - 1 for n in counts], device=dev)
            h = h[torch.arange(B, device=dev), last]  # [batch, hidden]
        return self.lm_head(self.norm(h)).float()  # [batch, vocab] or [batch, q, vocab]
