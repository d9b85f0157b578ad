"""Token ids -> text, incrementally: the detokenizer and the stop-string filter.

IncrementalDetokenizer decodes a sliding window (a few tokens of context + the new ones) and
emits the text only once it no longer ends in an incomplete UTF-8 sequence (U+FFFD), so
multi-byte characters split across tokens are never garbled and the concatenated deltas equal
``tokenizer.decode(all_ids)``. StopFilter holds back the last ``max(len(stop)) - 1`` characters
so that a stop string spanning chunks or tokens is caught before any part of it is sent.
"""

from __future__ import annotations

CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ):
        self.tok, self.skip_special = tokenizer, skip_special_tokens
        ctx = list(prompt_ids or [])[-CONTEXT_TOKENS:]
        self.ids = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(
            ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False
        )

    def add(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and (final or not text.endswith("\ufffd")):
            delta = text[len(prefix) :]
            # keep a little context before the read point so word-initial spaces decode right
            self.prefix_offset = max(self.read_offset, len(self.ids) - CONTEXT_TOKENS)
            self.prefix_offset = min(self.prefix_offset, len(self.ids))
            self.read_offset = len(self.ids)
            return delta
        return ""


class StopFilter:
    """``include``: the stop string itself ends the text (vLLM's include_stop_str_in_output)."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped it (vLLM's stop_reason)

    def feed(self, text: str, final: bool = False, search: bool = True) -> str:
        """Text that is safe to send now. After a stop string is seen, ``stopped`` is True and
        everything from the stop string on (``include``: after it) is dropped. A stop string
        counts where it ends in ``text``; ``search`` false (vLLM's min_tokens not reached):
        none does, the text is held back as usual."""
        if self.stopped:
            return ""
        buf = self.pending + text
        found = [
            (i, len(s), s)
            for s in self.stops
            if search and (i := buf.find(s, max(0, len(self.pending) - len(s) + 1))) >= 0
        ]
        if found:
            cut, size, self.matched = min(found, key=lambda f: f[0])
            self.stopped, self.pending = True, ""
            return buf[: cut + size] if self.include else buf[:cut]
        if final or self.hold == 0:
            self.pending = ""
            return buf
        keep = min(self.hold, len(buf))
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]
