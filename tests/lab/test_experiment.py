"""Experiments end to end: on the fake server (fast; every branch of planning, resume, quality gating and the
report), and on the bundled model with two tiny configs."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import pytest

from inferlab.lab.card import card_from_dict
from inferlab.lab.experiment import (Experiment, ExperimentError, PointResult, Variation, parse_vary,
                                     plan_configs, quality_checks, rank, verdict)
from inferlab.lab.report import render

FAKE_CARD = {
    "name": "fake-exp",
    "contract": {"endpoint": "completions", "quality": {"perplexity_max_increase_pct": 5}},
    "traffic": {"arrival": "closed", "concurrency": 2, "requests": 4, "warmup": 1, "input_len": 8, "output_len": 6},
    "objectives": {"ttft": {"p99": "1min"}, "e2e": {"p99": "1min"}, "max_error_rate": 0.0},
    "server": {"kind": "command", "ready_timeout": "120s",
               "command": f"{sys.executable} -m inferlab fake-server --port {{port}} --ttft 5ms",
               "config": {"itl": "1ms"}},
}


def fake_quality(point, baseline, pdir):
    # A deterministic stand-in for `inferlab eval`: the slower "itl" value pretends to lose quality.
    return {"perplexity": 10.0 if point.config["itl"] == "1ms" else 12.0, "task_accuracy": 0.5}, "stand-in"


def test_plan_changes_one_variable_at_a_time():
    pts = plan_configs({"quantization": "none", "max_num_seqs": 8},
                       [Variation("quantization", ["none", "int8", "int4"]), Variation("max_num_seqs", [8, 32])])
    assert [p.id for p in pts] == ["baseline", "quantization=int8", "quantization=int4", "max_num_seqs=32"]
    assert pts[2].config == {"quantization": "int4", "max_num_seqs": 8} and pts[2].changes == {"quantization": "int4"}


def test_parse_vary_types_and_errors():
    card = card_from_dict({**FAKE_CARD, "server": {"config": {"max_num_seqs": 4}}})
    v = parse_vary(["max-num-seqs=4,16", "enable_prefix_caching=true,false"], card)
    assert v[0].key == "max_num_seqs" and v[0].values == [4, 16] and v[1].values == [True, False]
    with pytest.raises(ExperimentError, match="not an `inferlab serve` option"):
        parse_vary(["max_seqs=1,2"], card)
    with pytest.raises(ExperimentError, match="write KEY=V1,V2"):
        parse_vary(["quantization"], card)
    with pytest.raises(ExperimentError, match="given twice"):
        parse_vary(["max_num_seqs=1", "max_num_seqs=2"], card)
    endpoint = card_from_dict({**FAKE_CARD, "server": {"kind": "endpoint", "url": "http://x:1"}})
    with pytest.raises(ExperimentError, match="cannot change its config"):
        parse_vary(["max_num_seqs=1,2"], endpoint)


def test_quality_floor_rejects_whatever_the_speed():
    card = card_from_dict(FAKE_CARD)
    base = PointResult("baseline", {}, {}, status="measured", quality={"perplexity": 10.0})
    fast = PointResult("x", {"a": 1}, {}, status="measured", quality={"perplexity": 10.8})
    run = {"ttft": {"p99": 0.01}, "e2e": {"p99": 0.1}, "requests_per_s": 100.0, "error_rate": 0.0,
           "goodput_rps": None, "goodput_share": None}
    base.repeats, fast.repeats = [dict(run, requests_per_s=1.0)], [run]
    checks = quality_checks(card, fast.quality, base.quality)
    assert checks[0].measured == pytest.approx(8.0) and checks[0].passed is False
    v = verdict(card, fast, base)
    assert not v.accepted and v.status == "rejected: below the quality floor"
    assert verdict(card, base, base).status == "accepted"
    assert [r.id for r, _ in rank(card, [fast, base])] == ["baseline", "x"]  # 100x faster, still ranked last
    unknown = PointResult("y", {}, {}, status="measured", quality=None, repeats=[run])
    assert verdict(card, unknown, base).status == "unverified: quality not measured"


def test_experiment_on_the_fake_server_resumes_and_reports(tmp_path, monkeypatch):
    card = card_from_dict(FAKE_CARD)
    logs: list[str] = []
    # busy_retries=0: this test counts bench calls, and this machine may be busy (that is tested below).
    exp = Experiment(card, [Variation("itl", ["1ms", "3ms"])], tmp_path, repeats=2, quality=fake_quality,
                     log=logs.append, busy_retries=0)

    # Interrupt the second config mid-measurement: the first stays measured.
    calls = {"n": 0}
    real_bench = Experiment._bench

    def flaky(self, srv, out, repeat):
        calls["n"] += 1
        if calls["n"] == 3:  # baseline took two runs; the second config's first run is interrupted
            raise KeyboardInterrupt
        return real_bench(self, srv, out, repeat)

    monkeypatch.setattr(Experiment, "_bench", flaky)
    with pytest.raises(KeyboardInterrupt):
        exp.run()
    state = json.loads((tmp_path / "state.json").read_text())
    assert list(state["points"]) == ["baseline"] and state["points"]["baseline"]["status"] == "measured"

    monkeypatch.setattr(Experiment, "_bench", real_bench)
    logs.clear()
    results = Experiment(card, [Variation("itl", ["1ms", "3ms"])], tmp_path, repeats=2, quality=fake_quality,
                         log=logs.append).run()
    assert any("resuming: 1 config(s) already measured (baseline)" in m for m in logs)
    assert any("baseline: measured before, kept" in m for m in logs)
    by_id = {r.id: r for r in results}
    assert set(by_id) == {"baseline", "itl=3ms"}
    slow = by_id["itl=3ms"]
    assert slow.status == "measured" and len(slow.repeats) == 2 and slow.config == {"itl": "3ms"}
    assert all(r["completed"] == 4 for r in slow.repeats)
    assert slow.metric("ttft.p99")["n"] == 2
    assert verdict(card, slow, by_id["baseline"]).status == "rejected: below the quality floor"

    text = render(card, results, [Variation("itl", ["1ms", "3ms"])], repeats=2, requests=None, command="cmd")
    for heading in ("## 1. Workload assumptions and missing measurements", "## 2. Objective and baseline",
                    "## 3. Main bottleneck hypothesis", "## 4. Ranked experiments", "## 5. Acceptance verdict"):
        assert heading in text
    assert "Recommended: **`baseline`**" in text
    assert "| 2 | `itl=3ms` | rejected: below the quality floor |" in text
    assert "perplexity +20%" in text  # the trade-off line

    with pytest.raises(ExperimentError, match="belongs to a different experiment"):
        Experiment(card, [Variation("itl", ["1ms", "9ms"])], tmp_path, repeats=2).run()


def test_failed_start_is_recorded_and_reported(tmp_path):
    card = card_from_dict({**FAKE_CARD, "server": {**FAKE_CARD["server"], "config": {"itl": "1ms"}}})
    # An invalid flag makes the fake server exit at once: the launcher's failure lands in the state and report.
    results = Experiment(card, [Variation("tokens_per_chunk", [0])], tmp_path, repeats=1, log=lambda m: None).run()
    bad = next(r for r in results if r.id == "tokens_per_chunk=0")
    assert bad.status == "failed" and "exited with code" in bad.error
    text = render(card, results, [], repeats=1, requests=None, command="cmd")
    assert "did not run: the engine exited with code" in text


@pytest.mark.slow
def test_experiment_on_the_bundled_model(tmp_path):
    """Two tiny configs of inferlab's own server on the bundled model, through the CLI; quality is skipped (the
    eval tests cover it) so the test stays bounded by two server starts and a few short requests."""
    from inferlab.cli import main
    from inferlab.common.bundled import bundled_model_path

    try:
        bundled_model_path()
    except FileNotFoundError:
        pytest.skip("bundled model not installed")
    card = tmp_path / "card.yaml"
    card.write_text(json.dumps({
        "name": "tiny", "contract": {"endpoint": "completions"},
        "traffic": {"arrival": "closed", "concurrency": 2, "requests": 3, "warmup": 1, "input_len": 16,
                    "output_len": 4},
        "objectives": {"ttft": {"p99": "10min"}, "max_error_rate": 0.0},
        "server": {"config": {"max_num_seqs": 2}, "ready_timeout": "10min"},
    }))
    out = tmp_path / "exp"
    assert main(["experiment", str(card), "--vary", "max_num_seqs=2,4", "--repeats", "1", "--no-quality",
                 "--output-dir", str(out)]) == 0
    state = json.loads((out / "state.json").read_text())
    assert {k: v["status"] for k, v in state["points"].items()} == {"baseline": "measured",
                                                                     "max_num_seqs=4": "measured"}
    base = state["points"]["baseline"]
    assert base["repeats"][0]["completed"] == 3 and base["repeats"][0]["error_rate"] == 0
    assert base["memory"]["weight_bytes"] > 0
    report = (out / "report.md").read_text()
    assert "## 5. Acceptance verdict" in report and "`max_num_seqs=4`" in report


def test_quality_from_a_real_eval_report(tmp_path):
    """The adapter reads what `inferlab eval` writes (built here with eval's own functions); a config that
    differs from the baseline only in speed options takes the baseline's eval without running one."""
    from inferlab.lab import eval as ev
    from inferlab.lab.experiment import ConfigPoint, eval_quality, quality_config, quality_from_eval

    agr = ev.greedy_agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]], 3)
    report = {"perplexity": {"perplexity": 12.5}, "tasks": {"accuracy": 0.4},
              "agreement": {**asdict(agr), "task_answers_identical": None}}
    q = quality_from_eval(report)
    assert q == {"perplexity": 12.5, "task_accuracy": 0.4, "greedy_agreement": agr.agreement}
    assert agr.agreement == 0.5

    assert quality_config({"max_num_seqs": 8, "quantization": "int4", "quant_group_size": 64, "port": 1}) == {
        "quantization": "int4", "quant_group_size": 64}
    base = ConfigPoint("baseline", {}, {"quantization": "none", "max_num_seqs": 4})
    (tmp_path / "baseline").mkdir()
    (tmp_path / "baseline" / "eval.json").write_text(json.dumps(report))
    point = ConfigPoint("max_num_seqs=8", {"max_num_seqs": 8}, {"quantization": "none", "max_num_seqs": 8})
    (tmp_path / "p").mkdir()
    got, note = eval_quality(point, base, tmp_path / "p")
    assert got["perplexity"] == 12.5 and "same numerics as the baseline" in note
    assert got["greedy_agreement"] == 1.0  # identical offline numerics, identical greedy tokens


def test_repeats_measured_on_a_busy_machine_are_measured_again_then_flagged(tmp_path, monkeypatch):
    from inferlab.lab.experiment import BUSY_RETRIES

    card = card_from_dict(FAKE_CARD)
    real_bench = Experiment._bench
    calls: list[int] = []

    def busy_bench(self, srv, out, repeat):
        run = real_bench(self, srv, out, repeat)
        calls.append(repeat)
        # repeat 0: busy once, then quiet; repeat 1: busy every time (the neighbour never leaves)
        busy = (repeat == 0 and calls.count(0) == 1) or repeat == 1
        run["machine"] = {**(run.get("machine") or {}), "foreign_cpu_share": 0.5 if busy else 0.01,
                          "contaminated": busy}
        return run

    monkeypatch.setattr(Experiment, "_bench", busy_bench)
    logs: list[str] = []
    (res,) = Experiment(card, [], tmp_path, repeats=2, quality=fake_quality, log=logs.append,
                        busy_retries=BUSY_RETRIES).run()
    assert calls == [0, 0] + [1] * (1 + BUSY_RETRIES)
    assert res.busy_repeats == 1 and len(res.repeats) == 2
    assert [r["machine"]["contaminated"] for r in res.repeats] == [False, True]
    assert sum("ran on a busy machine (other processes used 50% of the CPU)" in m for m in logs) == 1 + BUSY_RETRIES
    assert any("kept, flagged: still a busy machine" in m for m in logs)
    text = render(card, [res], [], repeats=2, requests=None, command="cmd")
    assert "- Missing: a quiet machine: repeats of baseline (1) ran beside other CPU work" in text


def test_reproduce_section_starts_a_command_server_by_hand():
    # A `server.kind: command` card has no bench flag that starts its server: the report must show the server's
    # command line and a bench run pointed at it, never an empty by-hand command.
    import shlex

    from inferlab.bench import cli as bench_cli

    card = card_from_dict(FAKE_CARD)
    text = render(card, [], [], repeats=1, requests=None, command="cmd")
    block = text.split("## Reproduce", 1)[1].split("```")[1].strip().splitlines()
    serve, bench = block[-2], block[-1]
    assert serve.endswith(" &") and "fake-server --port 8000 --ttft 5ms --itl 1ms" in serve
    assert bench.startswith("inferlab bench ") and "--base-url http://127.0.0.1:8000" in bench
    import argparse

    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    args = p.parse_args(shlex.split(bench)[2:])  # the by-hand command is one bench reads back
    assert args.base_url == "http://127.0.0.1:8000" and args.concurrency == 2
