import pytest

from server.settings import ServerSettings, known_env, unknown_env


def test_flags_beat_env_beat_file(tmp_path):
    file = {"host": "0.0.0.0", "port": 1000, "max_n": 3}
    env = {"SPECD_PORT": "2000", "SPECD_HOST": "10.0.0.1"}
    s = ServerSettings.from_sources(file, env=env, flags={"port": 3000, "host": None})
    assert (s.port, s.host, s.max_n) == (3000, "10.0.0.1", 3)
    s = ServerSettings.from_sources(file, env={})
    assert (s.port, s.host) == (1000, "0.0.0.0")


def test_api_keys_from_env_and_file(tmp_path):
    s = ServerSettings.from_sources({}, env={"SPECD_API_KEY": "a,b"})
    assert s.api_keys == ["a", "b"]
    f = tmp_path / "keys"
    f.write_text("k1\n\nk2\n")
    s = ServerSettings.from_sources({}, env={"SPECD_API_KEYS_FILE": str(f)})
    assert s.api_keys == ["k1", "k2"]
    s = ServerSettings.from_sources({}, env={"SPECD_API_KEY": "a"}, flags={"api_keys": ["z"]})
    assert s.api_keys == ["z"]


def test_an_empty_variable_is_not_set():
    """compose's ${SPECD_API_KEY:-} passes "" when the host has none: the file's keys stay,
    and so does every other file value an empty variable would otherwise replace."""
    file = {"api_keys": ["secret"], "port": 9000}
    s = ServerSettings.from_sources(file, env={"SPECD_API_KEY": "", "SPECD_PORT": ""})
    assert s.api_keys == ["secret"] and s.port == 9000
    s = ServerSettings.from_sources({}, env={"SPECD_SHUTDOWN_TIMEOUT": "", "SPECD_API_KEY": ""})
    assert s.shutdown_timeout_s == 25.0 and s.api_keys == []
    s = ServerSettings.from_sources(file, env={"SPECD_API_KEY": "other"})
    assert s.api_keys == ["other"]  # a value still replaces them


def test_defaults_are_safe():
    s = ServerSettings.from_sources({}, env={})
    assert s.host == "127.0.0.1" and s.api_keys == []


def test_unknown_key_refused():
    import pytest

    with pytest.raises(ValueError):
        ServerSettings.from_sources({"prot": 1}, env={})


def test_env_key_used_when_flag_absent():
    s = ServerSettings.from_sources(
        {}, env={"SPECD_API_KEY": "a"}, flags={"api_keys": None, "port": None}
    )
    assert s.api_keys == ["a"]


def test_shutdown_timeout_from_env_and_flag_and_refused_when_negative():
    assert ServerSettings.from_sources({}, env={}).shutdown_timeout_s == 25.0
    env = {"SPECD_SHUTDOWN_TIMEOUT_S": "40"}
    assert ServerSettings.from_sources({}, env=env).shutdown_timeout_s == 40.0
    flags = {"shutdown_timeout_s": 5.0}
    assert ServerSettings.from_sources({}, env=env, flags=flags).shutdown_timeout_s == 5.0
    with pytest.raises(ValueError, match="shutdown_timeout_s"):
        ServerSettings.from_sources({"shutdown_timeout_s": -1}, env={})


def test_the_flag_name_of_the_shutdown_timeout_is_read_too():
    """SPECD_<FLAG> for --shutdown-timeout (the field's own name, with _S, wins if both)."""
    env = {"SPECD_SHUTDOWN_TIMEOUT": "12"}
    assert ServerSettings.from_sources({}, env=env).shutdown_timeout_s == 12.0
    env["SPECD_SHUTDOWN_TIMEOUT_S"] = "7"
    assert ServerSettings.from_sources({}, env=env).shutdown_timeout_s == 7.0


def test_an_unknown_specd_variable_is_named_with_the_closest_known_one():
    env = {"SPECD_MAX_RUNING": "4", "SPECD_PORT": "9000", "PATH": "/bin", "SPECD_ZZZ": "1"}
    hint = "; did you mean SPECD_MAX_RUNNING?"
    assert unknown_env(env) == [
        "environment variable SPECD_MAX_RUNING is not one specd reads" + hint,
        "environment variable SPECD_ZZZ is not one specd reads",
    ]
    assert unknown_env({name: "1" for name in known_env()}) == []  # no false alarm


def test_every_specd_variable_the_project_names_is_known():
    """The names in the CLI's help, the Dockerfile, compose, the chart and the scripts: none
    would warn at start-up."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = [root / "Dockerfile", root / "docker-compose.yml", root / "server" / "cli.py"]
    files += [*(root / "scripts").glob("*.sh"), *(root / "deploy").rglob("*.yaml")]
    named = {m for f in files if f.exists() for m in re.findall(r"SPECD_[A-Z0-9_]+", f.read_text())}
    assert "SPECD_SHUTDOWN_TIMEOUT" in named and "SPECD_CONFIG" in named  # the scan read them
    assert named - known_env() == set()
