"""Speculation modes of a load run, and the interleaved order of runs.

A mode names what each request sends in specd's per-request ``speculation`` option:
``default`` or ``on``: nothing (the server's default); ``off``: ``{"enabled": false}``; ``kN``: a
fixed K = N (``{"k": N}``). A server other than specd only ever needs ``default``.

Interleaving: with several modes (or servers, or tools) every repeat runs each one once, the order
reversed every other repeat (A B, B A, A B, ...), so that a drift of the machine's load hits all of
them alike.
"""

from __future__ import annotations

AB = "on,off"  # what --ab means


def spec_option(mode: str) -> dict | None:
    """The ``speculation`` body field of ``mode``; ValueError for an unknown name."""
    if mode in ("default", "on"):
        return None
    if mode == "off":
        return {"enabled": False}
    if mode.startswith("k") and mode[1:].isdigit():
        return {"k": int(mode[1:])}
    raise ValueError(f"unknown mode {mode!r} (default, on, off, kN)")


def parse_modes(text: str) -> list[str]:
    """The modes of a comma list, each checked (ValueError on the first unknown one)."""
    modes = text.split(",")
    for m in modes:
        spec_option(m)
    return modes


def ordered(names: list[str], repeat: int) -> list[str]:
    """The order of ``names`` in repeat number ``repeat`` (reversed on odd repeats)."""
    return list(names) if repeat % 2 == 0 else list(reversed(names))


def interleaved(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, name) pairs of ``repeats`` repeats in the alternating order."""
    return [(rep, name) for rep in range(repeats) for name in ordered(names, rep)]
