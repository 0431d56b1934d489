"""The engine's CPU thread adaptation in /metrics, read back with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from inferlab.engine.outputs import EngineStats
from inferlab.server.metrics import ServerMetrics


def _samples(m: ServerMetrics) -> dict[tuple[str, str | None], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, s.labels.get("reason"))] = s.value
    return out


def test_threads_fallbacks_and_recoveries_are_exported():
    m = ServerMetrics("smol")
    m.engine.stats = EngineStats(cpu_threads=1, cpu_threads_max=2, cpu_fallbacks_total={"stall": 3, "contended": 1},
                                 cpu_recoveries_total=2)
    s = _samples(m)
    assert s[("inferlab:cpu_threads", None)] == 1 and s[("inferlab:cpu_threads_max", None)] == 2
    assert s[("inferlab:cpu_fallbacks_total", "stall")] == 3
    assert s[("inferlab:cpu_fallbacks_total", "slow")] == 0  # every reason is exported, so rate() works from zero
    assert s[("inferlab:cpu_fallbacks_total", "contended")] == 1
    assert s[("inferlab:cpu_recoveries_total", None)] == 2


def test_off_the_cpu_nothing_is_exported():
    m = ServerMetrics("smol")
    m.engine.stats = EngineStats()
    assert not any(name.startswith("inferlab:cpu_") for name, _ in _samples(m))
