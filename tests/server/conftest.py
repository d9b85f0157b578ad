"""Server-test fixtures: the shipped default config served for real (``live_default``), and the
``served`` parametrization over it and the fp32 ``live`` server. Before each test either server
is idle and its K controller starts over (tests/conftest.py ``fresh``).

``live`` (tests/conftest.py) is the real model in fp32 with the n-gram drafter, eager: the one
where greedy output is token-exact in every batch. ``live_default`` is ``configs/default.yaml``
as ``specd serve`` builds it: bf16 around the GGUF's 4-bit layers, the compiled forward, the
EAGLE-3 head with the per-row n-gram fallback, the adaptive K. One change: its deterministic mode
is ``request`` (``specd serve --deterministic request``) instead of ``off``, so that a request
that sends ``"deterministic": true`` runs the batch-invariant forward. In bf16 a forward's rounding
depends on its shape (docs/speculation.md, "What holds in which dtype"): greedy output with
speculation on can differ from plain decoding on the same server, so a test that compares outputs
token for token sends ``served.exact`` (``{"deterministic": true}`` there, ``{}`` on the fp32
server); every other request runs the default compiled forward exactly as the shipped server
runs it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import QUIET, fresh, served_fields, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"
SERVED = ["live", "live_default"]  # the ``served`` parametrization, by fixture name


def default_config():
    """configs/default.yaml as ``specd serve --deterministic request`` reads it."""
    from engine.config import EngineConfig

    cfg = EngineConfig.from_yaml(DEFAULT_CONFIG)
    cfg.deterministic = "request"
    cfg.__post_init__()
    return cfg


@pytest.fixture(scope="session")
def built_default():
    """The default config built (loaded and compiled once per run: ``specd prepare`` has
    filled inductor's cache, so compiling takes ~30 s)."""
    from engine.builder import build_engine

    return build_engine(default_config())


@pytest.fixture(scope="session")
def live_default(built_default):
    """configs/default.yaml served as ``specd serve`` serves it (server section of the file, any
    free port), the engine loop in a thread of its own; ready (compiled) when yielded. The same
    fields as ``live``, plus ``exact`` (the body a token-exact comparison sends) and ``name``."""
    from server.assembly import assemble
    from server.settings import ServerSettings, load_config_file

    file = load_config_file(DEFAULT_CONFIG).get("server")
    settings = ServerSettings.from_sources(file, env={}, flags=QUIET)
    with assemble(built_default, settings, engine_thread=True) as server:
        wait_until(server.worker.warmed.is_set, timeout=1200, what="the compile warm-up")
        yield served_fields(
            server, built_default, exact={"deterministic": True}, name="live_default"
        )


@pytest.fixture
def served(request):
    """Each server a test runs on: the fp32 one (``live``) and the default config's
    (``live_default``). Fields as ``live``'s, plus ``exact``: what a request whose output is
    compared token for token sends (deterministic mode where the forward is bf16)."""
    server = request.getfixturevalue(request.param)
    if not hasattr(server, "exact"):  # live (tests/conftest.py): fp32 is token-exact as it is
        server = SimpleNamespace(**vars(server), exact={}, name=request.param)
    fresh(server)
    return server


def pytest_generate_tests(metafunc):
    """``served`` runs every test that takes it on both servers, or on those its module names
    in a ``SERVED`` list of its own."""
    if "served" in metafunc.fixturenames:
        metafunc.parametrize("served", getattr(metafunc.module, "SERVED", SERVED), indirect=True)


@pytest.fixture(autouse=True)
def fresh_default(request):
    """Every test that uses ``live_default`` starts on it idle, with a fresh K controller
    (tests/conftest.py ``fresh``; ``fresh_live`` there does the same for ``live``)."""
    if "live_default" in request.fixturenames:
        fresh(request.getfixturevalue("live_default"))
