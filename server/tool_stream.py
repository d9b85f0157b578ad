"""A tool-mode output read as it grows (server/tools.py's format), so a stream can send OpenAI's
``delta.tool_calls`` as the model writes them: a call's ``index``, ``id`` and ``name`` once its
name is complete and its arguments have begun, then its ``arguments`` in pieces, raw as the model
wrote them; and a plain answer's ``{"response": "..."}`` text as decoded ``content`` pieces.

It only follows the JSON's nesting (containers, member keys, strings and their escapes) to find
where those values begin and end; it validates nothing (the grammar held the output to its
schema, and :func:`server.tools.read_output` parses the whole). Invariants: a call's arguments
pieces concatenate to exactly the raw text of its ``arguments`` value, which is what the
non-streamed answer carries too; a content piece never splits an escape or a surrogate pair.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class StreamedCall:
    """One call as far as it has been read: ``arguments`` spans ``args_start`` to ``args_end``
    (exclusive; None while open) of the text."""

    name: str | None = None
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    args_start: int | None = None
    args_end: int | None = None
    sent: int = 0  # characters of its arguments already handed out
    announced: bool = False  # its id and name went out


@dataclass
class _Level:
    array: bool
    path: tuple  # where this container sits: keys and indices from the top
    key: str | None = None  # an object's current member
    index: int = 0  # an array's current element
    expect_key: bool = True  # an object: the next string is a key


class ToolOutputReader:
    """Feed the output's text (:meth:`feed`); :meth:`take` hands out what is new."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: dict[int, StreamedCall] = {}
        self._stack: list[_Level] = []
        self._in_string, self._escape = False, False
        self._string_start = 0
        self._string_path: tuple | None = None  # a string value's path (None: a key)
        self._response_start: int | None = None  # the answer string's first character
        self._response_end: int | None = None
        self._response_sent = ""  # decoded answer text already handed out

    def feed(self, chunk: str) -> None:
        start = len(self.text)
        self.text += chunk
        for i in range(start, len(self.text)):
            self._char(i, self.text[i])

    def _value_path(self) -> tuple:
        if not self._stack:
            return ()
        top = self._stack[-1]
        return top.path + ((top.index,) if top.array else (top.key,))

    def _char(self, i: int, ch: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                self._string_done(i)
            return
        top = self._stack[-1] if self._stack else None
        if ch == '"':
            self._in_string, self._string_start = True, i
            is_key = top is not None and not top.array and top.expect_key
            self._string_path = None if is_key else self._value_path()
            if self._string_path == ("response",):
                self._response_start = i + 1
        elif ch in "{[":
            path = self._value_path()
            if len(path) == 3 and path[0] == "tool_calls" and path[2] == "arguments":
                self._call(path[1]).args_start = i
            self._stack.append(_Level(array=ch == "[", path=path))
        elif ch in "}]":
            if self._stack:
                done = self._stack.pop()
                p = done.path
                if len(p) == 3 and p[0] == "tool_calls" and p[2] == "arguments":
                    self._call(p[1]).args_end = i + 1
        elif top is not None and ch == ":":
            top.expect_key = False
        elif top is not None and ch == ",":
            if top.array:
                top.index += 1
            else:
                top.expect_key = True

    def _string_done(self, end: int) -> None:
        raw = self.text[self._string_start : end + 1]
        if self._string_path is None:  # a member key
            top = self._stack[-1]
            top.key = json.loads(raw, strict=False)
            return
        p = self._string_path
        if len(p) == 3 and p[0] == "tool_calls" and p[2] == "name":
            self._call(p[1]).name = json.loads(raw, strict=False)
        if p == ("response",):
            self._response_end = end

    def _call(self, index) -> StreamedCall:
        return self.calls.setdefault(index, StreamedCall())

    def arguments(self, call: StreamedCall) -> str:
        """The call's arguments as read so far (all of them once ``args_end`` is set)."""
        if call.args_start is None:
            return ""
        end = call.args_end if call.args_end is not None else len(self.text)
        return self.text[call.args_start : end]

    @property
    def answering(self) -> bool:
        """The output is a plain answer: its ``response`` string has begun."""
        return self._response_start is not None

    def readable_calls(self) -> list[StreamedCall]:
        """The calls whose name is whole and whose arguments have begun, in order."""
        calls = [self.calls[i] for i in sorted(self.calls)]
        return [c for c in calls if c.name is not None and c.args_start is not None]

    @property
    def streamed_anything(self) -> bool:
        """A call or some answer text has been handed out."""
        return bool(self._response_sent) or any(c.announced for c in self.calls.values())

    def take_calls(self) -> list[tuple[int, StreamedCall, bool, str]]:
        """(index, call, first, new arguments text) for each call with something new: ``first``
        when its id and name go out now (with the arguments so far)."""
        out = []
        for call in self.readable_calls():  # once its name is whole and its arguments began
            index = next(i for i, c in self.calls.items() if c is call)
            args = self.arguments(call)
            new, first = args[call.sent :], not call.announced
            call.sent, call.announced = len(args), True
            if new or first:
                out.append((index, call, first, new))
        return out

    def take_content(self) -> str:
        """The plain answer's text decoded since the last call (a trailing escape or half a
        surrogate pair waits for the rest)."""
        if self._response_start is None:
            return ""
        end = self._response_end if self._response_end is not None else len(self.text)
        raw = self.text[self._response_start : end]
        cut = raw.rfind("\\")
        if self._response_end is None and cut >= 0:
            escape = raw[cut:]
            complete = len(escape) >= 2 and (escape[1] != "u" or len(escape) >= 6)
            if not complete and not _escaped_backslash(raw, cut):
                raw = raw[:cut]
        text = json.loads(f'"{raw}"', strict=False)
        if self._response_end is None and text and "\ud800" <= text[-1] <= "\udbff":
            text = text[:-1]  # the high half of a pair: its low half is still to come
        new = text[len(self._response_sent) :]
        self._response_sent = text
        return new


def _escaped_backslash(raw: str, at: int) -> bool:
    """The backslash at ``at`` is itself escaped (an odd run of backslashes before it)."""
    run = len(raw[:at]) - len(raw[:at].rstrip("\\"))
    return run % 2 == 1
