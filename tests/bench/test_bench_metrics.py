"""Metric definitions on constructed records: no timing, no server. Expected values are worked out by hand
from docs/metrics.md's definitions."""

import math

import numpy as np
import pytest

from inferlab.bench import metrics, slo
from inferlab.bench.records import RequestRecord
from inferlab.bench.summary import summarize
from inferlab.common.units import UnitError, parse_duration


def rec(sent=0.0, times=(), toks=(), end=None, scheduled=None, out=None, **kw) -> RequestRecord:
    times, toks = list(times), list(toks)
    return RequestRecord(
        index=kw.pop("index", 0), sent=sent, scheduled=scheduled, chunk_times=times, chunk_tokens=toks,
        end=end if end is not None else (times[-1] if times else None),
        output_tokens=out if out is not None else sum(toks), **kw,
    )


def test_ttft_skips_zero_token_chunks_and_uses_send_time_in_closed_loop():
    # role-only chunk at 0.05 carries no token; the first token arrives at 0.2
    r = rec(sent=1.0, times=[1.05, 1.2, 1.3], toks=[0, 1, 1])
    assert metrics.ttft(r) == pytest.approx(0.2)


def test_open_loop_clock_starts_at_schedule_and_client_delay_is_recorded():
    r = rec(scheduled=1.0, sent=1.25, times=[1.5, 1.6], toks=[1, 1], end=1.7)
    assert metrics.ttft(r) == pytest.approx(0.5)  # not 0.25: the client's lateness is the user's wait too
    assert metrics.client_delay(r) == pytest.approx(0.25)
    assert metrics.e2e(r) == pytest.approx(0.7)
    closed = rec(sent=1.25, times=[1.5, 1.6], toks=[1, 1], end=1.7)
    assert metrics.ttft(closed) == pytest.approx(0.25)
    assert metrics.client_delay(closed) is None


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = rec(sent=0.0, times=[0.1, 0.2, 0.3, 0.4, 0.5], toks=[1, 1, 1, 1, 1], end=0.5)
    assert metrics.tpot(r) == pytest.approx((0.5 - 0.1) / 4)
    assert metrics.output_tokens_per_s_per_user(r) == pytest.approx(4 / 0.4)
    assert metrics.e2e_per_output_token(r) == pytest.approx(0.5 / 5)
    one = rec(sent=0.0, times=[0.1], toks=[1])
    assert metrics.tpot(one) is None and metrics.output_tokens_per_s_per_user(one) is None


def test_tpot_uses_server_output_tokens_not_chunk_count():
    # 3 chunks, but the server's usage says 7 tokens
    r = rec(sent=0.0, times=[0.1, 0.2, 0.7], toks=[1, 3, 3], end=0.7, out=7)
    assert metrics.tpot(r) == pytest.approx(0.6 / 6)


def test_itl_splits_multi_token_chunks_into_equal_gaps():
    # chunks of 2, 3, 1 tokens at 0.1, 0.4, 0.5
    r = rec(sent=0.0, times=[0.1, 0.4, 0.5], toks=[2, 3, 1])
    itl = metrics.itl_samples(r)
    np.testing.assert_allclose(itl, [0.0, 0.1, 0.1, 0.1, 0.1])
    assert itl.size == r.output_tokens - 1
    assert itl.sum() == pytest.approx(0.5 - 0.1)
    np.testing.assert_allclose(metrics.inter_chunk_samples(r), [0.3, 0.1])


def test_itl_mean_equals_tpot_when_the_stream_ends_with_the_last_token():
    r = rec(sent=0.0, times=[0.05, 0.2, 0.21, 0.5], toks=[1, 2, 1, 4], end=0.5)
    assert metrics.itl_samples(r).mean() == pytest.approx(metrics.tpot(r))


def test_ttft_content_only_when_reasoning_is_streamed_apart():
    r = rec(sent=0.0, times=[0.1, 0.2, 0.3], toks=[1, 1, 1], reasoning=True, first_content=0.3)
    assert metrics.ttft(r) == pytest.approx(0.1)
    assert metrics.ttft_content(r) == pytest.approx(0.3)
    assert metrics.ttft_content(rec(sent=0.0, times=[0.1], toks=[1], first_content=0.1)) is None


def test_stats_percentiles_follow_numpy_linear_interpolation():
    vals = np.arange(1, 101, dtype=float)  # 1..100
    s = metrics.stats(vals)
    assert s["count"] == 100 and s["mean"] == pytest.approx(50.5) and s["max"] == 100 and s["min"] == 1
    assert s["p50"] == pytest.approx(50.5)
    assert s["p99"] == pytest.approx(99.01)
    assert s["p90"] == pytest.approx(90.1)
    assert s["std"] == pytest.approx(np.std(vals))
    assert len(s["cdf"]) == metrics.CDF_POINTS and s["cdf"][0] == 1 and s["cdf"][-1] == 100
    assert metrics.stats([])["p99"] is None


def _load():
    return {"kind": "concurrency", "value": 2, "label": "concurrency 2"}


def test_summary_counts_throughput_and_leaves_out_warmup_errors_and_cancelled():
    rs = [
        rec(index=0, sent=0.0, times=[0.1, 0.2], toks=[1, 1], end=0.2, warmup=True, prompt_tokens=10),
        rec(index=1, sent=0.5, times=[0.6, 0.7, 0.8], toks=[1, 1, 1], end=0.8, prompt_tokens=10),
        rec(index=2, sent=0.5, times=[0.9, 2.5], toks=[2, 2], end=2.5, prompt_tokens=20),
        rec(index=3, sent=1.0, error_kind="http_500", error="boom", http_status=500),
        rec(index=4, sent=1.0, times=[1.1], toks=[1], error_kind="cancelled"),
        rec(index=5, sent=1.0, times=[1.2], toks=[1], error_kind="connection_dropped", error="reset"),
    ]
    s = summarize(rs, load=_load())
    c = s["counts"]
    assert (c["measured"], c["completed"], c["failed"], c["cancelled"], c["warmup"]) == (4, 2, 2, 1, 1)
    assert c["error_rate"] == pytest.approx(0.5)
    # window: first measured start 0.5 .. last byte seen by a measured request 2.5
    assert s["window"]["duration"] == pytest.approx(2.0)
    assert s["throughput"]["requests_per_s"] == pytest.approx(2 / 2.0)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx((3 + 4) / 2.0)
    assert s["throughput"]["input_tokens_per_s"] == pytest.approx(30 / 2.0)
    assert s["latency"]["ttft"]["count"] == 2
    assert s["latency"]["ttft"]["max"] == pytest.approx(0.4)
    assert s["errors"] == {"http_500": {"count": 1, "sample": "boom"},
                           "connection_dropped": {"count": 1, "sample": "reset"}}


def test_goodput_counts_requests_meeting_every_objective_and_failures_as_missing():
    rs = [
        rec(index=0, sent=0.0, times=[0.1, 0.2], toks=[1, 1], end=0.2),  # ttft .1 tpot .1 e2e .2: good
        rec(index=1, sent=0.0, times=[0.6, 0.7], toks=[1, 1], end=0.7),  # ttft too slow
        rec(index=2, sent=0.0, times=[0.1, 0.5], toks=[1, 1], end=0.5),  # tpot .4 too slow
        rec(index=3, sent=0.0, times=[0.1], toks=[1], end=0.1),  # one token: TPOT met vacuously: good
        rec(index=4, sent=0.0, error_kind="timeout", error="t"),
    ]
    slos = slo.parse_slos(["ttft=500ms", "tpot=200ms", "e2e=1s"])
    assert slos == {"ttft": 0.5, "tpot": 0.2, "e2e": 1.0}
    s = summarize(rs, load=_load(), slos=slos)
    g = s["goodput"]
    assert (g["good"], g["total"]) == (2, 5)
    assert g["share"] == pytest.approx(0.4)
    assert g["requests_per_s"] == pytest.approx(2 / 0.7)
    assert not s["slo_gate"]["passed"]
    assert any("ttft p99" in m for m in s["slo_gate"]["misses"])


def test_slo_gate_uses_the_chosen_percentile():
    rs = [rec(index=i, sent=0.0, times=[0.01 * (i + 1)], toks=[1]) for i in range(100)]  # ttft 10..1000 ms
    s = summarize(rs, load=_load(), slos={"ttft": 0.6}, slo_percentile="p50")
    assert s["slo_gate"]["passed"]
    s = summarize(rs, load=_load(), slos={"ttft": 0.6}, slo_percentile="p99")
    assert not s["slo_gate"]["passed"]


def test_assert_slo_helper():
    rs = [rec(index=i, sent=0.0, times=[0.1, 0.15], toks=[1, 1]) for i in range(10)]
    results = {"runs": [summarize(rs, load=_load())]}
    slo.assert_slo(results, ttft_p99="150ms", tpot_p99="60ms", error_rate="1%")
    with pytest.raises(AssertionError, match="ttft_p99"):
        slo.assert_slo(results, ttft_p99="50ms")
    with pytest.raises(slo.SLOError, match="bogus"):
        slo.assert_slo(results, bogus_p99="1s")


def test_slo_parsing_errors_name_the_problem():
    with pytest.raises(UnitError, match="has no unit"):
        parse_duration("500")
    with pytest.raises(UnitError, match="--slo ttft: '500' has no unit; write e.g. '500ms' or '500s'"):
        slo.parse_slos(["ttft=500"])
    with pytest.raises(slo.SLOError, match="cannot be negative"):
        slo.parse_slos(["ttft=-5ms"])
    assert slo.parse_slos(["ttft=500ms", "e2e=2m"]) == {"ttft": 0.5, "e2e": 120.0}
    with pytest.raises(slo.SLOError, match="unknown metric"):
        slo.parse_slos(["latency=1s"])
    with pytest.raises(slo.SLOError, match="METRIC=DURATION"):
        slo.parse_slos(["ttft"])
    assert parse_duration("50us") == pytest.approx(5e-5)
    assert parse_duration("2m") == 120
    assert slo.parse_percentile("99") == "p99"


def test_warnings_for_short_outputs_prompt_drift_cache_hits_and_client_delay():
    rs = [
        rec(index=0, scheduled=0.0, sent=0.05, times=[0.1, 0.2], toks=[1, 1], output_len=5, finish_reason="stop",
            input_len=100, prompt_tokens=100, cached_tokens=80),
        rec(index=1, scheduled=0.0, sent=0.0, times=[0.1, 0.2], toks=[1, 1], output_len=2, input_len=100,
            prompt_tokens=110, cached_tokens=0),
    ]
    w = " | ".join(summarize(rs, load=_load(), cache_free=True)["warnings"])
    assert "stopped before their requested output length" in w
    assert "drift" in w
    assert "prefix cache" in w
    assert "fell behind" in w


def test_timeline_counts_requests_in_flight_and_token_rate():
    rs = [rec(index=i, sent=0.0, times=[0.5, 1.0], toks=[5, 5], end=1.0) for i in range(3)]
    rs.append(rec(index=3, sent=0.0, times=[2.0], toks=[10], end=2.0))
    tl = summarize(rs, load=_load())["timeline"]
    t = np.array(tl["t"])
    conc = np.array(tl["concurrency"])
    assert conc[t < 0.9].min() == 4 and conc[(t > 1.1) & (t < 1.9)].max() == 1
    total = (np.array(tl["output_tokens_per_s"]) * tl["bucket_s"]).sum()
    assert math.isclose(total, 40, rel_tol=1e-9)
