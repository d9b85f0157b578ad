"""``python -m loadtest`` against a live specd (real model, fp32): the JSON has every field the
issue asks for with sane values, the A/B modes really switch speculation, the plots are written."""

import json

import pytest

from loadtest.cli import main

pytestmark = pytest.mark.real_model

PCTS = ("p50_ms", "p90_ms", "p95_ms", "p99_ms")


def _check_latency(d: dict, count: int | None = None):
    assert d["mean_ms"] > 0
    assert 0 < d["p50_ms"] <= d["p90_ms"] <= d["p95_ms"] <= d["p99_ms"]
    if count is not None:
        assert d["count"] == count


@pytest.mark.slow
def test_closed_loop_ab_run(live, tmp_path):
    out = tmp_path / "run"
    main(
        [
            "--base-url",
            live.base_url,
            "--workload",
            "humaneval,mtbench:2",
            "--per-category",
            "1",
            "--requests",
            "2",
            "--concurrency",
            "1,2",
            "--ab",
            "--repeat",
            "2",
            "--max-tokens",
            "8",
            "--warmup",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["model"] == "SmolLM2-135M-Instruct"
    runs = res["runs"]
    assert [(r["concurrency"], r["mode"], r["repeat"]) for r in runs] == [
        (1, "on", 0),
        (1, "off", 0),
        (1, "off", 1),
        (1, "on", 1),
        (2, "on", 0),
        (2, "off", 0),
        (2, "off", 1),
        (2, "on", 1),
    ]  # ABBA
    for run in runs:
        s, srv, reqs = run["summary"], run["server"], run["requests"]
        # 2 items per run, the first two of the interleaved list: a HumanEval completion and an
        # MT-Bench conversation of two turns (writing): 3 HTTP requests
        assert sorted((r["category"], r["turn"]) for r in reqs) == [
            ("humaneval", 0),
            ("writing", 0),
            ("writing", 1),
        ]
        assert s["requests"] == len(reqs) == 3 and s["completed"] == 3
        assert s["errors"] == 0 and s["error_rate"] == 0.0
        assert s["output_tokens"] == sum(r["output_tokens"] for r in reqs) == 3 * 8
        assert s["output_tok_s"] > 0 and s["requests_s"] > 0 and s["wall_s"] > 0
        for key in ("ttft", "e2e"):
            _check_latency(s[key], 3)
        _check_latency(s["itl_token"])
        _check_latency(s["itl_chunk"])
        for r in reqs:
            assert 0 < r["ttft"] <= r["e2e"]
            assert all(x >= 0 for x in r["itl_token"] + r["itl_chunk"])
            assert r["finish_reason"] == "length" and r["text"]
        # the server's own counters agree with the usage the responses reported
        assert srv["output_tokens"] == s["output_tokens"]
        assert srv["passes"] == sum(r["passes"] for r in reqs)
        assert 0.0 <= srv["acceptance"] <= 1.0 and 0.0 <= s["acceptance"] <= 1.0
        assert srv["tokens_per_pass"] >= 1.0
        if run["mode"] == "off":
            assert srv["drafted"] == 0 and srv["tokens_per_pass"] == 1.0
        assert sum(c["requests"] for c in s["by_category"].values()) == 3
    assert sum(r["server"]["drafted"] for r in runs if r["mode"] == "on") > 0
    # both turns of the conversation: the second one carries the first answer
    conv = [r for r in runs[0]["requests"] if r["id"].startswith("mtbench")]
    assert [r["turn"] for r in conv] == [0, 1] and conv[1]["prompt_tokens"] > conv[0][
        "prompt_tokens"
    ]
    assert [(a["load"], a["a"], a["b"]) for a in res["ab"]] == [
        ("c=1", "on", "off"),
        ("c=2", "on", "off"),
    ]
    for a in res["ab"]:
        r = a["tok_s_ratio"]
        assert r["n"] == 2 and r["mean"] > 0 and r["ci95"][0] <= r["mean"] <= r["ci95"][1]
    assert sorted(p.rsplit("/", 1)[1] for p in res["meta"]["plots"]) == [
        "acceptance_by_category.png",
        "latency_cdf.png",
        "load_curves.png",
    ]
    for p in res["meta"]["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_open_loop_run_with_jsonl_and_completions_endpoint(live, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": f"Count: {i}, {i + 1},", "id": f"c{i}"}) for i in range(3))
    )
    out = tmp_path / "open"
    main(
        [
            "--base-url",
            live.base_url,
            "--workload",
            f"jsonl:{prompts}",
            "--rate",
            "5",
            "--requests",
            "4",
            "--duration",
            "60",
            "--max-tokens",
            "6",
            "--seed",
            "1",
            "--warmup",
            "0",
            "--no-progress",
            "--no-plots",
            "--out",
            str(out),
        ]
    )
    res = json.loads((out / "results.json").read_text())
    (run,) = res["runs"]
    assert run["shape"] == "open" and run["rate"] == 5.0 and run["mode"] == "default"
    s = run["summary"]
    assert s["requests"] == s["completed"] == 4 and s["errors"] == 0
    assert [r["id"] for r in sorted(run["requests"], key=lambda r: r["start"])] == [
        "c0",
        "c1",
        "c2",
        "c0",
    ]
    starts = sorted(r["start"] for r in run["requests"])
    assert starts[-1] > starts[0]  # Poisson arrivals, not all at once
    _check_latency(s["ttft"], 4)
    assert "ab" not in res and "plots" not in res["meta"]
