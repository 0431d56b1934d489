"""bench.launcher, the one way bench and the lab start a server, without a GPU: `inferlab fake-server` stands in
for vLLM; tiny `python -c` engines exercise every failure message."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request

import pytest

from inferlab.bench.launcher import (LaunchError, config_flags, connect, fill_template, free_port, inferlab_argv,
                                     launch)

READY = 120.0  # generous: only a deadline for "eventually", never a speed assertion

FAKE = [sys.executable, "-m", "inferlab", "fake-server", "--port", "{port}", "--ttft", "10ms", "--itl", "1ms"]

# A minimal HTTP engine: answers /health, ignores SIGTERM when asked, and can spawn a grandchild.
ENGINE = r"""
import http.server, os, signal, subprocess, sys
port, ignore_term, pidfile = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
if ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if pidfile != "-":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(pidfile, "w").write(str(child.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def gone(pid: int, deadline: float = READY) -> bool:
    """Eventually dead: a SIGKILL is delivered asynchronously."""
    end = time.monotonic() + deadline
    while alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_fake_server_from_a_template(tmp_path):
    port = free_port()
    srv = launch(fill_template(FAKE, port), port, ready_timeout=READY, log_path=tmp_path / "engine.log")
    try:
        assert srv.base_url == f"http://127.0.0.1:{port}" and srv.ready_after is not None
        with urllib.request.urlopen(srv.base_url + "/v1/models", timeout=10) as r:
            assert json.load(r)["data"][0]["id"] == "fake-model"
        assert connect(srv.base_url + "/v1", ready_timeout=READY).base_url == srv.base_url
    finally:
        code = srv.stop()
    assert srv.process.poll() is not None and code is not None
    assert "fake server listening" in (tmp_path / "engine.log").read_text()


def test_engine_exits_early_shows_its_last_lines():
    port = free_port()
    argv = [sys.executable, "-c", "import sys; print('loading weights', flush=True); "
                                  "sys.stderr.write('torch.OutOfMemoryError: CUDA out of memory\\n'); sys.exit(3)"]
    with pytest.raises(LaunchError) as e:
        launch(argv, port, ready_timeout=READY)
    msg = str(e.value)
    assert "exited with code 3 before it was ready" in msg
    assert "loading weights" in msg and "CUDA out of memory" in msg


def test_engine_never_ready_is_stopped_at_the_deadline():
    port = free_port()
    argv = [sys.executable, "-c", "import time; print('still compiling', flush=True); time.sleep(600)"]
    with pytest.raises(LaunchError) as e:
        launch(argv, port, ready_timeout=5.0)
    msg = str(e.value)
    assert "did not become ready within 5 s" in msg and "it was stopped" in msg and "/health" in msg
    assert "still compiling" in msg
    assert e.value.server.process.poll() is not None  # stopped, not leaked


def test_port_taken_is_refused_before_starting():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {port} on 127.0.0.1 is already in use"):
            launch([sys.executable, "-c", "raise SystemExit('must not start')"], port, ready_timeout=READY)


def test_teardown_kills_the_group_even_when_sigterm_is_ignored(tmp_path):
    port = free_port()
    pidfile = tmp_path / "grandchild"
    srv = launch([sys.executable, "-c", ENGINE, str(port), "1", str(pidfile)], port, ready_timeout=READY)
    grandchild = int(pidfile.read_text())
    assert alive(grandchild)
    code = srv.stop(grace=0.5)
    assert code == -9  # SIGTERM ignored, so SIGKILL after the grace period
    assert gone(grandchild)


def test_polite_engine_stops_on_sigterm():
    port = free_port()
    srv = launch([sys.executable, "-c", ENGINE, str(port), "0", "-"], port, ready_timeout=READY)
    assert srv.stop(grace=READY) == -15


def test_templates_and_errors():
    assert fill_template("vllm serve 'my model' --port {port} --host {host}", 8123) == [
        "vllm", "serve", "my model", "--port", "8123", "--host", "127.0.0.1"]
    with pytest.raises(LaunchError, match="has no {port}"):
        fill_template("vllm serve m", 1)
    with pytest.raises(LaunchError, match="cannot start 'no-such-engine-binary'"):
        launch(["no-such-engine-binary"], free_port(), ready_timeout=READY)
    with pytest.raises(LaunchError, match="did not answer"):
        connect(f"http://127.0.0.1:{free_port()}", ready_timeout=0.5)
    argv = inferlab_argv(9000, "m.gguf", {"max_num_seqs": 4, "enable_prefix_caching": False})
    assert argv[:4] == [sys.executable, "-m", "inferlab", "serve"]
    assert argv[4:] == ["--host", "127.0.0.1", "--port", "9000", "--model", "m.gguf", "--max-num-seqs", "4",
                        "--no-enable-prefix-caching"]
    assert config_flags({"max_num_seqs": 8, "enable_prefix_caching": False, "x": True, "y": None}) == [
        "--max-num-seqs", "8", "--no-enable-prefix-caching", "--x"]


def test_free_ports_come_from_below_the_ephemeral_range(monkeypatch):
    """A port chosen for a server that binds it seconds later must not be one the kernel can hand to another
    connection meanwhile (a Ray cluster starting beside it takes dozens of ephemeral ports)."""
    from inferlab.bench import launcher

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(launcher.QUIET_PORTS[0] <= p < min(launcher.QUIET_PORTS[1], ephemeral_low) for p in ports)
    assert len(ports) > 1  # random, so two launchers at once do not pick the same one
    def bind_as_a_server_does(port):  # with SO_REUSEADDR, as uvicorn: an earlier test's TIME_WAIT is no obstacle
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()

    for p in ports:
        bind_as_a_server_does(p)  # free indeed
    # Every quiet port taken: the kernel's choice, still a free port.
    monkeypatch.setattr(launcher, "port_in_use", lambda host, port: True)
    bind_as_a_server_does(free_port())
