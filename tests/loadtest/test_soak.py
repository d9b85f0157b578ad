"""The soak, small: 16 streaming clients with random disconnects against `specd serve` in a child
process (fp32, on a port it bound itself) for 15 s; zero unexpected errors, every completed output
exactly its reference (every abandoned one a prefix of it), KV cache back to zero, RSS growth after
warm-up under 5%. The full run: python -m loadtest.soak --duration 3600."""

import pytest

from loadtest.soak import DEFAULT_CONFIG, soak, specd_child

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def test_soak_small(monkeypatch):
    # eager (the child inherits the environment): the subject is the server, and CI time
    monkeypatch.setenv("SPECD_ENFORCE_EAGER", "1")
    with specd_child(DEFAULT_CONFIG, clients=16) as (url, pid):
        result = soak(
            url,
            clients=16,
            duration=15,
            warmup=6,
            max_tokens=24,
            disconnect=0.25,
            prompts=6,
            seed=1,
            pid=pid,
        )
    print(result.summary())
    assert result.ok, result.summary()
    assert result.completed > 0 and result.disconnected > 0
