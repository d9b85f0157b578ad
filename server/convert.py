"""The one conversion from HTTP requests (server/protocol.py) to the engine's own dataclasses.

Which defaults win, field by field: a value set in the request, else the server config's
default (``default_max_tokens``, ``default_temperature``, ``default_top_p``), else the model's
sampling defaults (its generation_config.json, vLLM's ``--generation-config``:
server/generation_defaults.py), else OpenAI's default (temperature 1, top_p 1, no top-k, min_p 0,
repetition penalty 1; max_tokens 16 for /v1/completions and "the rest of the context" for chat).
Speculation: the request's ``speculation`` extension (a fixed ``k``, or a ``k_max``
cap on the controller; either above the cap is refused, the cap being the server's
``spec_k_max`` or the engine's K_max (``drafter.k_max``), the lower; ``method`` the config's
drafter name, or ``draft`` for any model-based drafter), else the engine's K controller (config
``drafter.controller``, adaptive by default) capped so. A temperature below 1e-5 decodes
greedily (engine/records/params.py); ``top_k`` above the vocabulary means no top-k.

Everything specd cannot honour is refused here with a 400 that names the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
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
    # the model's sampling defaults in force (server/generation_defaults.py; {}: OpenAI's)
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # the KV cache's configuration as vLLM's cache_config_info labels it (server/metrics.py)
    cache_info: dict[str, str] = field(default_factory=dict)


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
    include_stop: bool = False  # the stop string / stop token's text ends the output
    skip_special: bool = True  # special tokens' text left out of the output
    token_ids: bool = False  # logprobs' tokens as "token_id:<id>" (vLLM's)
    chat_echo: str = ""  # chat ``echo``: the last (assistant) message's text leads the answer
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs with the top N, or None


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


# guided_decoding_backend values that name what specd runs (llguidance), or leave it to it
BACKENDS = (None, "auto", "guidance", "llguidance")


def refuse_unsupported(req: _Sampling) -> None:
    """vLLM's fields specd cannot honour: a 400 naming the field (never ignored)."""
    if req.use_beam_search:
        raise bad("beam search is not supported", "use_beam_search", "unsupported_parameter")
    refusals = {
        "length_penalty": (req.length_penalty != 1.0, "applies to beam search, not supported"),
        "logits_processors": (bool(req.logits_processors), "is not supported"),
        "priority": (req.priority != 0, "is not supported (no priority scheduling): send 0"),
        "cache_salt": (req.cache_salt is not None, "is not supported"),
        "return_token_ids": (
            bool(req.return_token_ids),
            "is not supported: ask logprobs with return_tokens_as_token_ids",
        ),
        "kv_transfer_params": (bool(req.kv_transfer_params), "is not supported"),
        "vllm_xargs": (bool(req.vllm_xargs), "is not supported"),
        "guided_whitespace_pattern": (
            req.guided_whitespace_pattern is not None,
            "is not supported",
        ),
        "guided_decoding_backend": (
            req.guided_decoding_backend not in BACKENDS,
            "is not supported: specd's is llguidance ('auto', 'guidance')",
        ),
        "stream_options.continuous_usage_stats": (
            bool(req.stream_options and req.stream_options.continuous_usage_stats),
            "is not supported (usage comes in the last chunk)",
        ),
    }
    if isinstance(req, ChatCompletionRequest):
        refusals |= {
            "chat_template": (
                req.chat_template is not None,
                "is not supported per request: start the server with --chat-template",
            ),
            "mm_processor_kwargs": (bool(req.mm_processor_kwargs), "is not supported"),
            "structural_tag": (req.structural_tag is not None, "is not supported"),
            "include_reasoning": (not req.include_reasoning, "false: no reasoning parser runs"),
        }
    if isinstance(req, CompletionRequest):
        refusals["prompt_embeds"] = (req.prompt_embeds is not None, "is not supported")
    for param, (refused, why) in refusals.items():
        if refused:
            raise bad(f"{param} {why}", param, "unsupported_parameter")


def _token_ids(ids: list[int] | None, vocab: int, param: str) -> tuple[int, ...]:
    for t in ids or []:
        if not 0 <= t < vocab:
            raise bad(f"{param} must be token ids in [0, {vocab}): {t}", param)
    return tuple(ids or [])


def _truncated(ids: list[int], req: _Sampling) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last N tokens."""
    n = req.truncate_prompt_tokens
    return ids[-n:] if n is not None and n < len(ids) else ids


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
        model_based = capacity.drafter not in ("ngram", "suffix", "none")
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
    bad_words: tuple[tuple[int, ...], ...] = (),
) -> SamplingParams:
    room = capacity.max_model_len - prompt_len
    if room <= 0:
        raise bad(
            f"The prompt has {prompt_len} tokens, more than the model's context of "
            f"{capacity.max_model_len} tokens allows",
            "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            "context_length_exceeded",
        )
    d = capacity.sampling_defaults
    if max_tokens is None:
        model_max = int(d["max_tokens"]) if "max_tokens" in d else None
        max_tokens = s.default_max_tokens or model_max or default_max or room
        max_tokens = min(max_tokens, room)
    elif max_tokens > room:
        raise bad(
            f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
            f"model's context of {capacity.max_model_len} tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    temperature = _first(req.temperature, s.default_temperature, d.get("temperature"), 1.0)
    top_p = _first(req.top_p, s.default_top_p, d.get("top_p"), 1.0)
    top_k = int(_first(req.top_k, d.get("top_k"), 0))
    top_k = min(max(top_k, 0), capacity.vocab_size)  # -1 or 0: off
    if req.min_tokens > max_tokens:
        raise bad(f"min_tokens must be <= max_tokens ({max_tokens})", "min_tokens")
    allowed = None
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise bad("allowed_token_ids must not be empty", "allowed_token_ids")
        allowed = _token_ids(req.allowed_token_ids, capacity.vocab_size, "allowed_token_ids")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=_first(req.min_p, d.get("min_p"), 0.0),
        min_tokens=req.min_tokens,
        stop_token_ids=_token_ids(req.stop_token_ids, capacity.vocab_size, "stop_token_ids"),
        allowed_token_ids=allowed,
        bad_words=bad_words,
        max_tokens=max_tokens,
        seed=req.seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=_first(req.repetition_penalty, d.get("repetition_penalty"), 1.0),
        logit_bias=_logit_bias(req, capacity.vocab_size),
        grammar=grammar,
        deterministic=_deterministic(req, capacity),
        ignore_eos=req.ignore_eos,
    )


# bad_words a request may hold: the engine matches each at every verified position on the host
MAX_BAD_WORDS = 1024


def _bad_words(req: _Sampling, tokenizer: Any, vocab: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as token sequences (vLLM's SamplingParams.update_from_tokenizer):
    each word as the text would start with it, and -- where a leading space makes another
    sequence of as many tokens, as a word inside the text is written -- that one too."""
    words = req.bad_words or []
    if len(words) > MAX_BAD_WORDS:
        raise bad(f"bad_words may hold at most {MAX_BAD_WORDS} words", "bad_words")
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise bad("bad_words must not hold empty or blank words", "bad_words")
        out.append(tuple(plain))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(tuple(spaced))
    if any(not 0 <= t < vocab for w in out for t in w):
        raise bad(f"bad_words must encode to token ids in [0, {vocab})", "bad_words")
    return tuple(out)


def _prompt_logprobs(req: _Sampling, s: ServerSettings) -> int | None:
    """vLLM's ``prompt_logprobs``: the top N alternatives at each prompt token (0: the token's
    own only). Not with ``stream`` (vLLM's rule: a stream has no place for them); -1 (vLLM's
    whole vocabulary) and values above the server's max_logprobs are refused."""
    n = req.prompt_logprobs
    if n is None:
        return None
    if req.stream:
        raise bad("prompt_logprobs is not available when stream is true", "prompt_logprobs")
    if not 0 <= n <= s.max_logprobs:
        raise bad(f"prompt_logprobs must be in [0, {s.max_logprobs}]", "prompt_logprobs")
    return n


def _first(*values):
    """The first value that is set (the request's, then the defaults': module doc)."""
    return next(v for v in values if v is not None)


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
    refuse_unsupported(req)
    _check_best_of(req)
    if req.suffix:
        raise bad("suffix is not supported", "suffix", "unsupported_parameter")
    if req.logprobs is not None and req.logprobs > s.max_logprobs:
        raise bad(f"logprobs must be <= {s.max_logprobs}", "logprobs")
    p = req.prompt
    special = req.add_special_tokens is not False  # a prompt's default: true
    if isinstance(p, str):
        prompts = [tokenizer(p, add_special_tokens=special)["input_ids"]]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [tokenizer(x, add_special_tokens=special)["input_ids"] for x in p]
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
    prompts = [_truncated(list(ids), req) for ids in prompts]
    for ids in prompts:
        if not ids:
            raise bad("prompt is empty", "prompt")
        if any(not 0 <= t < capacity.vocab_size for t in ids):
            raise bad(f"prompt token ids must be in [0, {capacity.vocab_size})", "prompt")
    stop = _stops(req, s)
    longest = max(len(x) for x in prompts)
    # echo + logprobs, and vLLM's prompt_logprobs: the prompt is scored (the larger top N)
    echoed = req.logprobs if req.echo else None
    asked = [n for n in (echoed, _prompt_logprobs(req, s)) if n is not None]
    prompt_lp = max(asked) if asked else None
    grammar = grammar_for(req, grammars)
    banned = _bad_words(req, tokenizer, capacity.vocab_size)
    params = _params(
        req, s, capacity, longest, req.max_tokens, 16, req.logprobs, prompt_lp, grammar, banned
    )
    job = Job(prompts, params, _spec(req, s, capacity), req.n, stop, req.echo)
    job.prompt_logprobs = req.prompt_logprobs
    return _output_options(job, req)


def _check_best_of(req: _Sampling) -> None:
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        raise bad("best_of other than n is not supported", "best_of", "unsupported_parameter")


def _output_options(job: Job, req: _Sampling) -> Job:
    """How the output's text is made: vLLM's include_stop_str_in_output, skip_special_tokens
    and return_tokens_as_token_ids."""
    job.include_stop = req.include_stop_str_in_output
    job.skip_special = req.skip_special_tokens
    job.token_ids = bool(req.return_tokens_as_token_ids)
    return job


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
    kwargs = template_kwargs(req)
    if not generation_prompt:  # (/tokenize's add_generation_prompt false)
        kwargs["add_generation_prompt"] = False
    try:  # a template may refuse the conversation (e.g. role order)
        if req.add_special_tokens:  # vLLM's: BOS etc. on top of what the template writes
            text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
            return list(tokenizer(text, add_special_tokens=True)["input_ids"])
        out = tokenizer.apply_chat_template(messages, return_dict=True, **kwargs)
        return list(out["input_ids"])
    except TemplateError as e:  # the template's own message (raise_exception) is for the user
        why = str(e)[:200]
    except Exception:  # anything else is internal: to the log, not to the client
        log.warning("the chat template failed", exc_info=True)
        why = "the conversation is not valid"
    raise bad(f"messages could not be rendered by the model's chat template: {why}", "messages")


# apply_chat_template's own parameters: chat_template_kwargs may not set them
TEMPLATE_RESERVED = frozenset(
    {
        "conversation", "messages", "tools", "chat_template", "tokenize", "padding",
        "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs",
        "return_assistant_tokens_mask", "sanitize_control_tokens",
    }
)  # fmt: skip


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """What the chat template renders with, as vLLM passes it: add_generation_prompt,
    continue_final_message, documents, reasoning_effort, then chat_template_kwargs (which may
    override the first four, not the renderer's own parameters)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise bad(
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    kwargs: dict[str, Any] = {
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
    }
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
    extra = req.chat_template_kwargs or {}
    if wrong := sorted(TEMPLATE_RESERVED & set(extra)):
        raise bad(f"chat_template_kwargs may not set {', '.join(wrong)}", "chat_template_kwargs")
    return kwargs | extra


def _chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's text, when it is the assistant's (the role
    that answers), leads the answer."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, list):
        return "".join(part.text for part in last.content)
    return last.content


def chat_job(req: ChatCompletionRequest, ctx: JobContext) -> Job:
    tokenizer, s, capacity, grammars = ctx.tokenizer, ctx.settings, ctx.capacity, ctx.grammars
    _check_n(req, s)
    refuse_unsupported(req)
    _check_best_of(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs requires logprobs=true", "top_logprobs")
    tools = tool_mode(req)
    ids = _truncated(chat_prompt(req, tokenizer, tools), req)
    stop = _stops(req, s)
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    grammar = grammar_for(req, grammars, tools.schema if tools is not None else None)
    banned = _bad_words(req, tokenizer, capacity.vocab_size)
    prompt_lp = _prompt_logprobs(req, s)
    params = _params(
        req, s, capacity, len(ids), max_tokens, None, logprobs, prompt_lp, grammar, banned
    )
    job = Job([ids], params, _spec(req, s, capacity), req.n, stop, tools=tools)
    job.prompt_logprobs = prompt_lp
    job.chat_echo = _chat_echo(req) if tools is None else ""
    return _output_options(job, req)
