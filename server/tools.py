"""Tool calling for any model, its chat template aware of tools or not (SmolLM2's is not): the
tools go into the system prompt, and the output is held to a JSON-schema grammar -- the way
llama.cpp's "generic" format and vLLM's grammar-based tool choice do it.

The model answers one JSON object:
  * ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` -- calls (one at most unless
    ``parallel_tool_calls``), each ``arguments`` held to that tool's ``parameters`` schema;
  * ``{"response": "..."}`` -- a plain answer (only under ``tool_choice: "auto"``).
``required`` allows calls only; a named choice allows one call of that tool; ``none`` (or no
tools) leaves the output free. Earlier turns are rendered back in the same shape: an assistant
message with ``tool_calls`` as its JSON, a ``tool`` message as a turn of role ``tool``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import bad
from .protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall
from .tool_stream import ToolOutputReader


@dataclass(frozen=True)
class ToolMode:
    """What a chat job's output is: the schema it is held to, and how to read it."""

    schema: dict
    named: bool  # tool_choice named one function (OpenAI then finishes with "stop")


def _call_schema(tool) -> dict:
    f = tool.function
    return {
        "type": "object",
        "properties": {
            "name": {"const": f.name},
            "arguments": f.parameters or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_mode(req: ChatCompletionRequest) -> ToolMode | None:
    """The request's tool mode (None: free text); 400 for an inconsistent tool request."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad("tool_choice requires tools", "tool_choice")
        return None
    if choice == "none":
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise bad("tool names must be unique", "tools")
    tools = req.tools
    if not isinstance(choice, str) and choice is not None:
        tools = [t for t in req.tools if t.function.name == choice.function.name]
        if not tools:
            raise bad(f"tool_choice names an unknown tool: {choice.function.name}", "tool_choice")
    calls: dict = {"type": "array", "items": {"anyOf": [_call_schema(t) for t in tools]}}
    calls["minItems"] = 1
    if req.parallel_tool_calls is False or not isinstance(choice, str | None):
        calls["maxItems"] = 1
    schema: dict = {
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if choice in (None, "auto"):
        answer = {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
            "additionalProperties": False,
        }
        schema = {"anyOf": [schema, answer]}
    return ToolMode(schema, named=not isinstance(choice, str | None))


def system_prompt(req: ChatCompletionRequest, mode: ToolMode) -> str:
    """The tools and the answer format, for the system prompt."""
    assert req.tools is not None
    listing = [
        {
            "name": t.function.name,
            "description": t.function.description or "",
            "parameters": t.function.parameters or {"type": "object"},
        }
        for t in req.tools
    ]
    how = 'To call tools, answer {"tool_calls": [{"name": <tool name>, "arguments": {...}}]}'
    if "anyOf" in mode.schema:
        how += '; to answer without a tool, answer {"response": <your answer>}'
    return f"You can use these tools:\n{json.dumps(listing)}\n{how}."


def rendered(m: ChatMessage, content: str) -> dict:
    """A message for the chat template: earlier tool calls as the JSON the model writes."""
    if m.role == "assistant" and m.tool_calls:
        calls = [
            {"name": c.function.name, "arguments": _arguments(c.function.arguments)}
            for c in m.tool_calls
        ]
        return {"role": "assistant", "content": json.dumps({"tool_calls": calls})}
    return {"role": "system" if m.role == "developer" else m.role, "content": content}


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise bad("tool_calls arguments must be a JSON string", "messages") from None


def read_output(text: str) -> tuple[str | None, list[ToolCall] | None]:
    """(content, tool calls) of a tool-mode output, read the way a stream reads it
    (server/tool_stream.py), so both answers agree: the calls whose name is whole, each with its
    arguments' raw text (cut short with the output, as OpenAI's are at ``length``); else a plain
    answer's text; else, when neither began (cut early), the text itself as content."""
    reader = ToolOutputReader()
    reader.feed(text)
    if calls := reader.readable_calls():
        fns = [FunctionCall(name=str(c.name), arguments=reader.arguments(c)) for c in calls]
        return None, [ToolCall(id=c.id, function=f) for c, f in zip(calls, fns)]
    if reader.answering:
        return reader.take_content(), None
    return text, None


def finish_reason(mode: ToolMode, calls: list[ToolCall] | None, engine_reason: str | None):
    if calls and not mode.named and engine_reason != "length":  # cut short: "length" stays
        return "tool_calls"
    return engine_reason
