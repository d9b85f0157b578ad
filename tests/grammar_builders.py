"""Grammar tests' engines: tiny models that speak bytes, with llguidance's byte tokenizer
(tests/engine/round/test_grammar.py, test_forced.py)."""

from __future__ import annotations

from engine.sampling.grammar import GrammarCompiler
from tests.helpers import engine_for


def engine(byte_models, byte_tok, drafter, slots=4, max_len=16, **kw):
    grammars = GrammarCompiler(None, byte_tok.vocab_size)
    grammars._tokenizer = byte_tok  # the tiny model speaks bytes
    e = engine_for(
        byte_models, drafter, slots=slots, chunk=10**6, max_len=max_len, max_prefill=slots, **kw
    )
    e.grammars = grammars
    return e


def text(ids: list[int]) -> str:
    return bytes(ids).decode(errors="replace")
