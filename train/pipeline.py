"""``specd train-drafter [--config FILE]``: the whole recipe in one command.

Default config: ``configs/train/smollm2-eagle3.yaml``. Stages, in order, each resumable (run
the command again and it goes on where it stopped):
  1. ``distill`` of the ``e`` bucket (the evaluation rows), then of the training buckets
     (train/distill.py: the target answers ShareGPT prompts through specd's engine);
  2. ``original`` (when the config has that section; train/original.py): ShareGPT's own
     answers of the training buckets, more rows for the head at no generation cost;
  3. ``fit`` (train/fit.py): the EAGLE-3 head on those answers, written to ``fit.out``.

The config's ``distill`` section holds options shared by both splits plus ``eval:`` / ``train:``
sub-sections for per-split ones; ``fit`` holds fit's options. Keys are the command-line options
of ``python -m train distill`` / ``fit`` with ``-`` written ``_`` (``max_tokens: 256``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import distill, fit, original


def _argv(options: dict[str, Any]) -> list[str]:
    """``{"max_tokens": 256, "bf16": True}`` -> ``["--max-tokens", "256", "--bf16"]``."""
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        else:
            out += [flag, str(value)]
    return out


def _namespace(add_arguments, options: dict[str, Any]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(_argv(options))


def stages(config: dict[str, Any]) -> list[tuple[str, argparse.Namespace]]:
    """The recipe's stages as (name, parsed options), in the order they run."""
    d = dict(config.get("distill") or {})
    per_split = {s: d.pop(s, None) or {} for s in ("eval", "train")}
    out = []
    for split in ("eval", "train"):
        if per_split[split].get("skip"):
            continue
        opts = d | {k: v for k, v in per_split[split].items() if k != "skip"} | {"split": split}
        out.append((f"distill {split}", _namespace(distill.add_arguments, opts)))
    if config.get("original") is not None:
        opts = {"out": d.get("out", ".cache/distill")} | dict(config["original"] or {})
        out.append(("original train", _namespace(original.add_arguments, opts)))
    fit_opts = dict(config.get("fit") or {})
    fit_opts.setdefault("data", d.get("out", ".cache/distill"))
    out.append(("fit", _namespace(fit.add_arguments, fit_opts)))
    return out


def run(args: argparse.Namespace) -> None:
    import yaml

    config = yaml.safe_load(Path(args.config).read_text()) or {}
    for name, ns in stages(config):
        if args.only and not name.startswith(args.only):
            continue
        print(f"[train-drafter] {name}", flush=True)
        stage = name.split()[0]
        {"distill": distill.run, "original": original.run, "fit": fit.run}[stage](ns)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default="configs/train/smollm2-eagle3.yaml")
    ap.add_argument("--only", choices=["distill", "original", "fit"], help="run only these stages")
