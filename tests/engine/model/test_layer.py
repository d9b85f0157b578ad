"""One decoder layer as a function (engine/model/layer.py): the geometry read from a transformers
config with the documented defaults of its optional fields, and the layer against transformers'
own."""

import contextlib
from types import SimpleNamespace

import torch

from engine.model.layer import (
    LayerInputs,
    LayerShape,
    additive_mask,
    config_shape,
    decoder_layer,
    grouped_mask,
    grouped_sdpa,
    linear,
    qkv_split,
    varying_shape_attention,
)
from engine.model.weights import from_layer, fuse_dense


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
    at = LayerInputs(cos[:, None], sin[:, None], mask, torch.tensor([0]), pos, 0, shape)
    out = decoder_layer(h, from_layer(layer), kc, vc, at)
    causal = torch.full((1, 1, q, q), float("-inf")).triu(1)  # [batch, 1, q, q] additive
    with torch.no_grad():
        ref = layer(h, attention_mask=causal, position_ids=pos, position_embeddings=(cos, sin))
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert torch.allclose(out, ref, atol=1e-5)
    assert kc[0, :, :q].abs().sum() > 0 and kc[0, :, q:].abs().sum() == 0  # K/V written in place


def _layer_out(layer, w, shape, mask_fn=lambda m: m):
    """``decoder_layer`` of ``w`` over 5 tokens from position 0 (one slot), and its caches."""
    q, max_len = 5, 8
    torch.manual_seed(1)
    h = torch.randn(1, q, layer.input_layernorm.weight.shape[0])  # [batch, q, hidden]
    pos = torch.arange(q)[None]  # [batch, q]
    cos = torch.randn(1, 1, q, shape.head_dim)
    sin = torch.randn(1, 1, q, shape.head_dim)
    mask = (torch.arange(q)[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [1, 1, q, q]
    kc = torch.zeros(1, shape.kv_heads, max_len + 1, shape.head_dim)
    vc = kc.clone()
    at = LayerInputs(cos, sin, mask_fn(mask), torch.tensor([0]), pos, 0, shape)
    out = decoder_layer(h, w, kc, vc, at)
    return out, kc, vc


def test_dense_fused_weights_compute_the_same_layer(tiny_llama):
    """Q/K/V and gate/up as one dense matrix each (what a CUDA runner runs): the module's weights
    become views of the fused rows, so the transformers module, the unfused layer and the fused
    one all compute the same; fusing again reuses the matrices."""
    import copy

    model = copy.deepcopy(tiny_llama)
    layer = model.model.layers[0]
    shape, _ = config_shape(model.config, layer.input_layernorm)
    ref, kc_ref, vc_ref = _layer_out(layer, from_layer(layer), shape)
    a, m = layer.self_attn, layer.mlp
    before = [t.clone() for t in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)]
    w = fuse_dense(layer)
    assert w.q is None and w.k is None and w.v is None and w.gate is None and w.up is None
    assert isinstance(w.qkv, torch.Tensor) and isinstance(w.gate_up, torch.Tensor)
    assert w.qkv.shape == (4 * 16 + 2 * 2 * 16, 64)
    assert w.gate_up.shape == (2 * m.gate_proj.out_features, 64)
    assert qkv_split(w, shape) == (64, 32, 32)
    for t, old in zip((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), before):
        assert torch.equal(t, old)  # same values, now rows of the fused matrix
    assert a.q_proj.weight.data_ptr() == w.qkv.data_ptr()
    assert m.up_proj.weight.data_ptr() == w.gate_up[m.gate_proj.out_features :].data_ptr()
    # as on CUDA: the fused matrices with SDPA's GQA on the additive mask
    out, kc, vc = _layer_out(layer, w, shape, lambda m: additive_mask(m, torch.float32))
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(kc, kc_ref, atol=1e-6) and torch.allclose(vc, vc_ref, atol=1e-6)
    again = fuse_dense(layer)
    assert again.qkv is w.qkv and again.gate_up is w.gate_up  # no second copy


def test_fuse_dense_keeps_qkv_with_biases_apart():
    """qwen2's Q/K/V carry biases: only gate and up are fused; the layer computes the same."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    layer = Qwen2ForCausalLM(cfg).eval().model.layers[0]
    shape, _ = config_shape(cfg, layer.input_layernorm)
    ref, _, _ = _layer_out(layer, from_layer(layer), shape)
    w = fuse_dense(layer)
    assert w.qkv is None and w.q is not None and w.q_bias is not None
    assert isinstance(w.gate_up, torch.Tensor) and w.gate is None and w.up is None
    out, _, _ = _layer_out(layer, w, shape)
    assert torch.allclose(out, ref, atol=1e-5)


def test_varying_shape_attention_state():
    """Inside the CUDA context forwards of varying shapes group their query heads (read by
    ``groups_queries`` on CUDA) and SDPA runs without cuDNN; both are restored after. On CPU it
    is a no-op."""
    from engine.model import layer as layer_mod

    assert isinstance(varying_shape_attention(torch.device("cpu")), contextlib.nullcontext)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with layer_mod._VaryingShapes():
        assert layer_mod._varying_shapes[0] is True
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert layer_mod._varying_shapes[0] is False
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_varying_shape_attention_is_a_no_op_inside_a_compiled_function():
    """Dynamo (torch 2.11) cannot trace the kernel choice's context: a function compiled with
    the CUDA context inside (the EAGLE-3 head's forward) traces it as a no-op."""

    def f(x):
        with varying_shape_attention(torch.device("cuda")):
            return x + 1

    x = torch.arange(4.0)
    assert torch.equal(torch.compile(f, backend="eager", fullgraph=True)(x), x + 1)


def test_grouped_attention_on_an_additive_mask(tiny_llama):
    """Attention of forwards of varying shapes on CUDA (and of bf16 on CPU): SDPA's query heads
    grouped by KV head, on a float mask of 0 / -inf built once a forward, equals SDPA's own GQA
    on the boolean mask."""
    layer = tiny_llama.model.layers[0]
    shape, _ = config_shape(tiny_llama.config, layer.input_layernorm)
    B, q, L, hd = 2, 3, 7, shape.head_dim
    torch.manual_seed(2)
    qs = torch.randn(B, shape.num_heads, q, hd)
    keys, vals = torch.randn(B, shape.kv_heads, L, hd), torch.randn(B, shape.kv_heads, L, hd)
    pos = torch.tensor([[2, 3, 4], [4, 5, 6]])  # [batch, q]
    mask = (torch.arange(L)[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [B, 1, q, L]
    ref = torch.nn.functional.scaled_dot_product_attention(
        qs, keys, vals, attn_mask=mask, scale=hd**-0.5, enable_gqa=True
    )
    group = shape.num_heads // shape.kv_heads
    add = additive_mask(grouped_mask(mask, group), torch.float32)
    assert add.dtype == torch.float32 and set(add.unique().tolist()) == {0.0, float("-inf")}
    out = grouped_sdpa(qs, keys, vals, add, hd**-0.5)
    assert torch.allclose(out, ref, atol=1e-5)
