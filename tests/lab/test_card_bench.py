"""A card drives a real bench run against `inferlab fake-server` started by the launcher from a command template,
and the run is checked against the card's objectives and diagnosed: the lab's loop without a model."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request

import pytest

from inferlab.bench.benchmark import Benchmark
from inferlab.lab.card import ServerSpec, bench_slo_percentile, card_from_dict, evaluate, start_server, to_bench_config
from inferlab.lab.diagnose import diagnose

CARD = {
    "name": "fake",
    "contract": {"endpoint": "completions", "streaming": True},
    "traffic": {"arrival": "closed", "concurrency": 2, "requests": 6, "warmup": 1, "input_len": 16,
                "output_len": 8, "seed": 3},
    # A limit of 1 µs cannot be met (the fake server waits 10 ms before its first token); one of a minute is.
    "objectives": {"ttft": {"p50": "1us", "p99": "1min"}, "e2e": {"p99": "1min"}, "max_error_rate": 0.0},
    "server": {"kind": "command", "ready_timeout": "120s",
               "command": f"{sys.executable} -m inferlab fake-server --port {{port}} --ttft 10ms --itl 2ms",
               "config": {"model": "stand-in"}},
}


def test_bench_config_from_card():
    card = card_from_dict(CARD)
    cfg = to_bench_config(card, base_url="http://127.0.0.1:1")
    assert cfg.loads[0].kind == "concurrency" and cfg.loads[0].value == 2
    assert cfg.num_requests == 6 and cfg.warmup == 1 and cfg.seed == 3
    assert cfg.workload.input_len.describe() == "16" and cfg.workload.output_len.describe() == "8"
    assert cfg.slos == {"ttft": 60.0, "e2e": 60.0} and cfg.slo_percentile == "p99"
    assert cfg.target.endpoint == "completions" and cfg.target.stream
    with pytest.raises(ValueError, match="start it"):
        to_bench_config(card)  # a command server is started by the lab, not by bench
    open_loop = card_from_dict({**CARD, "traffic": {"arrival": "gamma", "rate": "120/min", "burstiness": 0.5,
                                                    "concurrency": 4, "input_len": {"dist": "uniform", "min": 8,
                                                                                    "max": 32}},
                                "server": {"config": {"max_num_seqs": 4}}})
    cfg = to_bench_config(open_loop)
    ld = cfg.loads[0]
    assert (ld.kind, ld.value, ld.arrival, ld.burstiness, ld.max_concurrency) == ("rate", 2.0, "gamma", 0.5, 4)
    assert cfg.workload.input_len.describe() == "uniform:8,32"
    assert cfg.base_url is None and cfg.serve_args == ["--max-num-seqs", "4"]
    assert cfg.server_timeout == 300.0  # the card's ready_timeout (its default) bounds bench's server start
    odd = card_from_dict({**CARD, "traffic": {"arrival": "poisson", "rate": "7/min"}, "server": {}})
    assert to_bench_config(odd).loads[0].value == 7 / 60  # exactly the card's rate, not a rounded one
    assert bench_slo_percentile(card_from_dict({**CARD, "objectives": {"ttft": {"p99.9": "1s"}}}).objectives) == "p99"
    assert bench_slo_percentile(card_from_dict({**CARD, "objectives": {"ttft": {"max": "1s"}}}).objectives) == "max"


def test_start_server_from_a_card_command(tmp_path):
    spec = ServerSpec(kind="command", command=f"{sys.executable} -m inferlab fake-server --port {{port}}",
                      config={"model": "stand-in", "ttft": "5ms"}, ready_timeout=120.0)
    with start_server(spec, log_path=tmp_path / "e.log") as srv:
        assert srv.argv[-4:] == ["--model", "stand-in", "--ttft", "5ms"]  # the config became flags
        with urllib.request.urlopen(srv.base_url + "/v1/models", timeout=10) as r:
            assert json.load(r)["data"][0]["id"] == "stand-in"
    assert srv.process.poll() is not None


def test_card_runs_through_bench_on_the_fake_server(tmp_path):
    card = card_from_dict(CARD)
    with start_server(card.server, log_path=tmp_path / "engine.log") as srv:
        cfg = to_bench_config(card, base_url=srv.base_url, output_dir=tmp_path / "bench")
        outcome = asyncio.run(Benchmark(cfg).run())
    results = outcome.results
    run = results["runs"][0]
    assert run["counts"]["completed"] == 6 and run["counts"]["warmup"] == 1
    assert results["provenance"]["target"]["model"] == "stand-in"
    assert run["tokens"]["output"]["mean"] == 8
    checks = {c.objective: c for c in evaluate(card.objectives, run)}
    assert checks["ttft p50 <= 0.001 ms"].passed is False
    assert checks["ttft p99 <= 60000 ms"].passed is True
    assert checks["e2e p99 <= 60000 ms"].passed is True
    assert checks["error rate <= 0.00%"].passed is True
    d = diagnose(results, card.objectives.latency)
    assert "ttft p99" in d.reference
    # TTFT misses its tightest objective and decode has none: the waiting-or-prefill hypothesis, with the
    # scraped metrics of the fake server (a few vllm: series) read where present.
    # A run on a busy machine (the test suite's own processes can make it one) is diagnosed as such first.
    busy = run["machine"]["contaminated"]
    if busy:
        assert d.hypotheses[0].title == "the machine was busy: the results are contaminated"
    ttft = d.hypotheses[1 if busy else 0]
    assert ttft.title == "high TTFT: waiting or prefill"
    assert "ttft p50" in ttft.symptom and "no objective or sweep" in ttft.symptom


def test_bench_flags_from_card_parse_to_the_same_config():
    """card_bench_argv and to_bench_config describe one run: bench's own parser turns the flags into the config."""
    import argparse

    from inferlab.bench import cli as bench_cli
    from inferlab.lab.card import card_bench_argv, load_card

    from pathlib import Path

    card = load_card(Path(__file__).resolve().parents[2] / "examples" / "card-chat.yaml")
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    argv = card_bench_argv(card) + ["--output-dir", "x"]
    via_flags = bench_cli.build_config(p.parse_args(argv), argv)
    direct = to_bench_config(card, output_dir="x")
    for name in ("loads", "workload", "serve_args", "num_requests", "duration", "warmup", "seed", "slos",
                 "slo_percentile", "scrape_metrics", "base_url"):
        assert getattr(via_flags, name) == getattr(direct, name), name
    assert via_flags.target.endpoint == direct.target.endpoint and via_flags.target.stream == direct.target.stream
