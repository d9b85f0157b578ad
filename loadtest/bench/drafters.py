"""Output tok/s of one specd config with each drafter: plain, n-gram, EAGLE-3 (adaptive K).

Two servers from the same config, differing only in ``engine.drafter``: the config's own (the
EAGLE-3 head) and the n-gram drafter. Each is started alone (they would share the cores), then
driven by ``python -m loadtest`` with the same 24 requests as ``loadtest/bench/servers.py`` (16
MT-Bench chats + 8 HumanEval completions, greedy, streamed) one at a time and 8 at a time.
On each server speculation on and off run interleaved (ABBA, ``--modes on,off``), so plain
decoding is measured beside each drafter in the same run; ratios are per repeat.

    python -m loadtest.bench.drafters --config configs/default.yaml --repeat 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import yaml

from loadtest import cli
from loadtest.bench.servers import mix_file
from loadtest.server_proc import specd_server

NGRAM = {"method": "ngram", "ngram_min": 1, "ngram_max": 3, "controller": "adaptive", "k_max": 7}


def configs(path: Path) -> dict[str, dict]:
    """The config as given, and the same with the n-gram drafter."""
    data = yaml.safe_load(path.read_text())
    ngram = json.loads(json.dumps(data))
    ngram["engine"]["drafter"] = NGRAM
    return {data["engine"]["drafter"]["method"]: data, "ngram": ngram}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.drafters", description=__doc__)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--requests", type=int, help="requests per level (default: the 24 items)")
    ap.add_argument("--out", default="loadtest/results/bench_drafters")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = mix_file(out / "mix.jsonl")
    rows = []
    for name, cfg in configs(Path(args.config)).items():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "config.yaml"
            path.write_text(yaml.safe_dump(cfg))
            with specd_server(path, max_running=8) as server:
                largs = ["--base-url", server.base_url, "--workload", f"jsonl:{data}"]
                largs += ["--max-tokens", str(args.max_tokens), "--concurrency", args.concurrency]
                largs += ["--modes", "on,off", "--repeat", str(args.repeat)]
                largs += ["--no-progress", "--no-plots", "--out", str(out / name)]
                largs += ["--requests", str(args.requests)] if args.requests else []
                res = cli.run(cli.parse_args(largs))
        for r in res["runs"]:
            s = r["summary"]
            rows.append(
                {
                    "drafter": name if r["mode"] == "on" else "plain",
                    "server": name,
                    "concurrency": r["concurrency"],
                    "repeat": r["repeat"],
                    "output_tok_s": s["output_tok_s"],
                    "itl_p95_ms": s["itl_token"]["p95_ms"],
                    "errors": s.get("errors", 0),
                    "server_stats": r.get("server"),
                }
            )
    (out / "rows.json").write_text(json.dumps(rows, indent=1, default=str))
    lines = [
        f"# python -m loadtest.bench.drafters --config {args.config} --repeat {args.repeat} "
        f"--max-tokens {args.max_tokens}"
        + (f" --requests {args.requests}" if args.requests else ""),
        (
            f"# {args.requests or 24} requests a level from the mix of 16 MT-Bench chats + "
            "8 HumanEval, greedy, streamed; plain = the same server with speculation off (ABBA)"
        ),
        (
            f"{'server':<8}{'drafter':<9}{'clients':>8}{'tok/s':>9}{'ITL p95 ms':>12}"
            f"{'x plain':>9}{'errors':>8}"
        ),
    ]
    for server in dict.fromkeys(r["server"] for r in rows):
        for c in sorted({r["concurrency"] for r in rows}):
            mine = [r for r in rows if r["server"] == server and r["concurrency"] == c]
            plain = {r["repeat"]: r["output_tok_s"] for r in mine if r["drafter"] == "plain"}
            for drafter in (server, "plain"):
                rs = [r for r in mine if r["drafter"] == drafter]
                ratio = statistics.median(r["output_tok_s"] / plain[r["repeat"]] for r in rs)
                lines.append(
                    f"{server:<8}{drafter:<9}{c:>8}"
                    f"{statistics.median(r['output_tok_s'] for r in rs):>9.1f}"
                    f"{statistics.median(r['itl_p95_ms'] for r in rs):>12.0f}{ratio:>9.2f}"
                    f"{sum(r['errors'] for r in rs):>8}"
                )
    text = "\n".join(lines)
    print(text)
    (out.parent / f"{out.name}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
