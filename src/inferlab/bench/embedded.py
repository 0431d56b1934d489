"""With no --base-url, bench measures inferlab's own server: started as a child process on a free loopback port,
waited for until GET /health answers 200, stopped with SIGTERM after the run. A child process, not an import,
so bench stays free of the engine and measures the server exactly as users run it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from inferlab.bench.client import BenchError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedServer:
    def __init__(self, serve_args: list[str], log_path: Path, timeout: float = 600.0):
        self.serve_args = serve_args
        self.log_path = log_path
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "inferlab", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                *self.serve_args]

    def start(self) -> str:
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        # Its own session: a Ctrl-C meant for bench must not kill the server before bench has written its summary.
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise BenchError(self._exit_message(code))
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.base_url
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise BenchError(f"inferlab's server did not answer GET /health within {self.timeout:g} s "
                         f"(log: {self.log_path}); raise --server-timeout or pass --base-url")

    def _exit_message(self, code: int) -> str:
        tail = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-8:]
        text = "\n".join(tail)
        if "No module named 'inferlab.server" in text or "No module named inferlab.server" in text:
            return ("`inferlab serve` is not available in this build yet (the inferlab.server package is missing), "
                    "so bench cannot start the embedded server: start a server yourself and pass --base-url")
        return f"inferlab's server exited with code {code} before it was ready (log: {self.log_path}):\n{text}"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def describe(self) -> dict:
        info = {"command": self.command, "log": str(self.log_path)}
        try:
            with urllib.request.urlopen(self.base_url + "/version", timeout=2) as r:
                info["version"] = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            pass
        return info
