"""The ``specd`` command.

specd serve    [--config FILE] [--host H] [--port P] [--dtype D] [--device D] [--api-key K]
               start the OpenAI-compatible server (flags > SPECD_* env > config file)
specd prepare  [--config FILE]            convert the configured model(s) once (GGUF -> safetensors)
specd generate [--config FILE] PROMPT...  run the engine directly on chat prompts and print the
                                          output with speculation stats
specd train-drafter [--config FILE] [--only distill|fit]
               train the EAGLE-3 head (train/pipeline.py; default configs/train/smollm2-eagle3.yaml)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def _config(args):
    import os

    from engine.config import EngineConfig

    cfg = EngineConfig.from_yaml(args.config)
    for name in ("dtype", "device"):  # flag > env > file
        value = getattr(args, name, None) or os.environ.get(f"SPECD_{name.upper()}")
        if value:
            setattr(cfg.model, name, value)
    return cfg


def cmd_serve(args) -> int:
    import logging

    from engine.builder import build_engine

    from .assembly import assemble
    from .settings import ServerSettings, load_config_file

    data = load_config_file(args.config)
    flags = {
        "host": args.host,
        "port": args.port,
        "api_keys": [args.api_key] if args.api_key else None,
    }
    settings = ServerSettings.from_sources(data.get("server"), flags=flags)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = _config(args)
    server = assemble(build_engine(cfg), settings, engine_thread=False)
    what = f"{cfg.model.name} ({cfg.model.dtype}, {cfg.model.device}, drafter {cfg.drafter.method})"
    try:  # the engine loop in this, the main thread; HTTP in a thread
        server.run(announce=lambda url: print(f"specd: serving {what} on {url}/v1", flush=True))
    except OSError as e:  # e.g. the port is taken
        print(f"specd: cannot serve on {server.url}: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_prepare(args) -> int:
    from engine.loader import prepare

    cfg = _config(args)
    print(prepare(cfg.model.source, cfg.cache_dir))
    if cfg.drafter.method == "model" and cfg.drafter.source:
        print(prepare(cfg.drafter.source, cfg.cache_dir))
    return 0


def cmd_generate(args) -> int:
    from engine.builder import build_engine
    from engine.sampling import SamplingParams
    from engine.sequence import SpecParams

    cfg = _config(args)
    if args.drafter:
        cfg.drafter.method = args.drafter
    built = build_engine(cfg)
    tok: Any = built.tokenizer
    engine = built.engine
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for p in args.prompt
    ]
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    t0 = time.perf_counter()
    spec = SpecParams() if args.k is None else SpecParams(enabled=args.k > 0, k=args.k)
    seqs = engine.generate(prompts, params, spec)
    dt = time.perf_counter() - t0
    for s in seqs:
        text = tok.decode(s.output_ids, skip_special_tokens=True)
        print(f"--- {s.request_id} ({s.finish_reason})\n{text}")
    n = sum(len(s.output_ids) for s in seqs)
    drafted, accepted = sum(s.drafted for s in seqs), sum(s.accepted for s in seqs)
    passes = sum(s.target_passes for s in seqs)
    print(
        f"--- {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s); drafter {cfg.drafter.method} "
        f"K={args.k if args.k is not None else cfg.drafter.controller}: drafted {drafted}, "
        f"accepted {accepted} "
        f"({accepted / max(drafted, 1):.0%}), {n / max(passes, 1):.2f} tokens per target pass",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="specd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("serve", "prepare", "generate"):
        p = sub.add_parser(name)
        p.add_argument("--config", default=str(DEFAULT_CONFIG))
        p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
        p.add_argument("--device", choices=["cpu", "cuda", "auto"])
        if name == "serve":
            p.add_argument("--host")
            p.add_argument("--port", type=int)
            p.add_argument("--api-key")
        if name == "generate":
            p.add_argument("prompt", nargs="+")
            p.add_argument("--max-tokens", type=int, default=128)
            p.add_argument("--temperature", type=float, default=0.0)
            p.add_argument("--seed", type=int)
            p.add_argument(
                "--k",
                type=int,
                default=None,
                help="fixed draft length (0 = plain decoding; default: the config's "
                "K controller, adaptive)",
            )
            p.add_argument("--drafter", choices=["ngram", "self", "layers", "none"])
    from train.pipeline import add_arguments as train_arguments

    train_arguments(sub.add_parser("train-drafter", help="train the EAGLE-3 head"))
    args = ap.parse_args(argv)
    if args.cmd == "train-drafter":
        from train.pipeline import run

        run(args)
        return 0
    return {"serve": cmd_serve, "prepare": cmd_prepare, "generate": cmd_generate}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
