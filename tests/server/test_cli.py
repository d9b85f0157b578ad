"""The specd command line: the model as the first argument, vLLM / llama.cpp style flags, each
also from its SPECD_* environment variable (flag > environment > config file)."""

import argparse
import json

import pytest

from server import cli
from server.settings import ServerSettings


def parse(argv: list[str]) -> argparse.Namespace:
    """serve's arguments, as main() parses them (without running anything)."""
    seen = {}
    real = cli.cmd_serve
    cli.cmd_serve = lambda args: seen.setdefault("args", args) and 0
    try:
        cli.main(["serve", *argv])
    finally:
        cli.cmd_serve = real
    return seen["args"]


def test_model_and_flags_override_the_config(monkeypatch):
    monkeypatch.delenv("SPECD_DRAFTER", raising=False)
    args = parse(
        ["/models/My-Model.gguf", "--drafter", "model:/models/draft", "--k-max", "5"]
        + ["--max-model-len", "1024", "--max-running", "3", "--dtype", "float32"]
    )
    cfg = cli._config(args)
    assert cfg.model.source == "/models/My-Model.gguf" and cfg.model.name == "My-Model"
    assert (cfg.drafter.method, cfg.drafter.source, cfg.drafter.k_max) == (
        "model",
        "/models/draft",
        5,
    )
    assert (cfg.max_model_len, cfg.max_running, cfg.model.dtype) == (1024, 3, "float32")


def test_another_model_drafts_with_ngram_unless_a_head_is_named(monkeypatch, capsys):
    """The default config's EAGLE-3 head reads SmolLM2's hidden states: serving another model
    with it falls back to n-gram (said on stderr); --drafter eagle:PATH keeps a head; naming
    the config's own model keeps the config's drafter."""
    monkeypatch.delenv("SPECD_DRAFTER", raising=False)
    monkeypatch.delenv("SPECD_MODEL", raising=False)
    default = cli._config(parse([]))
    assert default.drafter.method == "eagle3" and default.drafter.ngram_fallback == 3
    other = cli._config(parse(["/models/Other.gguf"]))
    assert (other.drafter.method, other.drafter.source, other.drafter.ngram_fallback) == (
        "ngram",
        None,
        0,
    )
    assert "n-gram" in capsys.readouterr().err
    headed = cli._config(parse(["/models/Other.gguf", "--drafter", "eagle:/heads/other"]))
    assert (headed.drafter.method, headed.drafter.source) == ("eagle3", "/heads/other")
    same = cli._config(parse([default.model.source]))
    assert same.drafter == default.drafter


def test_environment_fills_what_flags_leave(monkeypatch):
    monkeypatch.setenv("SPECD_DRAFTER", "eagle")
    monkeypatch.setenv("SPECD_MAX_RUNNING", "5")
    cfg = cli._config(parse(["--max-running", "2"]))
    assert cfg.drafter.method == "eagle3" and cfg.drafter.source.endswith("smollm2-135m-eagle3")
    assert cfg.max_running == 2  # the flag wins
    monkeypatch.setenv("SPECD_DRAFTER", "none")
    assert cli._config(parse([])).drafter.method == "none"


@pytest.mark.parametrize("bad", ["telepathy", "model"])
def test_bad_drafter_is_refused(monkeypatch, bad):
    monkeypatch.delenv("SPECD_DRAFTER", raising=False)
    with pytest.raises(SystemExit):
        cli._config(parse(["--drafter", bad]))


def test_help_reads_like_a_man_page(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "NAME" in out and "SYNOPSIS" in out and "EXAMPLES" in out and "``" not in out
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--drafter", "--k-max", "--max-model-len", "--max-running", "--port"):
        assert flag in out
    assert "SPECD_MAX_RUNNING" in out


def test_enforce_eager_flag_and_environment(monkeypatch):
    monkeypatch.delenv("SPECD_ENFORCE_EAGER", raising=False)
    assert cli._config(parse([])).compile.enabled  # the default compiles
    assert not cli._config(parse(["--enforce-eager"])).compile.enabled
    monkeypatch.setenv("SPECD_ENFORCE_EAGER", "1")
    assert not cli._config(parse([])).compile.enabled


def test_deterministic_flag_and_environment(monkeypatch):
    monkeypatch.delenv("SPECD_DETERMINISTIC", raising=False)
    assert cli._config(parse([])).deterministic == "off"
    assert cli._config(parse(["--deterministic", "always"])).deterministic == "always"
    monkeypatch.setenv("SPECD_DETERMINISTIC", "request")
    assert cli._config(parse([])).deterministic == "request"
    monkeypatch.setenv("SPECD_DETERMINISTIC", "sometimes")
    with pytest.raises(SystemExit, match="deterministic must be one of"):
        cli._config(parse([]))


SUFFIX_SPEC = json.dumps(
    {
        "method": "suffix",
        "num_speculative_tokens": 6,
        "suffix_decoding_max_tree_depth": 16,
        "suffix_decoding_max_cached_requests": 50,
        "suffix_decoding_max_spec_factor": 2,
        "suffix_decoding_min_token_prob": 0.2,
    }
)


@pytest.mark.parametrize(
    "spec,drafter,k_max",
    [
        ('{"method": "eagle3", "model": "/heads/h", "num_speculative_tokens": 4}', "eagle3", 4),
        ('{"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}', "ngram", None),
        ('{"model": "/models/draft", "num_speculative_tokens": 3}', "model", 3),
        (SUFFIX_SPEC, "suffix", 6),
    ],
)
def test_a_vllm_speculative_config_names_the_same_drafter(monkeypatch, spec, drafter, k_max):
    """vLLM's --speculative-config serves what the equivalent --drafter / --k-max would."""
    monkeypatch.delenv("SPECD_DRAFTER", raising=False)
    monkeypatch.delenv("SPECD_K_MAX", raising=False)
    cfg = cli._config(parse(["--speculative-config", spec]))
    equivalent = {
        "eagle3": ["--drafter", "eagle:/heads/h", "--k-max", "4"],
        "ngram": ["--drafter", "ngram"],
        "model": ["--drafter", "model:/models/draft", "--k-max", "3"],
        "suffix": ["--drafter", "suffix", "--k-max", "6"],
    }[drafter]
    want = cli._config(parse(equivalent))
    assert (cfg.drafter.method, cfg.drafter.source) == (want.drafter.method, want.drafter.source)
    assert cfg.drafter.k_max == want.drafter.k_max == (k_max or want.drafter.k_max)
    if drafter == "ngram":
        assert (cfg.drafter.ngram_min, cfg.drafter.ngram_max) == (2, 5)
    if drafter == "suffix":
        d = cfg.drafter
        knobs = (d.suffix_max_tree_depth, d.suffix_max_cached_requests, d.suffix_max_spec_factor)
        assert knobs + (d.suffix_min_token_prob,) == (16, 50, 2.0, 0.2)
        assert isinstance(d.suffix_max_spec_factor, float)
    with pytest.raises(SystemExit, match="both name the drafter"):
        cli._config(parse(["--speculative-config", spec, "--drafter", "ngram"]))


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        '{"method": "medusa"}',
        "[1]",
        '{"method": "ngram", "suffix_decoding_max_tree_depth": 8}',
        '{"method": "suffix", "suffix_decoding_min_token_prob": "high"}',
    ],
)
def test_a_speculative_config_specd_cannot_serve_is_refused(bad):
    with pytest.raises(SystemExit, match="speculative-config"):
        cli._config(parse(["--speculative-config", bad]))


def test_chat_template_from_a_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert cli.chat_template(str(path)) == path.read_text()
    assert cli.chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(SystemExit, match="neither a file nor"):
        cli.chat_template("no-such-file.jinja")
    assert parse(["--chat-template", str(path)]).chat_template == str(path)


def test_several_served_model_names():
    assert parse(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]


def test_tree_flags_and_their_environment(monkeypatch):
    """--tree-leaves / --tree-topk (and SPECD_TREE_LEAVES / SPECD_TREE_TOPK) set the drafter's
    draft trees; a top-k of 1 is refused (0: the chain's runners-up; 2 and up: an expansion)."""
    for name in ("SPECD_TREE_LEAVES", "SPECD_TREE_TOPK"):
        monkeypatch.delenv(name, raising=False)
    cfg = cli._config(parse(["--tree-leaves", "4", "--tree-topk", "4"]))
    assert (cfg.drafter.tree_leaves, cfg.drafter.tree_topk) == (4, 4)
    monkeypatch.setenv("SPECD_TREE_LEAVES", "3")
    monkeypatch.setenv("SPECD_TREE_TOPK", "2")
    cfg = cli._config(parse([]))
    assert (cfg.drafter.tree_leaves, cfg.drafter.tree_topk) == (3, 2)
    with pytest.raises(SystemExit):
        cli._config(parse(["--tree-topk", "1"]))


def test_threads_flag_and_its_environment(monkeypatch):
    """--threads (and SPECD_THREADS) set torch's CPU threads; unset keeps torch's default, and
    fewer than one is refused at start-up."""
    monkeypatch.delenv("SPECD_THREADS", raising=False)
    assert cli._config(parse([])).threads is None
    assert cli._config(parse(["--threads", "1"])).threads == 1
    monkeypatch.setenv("SPECD_THREADS", "3")
    assert cli._config(parse([])).threads == 3
    with pytest.raises(SystemExit, match="threads"):
        cli._config(parse(["--threads", "0"]))


def test_kv_layout_flag_and_its_environment(monkeypatch):
    """--kv-layout (and SPECD_KV_LAYOUT) choose the target's KV cache: slots by default, or the
    paged pool (engine/kv/paged_kv.py); another name is refused at start-up."""
    monkeypatch.delenv("SPECD_KV_LAYOUT", raising=False)
    assert cli._config(parse([])).kv_layout == "slots"
    assert cli._config(parse(["--kv-layout", "paged"])).kv_layout == "paged"
    monkeypatch.setenv("SPECD_KV_LAYOUT", "paged")
    assert cli._config(parse([])).kv_layout == "paged"
    monkeypatch.setenv("SPECD_KV_LAYOUT", "pages")
    with pytest.raises(SystemExit, match="kv_layout"):
        cli._config(parse([]))


def test_a_vllm_command_line_means_what_it_means_in_vllm(monkeypatch, capsys):
    """``vllm serve`` flags as vLLM's docs write them: each lands where specd keeps that
    setting (the engine config or the server's), the vLLM-only ones are accepted, none is
    dropped on the way."""
    for name in ("SPECD_DRAFTER", "SPECD_MODEL", "SPECD_DTYPE", "SPECD_MAX_RUNNING"):
        monkeypatch.delenv(name, raising=False)
    argv = ["--model", "/models/Qwen2.5-1.5B-Instruct", "--dtype", "auto", "--max-num-seqs", "4"]
    argv += ["--max-num-batched-tokens", "256", "--enable-prefix-caching", "--seed", "7"]
    argv += ["--tensor-parallel-size", "1", "--disable-log-requests", "--uvicorn-log-level"]
    argv += ["warning", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    argv += ["--generation-config", "vllm", "--response-role", "assistant"]
    argv += ["--gpu-memory-utilization", "0.9", "--device", "cpu"]
    argv += ["--disable-uvicorn-access-log"]
    args = parse(argv)
    cfg = cli._config(args)
    default = cli._config(parse([]))
    assert cfg.model.source == "/models/Qwen2.5-1.5B-Instruct"
    assert cfg.model.name == "Qwen2.5-1.5B-Instruct"
    assert cfg.model.dtype == default.model.dtype  # auto: the config's
    assert (cfg.max_running, cfg.prefill_chunk_tokens, cfg.seed) == (4, 256, 7)
    assert cfg.prefix_cache_tokens == default.prefix_cache_tokens > 0
    assert args.log_level == "warning"  # cmd_serve hands it to the server's settings
    settings = ServerSettings.from_sources(
        {"access_log": True}, env={}, flags=cli.server_flags(args)
    )
    assert (settings.log_level, settings.access_log) == ("warning", False)
    assert settings.generation_config == "vllm"  # the model's sampling defaults off
    on = ServerSettings.from_sources({}, env={}, flags=cli.server_flags(parse([])))
    assert on.access_log is True
    assert "does not apply on CPU" in capsys.readouterr().err
    assert cli._config(parse(["--dtype", "half"])).model.dtype == "float16"
    assert cli._config(parse(["--dtype", "float"])).model.dtype == "float32"
    # the old names stay
    assert cli._config(parse(["--max-running", "3"])).max_running == 3


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tensor-parallel-size", "2"], "one device"),
        (["-pp", "2"], "one device"),
        (["--response-role", "user"], "assistant"),
        (["--generation-config", "/no/such/folder"], "generation_config.json"),
        (["--gpu-memory-utilization", "1.5"], "(0, 1]"),
        (["--gpu-memory-utilization", "0.9", "--device", "cuda"], "--kv-cache-tokens"),
        (["/models/a.gguf", "--model", "/models/b.gguf"], "named twice"),
        (["--speculative-config", '{"method": "ngram", "num_lookahead_slots": 4}'], "keys"),
    ],
)
def test_a_vllm_flag_specd_cannot_honour_is_refused_with_the_reason(argv, says):
    with pytest.raises(SystemExit) as e:
        cli._config(parse(argv))
    assert says in str(e.value)


def test_an_engine_seed_makes_unseeded_sampling_repeat():
    """``--seed`` seeds the engine's generator: two engines of one seed sample an unseeded
    request alike, and another seed samples it otherwise (the control)."""
    from engine.api import SamplingParams
    from tests.helpers import engine_for, tiny_llama

    model = tiny_llama(3, layers=1, vocab=48, hidden=32, heads=2, kv_heads=1, max_positions=64)

    def sample(seed):
        e = engine_for(model, None, slots=2, max_len=64, seed=seed)  # config seed, as --seed
        return e.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=24))[0]

    assert sample(7).output_ids == sample(7).output_ids != sample(8).output_ids


def test_an_empty_environment_variable_is_not_set(monkeypatch):
    """compose's ${SPECD_X:-} passes "" for a variable the host lacks: the config's value
    stays, as if the variable were absent."""
    default = cli._config(parse([]))
    monkeypatch.setenv("SPECD_DRAFTER", "")
    monkeypatch.setenv("SPECD_MAX_RUNNING", "")
    monkeypatch.setenv("SPECD_MODEL", "")
    cfg = cli._config(parse([]))
    assert cfg.drafter.method == default.drafter.method
    assert cfg.max_running == default.max_running and cfg.model.source == default.model.source


def parsed(cmd: str, argv: list[str]) -> argparse.Namespace:
    """``cmd``'s arguments as main() resolves them (the command itself not run)."""
    seen = {}
    name = f"cmd_{cmd}"
    real = getattr(cli, name)
    setattr(cli, name, lambda args: seen.setdefault("args", args) and 0)
    try:
        cli.main([cmd, *argv])
    finally:
        setattr(cli, name, real)
    return seen["args"]


@pytest.mark.parametrize("cmd", ["serve", "prepare", "generate"])
def test_the_config_file_is_the_flag_then_specd_config_then_the_default(monkeypatch, tmp_path, cmd):
    """An installed package (the image) has no configs/ beside it in site-packages: the
    default is then the working directory's configs/default.yaml (the image's /app), and
    SPECD_CONFIG names another for every command, not only the image's CMD."""
    prompt = ["hi"] if cmd == "generate" else []
    monkeypatch.delenv("SPECD_CONFIG", raising=False)
    assert parsed(cmd, prompt).config == str(cli.DEFAULT_CONFIG)
    own = tmp_path / "own.yaml"
    own.write_text(cli.DEFAULT_CONFIG.read_text().replace("max_running:", "max_running: 3 #"))
    monkeypatch.setenv("SPECD_CONFIG", str(own))
    args = parsed(cmd, prompt)
    assert args.config == str(own) and cli._config(args).max_running == 3
    assert parsed(cmd, ["--config", str(cli.DEFAULT_CONFIG), *prompt]).config == str(
        cli.DEFAULT_CONFIG
    )
    monkeypatch.setenv("SPECD_CONFIG", "")  # compose's ${SPECD_CONFIG:-}: not set
    assert parsed(cmd, prompt).config == str(cli.DEFAULT_CONFIG)

    monkeypatch.delenv("SPECD_CONFIG")
    monkeypatch.setattr(cli, "DEFAULT_CONFIG", tmp_path / "site-packages" / "configs" / "x.yaml")
    app = tmp_path / "app" / "configs"
    app.mkdir(parents=True)
    (app / "default.yaml").write_text(own.read_text())
    monkeypatch.chdir(app.parent)
    args = parsed(cmd, prompt)
    assert args.config == str(app / "default.yaml") and cli._config(args).max_running == 3
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="SPECD_CONFIG"):
        parsed(cmd, prompt)
