"""The declared weights of a decoder layer (engine/model/weights.py): built from a transformers
layer by field name, and the name tables that address them (here and in engine/model/quant.py) are
checked, so a wrong or missing name fails loudly."""

import pytest

from engine.model import quant
from engine.model.weights import BIAS, FUSED, LayerWeights, check_fields, from_layer


def test_from_layer_shares_the_dense_weights(tiny_llama):
    layer = tiny_llama.model.layers[1]
    a, m = layer.self_attn, layer.mlp
    w = from_layer(layer)
    assert isinstance(w, LayerWeights)
    assert w.input_norm is layer.input_layernorm.weight
    assert w.post_norm is layer.post_attention_layernorm.weight
    assert w.q is a.q_proj.weight and w.k is a.k_proj.weight and w.v is a.v_proj.weight
    assert w.o is a.o_proj.weight
    assert w.gate is m.gate_proj.weight and w.up is m.up_proj.weight
    assert w.down is m.down_proj.weight
    assert w.qkv is None and w.gate_up is None  # fused only by engine/model/quant.py
    assert w.q_bias is None and w.k_bias is None and w.v_bias is None  # llama: no biases
    assert w.q_norm is None and w.k_norm is None  # qwen3 only


def test_name_tables_are_fields():
    fields = set(LayerWeights._fields)
    for fused, group in FUSED.items():
        assert fused in fields and set(group) <= fields
    assert set(BIAS) | set(BIAS.values()) <= fields
    assert set(quant._FIELDS.values()) <= fields  # GGUF tensor -> field, checked at import too


def test_a_wrong_name_fails_loudly(tiny_llama):
    check_fields(["qkv", "gate_up", "down"])
    with pytest.raises(TypeError, match="attn_q"):
        check_fields(["q", "attn_q"])
    w = from_layer(tiny_llama.model.layers[0])
    with pytest.raises(ValueError):
        w._replace(wq=None)  # quant writes by field name: an unknown one raises
