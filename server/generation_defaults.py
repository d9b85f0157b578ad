"""A model's sampling defaults, as vLLM's ``--generation-config`` reads them: the sampling keys of
the model's ``generation_config.json`` (``auto``, the default), of another folder's (a path), or
none (``vllm``). A request's own value always wins; where it sends none, the server config's
``default_*`` (``default_temperature``, ``default_top_p``, ``default_max_tokens``), then these,
then OpenAI's (server/convert.py).

The keys, vLLM's: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, and
``max_new_tokens`` (the default ``max_tokens``). Only what the file sets counts
(transformers' ``to_diff_dict``: a key left at transformers' own default is not the model's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, float]:
    """The sampling keys of a generation config (as a dict), ``max_new_tokens`` as
    ``max_tokens``."""
    out: dict[str, float] = {}
    for key in KEYS:
        value = generation_config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out["max_tokens" if key == "max_new_tokens" else key] = value
    return out


def resolve(mode: str, model: Any) -> dict[str, float]:
    """The defaults in force for ``mode`` (``auto`` / ``vllm`` / a folder) over ``model`` (a
    transformers model, its ``generation_config`` read). ValueError for a folder without a
    ``generation_config.json``."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        config = getattr(model, "generation_config", None)
        return sampling_defaults(config.to_diff_dict()) if config is not None else {}
    path = Path(mode) / "generation_config.json"
    if not path.is_file():
        raise ValueError(
            f"generation_config {mode!r}: not 'auto', 'vllm' or a folder holding a "
            "generation_config.json"
        )
    return sampling_defaults(json.loads(path.read_text()))
