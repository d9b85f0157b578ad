"""Tiny random Llama target and draft models built in the test (no download), and an engine over
them: shared by the worker and fault-injection tests."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.drafters import ModelDrafter, NgramDrafter
from engine.engine import SpecEngine
from engine.model_runner import ModelRunner


@pytest.fixture(scope="module")
def models():
    def make(seed, layers):
        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
        return LlamaForCausalLM(cfg).eval()

    return make(5, 3), make(6, 1)


def engine_for(models, drafter="model", slots=8, chunk=512):
    target, draft = models
    runner = ModelRunner(target, num_slots=slots, max_len=256)
    d = (
        ModelDrafter(ModelRunner(draft, num_slots=slots, max_len=256), 64)
        if drafter == "model"
        else NgramDrafter("cpu")
        if drafter == "ngram"
        else None
    )
    return SpecEngine(
        runner, d, eos_token_ids=[], max_prefill_per_step=4, prefill_chunk_tokens=chunk
    )
