"""Structured outputs: the request's ``response_format`` (OpenAI's), ``structured_outputs`` or
vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` as one
llguidance grammar for the engine (engine/sampling/grammar.py),
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


def _grammar(kind: str, value) -> str:
    """One constraint as an llguidance grammar: a JSON schema (an object or its JSON text), a
    regex, a Lark grammar, or a choice of strings."""
    from llguidance import LLMatcher

    if kind == "json":
        return schema_json(json.loads(value) if isinstance(value, str) else value)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(value)
    alts = " | ".join(json.dumps(c) for c in value)
    return LLMatcher.grammar_from_lark(f"start: {alts}")


def _named(param: str, kind: str, value) -> str:
    """:func:`_grammar`, a 400 naming ``param`` where it cannot be read."""
    try:
        return _grammar(kind, value)
    except ValueError as e:
        raise bad(f"{param} cannot be compiled: {str(e)[:300]}", param) from None


def _requested(req: _Sampling) -> list[tuple[str, str]]:
    """(param, grammar) for every constraint the request sets."""
    out = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", schema_json({"type": "object"})))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise bad("response_format.json_schema is required", "response_format.json_schema")
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        out.append(("response_format", schema_json(schema)))
    guided = {  # vLLM's guided_* fields, read as the structured_outputs ones
        "json": req.guided_json,
        "regex": req.guided_regex,
        "grammar": req.guided_grammar,
        "choice": req.guided_choice,
    }
    for kind, value in guided.items():
        if value is not None:
            out.append((f"guided_{kind}", _named(f"guided_{kind}", kind, value)))
    so = req.structured_outputs
    if so is not None:
        fields = {"json": so.json_, "regex": so.regex, "grammar": so.grammar, "choice": so.choice}
        for kind, value in fields.items():
            if value is not None:
                out.append((f"structured_outputs.{kind}", _grammar(kind, value)))
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
        raise bad(
            "set one of response_format, structured_outputs and the guided_* fields", found[1][0]
        )
    param, grammar = found[0]
    if grammars is None:
        raise bad("structured output is not available on this server", param)
    error = grammars.check(grammar)
    if error:
        raise bad(f"{param} cannot be compiled: {error[:300]}", param)
    return grammar
