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
