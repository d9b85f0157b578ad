"""The series names and label names a PromQL expression reads: enough of PromQL's grammar for
specd's rules, alerts and dashboard queries (selectors, functions, aggregations with by/without,
vector matching with on/ignoring/group_*, ranges, strings, numbers). Anything else it does not
know fails loudly rather than passing unread."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TOKEN = re.compile(
    r"""
     (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    |(?P<range>\[[^\]]*\])
    |(?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
    |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    |(?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}])
    |(?P<ws>\s+)
    """,
    re.X,
)
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING | {"and", "or", "unless", "bool", "offset"}


@dataclass
class Selector:
    name: str | None
    matchers: list[tuple[str, str, str]] = field(default_factory=list)  # (label, op, value)


@dataclass
class Reads:
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)  # labels named in by/without/on/ignoring

    @property
    def names(self) -> set[str]:
        return {s.name for s in self.selectors if s.name}


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"unreadable PromQL at {pos}: {expr[pos : pos + 20]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
    return out


def reads(expr: str) -> Reads:
    toks, r, i = tokens(expr), Reads(), 0

    def peek(j: int) -> str | None:
        return toks[j][1] if j < len(toks) else None

    def matchers(j: int) -> tuple[list[tuple[str, str, str]], int]:
        """From the token after '{' to the one after '}'."""
        found = []
        while peek(j) != "}":
            label, op, value = toks[j], toks[j + 1], toks[j + 2]
            if label[0] != "ident" or op[1] not in ("=", "!=", "=~", "!~") or value[0] != "str":
                raise ValueError(f"unreadable matcher in {expr!r}")
            found.append((label[1], op[1], value[1][1:-1]))
            j += 3
            if peek(j) == ",":
                j += 1
        return found, j + 1

    while i < len(toks):
        kind, text = toks[i]
        if kind == "ident" and text in GROUPING:
            i += 1
            if peek(i) == "(":
                i += 1
                while peek(i) != ")":
                    if toks[i][0] == "ident":
                        r.grouping.add(toks[i][1])
                    i += 1
                i += 1
            continue
        if kind == "ident" and text in KEYWORDS:
            i += 1
        elif kind == "ident" and (peek(i + 1) == "(" or peek(i + 1) in ("by", "without")):
            i += 1  # a function or an aggregation
        elif kind == "ident":
            sel = Selector(text)
            i += 1
            if peek(i) == "{":
                sel.matchers, i = matchers(i + 1)
            r.selectors.append(sel)
        elif text == "{":
            found, i = matchers(i + 1)
            name = next((v for lab, op, v in found if lab == "__name__" and op == "="), None)
            r.selectors.append(Selector(name, found))
        else:
            i += 1
    return r


LABEL_VALUES = re.compile(r"^\s*label_values\((?P<series>.*),\s*(?P<label>[A-Za-z_]\w*)\s*\)\s*$")


def variable_reads(query: str) -> Reads:
    """A Grafana variable's ``label_values(series, label)``: the series' reads plus the label."""
    m = LABEL_VALUES.match(query)
    if not m:
        raise ValueError(f"not label_values(series, label): {query!r}")
    r = reads(m["series"])
    r.grouping.add(m["label"])
    return r
