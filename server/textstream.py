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
    def __init__(self, tokenizer, prompt_ids: list[int] | None = None):
        self.tok = tokenizer
        ctx = list(prompt_ids or [])[-CONTEXT_TOKENS:]
        self.ids = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

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
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, text: str, final: bool = False) -> str:
        """Text that is safe to send now. After a stop string is seen, ``stopped`` is True and
        everything from the stop string on is dropped."""
        if self.stopped:
            return ""
        buf = self.pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.pending = True, ""
            return buf[:cut]
        if final or self.hold == 0:
            self.pending = ""
            return buf
        keep = min(self.hold, len(buf))
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]
