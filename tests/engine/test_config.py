"""engine/config.py: what a config file may say, and what it is refused for."""

import pytest

from engine.config import EngineConfig


@pytest.mark.parametrize(
    "value,mode",
    [("off", "off"), ("request", "request"), ("always", "always")]
    + [(False, "off"), (True, "always")],
)
def test_deterministic_modes(value, mode):
    """YAML reads a bare ``off`` as False: it means "off"."""
    assert EngineConfig.from_dict({"deterministic": value}).deterministic == mode


def test_unknown_values_and_keys_are_refused():
    with pytest.raises(ValueError, match="deterministic must be one of off, request, always"):
        EngineConfig.from_dict({"deterministic": "sometimes"})
    with pytest.raises(ValueError, match="unknown engine config keys"):
        EngineConfig.from_dict({"determinstic": "always"})


def test_a_kv_budget_below_one_context_is_refused():
    with pytest.raises(ValueError, match="kv_cache_tokens=4096 cannot hold one sequence"):
        EngineConfig(max_model_len=8192, kv_cache_tokens=4096)
    assert EngineConfig(max_model_len=8192, kv_cache_tokens=8192).kv_cache_tokens == 8192
