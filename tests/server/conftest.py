"""Fixtures of the server tests (the pieces they use live in server_testkit.py)."""

from __future__ import annotations

import pytest

from server_testkit import FakeEngine, LiveServer


@pytest.fixture
def fake_server():
    """Factory: fake_server(engine=None, **ServerConfig fields) -> LiveServer (stopped at teardown)."""
    from inferlab.server.api import ServerConfig, build_app

    servers: list[LiveServer] = []

    def make(engine: FakeEngine | None = None, **cfg) -> LiveServer:
        engine = engine or FakeEngine()
        s = LiveServer(build_app(engine, ServerConfig(**cfg)))
        s.engine = engine  # type: ignore[attr-defined]
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()


# The real engine behind the real app, stepped as `inferlab serve` steps it; one server per test module that asks.
@pytest.fixture(scope="module")
def server(llm_fp32):
    from inferlab.server.api import ServerConfig, build_app

    with LiveServer(build_app(llm_fp32.engine, ServerConfig())) as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    """The official openai client on `server`."""
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=600)
