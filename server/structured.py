"""Structured outputs: the request's ``response_format`` (OpenAI's) or ``structured_outputs``
(the vLLM-style extension) as one llguidance grammar for the engine (engine/sampling/grammar.py),
checked against the tokenizer before admission (a grammar that cannot compile answers 400).

JSON is generated compact (no free whitespace between tokens): a small model given the freedom
spends tokens on spaces and newlines. ``json_object`` is any JSON object.
"""

from __future__ import annotations

import json

from engine.api import GrammarCompiler

from .errors import bad
from .protocol import _Sampling

JSON_OPTIONS = {"whitespace_flexible": False}


def schema_json(schema) -> str:
    import llguidance

    options = JSON_OPTIONS  # (a JsonCompileOptions TypedDict)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]


def _requested(req: _Sampling) -> list[tuple[str, str]]:
    """(param, grammar) for every constraint the request sets."""
    from llguidance import LLMatcher

    out = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", schema_json({"type": "object"})))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise bad("response_format.json_schema is required", "response_format.json_schema")
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        out.append(("response_format", schema_json(schema)))
    so = req.structured_outputs
    if so is not None:
        if so.json_ is not None:
            schema = json.loads(so.json_) if isinstance(so.json_, str) else so.json_
            out.append(("structured_outputs.json", schema_json(schema)))
        if so.regex is not None:
            out.append(("structured_outputs.regex", LLMatcher.grammar_from_regex(so.regex)))
        if so.grammar is not None:
            out.append(("structured_outputs.grammar", LLMatcher.grammar_from_lark(so.grammar)))
        if so.choice is not None:
            alts = " | ".join(json.dumps(c) for c in so.choice)
            out.append(("structured_outputs.choice", LLMatcher.grammar_from_lark(f"start: {alts}")))
    return out


def grammar_for(
    req: _Sampling, grammars: GrammarCompiler | None, tools: dict | None = None
) -> str | None:
    """The request's one grammar (None: free text); ``tools``: the schema of a tool-calling
    answer (server/tools.py). 400 for two constraints or a bad one, or for any where the engine
    has no grammar compiler (``grammars`` None)."""
    try:
        found = _requested(req)
        if tools is not None:
            found.append(("tools", schema_json(tools)))
    except ValueError as e:  # a schema / regex / grammar llguidance cannot read
        raise bad(
            f"structured output cannot be compiled: {str(e)[:300]}", "response_format"
        ) from None
    if not found:
        return None
    if len(found) > 1:
        raise bad("set one of response_format and structured_outputs", found[1][0])
    param, grammar = found[0]
    if grammars is None:
        raise bad("structured output is not available on this server", param)
    error = grammars.check(grammar)
    if error:
        raise bad(f"{param} cannot be compiled: {error[:300]}", param)
    return grammar
