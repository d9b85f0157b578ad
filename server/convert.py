"""The one conversion from HTTP requests (server/protocol.py) to the engine's own dataclasses.

Which defaults win, field by field: a value set in the request, else the server config's
default (``default_max_tokens``, ``default_temperature``, ``default_top_p``), else OpenAI's default
(temperature 1, top_p 1, no top-k; max_tokens 16 for /v1/completions and "the rest of the context"
for chat). Speculation: the request's ``speculation`` extension (a fixed ``k``, or a ``k_max``
cap on the controller; either above the cap is refused, the cap being the server's
``spec_k_max`` or the engine's K_max (``drafter.k_max``), the lower; ``method`` the config's
drafter name, or ``draft`` for any model-based drafter), else the engine's K controller (config
``drafter.controller``, adaptive by default) capped so. A temperature below 1e-5 decodes
greedily (engine/records/params.py); ``top_k`` above the vocabulary means no top-k.

Everything specd cannot honour is refused here with a 400 that names the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from jinja2 import TemplateError

from engine.api import GrammarCompiler, SamplingParams, SpecParams

from .errors import APIError, bad
from .protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from .settings import ServerSettings
from .structured import grammar_for
from .tools import ToolMode, rendered, system_prompt, tool_mode

log = logging.getLogger("specd.server")


@dataclass
class EngineCapacity:
    """What the engine can take, from its config: the context, the vocabulary, the configured
    drafter and its largest K."""

    max_model_len: int
    vocab_size: int
    drafter: str  # configured drafter method
    k_max: int = 8  # the engine's largest K (metrics buckets)
    deterministic: str = "off"  # the engine's deterministic mode: off | request | always


@dataclass
class Job:
    """One HTTP request, converted: the prompts to run, each ``n`` times."""

    prompts: list[list[int]]
    params: SamplingParams
    spec: SpecParams
    n: int
    stop: list[str]
    echo: bool = False
    tools: ToolMode | None = None  # chat with tools: the output is read as calls (tools.py)


def check_model(name: str, served: list[str]) -> None:
    """OpenAI's 404 for a model it does not serve (clients map it to NotFoundError)."""
    if name not in served:
        raise APIError(
            404,
            f"The model `{name}` does not exist or you do not have access to it. This server "
            f"serves: {', '.join(served)}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _logit_bias(req: _Sampling, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token ids (as strings) to a bias in [-100, 100]."""
    out = []
    for key, value in (req.logit_bias or {}).items():
        if not (key.isdigit() and int(key) < vocab):
            raise bad(f"logit_bias keys must be token ids in [0, {vocab}): {key!r}", "logit_bias")
        if not -100 <= value <= 100:
            raise bad(f"logit_bias values must be in [-100, 100]: {value}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def _stops(req: _Sampling, s: ServerSettings) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > s.max_stop:
        raise bad(f"stop may hold at most {s.max_stop} sequences", "stop")
    if any(x == "" for x in stop):
        raise bad("stop sequences must not be empty strings", "stop")
    return stop


def _spec(req: _Sampling, s: ServerSettings, capacity: EngineCapacity) -> SpecParams:
    o = req.speculation
    cap = min(s.spec_k_max, capacity.k_max)  # the server's cap, never past the engine's K_max
    if o is None:  # the engine's controller chooses K (adaptive by default), at most the cap
        return SpecParams(enabled=capacity.drafter != "none", k=None, k_max=cap)
    if o.method is not None:  # the config's name, or "draft" for any model-based drafter
        model_based = capacity.drafter not in ("ngram", "none")
        named = o.method == capacity.drafter or (o.method == "draft" and model_based)
        if capacity.drafter == "none" or not named:
            raise bad(
                f"speculation.method {o.method!r} is not available on this server "
                f"(configured drafter: {capacity.drafter})",
                "speculation.method",
            )
    for name in ("k", "k_max"):
        v = getattr(o, name)
        if v is not None and v > cap:
            raise bad(f"speculation.{name} must be <= {cap}", f"speculation.{name}")
    k_max = o.k_max if o.k_max is not None else cap
    enabled = (
        (o.enabled if o.enabled is not None else True)
        and capacity.drafter != "none"
        and o.k != 0
        and k_max > 0
    )
    return SpecParams(enabled=enabled, k=o.k, k_max=k_max)


def _params(
    req: _Sampling,
    s: ServerSettings,
    capacity: EngineCapacity,
    prompt_len: int,
    max_tokens: int | None,
    default_max: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    grammar: str | None = None,
) -> SamplingParams:
    room = capacity.max_model_len - prompt_len
    if room <= 0:
        raise bad(
            f"The prompt has {prompt_len} tokens, more than the model's context of "
            f"{capacity.max_model_len} tokens allows",
            "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            "context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = s.default_max_tokens or default_max or room
        max_tokens = min(max_tokens, room)
    elif max_tokens > room:
        raise bad(
            f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
            f"model's context of {capacity.max_model_len} tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    temperature = (
        req.temperature
        if req.temperature is not None
        else (s.default_temperature if s.default_temperature is not None else 1.0)
    )
    top_p = (
        req.top_p
        if req.top_p is not None
        else (s.default_top_p if s.default_top_p is not None else 1.0)
    )
    top_k = min(max(req.top_k or 0, 0), capacity.vocab_size)
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        seed=req.seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        logit_bias=_logit_bias(req, capacity.vocab_size),
        grammar=grammar,
        deterministic=_deterministic(req, capacity),
        ignore_eos=req.ignore_eos,
    )


def _deterministic(req: _Sampling, capacity: EngineCapacity) -> bool:
    if req.deterministic and capacity.deterministic == "off":
        raise bad(
            "deterministic mode is off on this server (start it with --deterministic request "
            "or always)",
            "deterministic",
            "unsupported_parameter",
        )
    return bool(req.deterministic) or capacity.deterministic == "always"


def _check_n(req: _Sampling, s: ServerSettings, prompts: int = 1) -> None:
    if req.n > s.max_n:
        raise bad(f"n must be <= {s.max_n}", "n")
    if prompts * req.n > s.max_choices:
        raise bad(f"prompts x n must be <= {s.max_choices}", "prompt")


class JobContext(Protocol):
    """What turning a request into a :class:`Job` reads (the routes' ``Serving``)."""

    tokenizer: Any
    settings: ServerSettings
    capacity: EngineCapacity
    grammars: GrammarCompiler | None  # None: no grammar compiler (structured outputs refused)


def completion_job(req: CompletionRequest, ctx: JobContext) -> Job:
    tokenizer, s, capacity, grammars = ctx.tokenizer, ctx.settings, ctx.capacity, ctx.grammars
    _check_n(req, s)
    if req.best_of is not None and req.best_of != req.n:
        raise bad("best_of other than n is not supported", "best_of", "unsupported_parameter")
    if req.suffix:
        raise bad("suffix is not supported", "suffix", "unsupported_parameter")
    if req.logprobs is not None and req.logprobs > s.max_logprobs:
        raise bad(f"logprobs must be <= {s.max_logprobs}", "logprobs")
    p = req.prompt
    if isinstance(p, str):
        prompts = [tokenizer(p)["input_ids"]]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [tokenizer(x)["input_ids"] for x in p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [[x for x in p if isinstance(x, int)]]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [list(x) for x in p if isinstance(x, list)]
    else:
        raise bad(
            "prompt must be a non-empty string, list of strings, token ids or list of "
            "token-id lists",
            "prompt",
        )
    _check_n(req, s, len(prompts))
    for ids in prompts:
        if not ids:
            raise bad("prompt is empty", "prompt")
        if any(not 0 <= t < capacity.vocab_size for t in ids):
            raise bad(f"prompt token ids must be in [0, {capacity.vocab_size})", "prompt")
    stop = _stops(req, s)
    longest = max(len(x) for x in prompts)
    prompt_lp = req.logprobs if req.echo else None  # echo + logprobs: the prompt's too
    grammar = grammar_for(req, grammars)
    params = _params(
        req, s, capacity, longest, req.max_tokens, 16, req.logprobs, prompt_lp, grammar
    )
    return Job(prompts, params, _spec(req, s, capacity), req.n, stop, req.echo)


def chat_prompt(
    req: ChatCompletionRequest,
    tokenizer,
    tools: ToolMode | None = None,
    *,
    generation_prompt: bool = True,
) -> list[int]:
    """The conversation's token ids as the model's chat template renders it
    (``generation_prompt``: the assistant's turn opened, as a chat request runs it)."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        if content is None:
            if m.role != "assistant":
                raise bad(
                    f"messages[{i}].content is required for role {m.role!r}",
                    f"messages[{i}].content",
                )
            content = ""
        messages.append(rendered(m, content))
    if tools is not None:  # the tools and the answer format lead the system prompt
        head = system_prompt(req, tools)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{head}\n\n{messages[0]['content']}"}
        else:
            messages.insert(0, {"role": "system", "content": head})
    try:  # a template may refuse the conversation (e.g. role order)
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, return_dict=True
        )
        return list(out["input_ids"])
    except TemplateError as e:  # the template's own message (raise_exception) is for the user
        why = str(e)[:200]
    except Exception:  # anything else is internal: to the log, not to the client
        log.warning("the chat template failed", exc_info=True)
        why = "the conversation is not valid"
    raise bad(f"messages could not be rendered by the model's chat template: {why}", "messages")


def chat_job(req: ChatCompletionRequest, ctx: JobContext) -> Job:
    tokenizer, s, capacity, grammars = ctx.tokenizer, ctx.settings, ctx.capacity, ctx.grammars
    _check_n(req, s)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs requires logprobs=true", "top_logprobs")
    tools = tool_mode(req)
    ids = chat_prompt(req, tokenizer, tools)
    stop = _stops(req, s)
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    grammar = grammar_for(req, grammars, tools.schema if tools is not None else None)
    params = _params(req, s, capacity, len(ids), max_tokens, None, logprobs, None, grammar)
    return Job([ids], params, _spec(req, s, capacity), req.n, stop, tools=tools)
