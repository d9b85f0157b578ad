"""NAME
    specd - an OpenAI-compatible inference server with lossless speculative decoding

SYNOPSIS
    specd serve [MODEL] [--drafter eagle[:PATH]|ngram|suffix|model:PATH|none] [--k-max N]
                [--max-model-len N] [--max-running N] [--dtype D] [--device D]
                [--speculative-config JSON] [--chat-template FILE|TEMPLATE]
                [--host H] [--port P] [--api-key K] [--served-model-name NAME...]
                [--shutdown-timeout SECONDS] [--enforce-eager] [--threads N] [--config FILE]
    specd prepare [MODEL] [--config FILE]
    specd generate [--model MODEL] [--config FILE] [--k K] [--max-tokens N] PROMPT...
    specd train-drafter [--config FILE] [--only distill|original|fit]

DESCRIPTION
    serve          Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /ready and
                   /metrics. MODEL (default: the config's, SmolLM2-135M-Instruct) is a GGUF
                   file, a folder of safetensors, a Hub id or a pkg:PACKAGE/FILE spec.
    prepare        Convert the model once (GGUF -> a safetensors cache) and, where the config
                   compiles, compile its forward once, ahead of serving.
    generate       Run the engine on chat prompts and print the output with speculation stats.
    train-drafter  Train the EAGLE-3 head (train/pipeline.py).

    vLLM's serve flags work too, with specd's meaning: --model, --max-num-seqs (= --max-running),
    --max-num-batched-tokens (prompt tokens a step), --enable-prefix-caching, --dtype auto / half /
    float, --seed (the engine's generator), --uvicorn-log-level, --disable-uvicorn-access-log
    (no access-log line per request; the /health, /ready and /metrics probes never get one),
    --speculative-config; accepted
    for their command lines: --disable-log-requests, --enable-auto-tool-choice,
    --tool-call-parser, --response-role assistant; --generation-config auto (the default: the
    model's generation_config.json sampling defaults apply where a request sets none), vllm
    (none) or a folder; refused with the reason: --tensor-parallel-size /
    --pipeline-parallel-size above 1, --gpu-memory-utilization on a GPU, any other
    --generation-config or --response-role, unknown --speculative-config keys.

    Every flag of serve can also come from the environment, SPECD_<FLAG> (e.g. SPECD_PORT,
    SPECD_DRAFTER, SPECD_MAX_RUNNING); a flag beats the environment, the environment beats the
    config file (--config or SPECD_CONFIG; default configs/default.yaml, beside the package or in
    the working directory), which sets everything else.

    SIGTERM (or Ctrl-C) drains serve: /ready and new requests answer 503 with Retry-After at
    once, while every request already taken finishes (or, at the deadline, ends with an error
    event and [DONE]); the process exits when drained, at most --shutdown-timeout seconds
    after the signal. A second signal cuts the drain to 2 s.

EXAMPLES
    specd serve                                   # the embedded CPU default
    specd serve ./my-model --drafter ngram --k-max 6 --port 8080
    specd serve model.gguf --drafter model:./draft-model --max-running 8
    SPECD_API_KEY=secret specd serve --config configs/cpu-eagle.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"
# SmolLM2's EAGLE-3 head; relative, so that engine/builder.py's head_folder finds it in the
# working directory (the image's /app) as well as beside a checkout's package
DEFAULT_HEAD = "models/smollm2-135m-eagle3"


def config_file(given: str | None) -> str:
    """The config file: --config, else SPECD_CONFIG (the image sets it), else
    configs/default.yaml beside the package (a checkout), else in the working directory (an
    installed package has no configs/ beside it in site-packages; the image's is /app/configs)."""
    import os

    if given:
        return given
    if env := os.environ.get("SPECD_CONFIG"):  # (empty: not set, as compose's ${X:-} passes)
        return env
    for candidate in (DEFAULT_CONFIG, Path.cwd() / "configs" / "default.yaml"):
        if candidate.is_file():
            return str(candidate)
    raise SystemExit(
        f"specd: no config file: give --config FILE or set SPECD_CONFIG (no configs/default.yaml "
        f"in {ROOT} nor in the working directory {Path.cwd()})"
    )


# vLLM's suffix decoding knobs (``suffix_decoding_<key>``) -> specd's drafter fields, with the
# type each takes; max_cached_tokens is specd's own (the shared index's token bound)
SUFFIX_KEYS = {
    "max_tree_depth": ("suffix_max_tree_depth", int),
    "max_cached_requests": ("suffix_max_cached_requests", int),
    "max_cached_tokens": ("suffix_max_cached_tokens", int),
    "max_spec_factor": ("suffix_max_spec_factor", float),
    "min_token_prob": ("suffix_min_token_prob", float),
}
SPECULATIVE_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    *(f"suffix_decoding_{k}" for k in SUFFIX_KEYS),
}
# vLLM's --dtype names for specd's (auto: the model's own, the config's here)
DTYPES = {"auto": None, "half": "float16", "float": "float32"}


def vllm_flags(args) -> None:
    """``vllm serve`` flags with the meaning specd gives them, or a refusal that says why (never
    silently dropped): SystemExit on a value specd cannot honour."""
    for name, flag in (("tensor_parallel_size", "--tensor-parallel-size"),
                       ("pipeline_parallel_size", "--pipeline-parallel-size")):  # fmt: skip
        n = getattr(args, name, None)
        if n is not None and n != 1:
            raise SystemExit(f"specd: {flag} {n}: specd runs a model on one device (1 only)")
    role = getattr(args, "response_role", None)
    if role is not None and role != "assistant":
        raise SystemExit(f"specd: --response-role {role!r}: specd answers as 'assistant' only")
    gen = getattr(args, "generation_config", None)
    if gen is not None and gen not in ("auto", "vllm") and not Path(gen).is_dir():
        raise SystemExit(
            f"specd: --generation-config {gen!r}: 'auto' (the model's sampling defaults), "
            "'vllm' (none) or a folder holding a generation_config.json"
        )
    util = getattr(args, "gpu_memory_utilization", None)
    if util is not None and not 0 < util <= 1:
        raise SystemExit(f"specd: --gpu-memory-utilization must be in (0, 1], not {util}")


def _env_or(args, name: str):
    """A flag's value, else its SPECD_<NAME> environment variable (None: neither; an empty
    variable, as compose's ``${X:-}`` passes for an unset one, is not set)."""
    import os

    value = getattr(args, name, None)
    return value if value is not None else (os.environ.get(f"SPECD_{name.upper()}") or None)


def speculative_config(text: str) -> tuple[str, int | None, dict[str, object]]:
    """vLLM's ``--speculative-config`` JSON as specd's drafter: (the ``--drafter`` value,
    ``num_speculative_tokens`` as K_max or None, the drafter fields it sets). Methods: eagle3 /
    eagle (``model``: the head's folder; none: the default head), ngram
    (``prompt_lookup_min`` / ``_max``), suffix (``suffix_decoding_*``: :data:`SUFFIX_KEYS`),
    draft_model or a bare ``model`` (a draft model)."""
    import json

    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"specd: --speculative-config is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise SystemExit("specd: --speculative-config must be a JSON object")
    if unknown := sorted(set(d) - SPECULATIVE_KEYS):
        raise SystemExit(
            f"specd: --speculative-config keys {unknown} are not ones specd serves "
            f"(it reads {', '.join(sorted(SPECULATIVE_KEYS))})"
        )
    method, model, k = d.get("method"), d.get("model"), d.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or k < 0):
        raise SystemExit(f"specd: num_speculative_tokens must be an integer >= 0, not {k!r}")
    suffix = {
        key: d[f"suffix_decoding_{key}"] for key in SUFFIX_KEYS if f"suffix_decoding_{key}" in d
    }
    if suffix and method != "suffix":
        raise SystemExit("specd: --speculative-config suffix_decoding_* keys need method 'suffix'")
    if method in ("eagle3", "eagle"):
        return (f"eagle:{model}" if model else "eagle"), k, {}
    if method == "ngram":
        lo, hi = d.get("prompt_lookup_min", 1), d.get("prompt_lookup_max", 3)
        return "ngram", k, {"ngram_min": int(lo), "ngram_max": int(hi)}
    if method == "suffix":
        fields: dict[str, object] = {}
        for key, value in suffix.items():
            name, cast = SUFFIX_KEYS[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SystemExit(
                    f"specd: --speculative-config suffix_decoding_{key} must be a number, "
                    f"not {value!r}"
                )
            fields[name] = cast(value)
        return "suffix", k, fields
    if method in (None, "draft_model") and model:
        return f"model:{model}", k, {}
    raise SystemExit(
        f"specd: --speculative-config method {method!r} is not one specd serves "
        "(eagle3, eagle, ngram, suffix, draft_model with a model)"
    )


def chat_template(value: str) -> str:
    """``--chat-template``: a file holding a Jinja chat template, or the template itself."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise SystemExit(f"specd: --chat-template {value!r} is neither a file nor a Jinja template")


def _config(args):
    from engine.api import EngineConfig

    cfg = EngineConfig.from_yaml(args.config)
    vllm_flags(args)
    option = getattr(args, "model_option", None)  # vLLM's --model beside the positional
    if option and getattr(args, "model", None) not in (None, option):
        raise SystemExit(f"specd: the model is named twice: {args.model!r} and --model {option!r}")
    model = option or _env_or(args, "model")
    other_model = bool(model) and model != cfg.model.source
    if model:
        cfg.model.source = model
        cfg.model.name = Path(model.split(":")[-1].rstrip("/")).name.removesuffix(".gguf")
    for name in ("dtype", "device"):  # flag > env > file
        value = _env_or(args, name)
        if name == "dtype":
            value = DTYPES.get(value, value)
        if value:
            setattr(cfg.model, name, value)
    drafter = _env_or(args, "drafter")
    spec_k = None
    if spec := _env_or(args, "speculative_config"):
        if drafter:
            raise SystemExit("specd: --speculative-config and --drafter both name the drafter")
        drafter, spec_k, fields = speculative_config(spec)
        for name, value in fields.items():
            setattr(cfg.drafter, name, value)
    if other_model and not drafter and cfg.drafter.method == "eagle3":
        # the config's EAGLE-3 head reads its own target's hidden states: another model
        # speculates with n-gram prompt lookup unless --drafter names a head for it
        print(
            f"specd: {model}: the config's EAGLE-3 head is for its own model; drafting with "
            "n-gram prompt lookup (--drafter eagle:PATH names a head for this one)",
            file=sys.stderr,
        )
        cfg.drafter.method, cfg.drafter.source, cfg.drafter.ngram_fallback = "ngram", None, 0
    if drafter:
        method, _, source = drafter.partition(":")
        method = {"eagle": "eagle3"}.get(method, method)
        if method not in ("eagle3", "ngram", "suffix", "model", "self", "none"):
            raise SystemExit(f"specd: unknown --drafter {drafter!r}")
        if method == "model" and not source:
            raise SystemExit("specd: --drafter model:PATH needs the draft model's PATH")
        cfg.drafter.method = method
        if source or method == "eagle3":
            cfg.drafter.source = source or cfg.drafter.source or DEFAULT_HEAD
    for name, field, cast in (
        ("k_max", "k_max", int),
        ("tree_leaves", "tree_leaves", int),
        ("tree_topk", "tree_topk", int),
        ("max_model_len", "max_model_len", int),
        ("max_running", "max_running", int),
        ("deterministic", "deterministic", str),
        ("prefix_cache_tokens", "prefix_cache_tokens", int),
        ("kv_cache_tokens", "kv_cache_tokens", int),
        ("kv_layout", "kv_layout", str),
        ("threads", "threads", int),
    ):
        value = _env_or(args, name)
        if value is not None:
            target = cfg.drafter if name in ("k_max", "tree_leaves", "tree_topk") else cfg
            setattr(target, field, cast(value))
    if spec_k is not None and _env_or(args, "k_max") is None:
        cfg.drafter.k_max = spec_k
    if getattr(args, "enable_prefix_caching", None) and not cfg.prefix_cache_tokens:
        cfg.prefix_cache_tokens = EngineConfig.prefix_cache_tokens  # on, at its default size
    if str(_env_or(args, "no_enable_prefix_caching")).lower() in ("true", "1", "yes"):
        cfg.prefix_cache_tokens = 0  # vLLM's flag: every prompt computed whole
    if (batched := getattr(args, "max_num_batched_tokens", None)) is not None:
        cfg.prefill_chunk_tokens = batched  # vLLM's per-step token budget: prompt tokens a step
    if (seed := getattr(args, "engine_seed", None)) is not None:
        cfg.seed = seed
    if getattr(args, "gpu_memory_utilization", None) is not None:
        from engine.api import resolve_device

        if resolve_device(cfg.model.device).type != "cpu":
            raise SystemExit(
                "specd: --gpu-memory-utilization: specd sizes its KV memory in positions, not "
                "as a share of GPU memory: use --kv-cache-tokens"
            )
        print(  # as in vLLM's CPU build, which sizes its KV cache by VLLM_CPU_KVCACHE_SPACE
            "specd: --gpu-memory-utilization does not apply on CPU (the KV memory is "
            "--kv-cache-tokens positions)",
            file=sys.stderr,
        )
    if str(_env_or(args, "enforce_eager")).lower() in ("true", "1", "yes"):
        cfg.compile.enabled = False  # vLLM's flag: no compiled forward, ready without compiling
    try:
        cfg.__post_init__()  # what the flags and environment set is checked as the file was
    except ValueError as e:
        raise SystemExit(f"specd: {e}") from None
    return cfg


def server_flags(args) -> dict[str, Any]:
    """The server settings serve's flags set (None: the flag was not given)."""
    return {
        "host": args.host,
        "port": args.port,
        "api_keys": [args.api_key] if args.api_key else None,
        "served_model_names": args.served_model_name or None,
        "shutdown_timeout_s": args.shutdown_timeout,
        "log_level": args.log_level,
        "access_log": False if args.disable_uvicorn_access_log else None,
        "generation_config": args.generation_config,
    }


def cmd_serve(args) -> int:
    import logging

    from engine.api import build_engine

    from .assembly import assemble
    from .settings import ServerSettings, load_config_file, unknown_env

    data = load_config_file(args.config)
    settings = ServerSettings.from_sources(data.get("server"), flags=server_flags(args))
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for warning in unknown_env():
        logging.getLogger("specd").warning(warning)
    cfg = _config(args)
    built = build_engine(cfg)
    if template := _env_or(args, "chat_template"):  # the model's own otherwise
        tokenizer: Any = built.tokenizer
        tokenizer.chat_template = chat_template(template)
    try:
        server = assemble(built, settings, engine_thread=False)
    except ValueError as e:  # (a generation_config folder without one)
        raise SystemExit(f"specd: {e}") from None
    load = built.engine.load()
    cache = load.prefix_cache_tokens
    prefix = f"prefix cache {cache} positions" if cache else "prefix cache off"
    what = (
        f"{cfg.model.name} ({cfg.model.dtype}, {cfg.model.device}, drafter "
        f"{cfg.drafter.method}, KV {load.kv_budget_tokens} positions in {cfg.kv_layout}, "
        f"{prefix})"
    )
    try:  # the engine loop in this, the main thread; HTTP in a thread
        server.run(announce=lambda url: print(f"specd: serving {what} on {url}/v1", flush=True))
    except OSError as e:  # e.g. the port is taken
        print(f"specd: cannot serve on {server.url}: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_prepare(args) -> int:
    from engine.api import prepare

    cfg = _config(args)
    print(prepare(cfg.model.source, cfg.cache_dir))
    if cfg.drafter.method == "model" and cfg.drafter.source:
        print(prepare(cfg.drafter.source, cfg.cache_dir))
    if cfg.compile.enabled:  # compile the forward once too: `serve` then loads inductor's cache
        from engine.api import build_engine

        build_engine(cfg).engine.warm_up()
        print(f"compiled the forward into {os.environ.get('TORCHINDUCTOR_CACHE_DIR')}")
    return 0


def cmd_generate(args) -> int:
    from engine.api import SamplingParams, SpecParams, build_engine

    cfg = _config(args)
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
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    helps = {
        "serve": "serve the OpenAI-compatible API",
        "prepare": "convert the model once, ahead of serving",
        "generate": "run the engine on chat prompts (no server)",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text)
        model_help = (
            "GGUF file, safetensors folder, Hub id or pkg:PACKAGE/FILE (env SPECD_MODEL; "
            "default: the config's)"
        )
        if name == "generate":  # (its positionals are the prompts)
            p.add_argument("--model", help=model_help)
        else:
            p.add_argument("model", nargs="?", metavar="MODEL", help=model_help)
        p.add_argument(
            "--config",
            help="config file (YAML; env SPECD_CONFIG; default configs/default.yaml, the "
            "checkout's or the working directory's)",
        )
        p.add_argument(
            "--dtype",
            choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
            help="weights and activations; vLLM's names too: auto (the config's), half, float "
            "(env SPECD_DTYPE)",
        )
        p.add_argument("--device", choices=["cpu", "cuda", "auto"], help="(env SPECD_DEVICE)")
        if name in ("serve", "generate"):
            p.add_argument(
                "--speculative-config",
                metavar="JSON",
                help='vLLM\'s form of --drafter and --k-max: {"method": "eagle3", "model": PATH, '
                '"num_speculative_tokens": K}, or "ngram" (prompt_lookup_min / _max), or "suffix" '
                "(suffix_decoding_max_tree_depth, _max_cached_requests, _max_spec_factor, "
                '_min_token_prob), or "draft_model" (env SPECD_SPECULATIVE_CONFIG)',
            )
            p.add_argument(
                "--drafter",
                metavar="eagle[:PATH]|ngram|suffix|model:PATH|none",
                help="what drafts: an EAGLE-3 head (default PATH: SmolLM2's, "
                "models/smollm2-135m-eagle3), prompt lookup, suffix decoding (the request's "
                "text and recent outputs), a draft model sharing the tokenizer, or none "
                "(env SPECD_DRAFTER)",
            )
            p.add_argument("--k-max", type=int, help="largest draft length K (env SPECD_K_MAX)")
            p.add_argument(
                "--tree-leaves",
                type=int,
                help="draft trees: up to N of the EAGLE-3 head's runners-up (or the suffix "
                "drafter's other continuations) verified beside its chain where the controller "
                "finds they pay; 0: chains (env SPECD_TREE_LEAVES)",
            )
            p.add_argument(
                "--tree-topk",
                type=int,
                help="EAGLE-2 tree expansion: each draft depth also feeds the head K-1 other "
                "candidates and keeps the top K children of each, so leaves may hang deeper; "
                "0: leaves are the chain's runners-up (env SPECD_TREE_TOPK)",
            )
            p.add_argument(
                "--max-model-len",
                type=int,
                help="tokens per sequence, prompt + output (env SPECD_MAX_MODEL_LEN)",
            )
            p.add_argument(
                "--max-running",
                "--max-num-seqs",
                dest="max_running",
                type=int,
                help="sequences decoded together = KV cache slots (--max-num-seqs: vLLM's name; "
                "env SPECD_MAX_RUNNING)",
            )
            p.add_argument(
                "--max-num-batched-tokens",
                type=int,
                help="prompt tokens one engine step prefills (vLLM's per-step token budget; "
                "config prefill_chunk_tokens)",
            )
            p.add_argument(
                "--enable-prefix-caching",
                action="store_const",
                const=True,
                help="cache prompts' K/V for prompts that start the same (on by default)",
            )
            for flag, short in (("--tensor-parallel-size", "-tp"),
                                ("--pipeline-parallel-size", "-pp")):  # fmt: skip
                p.add_argument(flag, short, type=int, help="1 only: specd runs on one device")
            p.add_argument(
                "--gpu-memory-utilization",
                type=float,
                help="vLLM's share of GPU memory: refused on a GPU (specd sizes KV memory by "
                "--kv-cache-tokens), without effect on CPU, as in vLLM's CPU build",
            )
            p.add_argument(
                "--deterministic",
                choices=["off", "request", "always"],
                help="batch-invariant forwards: greedy and seeded output the same alone or in "
                "any batch, speculation on or off, in bf16 too; 'request': for requests that "
                'send "deterministic": true (env SPECD_DETERMINISTIC; default off)',
            )
            p.add_argument(
                "--prefix-cache-tokens",
                type=int,
                help="positions whose K/V the prefix cache keeps, so a prompt that starts as an "
                "earlier one did (a conversation's next turn) computes only the rest (env "
                "SPECD_PREFIX_CACHE_TOKENS; default 16384)",
            )
            p.add_argument(
                "--kv-cache-tokens",
                type=int,
                help="KV positions the running sequences may hold in all; past it the latest "
                "admitted is preempted and recomputed later (env SPECD_KV_CACHE_TOKENS; default: "
                "max_running x max_model_len)",
            )
            p.add_argument(
                "--kv-layout",
                choices=["slots", "paged"],
                help="the KV cache: a slot of max_model_len positions per sequence ('slots', "
                "resident only where written on CPU) or one pool of blocks of kv_cache_tokens "
                "positions with a block table per sequence ('paged') (env SPECD_KV_LAYOUT; "
                "default slots)",
            )
            p.add_argument(
                "--no-enable-prefix-caching",
                action="store_const",
                const=True,
                help="compute every prompt whole (env SPECD_NO_ENABLE_PREFIX_CACHING=1)",
            )
            p.add_argument(
                "--enforce-eager",
                action="store_const",
                const=True,
                help="run every forward eagerly, never compiled: ready in seconds, slower per "
                "token (env SPECD_ENFORCE_EAGER=1)",
            )
            p.add_argument(
                "--threads",
                type=int,
                help="torch's threads on CPU (env SPECD_THREADS; default: torch's, one a core)",
            )
        if name in ("serve", "prepare"):
            p.add_argument("--model", dest="model_option", metavar="MODEL", help="as MODEL")
        if name == "serve":
            p.add_argument(
                "--seed",
                dest="engine_seed",
                type=int,
                help="seed of the engine's generator (unseeded requests draw from it)",
            )
            p.add_argument(
                "--uvicorn-log-level",
                dest="log_level",
                choices=["critical", "error", "warning", "info", "debug"],
                help="the server's log level (config server.log_level; default info)",
            )
            p.add_argument(
                "--disable-uvicorn-access-log",
                action="store_true",
                help="no access-log line per request (config server.access_log; the /health, "
                "/ready and /metrics probes are never logged)",
            )
            p.add_argument(
                "--disable-log-requests",
                action="store_true",
                help="accepted for vLLM's command lines: specd never logs requests' contents",
            )
            p.add_argument(
                "--enable-auto-tool-choice",
                action="store_true",
                help="accepted for vLLM's command lines: tool_choice auto is always served",
            )
            p.add_argument(
                "--tool-call-parser",
                metavar="NAME",
                help="accepted for vLLM's command lines: specd constrains tool calls to its own "
                "JSON format by a grammar and parses that (server/tools.py), whatever NAME",
            )
            p.add_argument(
                "--generation-config",
                metavar="auto|vllm|FOLDER",
                help="a request's sampling defaults: 'auto' (default), the model's "
                "generation_config.json; 'vllm', OpenAI's; or FOLDER's generation_config.json "
                "(config server.generation_config; the config's server.default_* come first)",
            )
            p.add_argument(
                "--response-role", metavar="assistant", help="'assistant' only (chat answers)"
            )
            p.add_argument("--host", help="listen address (env SPECD_HOST; default 127.0.0.1)")
            p.add_argument("--port", type=int, help="listen port (env SPECD_PORT; default 8000)")
            p.add_argument(
                "--api-key",
                help="required Bearer key (env SPECD_API_KEY=k1,k2 or SPECD_API_KEYS_FILE)",
            )
            p.add_argument(
                "--served-model-name",
                nargs="+",
                metavar="NAME",
                help="the names /v1/models answers and requests may use, the first listed first "
                "(env SPECD_SERVED_MODEL_NAMES, comma-separated)",
            )
            p.add_argument(
                "--chat-template",
                metavar="FILE|TEMPLATE",
                help="a Jinja chat template (a file, or the template itself) in place of the "
                "model's (env SPECD_CHAT_TEMPLATE)",
            )
            p.add_argument(
                "--shutdown-timeout",
                type=float,
                metavar="SECONDS",
                help="SIGTERM drains: /ready and new requests answer 503, held requests finish; "
                "the process exits by then (env SPECD_SHUTDOWN_TIMEOUT; default 25)",
            )
        if name == "generate":
            p.add_argument("prompt", nargs="+", help="chat prompts, run together")
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
    from train.pipeline import add_arguments as train_arguments

    train_arguments(
        sub.add_parser(
            "train-drafter", help="train the EAGLE-3 head", description="train the EAGLE-3 head"
        )
    )
    args = ap.parse_args(argv)
    if args.cmd == "train-drafter":
        from train.pipeline import run

        run(args)
        return 0
    args.config = config_file(args.config)
    return {"serve": cmd_serve, "prepare": cmd_prepare, "generate": cmd_generate}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
