"""llguidance against xgrammar on SmolLM2's vocabulary (issue 19's choice of grammar engine):
tokenizer setup, a schema's compile (the first includes xgrammar's warm-up) and the time to fill
one token mask while walking a real output of each of loadtest/bench/structured.py's schemas.
xgrammar is not a dependency of specd: install it beside the venv with

    pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xg python -m loadtest.bench.grammar_engines
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import llguidance
import llguidance.hf
import llguidance.torch as llt
import transformers
import xgrammar as xgr  # type: ignore[import-not-found]

from engine.config import EngineConfig
from engine.model.loader import prepare
from loadtest.bench.structured import SCHEMAS
from server.structured import schema_json

V = 49152
OUTPUTS = {
    "person": '{"name":"Alice Smith","age":34,"email":"al@example.com","skills":["go","c"]}',
    "order": '{"id":17,"status":"shipped","items":[{"sku":"BK-1","qty":2},{"sku":"BK-2","qty":1}]}',
}


def walk(ids: list[int], fill: Callable[[], None], take: Callable[[int], bool]) -> list[float]:
    """Seconds to fill each position's mask along ``ids``."""
    times = []
    for i in ids:
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        assert take(i)
    return times


def main() -> None:
    cfg = EngineConfig.from_yaml("configs/default.yaml")
    folder = prepare(cfg.model.source, cfg.cache_dir, progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    t = time.perf_counter()
    ll = llguidance.hf.from_tokenizer(tok, V)
    ll_setup = time.perf_counter() - t
    t = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V))
    xg_setup = time.perf_counter() - t
    print(
        f"tokenizer setup: llguidance {ll_setup * 1000:.0f} ms, xgrammar {xg_setup * 1000:.0f} ms"
        f" (SmolLM2, vocab {V}); compact JSON in both"
    )
    for name, schema in SCHEMAS.items():
        ids = tok(OUTPUTS[name])["input_ids"]
        t = time.perf_counter()
        m = llguidance.LLMatcher(ll, schema_json(schema))
        ll_compile = time.perf_counter() - t
        bits = llt.allocate_token_bitmask(1, V)
        ll_times = walk(
            ids,
            lambda m=m, bits=bits: llt.fill_next_token_bitmask(m, bits, 0),
            lambda i, m=m: m.consume_tokens([i]),
        )
        t = time.perf_counter()
        grammar = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        xm = xgr.GrammarMatcher(grammar)
        xg_compile = time.perf_counter() - t
        xbits = xgr.allocate_token_bitmask(1, V)
        xg_times = walk(
            ids, lambda xm=xm, xbits=xbits: xm.fill_next_token_bitmask(xbits, 0), xm.accept_token
        )
        for lib, c, ts in (
            ("llguidance", ll_compile, ll_times),
            ("xgrammar", xg_compile, xg_times),
        ):
            print(
                f"{lib:<11}{name:<8} compile + matcher {c * 1000:7.1f} ms   mask mean "
                f"{statistics.mean(ts) * 1e6:6.0f} us  max {max(ts) * 1e6:6.0f} us "
                f"({len(ts)} tokens)"
            )


if __name__ == "__main__":
    main()
