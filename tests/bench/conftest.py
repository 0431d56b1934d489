import json

import pytest

from inferlab.bench.fake_server import FakeConfig, FakeServer


@pytest.fixture
def fake():
    """Start fake servers on free loopback ports, in background threads: fake(ttft=..., itl=...) -> (url, server)."""
    started = []

    def start(**kw):
        server = FakeServer(FakeConfig(**kw))
        url = server.start_in_thread()
        started.append(server)
        return url, server

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def bench(tmp_path):
    """Run `inferlab bench ARGS` in-process; returns (exit status, results dict or None, output dir)."""
    from inferlab.cli import main

    counter = iter(range(1000))

    def run(*args: str):
        out = tmp_path / f"run{next(counter)}"
        rc = main(["bench", "--quiet", "--output-dir", str(out), *args])
        path = out / "results.json"
        return rc, (json.loads(path.read_text()) if path.exists() else None), out

    return run
