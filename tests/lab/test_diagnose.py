"""Diagnosis rules on synthetic results, built with bench's own summarize() so the shape is the real one."""

from __future__ import annotations

import json

import pytest

from inferlab.bench.records import RequestRecord
from inferlab.bench.summary import summarize
from inferlab.lab.diagnose import diagnose, runs_from_results


def records(n: int, ttft: float, itl: float, out: int = 20, gap: float = 0.1, errors: int = 0,
            tail: float | None = None, delay: float = 0.0) -> list[RequestRecord]:
    """n requests sent `gap` apart, each with the given TTFT and a constant inter-token gap; with `tail`, every
    tenth request's TTFT is `tail` instead."""
    out_recs = []
    for i in range(n):
        t0 = i * gap
        first = t0 + (tail if tail is not None and i % 10 == 9 else ttft) + delay
        times = [first + k * itl for k in range(out)]
        r = RequestRecord(index=i, scheduled=t0 if delay else None, sent=t0 + delay, end=times[-1],
                          chunk_times=times, chunk_tokens=[1] * out, token_source="usage", input_len=100,
                          output_len=out, prompt_tokens=100, output_tokens=out, finish_reason="length")
        out_recs.append(r)
    for i in range(errors):
        out_recs.append(RequestRecord(index=n + i, sent=0.0, error_kind="http_429", error="queue full",
                                      http_status=429))
    return out_recs


def run(recs, load: float, slos=None, server=None) -> dict:
    s = summarize(recs, load={"label": f"c={load:g}", "concurrency": load}, slos=slos)
    if server:
        s["server_metrics"] = server
    return s


def titles(d) -> list[str]:
    return [h.title for h in d.hypotheses]


def test_adapter_reads_bench_summaries():
    res = {"runs": [run(records(20, 0.5, 0.02), 8), run(records(20, 0.1, 0.02), 1)]}
    views = runs_from_results(res)
    assert [v.load for v in views] == [1, 8]  # sorted lightest first
    assert views[0].stat("ttft") == pytest.approx(0.1)
    assert views[1].stat("tpot") == pytest.approx(0.02)
    assert views[0].output_mean == 20 and views[0].input_mean == 100


def scraped(before: str, after: str) -> dict:
    """Server metrics in the shape bench's --scrape-metrics writes, made by bench's own Scraper."""
    from inferlab.bench.scrape import Scraper, parse

    sc = Scraper(None, "http://x")
    sc.samples = [parse(before), parse(after)]
    return sc.summary()


def test_adapter_reads_bench_scrape_summaries():
    before = ("vllm:num_preemptions_total 2\nvllm:kv_cache_usage_perc 0.5\nvllm:num_requests_waiting 0\n"
              "vllm:request_queue_time_seconds_sum 1.0\nvllm:request_queue_time_seconds_count 10\n"
              "inferlab:engine_steps_total 100\ninferlab:engine_step_seconds_total 1.0\n")
    after = ("vllm:num_preemptions_total 9\nvllm:kv_cache_usage_perc 0.95\nvllm:num_requests_waiting 7\n"
             "vllm:request_queue_time_seconds_sum 5.0\nvllm:request_queue_time_seconds_count 30\n"
             "inferlab:engine_steps_total 300\ninferlab:engine_step_seconds_total 9.0\n")
    v = runs_from_results(run(records(5, 0.1, 0.02), 1, server=scraped(before, after)))[0]
    assert v.server["preemptions"] == 7
    assert v.server["kv_cache_usage"] == 0.95  # the peak of the sampled gauge
    assert v.server["num_waiting"] == 7
    assert v.server["queue_time_mean"] == pytest.approx(4.0 / 20)
    assert v.server["step_time_mean"] == pytest.approx(8.0 / 200)


def test_high_ttft_normal_decode_points_at_queueing():
    server = {"vllm:request_queue_time_seconds": {"sum": 6.0, "count": 10},
              "vllm:request_prefill_time_seconds": {"sum": 0.5, "count": 10}}
    res = {"runs": [run(records(20, 0.1, 0.02), 1), run(records(20, 0.8, 0.021), 16, server=server)]}
    d = diagnose(res)
    h = d.hypotheses[0]
    assert h.title.startswith("high TTFT with normal decode")
    assert "x8.0" in h.symptom
    assert h.causes[0].startswith("queueing") and h.supported
    assert any("queue time mean 600.0 ms = 75% of TTFT" in e for e in h.evidence)
    assert "vllm:request_queue_time_seconds" in h.confirm and h.vary
    assert not any("slow decode" in t for t in titles(d))


def test_prefill_dominant_reorders_the_causes():
    server = {"queue_time_mean": 0.05, "prefill_time_mean": 0.7}
    res = {"runs": [run(records(20, 0.1, 0.02), 1), run(records(20, 0.8, 0.02), 16, server=server)]}
    assert diagnose(res).hypotheses[0].causes[0].startswith("long prompts")


def test_slow_decode_with_kv_pressure():
    server = {"vllm:kv_cache_usage_perc": 0.97, "vllm:num_preemptions": {"delta": 12}}
    res = {"runs": [run(records(20, 0.1, 0.02), 1), run(records(20, 0.12, 0.07), 32, server=server)]}
    d = diagnose(res)
    h = d.hypotheses[0]
    assert h.title.startswith("normal TTFT with slow decode")
    assert h.causes[0].startswith("KV pressure") and h.supported
    assert "KV cache usage 97%" in h.evidence and "12 preemptions during the run" in h.evidence
    assert h.vary.startswith("quantization")


def test_both_degrading_with_a_throughput_plateau_is_saturation():
    # Same send spacing at both loads: throughput flat while both latencies grow.
    res = {"runs": [run(records(30, 0.1, 0.02), 4), run(records(30, 0.5, 0.06), 8, server={"num_waiting": 20})]}
    d = diagnose(res)
    assert titles(d)[0].startswith("TTFT and decode both degrade")
    assert d.hypotheses[0].supported
    assert any("stopped rising" in e for e in d.hypotheses[0].evidence)


def test_rising_throughput_with_a_broken_tail_is_the_batching_policy():
    light = run(records(40, 0.1, 0.02, gap=0.2), 2)
    heavy = run(records(40, 0.1, 0.02, gap=0.05, tail=2.0), 8)
    d = diagnose({"runs": [light, heavy]})
    assert "throughput still rises but the tail breaks: the batching policy" in titles(d)
    h = next(h for h in d.hypotheses if "batching" in h.title)
    assert "ttft p99" in h.symptom and "max_num_batched_tokens" in h.vary


def test_objectives_from_a_card_judge_a_single_run():
    res = run(records(20, 0.9, 0.02), 4)
    d = diagnose(res, {"ttft": {"p99": 0.5}, "tpot": {"p99": 0.05}})
    assert titles(d)[0].startswith("high TTFT")
    assert "ttft p99 900.0 ms > objective 500.0 ms" in d.hypotheses[0].symptom
    assert not d.hypotheses[0].supported  # no server metrics: the symptom only
    assert any("--scrape-metrics" in n for n in d.notes)


def test_run_slos_are_used_when_no_card():
    res = run(records(20, 0.1, 0.09), 4, slos={"ttft": 0.5, "tpot": 0.05})
    d = diagnose(res)
    assert titles(d)[0].startswith("normal TTFT with slow decode")
    assert "objectives" in d.reference


def test_single_run_without_reference_makes_no_latency_claims():
    d = diagnose(run(records(20, 3.0, 0.5), 4))
    assert d.hypotheses == []
    assert any("nothing to judge it by" in n for n in d.notes)


def test_errors_and_client_delay():
    res = run(records(20, 0.1, 0.02, errors=3, delay=0.05), 4)
    d = diagnose(res)
    t = titles(d)
    assert "requests fail" in t and "the load generator fell behind" in t
    fail = next(h for h in d.hypotheses if h.title == "requests fail")
    assert "http_429 x3" in fail.symptom and fail.causes[0].startswith("admission control")


def test_prefix_cache_misses():
    res = run(records(20, 0.1, 0.02), 4, server={"vllm:prefix_cache_queries": 2000, "vllm:prefix_cache_hits": 0})
    d = diagnose(res, prefix_share=0.4)
    h = d.hypotheses[0]
    assert "not served from cache" in h.title and "served 0%" in h.symptom


def test_cli_says_these_are_hypotheses(tmp_path, capsys):
    from inferlab.cli import main

    res = {"runs": [run(records(20, 0.1, 0.02), 1), run(records(20, 0.8, 0.02), 16)]}
    p = tmp_path / "results.json"
    p.write_text(json.dumps(res))
    assert main(["diagnose", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "hypotheses drawn from symptoms, not conclusions" in out and "Hypothesis 1: high TTFT" in out
    assert main(["diagnose", str(p), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["disclaimer"].startswith("These are hypotheses") and d["hypotheses"][0]["confirm"]
    (tmp_path / "bad.json").write_text("{nope")
    assert main(["diagnose", str(tmp_path / "bad.json")]) == 2
    assert "is not JSON" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"a": 1}')
    assert main(["diagnose", str(tmp_path / "other.json")]) == 2
    assert "does not look like bench results" in capsys.readouterr().err


def test_both_slow_without_queueing_points_at_the_step():
    obj = {"ttft": {"p99": 0.5}, "tpot": {"p99": 0.05}}
    quiet = run(records(20, 0.9, 0.2), 4, server={"requests_waiting": {"mean": 0.2, "max": 1},
                                                  "counters_delta": {"inferlab:engine_steps_total": 100,
                                                                     "inferlab:engine_step_seconds_total": 20.0}})
    d = diagnose(quiet, obj)
    assert titles(d)[:2] == ["TTFT and decode both slow without queueing: every engine step is slow",
                             "TTFT and decode both degrade: the server is saturated"]
    assert d.hypotheses[0].supported and "engine step mean 200.0 ms" in d.hypotheses[0].evidence
    busy = run(records(20, 0.9, 0.2), 4, server={"requests_waiting": {"mean": 6, "max": 12}})
    d = diagnose(busy, obj)
    assert titles(d)[0] == "TTFT and decode both degrade: the server is saturated" and d.hypotheses[0].supported


def _machine(foreign: float, bench_cores: float = 0.1) -> dict:
    from inferlab.bench.machine import CLIENT_BUSY, FOREIGN_MAX

    return {"foreign_cpu_share": foreign, "server_cpu_share": 0.4, "bench_cpu_cores": bench_cores,
            "cpu_pressure_some_avg": 35.0, "contaminated": foreign >= FOREIGN_MAX,
            "client_bound": bench_cores >= CLIENT_BUSY}


def test_a_contaminated_run_is_said_first(tmp_path, capsys):
    quiet, busy = run(records(20, 0.1, 0.02), 1), run(records(20, 0.9, 0.2), 8)
    quiet["machine"], busy["machine"] = _machine(0.02), _machine(0.48)
    d = diagnose({"runs": [quiet, busy]})
    h = d.hypotheses[0]
    assert h.title == "the machine was busy: the results are contaminated" and h.supported
    assert "1 of 2 load point(s)" in h.symptom
    assert any("c=8: other processes used 48%" in e for e in h.evidence)
    from inferlab.cli import main

    (tmp_path / "results.json").write_text(json.dumps({"runs": [quiet, busy]}))
    assert main(["diagnose", str(tmp_path)]) == 0
    assert "Hypothesis 1: the machine was busy" in capsys.readouterr().out


def test_quiet_runs_say_nothing_about_the_machine_and_a_busy_client_is_named():
    quiet = run(records(20, 0.1, 0.02), 4)
    quiet["machine"] = _machine(0.01)
    assert not any("busy" in t for t in titles(diagnose(quiet)))
    quiet["machine"] = _machine(0.01, bench_cores=0.95)
    h = next(h for h in diagnose(quiet).hypotheses if h.title == "the load generator fell behind")
    assert "0.95 CPU cores" in h.symptom and h.evidence
