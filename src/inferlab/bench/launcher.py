"""Start, wait for and stop the server under test: inferlab's own (bench with no --base-url, and the lab), an
external engine from a command template (vLLM, SGLang, llama.cpp's server ... with {port} filled in), or an
endpoint someone else runs. A child process, never an import: bench stays free of the engine and measures a
server exactly as users run it.

The engine runs in its own process group (start_new_session), so teardown reaches whatever it spawned (vLLM
starts worker processes): SIGTERM to the group, a grace period, then SIGKILL. Its stdout and stderr go to a log
file, not a pipe: a pipe nobody reads fills up and blocks the engine, and the file's tail is what a failure
message needs.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

READY_PATHS = ("/health", "/v1/models")
LOG_TAIL_LINES = 20


class LaunchError(RuntimeError):
    def __init__(self, message: str, server: "RunningServer | None" = None):
        super().__init__(message)
        self.server = server  # the stopped engine, when one was started


# Ports a server is told to listen on come from below the kernel's ephemeral range and above Ray's worker ports
# (10002-19999 by default). A server binds its port only once it has loaded its model, seconds after the port was
# chosen, and meanwhile every outgoing connection and port-0 bind on the machine is handed an ephemeral port: a
# Ray cluster starting beside it takes dozens, and once took the one a Serve proxy had been given (the test suite,
# 2026-12-04: "Failed to bind to address '127.0.0.1:44217'").
QUIET_PORTS = (20000, 32768)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return QUIET_PORTS[1]  # Linux's default; elsewhere the range differs, and the bind below checks anyway


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, that the kernel will not hand to anyone else's connection meanwhile."""
    low, high = QUIET_PORTS[0], min(QUIET_PORTS[1], _ephemeral_low())
    rng = random.SystemRandom()  # two launchers started at once must not walk the same sequence
    for _ in range(64 if high > low else 0):
        port = rng.randrange(low, high)
        if not port_in_use(host, port):
            return port
    with socket.socket() as s:  # no quiet port free (or none configured): any port the kernel gives
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _tail(path: Path | None, n: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.exists():
        return "(no output captured)"
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:]
    return "\n".join("    " + ln for ln in lines) if lines else "(it printed nothing)"


def _probe(base_url: str, api_key: str | None, timeout: float = 2.0) -> tuple[bool, str]:
    """(ready, what was seen): ready when any readiness path answers 200."""
    seen = []
    for path in READY_PATHS:
        req = urllib.request.Request(base_url + path)
        if api_key:
            req.add_header("Authorization", f"Bearer {api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                if r.status == 200:
                    return True, f"{path} answered 200"
                seen.append(f"{path}: HTTP {r.status}")
        except urllib.error.HTTPError as e:
            seen.append(f"{path}: HTTP {e.code}")
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            seen.append(f"{path}: {reason}")
    return False, "; ".join(seen)


@dataclass(slots=True)
class RunningServer:
    base_url: str  # http://host:port, without /v1
    argv: list[str] | None = None
    process: subprocess.Popen | None = None  # None for an endpoint we did not start
    log_path: Path | None = None
    api_key: str | None = None
    started: float = field(default_factory=time.monotonic)
    ready_after: float | None = None  # seconds from start to ready

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        return _tail(self.log_path, n)

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM to the engine's process group, SIGKILL after `grace` seconds; returns its exit code."""
        p = self.process
        if p is None:
            return None
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        # Children that outlived their parent (or ignored SIGTERM) go with the group.
        _signal_group(p, signal.SIGKILL)
        return p.returncode

    def __enter__(self) -> "RunningServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # start_new_session made the engine the leader of a group with its own pid
    except (ProcessLookupError, PermissionError):
        pass


def fill_template(template: str | list[str], port: int, host: str = "127.0.0.1") -> list[str]:
    """A command template (a string in shell syntax, or an argv list) with {port} and {host} filled in. Each
    argument is filled after splitting, so a value can never inject extra arguments."""
    argv = shlex.split(template) if isinstance(template, str) else list(template)
    if not any("{port}" in a for a in argv):
        raise LaunchError(f"the command template has no {{port}}: {template!r}")
    return [a.replace("{port}", str(port)).replace("{host}", host) for a in argv]


def config_flags(config: dict) -> list[str]:
    """{'max_num_seqs': 8, 'enable_prefix_caching': False} -> ['--max-num-seqs', '8', '--no-enable-prefix-caching'].
    True is a bare flag; False the --no- form (argparse's BooleanOptionalAction, which vLLM also uses); None omits."""
    out: list[str] = []
    for key, value in config.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def inferlab_argv(port: int, model: str | None = None, config: dict | None = None,
                  host: str = "127.0.0.1") -> list[str]:
    argv = [sys.executable, "-m", "inferlab", "serve", "--host", host, "--port", str(port)]
    if model:
        argv += ["--model", model]
    return argv + config_flags(config or {})


def launch(argv: list[str], port: int, host: str = "127.0.0.1", ready_timeout: float = 300.0,
           log_path: str | Path | None = None, env: dict | None = None, api_key: str | None = None,
           poll_interval: float = 0.2) -> RunningServer:
    """Start `argv` (which must listen on host:port) and wait until it answers a readiness path.

    Raises LaunchError when the port is taken before the start, when the process exits before it is ready (with
    the last lines of its output), or when the deadline passes (after stopping it)."""
    if port_in_use(host, port):
        raise LaunchError(
            f"port {port} on {host} is already in use: another server is running there, and waiting for "
            f"readiness would measure it instead; stop it or let the lab pick a free port"
        )
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="inferlab-engine-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env)
        except OSError as e:
            raise LaunchError(f"cannot start {argv[0]!r}: {e.strerror or e}") from None
    server = RunningServer(f"http://{host}:{port}", argv, proc, log_path, api_key)
    deadline = time.monotonic() + ready_timeout
    seen = "nothing yet"
    while True:
        code = proc.poll()
        if code is not None:
            server.stop()
            raise LaunchError(
                f"the engine exited with code {code} before it was ready: {shlex.join(argv)}\n"
                f"  last lines of its output ({log_path}):\n{server.log_tail()}", server
            )
        ok, seen = _probe(server.base_url, api_key, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
        if ok and proc.poll() is None:
            server.ready_after = time.monotonic() - server.started
            return server
        if time.monotonic() >= deadline:
            server.stop()
            raise LaunchError(
                f"the engine did not become ready within {ready_timeout:g} s (polling {', '.join(READY_PATHS)} on "
                f"{server.base_url}; last answer: {seen}); it was stopped: {shlex.join(argv)}\n"
                f"  last lines of its output ({log_path}):\n{server.log_tail()}", server
            )
        time.sleep(poll_interval)


def connect(base_url: str, ready_timeout: float = 10.0, api_key: str | None = None) -> RunningServer:
    """An endpoint someone else runs: check that it answers, start nothing."""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    deadline = time.monotonic() + ready_timeout
    while True:
        ok, seen = _probe(base, api_key)
        if ok:
            return RunningServer(base, api_key=api_key, ready_after=0.0)
        if time.monotonic() >= deadline:
            raise LaunchError(f"the endpoint {base} did not answer {', '.join(READY_PATHS)} within "
                              f"{ready_timeout:g} s ({seen})")
        time.sleep(0.5)

