"""engine/builder.py: where the compiled graphs are cached."""

import os
from pathlib import Path

import torch._dynamo  # noqa: F401 -- its import sets TORCHINDUCTOR_CACHE_DIR to torch's /tmp default
from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

from engine.builder import use_inductor_cache


def test_inductor_cache_moves_beside_the_model_cache_unless_the_user_named_one(monkeypatch):
    ours = Path("/somewhere/specd/inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_default())  # what importing dynamo left
    use_inductor_cache(ours)
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == ours
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    use_inductor_cache(ours)
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == ours
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")  # the user's choice is kept
    use_inductor_cache(ours)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine"
