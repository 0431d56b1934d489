"""inferlab bench: an honest load generator and latency report for any OpenAI-compatible server.
It never imports the engine or torch; see docs/metrics.md for what every number means."""

__all__ = ["assert_slo"]


def __getattr__(name: str):
    if name == "assert_slo":
        from inferlab.bench.slo import assert_slo

        return assert_slo
    raise AttributeError(name)
