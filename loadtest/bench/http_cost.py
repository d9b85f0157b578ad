"""What serving over HTTP costs one request at a time: the same prompts decoded by an engine in
this process (``Engine.generate``) and by ``specd serve`` (a child process, same config) through
the official ``openai`` client, streamed, interleaved A B B A so machine noise hits both.

Both sides get the same token ids (the HTTP side as a completion prompt of ids), greedy, the same
``--max-tokens``, speculation on or off (``--k``). Prints each side's output tok/s, the ratio
and the milliseconds a token that the HTTP side adds (its wall time includes the client's own
parsing, on the same cores: a real client pays that too).

    python -m loadtest.bench.http_cost --config configs/default.yaml --prompts 8 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import openai

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.records.params import SamplingParams, SpecParams
from loadtest.server_proc import specd_server
from prompts.sets import encode, mixed


def in_process(engine, ids: list[int], max_tokens: int, k: int) -> tuple[int, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    spec = SpecParams(k=k) if k > 0 else SpecParams(enabled=False)
    t = time.perf_counter()
    seq = engine.generate([ids], params, spec)[0]
    return len(seq.output_ids), time.perf_counter() - t


def over_http(client, model: str, ids: list[int], max_tokens: int, k: int) -> tuple[int, float]:
    spec = {"k": k} if k > 0 else {"enabled": False}
    t = time.perf_counter()
    stream = client.completions.create(
        model=model,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculation": spec},
    )
    tokens = 0
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, time.perf_counter() - t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.http_cost", description=__doc__)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="ABBA pairs over the prompts")
    ap.add_argument("--k", type=int, default=0, help="fixed K (0: speculation off)")
    a = ap.parse_args(argv)
    cfg = EngineConfig.from_yaml(a.config)
    built = build_engine(cfg)
    if built.engine.needs_warm_up():
        built.engine.warm_up()
    prompts = [encode(built.tokenizer, p) for p in mixed(1)[: a.prompts]]
    totals = {"in process": [0, 0.0], "http": [0, 0.0]}
    pairs: list[float] = []
    with specd_server(Path(a.config), max_running=1) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=2)
        model = client.models.list().data[0].id
        runs = {
            "in process": lambda ids: in_process(built.engine, ids, a.max_tokens, a.k),
            "http": lambda ids: over_http(client, model, ids, a.max_tokens, a.k),
        }
        for ids in prompts[:2]:  # warm both: first calls, the controllers' calibration
            for run in runs.values():
                run(ids)
        for rep in range(2 * a.repeats):
            order = ["in process", "http"] if rep % 2 == 0 else ["http", "in process"]
            got = {}
            for name in order:
                n = s = 0.0
                for ids in prompts:
                    tokens, secs = runs[name](ids)
                    n, s = n + tokens, s + secs
                totals[name][0] += int(n)
                totals[name][1] += s
                got[name] = n / s
            pairs.append(got["http"] / got["in process"])
            print(f"  repeat {rep}: in process {got['in process']:.1f} tok/s, "
                  f"http {got['http']:.1f} tok/s, ratio {pairs[-1]:.3f}", flush=True)  # fmt: skip
    tps = {name: n / s for name, (n, s) in totals.items()}
    extra_ms = (1 / tps["http"] - 1 / tps["in process"]) * 1e3
    print(f"{a.config}, K = {a.k}, {a.prompts} prompts x {2 * a.repeats}, c = 1:")
    print(f"  in process {tps['in process']:.1f} tok/s, over HTTP {tps['http']:.1f} tok/s")
    print(f"  http / in process: {tps['http'] / tps['in process']:.3f} (pairs: median "
          f"{statistics.median(pairs):.3f}, {min(pairs):.3f}-{max(pairs):.3f}); HTTP adds "
          f"{extra_ms:.2f} ms a token")  # fmt: skip


if __name__ == "__main__":
    main()
