"""Server settings. Precedence: command-line flag > environment (SPECD_*) > config file >
default. An environment variable set to the empty string counts as not set."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"  # loopback by default; the container binds 0.0.0.0 explicitly
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    served_model_names: list[str] = field(default_factory=list)  # default: the model's name
    max_n: int = 8
    max_stop: int = 4
    max_logprobs: int = 20
    default_max_tokens: int | None = (
        None  # None: OpenAI's (16 for completions, rest of context for chat)
    )
    default_temperature: float | None = None  # None: OpenAI's (1.0)
    default_top_p: float | None = None  # None: OpenAI's (1.0)
    # the sampling defaults of a request (vLLM's --generation-config): "auto", the model's
    # generation_config.json; "vllm", none (OpenAI's); else a folder holding a
    # generation_config.json (server/generation_defaults.py)
    generation_config: str = "auto"
    spec_k_max: int = 8  # cap on a request's speculation.k / k_max
    max_choices: int = 64  # prompts x n of one request
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a request body must arrive whole within this (else 408)
    header_timeout_s: float = (
        10.0  # a request head must arrive within this (else the connection closes)
    )
    max_header_bytes: int = 16384  # request head size (uvicorn answers 400 past it)
    keep_alive_s: float = 5.0  # idle keep-alive connections close after this
    stream_send_timeout_s: float = 60.0  # a stream whose client takes nothing for this long closes
    # SIGTERM to exit at most: the engine drains for all but the last DRAIN_FLUSH_S of it
    shutdown_timeout_s: float = 25.0
    cors_origins: list[str] = field(default_factory=list)  # empty: no CORS headers at all
    # /health answers 503 once the engine loop has held requests this long without coming round
    # (a hung step: liveness restarts the process); a long prefill chunk takes seconds
    health_stall_s: float = 120.0
    metrics_cache_s: float = 0.1  # /metrics renders at most this often (scrapers share one page)
    log_level: str = "info"
    # uvicorn's access log (a line per request; never for the /health, /ready and /metrics
    # probes: server/transport.py); vLLM's --disable-uvicorn-access-log turns it off
    access_log: bool = True

    def __post_init__(self) -> None:
        if not self.shutdown_timeout_s >= 0:  # (NaN too)
            raise ValueError(f"shutdown_timeout_s must be >= 0, not {self.shutdown_timeout_s}")

    @classmethod
    def from_sources(
        cls, file_data: dict | None, env: Mapping[str, str] | None = None, flags: dict | None = None
    ) -> ServerSettings:
        env = os.environ if env is None else env
        # an empty variable is not set: docker-compose's ${SPECD_API_KEY:-} passes "" when the
        # host has no value, and that must not replace the config file's keys with none
        env = {k: v for k, v in env.items() if k.startswith("SPECD_") and v != ""}
        values: dict = {}
        known = {f.name: f for f in fields(cls)}
        for k, v in (file_data or {}).items():
            if k not in known:
                raise ValueError(f"unknown server config key {k!r}")
            values[k] = v
        for name, f in known.items():
            raw = env.get(f"SPECD_{name.upper()}")
            if raw is not None:
                values[name] = _parse(raw, f.type)
        if "SPECD_SHUTDOWN_TIMEOUT" in env and "SPECD_SHUTDOWN_TIMEOUT_S" not in env:
            # the --shutdown-timeout flag's own SPECD_<FLAG> name (the field's name has _S)
            values["shutdown_timeout_s"] = float(env["SPECD_SHUTDOWN_TIMEOUT"])
        if "SPECD_API_KEY" in env:
            values["api_keys"] = [k for k in env["SPECD_API_KEY"].split(",") if k]
        keys_file = env.get("SPECD_API_KEYS_FILE")
        if keys_file:
            values["api_keys"] = [
                line.strip() for line in Path(keys_file).read_text().splitlines() if line.strip()
            ]
        for k, v in (flags or {}).items():  # flags last: they win
            if v is not None:
                values[k] = v
        return cls(**values)


# SPECD_* names read somewhere besides the settings' fields: serve's engine flags (server/cli.py),
# keys, the model cache, the 4-bit kernel switch, the image's config path, setup and tests
OTHER_ENV = {
    "MODEL",
    "DTYPE",
    "DEVICE",
    "DRAFTER",
    "K_MAX",
    "TREE_LEAVES",
    "TREE_TOPK",
    "THREADS",
    "MAX_MODEL_LEN",
    "MAX_RUNNING",
    "DETERMINISTIC",
    "PREFIX_CACHE_TOKENS",
    "KV_CACHE_TOKENS",
    "KV_LAYOUT",
    "SPECULATIVE_CONFIG",
    "CHAT_TEMPLATE",
    "NO_ENABLE_PREFIX_CACHING",
    "ENFORCE_EAGER",
    "SHUTDOWN_TIMEOUT",
    "API_KEY",
    "API_KEYS_FILE",
    "CACHE_DIR",
    "Q4_KERNEL",
    "CONFIG",
    "PUBLISH",
    "SETUP_PREPARE",
    "TORCH_VERSION",
    "TEST_DEVICE",
    "SCHEMATHESIS_EXAMPLES",
}


def known_env() -> set[str]:
    """Every SPECD_* variable specd reads."""
    return {f"SPECD_{f.name.upper()}" for f in fields(ServerSettings)} | {
        f"SPECD_{n}" for n in OTHER_ENV
    }


def unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each SPECD_* variable in ``env`` that specd does not read (a misspelt one
    would otherwise be ignored without a word), naming the closest known name."""
    env = os.environ if env is None else env
    known = known_env()
    out = []
    for name in sorted(env):
        if name.startswith("SPECD_") and name not in known:
            # compared without the prefix, which every name shares
            suffixes = sorted(k.removeprefix("SPECD_") for k in known)
            close = difflib.get_close_matches(name.removeprefix("SPECD_"), suffixes, n=1)
            hint = f"; did you mean SPECD_{close[0]}?" if close else ""
            out.append(f"environment variable {name} is not one specd reads{hint}")
    return out


def _parse(raw: str, typ) -> object:
    t = str(typ)
    if "list" in t:
        return [x for x in raw.split(",") if x]
    if t.startswith("int"):
        return int(raw)
    if t.startswith("float"):
        return float(raw)
    return raw


def load_config_file(path: str | Path | None) -> dict:
    if not path:
        return {}
    return yaml.safe_load(Path(path).read_text()) or {}
