"""A server in a child process (loadtest/server_proc.py): the port is the one the child bound
(port 0), readiness, errors, stop, and the peak-RSS definition."""

import math
import os
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from loadtest.server_proc import (
    RssSampler,
    listening_ports,
    process_tree,
    rss_mib,
    spawn,
    stop_process,
)

HTTP_SERVER = [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"]


def test_spawn_finds_the_port_the_child_bound(tmp_path):
    (tmp_path / "ready").write_text("yes")
    with spawn(HTTP_SERVER, ready_path="/ready", cwd=tmp_path, log=tmp_path / "log") as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
        assert server.base_url == server.url + "/v1"
        assert server.port in listening_ports(server.pid)
        assert httpx.get(f"{server.url}/ready", timeout=10).text == "yes"
        assert server.ready_s > 0
        server.rss.stop()
        assert server.rss.peak > 0
    assert server.proc.poll() is not None  # stopped with the block


def test_spawn_reports_a_child_that_exits(tmp_path):
    argv = [sys.executable, "-c", "print('bye')"]
    with pytest.raises(RuntimeError, match="exited with 0"), spawn(argv, ready_path="/", name="x"):
        pass


def test_spawn_gives_up_when_never_ready(tmp_path):
    log = tmp_path / "log"
    with (
        pytest.raises(RuntimeError, match="did not become ready"),
        spawn(HTTP_SERVER, ready_path="/missing", cwd=tmp_path, log=log, timeout=1) as _,
    ):
        pass


def test_listening_ports_and_tree_of_this_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert s.getsockname()[1] in listening_ports(os.getpid())
    assert process_tree(os.getpid())[0] == os.getpid()
    assert rss_mib(os.getpid()) > 0


def test_a_thread_ending_meanwhile_does_not_lose_the_process(monkeypatch):
    """A thread of the process may end between listing its tasks and reading one's children
    (the test suite's own process starts and ends threads all the time)."""
    from pathlib import Path

    done = threading.Event()
    worker = threading.Thread(target=done.wait)
    worker.start()
    read = Path.read_text

    def gone_thread(self, *a, **k):
        if self.name == "children" and self.parent.name != str(os.getpid()):
            raise FileNotFoundError(self)
        return read(self, *a, **k)

    try:
        monkeypatch.setattr(Path, "read_text", gone_thread)
        assert process_tree(os.getpid())[0] == os.getpid()
    finally:
        done.set()
        worker.join()


def test_stop_process_kills_a_child_that_ignores_sigterm():
    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('armed', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "armed"  # the handler is in place
    stop_process(proc, grace=0.5)
    assert proc.returncode == -9
    proc.stdout.close()
    assert math.isnan(rss_mib(proc.pid)) and process_tree(proc.pid) == []


def test_peak_between_windows():
    s = RssSampler(os.getpid())
    s.samples = [(1.0, 10.0), (2.0, 30.0), (3.0, 20.0)]
    assert s.peak == 30.0
    assert s.peak_between(0.0, 2.0) == 10.0 and s.peak_between(2.5) == 20.0
    assert math.isnan(s.peak_between(5.0))
    assert s.stop() >= 30.0  # never started: stop() takes one sample of a live process
