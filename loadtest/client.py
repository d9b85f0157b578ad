"""One request (or one multi-turn conversation) through the official ``openai`` async client,
streamed, with its timings.

Per request: time to first token (first chunk with text), end-to-end latency, inter-token latency
per chunk (gaps between text chunks) and per token, output tokens from ``usage`` (asked for with
``stream_options.include_usage``), specd's ``usage.speculation`` extension when present, and the
error if one happened. A server may send several tokens in one chunk (specd sends what one
speculative round produced); the per-token gaps spread a chunk's gap over its tokens: a chunk of n
tokens after a gap g counts n times g/n. n comes from the usage total split over the chunks in
proportion to their text length (at least 1 per chunk): exact when every chunk is one token, an
estimate otherwise, and the same for every server.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import openai


@dataclass
class Options:
    model: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    timeout: float = 300.0


@dataclass
class Record:
    id: str
    category: str
    turn: int = 0
    start: float = 0.0  # seconds since the run began
    ttft: float | None = None
    e2e: float | None = None
    itl_chunk: list[float] = field(default_factory=list)
    itl_token: list[float] = field(default_factory=list)
    chunks: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    drafted: int | None = None  # specd's usage.speculation, None from other servers
    accepted: int | None = None
    passes: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""


def tokens_per_chunk(lengths: list[int], total: int) -> list[int]:
    """Split ``total`` tokens over chunks by text length, at least one per chunk."""
    chars = sum(lengths)
    if not lengths:
        return []
    if total <= len(lengths) or chars == 0:
        return [1] * len(lengths)
    out, given, seen = [], 0, 0
    for n in lengths:
        seen += n
        upto = round(total * seen / chars)
        out.append(max(1, upto - given))
        given += out[-1]
    return out


async def _stream(
    client: openai.AsyncOpenAI,
    opts: Options,
    rec: Record,
    *,
    prompt=None,
    messages=None,
    max_tokens: int,
    extra: dict,
    t_run: float,
) -> None:
    common = dict(
        model=opts.model,
        stream=True,
        max_tokens=max_tokens,
        temperature=opts.temperature,
        stream_options={"include_usage": True},
        extra_body=extra or None,
        timeout=opts.timeout,
    )
    if opts.seed is not None:
        common["seed"] = opts.seed
    t0 = time.perf_counter()
    rec.start = t0 - t_run
    if prompt is not None:
        stream = await client.completions.create(prompt=prompt, **common)
    else:
        stream = await client.chat.completions.create(messages=list(messages), **common)
    times, lengths, parts, usage = [], [], [], None
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text = choice.text if prompt is not None else (choice.delta.content or "")
        if choice.finish_reason:
            rec.finish_reason = choice.finish_reason
        if text:
            times.append(now)
            lengths.append(len(text))
            parts.append(text)
    end = time.perf_counter()
    rec.text = "".join(parts)
    rec.e2e = end - t0
    rec.chunks = len(times)
    rec.ttft = (times[0] if times else end) - t0
    if usage is not None:
        rec.prompt_tokens = usage.prompt_tokens
        rec.output_tokens = usage.completion_tokens
        spec = (usage.model_extra or {}).get("speculation")
        if spec:
            rec.drafted, rec.accepted = spec["drafted_tokens"], spec["accepted_tokens"]
            rec.passes = spec["target_passes"]
    else:  # a server without usage in streams: count chunks
        rec.output_tokens = len(times)
    counts = tokens_per_chunk(lengths, rec.output_tokens)
    for prev, now, n in zip(times, times[1:], counts[1:]):
        gap = now - prev
        rec.itl_chunk.append(gap)
        rec.itl_token += [gap / n] * n


def _error_text(e: BaseException) -> str:
    if isinstance(e, openai.APIStatusError):
        return f"HTTP {e.status_code}: {str(e)[:200]}"
    return f"{type(e).__name__}: {str(e)[:200]}"


async def run_item(
    client: openai.AsyncOpenAI,
    item,
    opts: Options,
    spec: dict | None,
    t_run: float,
    records: list[Record],
) -> None:
    """Send one workload item (every turn of a conversation); appends one record per turn to
    ``records`` as it starts, so a request cancelled by the run's time limit is still counted."""
    extra = {"speculation": spec} if spec is not None else {}
    max_tokens = item.max_tokens or opts.max_tokens
    messages = list(item.messages)
    rec = None
    for turn in range(1 + len(item.followups)):
        prev, rec = rec, Record(item.id, item.category, turn)
        records.append(rec)
        if turn:
            messages += [
                {"role": "assistant", "content": prev.text},
                {"role": "user", "content": item.followups[turn - 1]},
            ]
        try:
            await _stream(
                client,
                opts,
                rec,
                prompt=item.prompt,
                messages=messages,
                max_tokens=max_tokens,
                extra=extra,
                t_run=t_run,
            )
        except asyncio.CancelledError:
            rec.error = "cancelled: run time limit"
            raise
        except Exception as e:  # noqa: BLE001 - every failure is a measured error, not a crash
            rec.error = _error_text(e)
        if rec.error:
            break
