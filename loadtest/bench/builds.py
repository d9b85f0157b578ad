"""Two builds of specd side by side: the same config, prompts and load against this tree's server
and another checkout's (e.g. a commit before a refactor), interleaved A B, B A, ... so machine
noise hits both, one table of the ratios.

    git worktree add /tmp/before <commit>
    python -m loadtest.bench.builds --other /tmp/before --config configs/cpu-compiled.yaml \
        --concurrency 1,8 --repeat 2 --per-category 1 --max-tokens 128

Both servers are started first (each from its own checkout, port 0, ready on /ready) and stay up;
only one is driven at a time. The ratio is this tree's output tok/s over the other's, per repeat
and load point, with a 95% t interval over the repeats (loadtest.stats.mean_ci).
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import ExitStack
from pathlib import Path

from loadtest import cli, stats
from loadtest.modes import interleaved
from loadtest.server_proc import spawn, specd_argv

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, help="the other checkout (its own configs/)")
    ap.add_argument("--config", default="configs/cpu-compiled.yaml", help="relative to each tree")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="loadtest/results/builds.json")
    return ap.parse_args(argv)


def drive(base_url: str, args) -> dict[int, dict]:
    """One loadtest run (every load point once) against ``base_url``: summary per concurrency."""
    argv = ["--base-url", base_url, "--concurrency", args.concurrency, "--no-plots"]
    argv += ["--no-progress", "--per-category", str(args.per_category), "--warmup", "0"]
    argv += ["--max-tokens", str(args.max_tokens), "--temperature", "0"]
    res = cli.run(cli.parse_args(argv))
    return {int(r["concurrency"]): r["summary"] for r in res["runs"]}


def main(argv=None) -> None:
    args = parse_args(argv)
    trees = {"this": ROOT, "other": Path(args.other).resolve()}
    runs: list[dict] = []
    with ExitStack() as stack:
        servers = {}
        for name, tree in trees.items():
            log = Path(f"/tmp/specd-{name}.log")
            servers[name] = stack.enter_context(
                spawn(specd_argv(args.config), ready_path="/ready", name=name, cwd=tree, log=log)
            )
            print(f"{name}: {tree} ready in {servers[name].ready_s:.0f} s", flush=True)
        if args.warmup:
            for s in servers.values():
                w = argparse.Namespace(**{**vars(args), "concurrency": "1", "per_category": 1})
                drive(s.base_url, w)
        for rep, name in interleaved(list(trees), args.repeat):
            t0 = time.perf_counter()
            for c, summary in drive(servers[name].base_url, args).items():
                runs.append({"build": name, "repeat": rep, "concurrency": c, "summary": summary})
            print(f"repeat {rep} {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        rss = {name: s.rss.peak for name, s in servers.items()}
    rows = []
    for c in sorted({r["concurrency"] for r in runs}):
        pick = {(r["build"], r["repeat"]): r["summary"] for r in runs if r["concurrency"] == c}
        tok = {b: [pick[(b, i)]["output_tok_s"] for i in range(args.repeat)] for b in trees}
        itl = {b: [pick[(b, i)]["itl_token"]["p95_ms"] for i in range(args.repeat)] for b in trees}
        ratio = stats.mean_ci([a / b for a, b in zip(tok["this"], tok["other"])])
        rows.append({"concurrency": c, "tok_s": tok, "itl_p95_ms": itl, "ratio": ratio})
        lo, hi = ratio["ci95"]
        ci = f" [{lo:.3f}, {hi:.3f}]" if lo is not None else ""
        mean = {b: sum(v) / len(v) for b, v in tok.items()}
        runs_s = {b: [round(x, 1) for x in v] for b, v in tok.items()}
        print(
            f"c={c}: this {mean['this']:.1f} tok/s {runs_s['this']}, "
            f"other {mean['other']:.1f} {runs_s['other']}; "
            f"ratio this/other {ratio['mean']:.3f}{ci}; "
            f"p95 ITL ms this {itl['this']} other {itl['other']}",
            flush=True,
        )
    print(f"peak RSS MiB: {rss}")
    out = {"args": vars(args), "rows": rows, "peak_rss_mib": rss, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
