"""Tiny random Llama target and draft models built in the test (no download, tests/helpers.py),
shared by the worker, fast-path and fault-injection tests (which build their engines over them
with tests.helpers.engine_for)."""

import pytest

from tests.helpers import one_torch_thread, tiny_llama


@pytest.fixture(scope="module")
def models():
    """(target: 3 layers, draft: 1 layer), vocabulary 64, untied."""
    return tiny_llama(5, layers=3), tiny_llama(6, layers=1)


@pytest.fixture
def single_thread():
    """One torch thread for the test (tiny models: threads only add synchronisation, and on a
    shared machine they spin against each other); the previous count is restored."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def byte_tok():
    """llguidance's byte tokenizer (grammar tests: the tiny models below speak bytes)."""
    llguidance = pytest.importorskip("llguidance")
    return llguidance.LLTokenizer("byte")


@pytest.fixture(scope="module")
def byte_models(byte_tok):
    """(target: 2 layers, draft: 1 layer) over the byte tokenizer's vocabulary."""
    make = dict(vocab=byte_tok.vocab_size, hidden=32, heads=2, kv_heads=1, max_positions=64)
    return tiny_llama(11, layers=2, sharpen=6.0, **make), tiny_llama(12, layers=1, **make)


@pytest.fixture
def invariant_calls(monkeypatch) -> list[int]:
    """One entry per call of the batch-invariant forward (engine/model/invariant.py) during the
    test: a test of deterministic mode proves which forward ran."""
    from engine.model import invariant

    calls: list[int] = []
    real = invariant.forward

    def forward(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(invariant, "forward", forward)
    return calls
