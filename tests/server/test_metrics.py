"""/metrics after real traffic: counters equal the usage the responses reported, histogram counts
equal what was served, the exposition parses; with Debian's prometheus, every recording rule and
every dashboard query returns data, and promtool accepts the config and the rules."""

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from tests.conftest import MODEL, make_app
from tests.server.helpers import scrape, total

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "specd.json"


def test_counters_equal_usage_and_histograms_count_what_was_served(live, built):
    prompts = [
        "Repeat exactly: one two three one two three",
        "Name three colors.",
        "List the numbers 1 to 10.",
    ]
    with TestClient(make_app(built, live.worker)) as c:
        usage = {"prompt": 0, "completion": 0, "drafted": 0, "accepted": 0, "passes": 0}
        sequences = requests = 0

        def add(u):
            usage["prompt"] += u["prompt_tokens"]
            usage["completion"] += u["completion_tokens"]
            for k, f in (
                ("drafted", "drafted_tokens"),
                ("accepted", "accepted_tokens"),
                ("passes", "target_passes"),
            ):
                usage[k] += u["speculation"][f]

        for i, p in enumerate(prompts):
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "max_tokens": 24,
                    "temperature": 0,
                    "n": 1 + (i == 0),
                    "messages": [{"role": "user", "content": p}],
                    "speculation": {"k": 4},  # forced: drafts whatever this machine's speed
                },
            )
            assert r.status_code == 200
            add(r.json()["usage"])
            sequences += 1 + (i == 0)
            requests += 1
        with c.stream(
            "POST",
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "def add(a, b):",
                "max_tokens": 20,
                "stream": True,
                "stream_options": {"include_usage": True},
                "speculation": {"k": 4},
            },
        ) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        add(json.loads(events[-2])["usage"])
        sequences += 1
        requests += 1
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        }
        r = c.post(  # the grammar forces '{"city":"': free drafts (engine/drafters/forced.py)
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "max_tokens": 12,
                "temperature": 0,
                "messages": [{"role": "user", "content": "Name a city."}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "city", "schema": schema},
                },
                "speculation": {"k": 4},
            },
        )
        assert r.status_code == 200
        add(r.json()["usage"])
        sequences += 1
        requests += 1
        assert c.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404

        r = c.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        m = scrape(r.text)

    lab = {"model": MODEL, "drafter": "ngram"}
    assert total(m, "specd_prompt_tokens_total", **lab) == usage["prompt"]
    assert total(m, "specd_output_tokens_total", **lab) == usage["completion"]
    assert total(m, "specd_draft_tokens_total", **lab) == usage["drafted"] > 0
    assert total(m, "specd_accepted_tokens_total", **lab) == usage["accepted"]
    assert total(m, "specd_target_passes_total", **lab) == usage["passes"]
    assert total(m, "specd_forced_tokens_total", **lab) > 0
    assert total(m, "specd_draft_tokens_by_position_total") == usage["drafted"]
    assert total(m, "specd_accepted_tokens_by_position_total") == usage["accepted"]
    assert total(m, "specd_accepted_tokens_by_position_total", position="1") <= total(
        m, "specd_draft_tokens_by_position_total", position="1"
    )
    # histograms: one observation per sequence / per token / per pass
    assert total(m, "specd_time_to_first_token_seconds_count") == sequences
    assert total(m, "specd_request_latency_seconds_count") == sequences
    assert total(m, "specd_queue_time_seconds_count") == sequences
    assert total(m, "specd_inter_token_latency_seconds_count") == usage["completion"] - sequences
    assert total(m, "specd_tokens_per_pass_count") == usage["passes"]
    assert total(m, "specd_tokens_per_pass_sum") == usage["completion"]
    assert total(m, "specd_draft_length_count") == usage["passes"] - sequences  # one per round
    assert total(m, "specd_round_phase_seconds_count", phase="verify") > 0
    assert total(m, "specd_sequences_finished_total") == sequences
    assert total(m, "specd_requests_total", endpoint="chat", status="200") == len(prompts) + 1
    assert total(m, "specd_requests_total", endpoint="completions", status="200") == 1
    assert total(m, "specd_requests_total", endpoint="completions", status="404") == 1
    assert total(m, "specd_requests_total") == requests + 1
    assert total(m, "specd_kv_cache_usage_ratio") == 0.0  # everything finished and freed
    assert ("specd_running_sequences", frozenset(lab.items())) in m
    # vLLM's names carry the same values (its dashboards and alerts work unchanged)
    v = {"model_name": MODEL}
    assert total(m, "vllm:spec_decode_num_draft_tokens_total", **v) == usage["drafted"]
    assert total(m, "vllm:spec_decode_num_accepted_tokens_total", **v) == usage["accepted"]
    assert 0 < total(m, "vllm:spec_decode_num_drafts_total", **v) <= usage["passes"]
    assert total(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == usage["accepted"]
    assert total(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == total(
        m, "specd_accepted_tokens_by_position_total", position="1"
    )
    assert total(m, "vllm:prompt_tokens_total", **v) == usage["prompt"]
    assert total(m, "vllm:generation_tokens_total", **v) == usage["completion"]
    for ours, theirs in [
        ("specd_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
        ("specd_inter_token_latency_seconds", "vllm:inter_token_latency_seconds"),
        ("specd_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
        ("specd_queue_time_seconds", "vllm:request_queue_time_seconds"),
    ]:
        assert total(m, f"{theirs}_count", **v) == total(m, f"{ours}_count") > 0
    # vLLM's per-request measures: one observation per sequence, its tokens and its phases
    assert total(m, "vllm:request_success_total", **v) == sequences
    assert total(m, "vllm:request_success_total", finished_reason="abort", **v) == 0
    assert total(m, "vllm:request_generation_tokens_sum", **v) == usage["completion"]
    assert total(m, "vllm:request_prompt_tokens_count", **v) == sequences
    assert total(m, "vllm:request_max_num_generation_tokens_count", **v) == requests
    assert total(m, "vllm:request_max_num_generation_tokens_sum", **v) <= usage["completion"]
    for phase in ("prefill", "decode", "inference"):
        assert total(m, f"vllm:request_{phase}_time_seconds_count", **v) == sequences
    assert total(m, "vllm:request_inference_time_seconds_sum", **v) == pytest.approx(
        total(m, "vllm:request_prefill_time_seconds_sum", **v)
        + total(m, "vllm:request_decode_time_seconds_sum", **v)
    )
    # every token of a step: the outputs, and each prompt whole in the step of its first token
    assert total(m, "vllm:iteration_tokens_total_sum", **v) == usage["completion"] + total(
        m, "vllm:request_prompt_tokens_sum", **v
    )
    assert total(m, "process_cpu_seconds_total") > 0


def test_vllm_model_name_is_the_served_name(live, built):
    """With --served-model-name, vLLM's model_name label is that name (the gateway and vLLM's
    dashboards select by the name clients send), and its counters move with the traffic."""
    with TestClient(make_app(built, live.worker, served_model_names=["alias", "other"])) as c:
        before = scrape(c.get("/metrics").text)
        r = c.post(
            "/v1/completions",
            json={"model": "other", "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        time.sleep(0.2)  # past metrics_cache_s: the next scrape renders anew
        after = scrape(c.get("/metrics").text)
    v = {"model_name": "alias"}
    made = r.json()["usage"]["completion_tokens"]

    def moved(name, **lab):
        return total(after, name, **v, **lab) - total(before, name, **v, **lab)

    assert moved("vllm:generation_tokens_total") == made > 0
    assert moved("vllm:request_success_total") == 1
    assert moved("vllm:request_generation_tokens_sum") == made
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert not [k for k in after if k[0].startswith("vllm:") and ("model_name", MODEL) in k[1]]


def listening_address(prom: subprocess.Popen) -> str:
    """host:port from prometheus's "Listening on" log line (it bound port 0: any free port);
    the rest of its log is drained in a thread."""
    for line in prom.stderr:
        found = re.search(r'msg="Listening on" address=(\S+)', line)
        if found:
            threading.Thread(target=prom.stderr.read, daemon=True).start()
            return found.group(1)
    raise AssertionError(f"prometheus exited ({prom.wait()}) before listening")


# what vLLM's example Grafana dashboard and the gateway read, with its $model_name variable set
# to the model (docs/operations.md says these work unchanged on specd)
_M = f'{{model_name="{MODEL}"}}'  # the selector of vLLM's dashboard, $model_name set
VLLM_QUERIES = [
    *(
        f"histogram_quantile(0.99, sum by(le) (rate(vllm:{h}_bucket{_M}[1m])))"
        for h in (
            "e2e_request_latency_seconds",
            "inter_token_latency_seconds",
            "time_to_first_token_seconds",
            "iteration_tokens_total",
        )
    ),
    *(
        f"rate(vllm:{c}{_M}[1m])"
        for c in (
            "prompt_tokens_total",
            "generation_tokens_total",
            "e2e_request_latency_seconds_sum",
            "request_queue_time_seconds_sum",
            "request_prefill_time_seconds_sum",
            "request_decode_time_seconds_sum",
            "request_inference_time_seconds_sum",
            "request_max_num_generation_tokens_sum",
            "spec_decode_num_accepted_tokens_total",
            "spec_decode_num_draft_tokens_total",
        )
    ),
    f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{_M}[1m]))",
    f"sum by(le) (increase(vllm:request_generation_tokens_bucket{_M}[1m]))",
    f"sum by(finished_reason) (increase(vllm:request_success_total{_M}[1m]))",
    f"vllm:num_requests_running{_M}",
    f"vllm:num_requests_waiting{_M}",
    f"vllm:kv_cache_usage_perc{_M}",
    'vllm:cache_config_info{block_size!="", engine="0"}',
    'max by (running_lora_adapters, waiting_lora_adapters) (vllm:lora_requests_info{max_lora="0"})',
    "rate(process_cpu_seconds_total[1m])",
    "process_resident_memory_bytes",
]


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    for var in ("$namespace", "$pod", "$model", "$drafter"):  # "All" is .*
        exprs = [e.replace(var, ".*") for e in exprs]
    return [e.replace("$__rate_interval", "1m") for e in exprs]


def rule_names() -> list[str]:
    import yaml

    return [r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


@pytest.mark.skipif(
    not shutil.which("prometheus") or not shutil.which("promtool"),
    reason="Debian's prometheus package is not installed (scripts/setup.sh installs it as root)",
)
def test_prometheus_rules_and_dashboard_queries_return_data(live):
    """...and every alert evaluates without error; the eager-fallback one sees this server's
    eager target (the fp32 test config does not compile)."""
    for rules in (RULES, ALERTS):
        subprocess.run(["promtool", "check", "rules", str(rules)], check=True, capture_output=True)
    subprocess.run(
        ["promtool", "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")],
        check=True,
        capture_output=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "prometheus.yml"
        cfg.write_text(
            json.dumps(
                {  # YAML is a superset of JSON
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES), str(ALERTS)],
                    "scrape_configs": [
                        {
                            "job_name": "specd",
                            "static_configs": [{"targets": [live.url.removeprefix("http://")]}],
                        }
                    ],
                }
            )
        )
        subprocess.run(["promtool", "check", "config", str(cfg)], check=True, capture_output=True)
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp}/data",
                "--web.listen-address=127.0.0.1:0",  # the port it binds is read from its log
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            api = f"http://{listening_address(prom)}/api/v1/query"
            client = openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0)
            deadline = time.monotonic() + 300  # bounds a hang only
            queries = rule_names() + dashboard_queries() + VLLM_QUERIES
            missing = queries
            while missing and time.monotonic() < deadline:
                # traffic in between scrapes, so that every rate has two samples that differ
                client.chat.completions.create(
                    model=MODEL,
                    max_tokens=12,
                    temperature=0,
                    messages=[
                        {"role": "user", "content": "Repeat: alpha beta gamma alpha beta gamma"}
                    ],
                )
                time.sleep(1)
                try:
                    missing = [
                        q
                        for q in missing
                        if not httpx.get(api, params={"query": q}, timeout=5).json()["data"][
                            "result"
                        ]
                    ]
                except httpx.HTTPError:  # prometheus still starting
                    continue
            assert not missing, f"queries without data: {missing}"
            rules: dict = {}
            while time.monotonic() < deadline:  # until each alert has been evaluated
                groups = httpx.get(api.removesuffix("query") + "rules", timeout=30).json()
                rules = {r["name"]: r for g in groups["data"]["groups"] for r in g["rules"]}
                if all(r["health"] != "unknown" for r in rules.values()):
                    break
                time.sleep(1)
            assert len(rules) == len(rule_names()) + 5
            assert all(r["health"] == "ok" for r in rules.values()), rules
            assert rules["SpecdEagerFallback"]["state"] in ("pending", "firing")
            (alert,) = rules["SpecdEagerFallback"]["alerts"]
            assert alert["labels"]["component"] == "target" and alert["labels"]["path"] == "eager"
        finally:
            prom.terminate()
            prom.wait(10)


@pytest.mark.skipif(
    not shutil.which("docker-compose"),
    reason="Debian's docker-compose client is not installed (scripts/setup.sh installs it as root)",
)
@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_file_is_valid(profile):
    env = dict(os.environ, COMPOSE_PROFILES=profile)

    def compose(*args: str) -> subprocess.CompletedProcess:
        cmd = ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", *args]
        return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True)

    r = compose("-q")
    assert r.returncode == 0, r.stderr
    r = compose("--services")
    services = set(r.stdout.split())
    assert {"prometheus", "grafana"} <= services
    assert ("specd" if profile == "gpu" else "specd-cpu") in services


def test_deployment_configs_parse():
    from engine.config import EngineConfig
    from server.settings import ServerSettings, load_config_file

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = EngineConfig.from_yaml(path)
        assert cfg.model.source and cfg.drafter.controller in ("adaptive", "heuristic", "fixed")
        ServerSettings.from_sources(load_config_file(path).get("server"), env={})
    gpu = EngineConfig.from_yaml(ROOT / "configs" / "gpu-qwen2.5-7b.yaml")
    assert gpu.model.device == "cuda" and gpu.drafter.method == "model" and gpu.drafter.source


def test_vllm_named_gauges_carry_the_same_values():
    """The gateway's endpoint picker reads vLLM's gauge names by default (deploy/helm: the
    InferencePool): specd exports its queue, running and KV-cache gauges under them too."""
    from prometheus_client import generate_latest

    from server.metrics import Metrics

    metrics = Metrics("m", "ngram")
    stats = {"running": 3, "waiting": 5, "kv_used_tokens": 1024, "kv_budget_tokens": 4096}
    metrics.set_gauges({**stats, "preemptions": 2})
    m = scrape(generate_latest(metrics.registry).decode())
    assert total(m, "vllm:num_requests_waiting", model_name="m") == 5
    assert total(m, "vllm:num_requests_running", model_name="m") == 3
    assert total(m, "vllm:kv_cache_usage_perc", model_name="m") == 0.25
    assert total(m, "specd_waiting_sequences") == 5
    assert total(m, "specd_kv_cache_usage_ratio") == 0.25
    assert total(m, "vllm:num_preemptions_total", model_name="m") == 2
    assert total(m, "specd_preemptions_total") == 2


def test_vllm_request_metrics_move_with_a_sequence():
    """vLLM's per-request histograms, finish-reason counter, step tokens and info gauges, fed
    as the engine and the server feed them; vLLM's model_name is the served name."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from engine.api import StepOutput
    from server.metrics import Metrics

    info = {"block_size": "16", "num_gpu_blocks": "4096", "cache_dtype": "float32"}
    metrics = Metrics(
        "config-name", "ngram", served_name="alias", max_model_len=100, cache_info=info
    )
    m = scrape(generate_latest(metrics.registry).decode())
    for why in ("stop", "length", "abort"):  # every reason's series, at 0 before any request
        assert (
            m[
                (
                    "vllm:request_success_total",
                    frozenset({"model_name": "alias", "finished_reason": why}.items()),
                )
            ]
            == 0
        )
    assert total(m, "vllm:request_prompt_tokens_bucket", le="100.0") == 0
    assert (
        "vllm:request_prompt_tokens_bucket",
        frozenset({"model_name": "alias", "le": "200.0"}.items()),
    ) not in m  # buckets end at the context

    t0 = time.perf_counter()
    seq = SimpleNamespace(arrival=t0 - 0.5, admitted=t0 - 0.2, prompt_ids=list(range(7)))
    metrics.observe_step([StepOutput("r-0", [5], False, None, seq=seq)], {})  # prefill token
    clock = metrics.sequence_clock(t0 - 0.5, prompt_tokens=7)
    clock.tokens(1, seq)
    time.sleep(0.01)
    clock.tokens(3, seq)
    clock.done("length")
    other = metrics.sequence_clock(time.perf_counter(), prompt_tokens=2)
    other.done("error")  # never got a token: counted, with no timings
    metrics.set_gauges({"running": 0, "waiting": 0})
    m = scrape(generate_latest(metrics.registry).decode())
    v = {"model_name": "alias"}
    assert not [k for k in m if k[0].startswith("vllm:") and ("model_name", "config-name") in k[1]]
    assert total(m, "vllm:request_success_total", finished_reason="length", **v) == 1
    assert total(m, "vllm:request_success_total", finished_reason="abort", **v) == 1
    assert total(m, "vllm:request_success_total", finished_reason="stop", **v) == 0
    assert total(m, "vllm:request_prompt_tokens_sum", **v) == 9
    assert total(m, "vllm:request_prompt_tokens_count", **v) == 2
    assert total(m, "vllm:request_generation_tokens_sum", **v) == 4
    assert total(m, "vllm:request_generation_tokens_bucket", le="5.0", **v) == 2
    assert total(m, "vllm:request_generation_tokens_bucket", le="2.0", **v) == 1
    assert total(m, "vllm:iteration_tokens_total_sum", **v) == 8  # the prompt + its first token
    assert total(m, "vllm:iteration_tokens_total_count", **v) == 1
    prefill = total(m, "vllm:request_prefill_time_seconds_sum", **v)
    decode = total(m, "vllm:request_decode_time_seconds_sum", **v)
    inference = total(m, "vllm:request_inference_time_seconds_sum", **v)
    assert total(m, "vllm:request_prefill_time_seconds_count", **v) == 1
    assert prefill >= 0.2 and decode >= 0.01
    assert inference == pytest.approx(prefill + decode)
    assert total(m, "vllm:e2e_request_latency_seconds_count", **v) == 1
    assert m[("vllm:cache_config_info", frozenset({**info, "engine": "0"}.items()))] == 1
    lora = {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(m[("vllm:lora_requests_info", frozenset(lora.items()))] - time.time()) < 60
    assert total(m, "process_resident_memory_bytes") > 0
    assert total(m, "process_cpu_seconds_total") > 0


def test_forward_path_gauge_shows_the_path_taken_and_a_fallback():
    """specd_forward_path: 1 for each component's path now; after a fallback the old path
    reads 0 and eager 1 (an alert on eager, or on a compiled path at 0, sees it)."""
    from prometheus_client import generate_latest

    from server.metrics import Metrics

    metrics = Metrics("m", "eagle3")
    paths = {"target": "compiled+q4-specd", "head": "compiled"}
    metrics.set_forward_paths(paths)
    m = scrape(generate_latest(metrics.registry).decode())
    assert total(m, "specd_forward_path", component="target", path="compiled+q4-specd") == 1
    assert total(m, "specd_forward_path", component="head", path="compiled") == 1
    metrics.set_forward_paths({"target": "eager+q4-specd", "head": "compiled"})
    m = scrape(generate_latest(metrics.registry).decode())
    assert total(m, "specd_forward_path", component="target", path="compiled+q4-specd") == 0
    assert total(m, "specd_forward_path", component="target", path="eager+q4-specd") == 1
    assert total(m, "specd_forward_path", component="head") == 1


def test_served_forward_paths_are_what_the_configs_ask(live, live_default):
    """The fp32 test server runs eagerly; the shipped default runs its target and its head
    compiled, the 4-bit layers of each on a named kernel: a silent fallback would fail here."""
    m = scrape(httpx.get(f"{live.url}/metrics").text)
    assert total(m, "specd_forward_path", component="target", path="eager") == 1
    m = scrape(httpx.get(f"{live_default.url}/metrics").text)
    on = {
        dict(lab)["component"]: dict(lab)["path"]
        for (n, lab), v in m.items()
        if v == 1 and n == "specd_forward_path"
    }
    assert on["target"].startswith("compiled+q4-"), on
    assert on["head"].startswith("compiled+q4-"), on


def test_copied_drafts_are_counted_apart_and_in_the_totals():
    """specd_copied_*: the drafted / accepted tokens of rounds whose draft was a copy (n-gram,
    suffix), also in the totals; a model's draft (the head's) is in the totals only."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from engine.records.sequence import RoundStats
    from server.metrics import Metrics

    metrics = Metrics("m", "eagle3")
    rounds = [RoundStats(4, 4, 3, 4, 0.0, 0.0, copied=True), RoundStats(3, 3, 1, 2, 0.0, 0.0)]
    metrics.observe_step(
        [SimpleNamespace(new_token_ids=[1] * r.emitted, stats=r) for r in rounds], {}
    )
    m = scrape(generate_latest(metrics.registry).decode())
    assert total(m, "specd_copied_draft_tokens_total") == 4
    assert total(m, "specd_copied_accepted_tokens_total") == 3
    assert total(m, "specd_draft_tokens_total") == 7
    assert total(m, "specd_accepted_tokens_total") == 4
