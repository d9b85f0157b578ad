"""What a load run sends: MT-Bench (first turns, or both turns as one conversation), HumanEval
completions, or any JSONL file of prompts.

A workload spec is ``mtbench``, ``mtbench:2`` (both turns: the second user turn is sent after the
first answer, in the same conversation), ``humaneval`` or ``jsonl:PATH``. A JSONL line holds either
``{"prompt": "..."}`` (completions endpoint) or ``{"messages": [...]}`` (chat), with optional
``id``, ``category`` and ``max_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from prompts import sets


@dataclass(frozen=True)
class Item:
    id: str
    category: str
    prompt: str | None = None  # completions endpoint
    messages: tuple[dict, ...] = ()  # chat endpoint
    followups: tuple[str, ...] = ()  # further user turns of one conversation (chat only)
    max_tokens: int | None = None  # per-item override of the run's max_tokens

    @property
    def endpoint(self) -> str:
        return "completions" if self.prompt is not None else "chat"

    def as_endpoint(self, endpoint: str) -> Item:
        """The same text sent to another endpoint ("auto" keeps the item's own)."""
        if endpoint in ("auto", self.endpoint):
            return self
        if endpoint == "chat":
            return Item(
                self.id,
                self.category,
                messages=({"role": "user", "content": self.prompt},),
                max_tokens=self.max_tokens,
            )
        if endpoint == "completions":
            text = "\n\n".join(str(m["content"]) for m in self.messages)
            return Item(self.id, self.category, prompt=text, max_tokens=self.max_tokens)
        raise ValueError(f"unknown endpoint {endpoint!r} (auto, chat, completions)")


def _mtbench(turns: int) -> list[Item]:
    root = sets.mtbench_question_file()
    out = []
    for line in root.read_text().splitlines():
        q = json.loads(line)
        out.append(
            Item(
                f"mtbench-{q['question_id']}",
                q["category"],
                messages=({"role": "user", "content": q["turns"][0]},),
                followups=tuple(q["turns"][1:turns]),
            )
        )
    return out


def _jsonl(path: str) -> list[Item]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        d = json.loads(line)
        common = dict(
            id=str(d.get("id", f"line-{n + 1}")),
            category=str(d.get("category", "jsonl")),
            max_tokens=d.get("max_tokens"),
        )
        if "messages" in d:
            out.append(Item(messages=tuple(d["messages"]), **common))
        elif "prompt" in d:
            out.append(Item(prompt=str(d["prompt"]), **common))
        else:
            raise ValueError(f"{path}:{n + 1}: a line needs 'prompt' or 'messages'")
    return out


def load(spec: str) -> list[Item]:
    """Items of one workload spec (see the module docstring)."""
    name, _, arg = spec.partition(":")
    if name == "mtbench":
        return _mtbench(int(arg or 1))
    if name == "humaneval":
        return [Item(p.id, p.category, prompt=p.text) for p in sets.human_eval()]
    if name == "jsonl":
        return _jsonl(arg)
    raise ValueError(f"unknown workload {spec!r} (mtbench, mtbench:2, humaneval, jsonl:PATH)")


def build(specs: list[str], per_category: int | None = None, endpoint: str = "auto") -> list[Item]:
    """Items of several workloads, optionally the first ``per_category`` of each category,
    interleaved category by category so that any prefix of the list mixes the workloads."""
    items = [it.as_endpoint(endpoint) for s in specs for it in load(s)]
    by_cat: dict[str, list[Item]] = {}
    for it in items:
        by_cat.setdefault(it.category, []).append(it)
    if per_category is not None:
        by_cat = {c: v[:per_category] for c, v in by_cat.items()}
    out, i = [], 0
    while any(i < len(v) for v in by_cat.values()):
        out += [v[i] for v in by_cat.values() if i < len(v)]
        i += 1
    return out
