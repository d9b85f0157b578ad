"""One decoder layer as a function (engine/layer.py): the geometry read from a transformers config
with the documented defaults of its optional fields, and the layer against transformers' own."""

from types import SimpleNamespace

import torch

from engine.layer import LayerShape, config_shape, decoder_layer, linear
from engine.layer_weights import from_layer


def test_config_shape_reads_the_config(tiny_llama):
    cfg, norm = tiny_llama.config, tiny_llama.model.layers[0].input_layernorm
    shape, max_positions = config_shape(cfg, norm)
    assert shape == LayerShape(4, 2, 16, cfg.rms_norm_eps, "silu")
    assert max_positions == 256


def test_config_shape_defaults_of_optional_fields():
    cfg = SimpleNamespace(num_attention_heads=4, hidden_size=64)  # no GQA, head_dim, act, limit
    shape, max_positions = config_shape(cfg, SimpleNamespace())
    assert shape == LayerShape(4, 4, 16, 1e-6, "silu")
    assert max_positions is None
    cfg = SimpleNamespace(
        num_attention_heads=4,
        hidden_size=64,
        num_key_value_heads=None,  # present but None: the default too
        head_dim=32,
        hidden_act="gelu_pytorch_tanh",
    )
    shape, _ = config_shape(cfg, SimpleNamespace(eps=1e-5))
    assert shape == LayerShape(4, 4, 32, 1e-5, "gelu_pytorch_tanh")


def test_linear_is_f_linear_for_dense_weights():
    x, w, b = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_decoder_layer_matches_transformers(tiny_llama):
    """One layer over a one-slot cache equals transformers' decoder layer (causal, from 0)."""
    layer = tiny_llama.model.layers[0]
    shape, _ = config_shape(tiny_llama.config, layer.input_layernorm)
    q, max_len = 5, 8
    torch.manual_seed(1)
    h = torch.randn(1, q, tiny_llama.config.hidden_size)  # [batch, q, hidden]
    pos = torch.arange(q)[None]  # [batch, q]
    cos, sin = tiny_llama.model.rotary_emb(h, pos)  # [batch, q, head_dim]
    kv_idx = torch.arange(q)
    mask = (kv_idx[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [batch, 1, q, kv_len]
    cache = torch.zeros(1, shape.kv_heads, max_len + 1, shape.head_dim)  # [slots, kvh, L+1, hd]
    kc, vc = cache.clone(), cache.clone()
    out = decoder_layer(
        h, from_layer(layer), cos[:, None], sin[:, None], mask, kc, vc,
        torch.tensor([0]), pos, 0, shape,
    )  # fmt: skip
    causal = torch.full((1, 1, q, q), float("-inf")).triu(1)  # [batch, 1, q, q] additive
    with torch.no_grad():
        ref = layer(h, attention_mask=causal, position_ids=pos, position_embeddings=(cos, sin))
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert torch.allclose(out, ref, atol=1e-5)
    assert kc[0, :, :q].abs().sum() > 0 and kc[0, :, q:].abs().sum() == 0  # K/V written in place
