"""The short version of loadtest/rolling.py: two real replicas behind HAProxy, streamed greedy
requests at a steady rate, each replica restarted in turn with SIGTERM: no request fails or is
cut, and every output equals the reference."""

import pytest

from loadtest.rolling import haproxy_bin, haproxy_config, run

pytestmark = pytest.mark.real_model


def test_haproxy_config_routes_by_least_connections_and_checks_ready():
    cfg = haproxy_config(9000, [9001, 9002])
    assert "balance leastconn" in cfg and "option httpchk GET /ready" in cfg
    assert "retry-on conn-failure empty-response 503" in cfg
    assert "server r0 127.0.0.1:9001" in cfg and "server r1 127.0.0.1:9002" in cfg


@pytest.mark.skipif(haproxy_bin() is None, reason="haproxy not installed (setup.sh)")
def test_rolling_restart_under_load_loses_nothing(tmp_path):
    # Eager replicas: restarts are the subject, not the compiled forward. The suite's other
    # worker runs beside them on two cores: a torch thread each keeps the two replicas from
    # spinning against each other, and the drain gets time enough for a slowed machine (the
    # subject is that nothing is lost, not how fast a loaded CPU drains).
    out = run(
        rate=0.5, max_tokens=12, warm_s=3.0, settle_s=1.5, workdir=tmp_path, timeout=400,
        threads=1, shutdown_timeout_s=180.0, extra_args=("--enforce-eager",),
    )  # fmt: skip
    print(out.summary())
    assert out.sent >= 10
    assert all(r["held"] > 0 for r in out.restarts)  # each restart happened under load
    assert out.passed, out.summary()
