"""The `inferlab bench` command end to end against the fake server: outputs, SLO gate, sweeps, workers,
interrupts, usage errors, and independence from the engine."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inferlab.bench.records import read_records
from inferlab.bench.slo import assert_slo

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_outputs_are_views_of_the_results_json(fake, bench):
    url, _ = fake(ttft=0.01, itl=0.005)
    rc, res, out = bench("--base-url", url, "--concurrency", "3", "--num-requests", "9", "--warmup", "2",
                         "--input-len", "uniform:8,24", "--output-len", "5", "--scrape-metrics", "--seed", "4")
    assert rc == 0
    assert set(res) >= {"schema", "provenance", "runs", "sweep", "slo_passed", "records", "interrupted"}
    prov = res["provenance"]
    assert prov["target"]["model"] == "fake-model" and prov["models"]["data"][0]["id"] == "fake-model"
    assert prov["seed"] == 4 and prov["workload"]["input_len"] == "uniform:8,24" and prov["machine"]["cpu_count"]
    run = res["runs"][0]
    assert run["counts"]["warmup"] == 2 and run["counts"]["completed"] == 9
    recs = list(read_records(out / "records.jsonl"))
    assert len(recs) == 11 and sum(r.warmup for r in recs) == 2
    assert run["server_metrics"]["prefix_cache_queries"] == sum(r.prompt_tokens for r in recs)
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 1
    assert float(rows[0]["ttft_p99_ms"]) == pytest.approx(run["latency"]["ttft"]["p99"] * 1e3)
    html = (out / "report.html").read_text()
    assert "<svg" in html and "TTFT CDF" in html and "http" not in html.split("<body>")[0]  # offline: no links


def test_same_seed_same_workload_and_schedule(fake, bench):
    url, _ = fake(ttft=0.002, itl=0.001)
    runs = []
    for _ in range(2):
        rc, res, out = bench("--base-url", url, "--rate", "50", "--num-requests", "8", "--input-len", "12",
                             "--output-len", "2", "--seed", "9")
        runs.append(sorted(read_records(out / "records.jsonl"), key=lambda r: r.index))
    assert [r.scheduled for r in runs[0]] == [r.scheduled for r in runs[1]]
    assert [r.input_len for r in runs[0]] == [r.input_len for r in runs[1]]


def test_a_text_seed_sends_the_same_draw_in_other_words(fake, bench):
    """Two runs of one seed at two rates with different --text-seed: the same lengths and the same arrival times
    scaled by the rate, and no prompt the fake server's prefix cache has seen; a repeated text seed is seen."""
    url, _ = fake(ttft=0.002, itl=0.001)
    runs = []
    for rate, text in (("50", "1"), ("25", "2"), ("25", "2")):
        rc, res, out = bench("--base-url", url, "--rate", rate, "--num-requests", "8", "--input-len", "uniform:12,40",
                             "--output-len", "2", "--seed", "9", "--text-seed", text, "--scrape-metrics")
        assert rc == 0 and res["provenance"]["text_seed"] == int(text)
        runs.append((sorted(read_records(out / "records.jsonl"), key=lambda r: r.index), res))
    (a, res_a), (b, res_b), (_, res_c) = runs
    assert [r.input_len for r in a] == [r.input_len for r in b] and len({r.input_len for r in a}) > 1
    assert [2 * r.scheduled for r in a] == pytest.approx([r.scheduled for r in b], abs=1e-9)
    hits = lambda res: res["runs"][0]["server_metrics"]["prefix_cache_hits"]
    assert hits(res_a) == 0 and hits(res_b) == 0 and hits(res_c) > 0


def test_slo_gate_sets_the_exit_status(fake, bench):
    url, _ = fake(ttft=0.05, itl=0.002)
    rc, res, _ = bench("--base-url", url, "--concurrency", "2", "--num-requests", "4", "--input-len", "8",
                       "--output-len", "3", "--slo", "ttft=1ms", "--slo", "e2e=10s")
    assert rc == 1 and res["slo_passed"] is False
    assert res["runs"][0]["goodput"]["share"] == 0.0
    assert "ttft p99" in res["runs"][0]["slo_gate"]["misses"][0]
    rc, res, _ = bench("--base-url", url, "--concurrency", "2", "--num-requests", "4", "--input-len", "8",
                       "--output-len", "3", "--slo", "ttft=5s", "--slo-percentile", "p50")
    assert rc == 0 and res["slo_passed"] is True and res["runs"][0]["goodput"]["share"] == 1.0
    assert_slo(res, ttft_p50="5s")


def test_sweep_list_and_automatic_saturation(fake, bench):
    url, _ = fake(ttft=0.05, itl=0.005, max_concurrency=2)  # a server that runs two requests at a time
    rc, res, _ = bench("--base-url", url, "--sweep", "concurrency:1,2", "--num-requests", "6", "--input-len", "8",
                       "--output-len", "4")
    assert rc == 0 and [r["load"]["value"] for r in res["runs"]] == [1, 2]
    assert res["sweep"]["points"] == ["concurrency 1", "concurrency 2"]
    rc, res, out = bench("--base-url", url, "--sweep", "auto", "--num-requests", "8", "--input-len", "8",
                         "--output-len", "4", "--slo", "e2e=10s")
    values = [r["load"]["value"] for r in res["runs"]]
    assert values[:3] == [1, 2, 4]
    sat = res["sweep"]["saturation"]
    # throughput doubles from 1 to 2 users, then stops rising at the server's two slots (margins of 2x, so a
    # noisy machine moves the detected point by one step at most)
    assert sat is not None and sat["value"] in (2, 4, 8) and len(values) <= 5
    assert res["sweep"]["max_load_meeting_slos"]["value"] == values[-1]
    assert "throughput vs load" in (out / "report.html").read_text()
    # each load point draws its own prompts, so one point cannot warm the prefix cache for the next
    prompts = {}
    for r in read_records(out / "records.jsonl"):
        prompts.setdefault(r.run, set()).add(r.request_id)
    assert len(prompts) == len(values)


def test_rate_sweep_with_workers_merges_records(fake, bench):
    url, server = fake(ttft=0.002, itl=0.001)
    rc, res, out = bench("--base-url", url, "--sweep", "rate:40,80", "--num-requests", "20", "--input-len", "8",
                         "--output-len", "2", "--workers", "2")
    assert rc == 0, res
    for run in res["runs"]:
        assert run["workers"] == 2 and run["counts"]["completed"] == 20 and run["clock_origin"] > 0
    recs = list(read_records(out / "records.jsonl"))
    assert len(recs) == 40 and {r.worker for r in recs} == {0, 1}
    assert sorted(r.index for r in recs if r.run == 0) == list(range(20))
    assert not list(out.glob("records.run*"))  # parts merged and removed


def test_repeated_prompts_warn_about_the_prefix_cache(fake, bench):
    url, _ = fake(ttft=0.002, itl=0.001)
    args = ("--base-url", url, "--concurrency", "2", "--num-requests", "4", "--input-len", "8", "--output-len", "2")
    bench(*args)
    rc, res, _ = bench(*args)  # same seed: the same prompts again, which the fake server reports as cached
    assert any("prefix cache" in w for w in res["runs"][0]["warnings"])


@pytest.mark.parametrize("args,msg", [
    (["--input-len", "lots"], "--input-len"),
    (["--concurrency", "0"], "--concurrency"),
    (["--sweep", "speed:1,2"], "--sweep"),
    (["--slo", "ttft=fast"], "duration"),
    (["--dataset", "/nonexistent.jsonl"], "file not found"),
    (["--rate", "inf", "--duration", "5s"], "--rate inf"),
    (["--base-url", "localhost:8000"], "give a URL"),
    (["--concurrency", "2", "--rate", "3"], "not allowed with"),
    (["--arrival", "gamma"], "--burstiness"),
    (["--dataset-format", "conversations", "--text-seed", "1"], "--text-seed"),
])
def test_bad_flags_give_a_usage_error_naming_the_problem(bench, capsys, args, msg):
    with pytest.raises(SystemExit) as e:
        rc, _, _ = bench(*args)
        raise SystemExit(rc)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_bad_workload_file_is_named(bench, tmp_path, fake, capsys):
    url, _ = fake()
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    rc, _, _ = bench("--base-url", url, "--dataset", str(p))
    assert rc == 2 and "bad.jsonl:2: needs a 'prompt'" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_keeps_the_records_and_writes_the_summary(tmp_path, workers):
    env = {**os.environ, "PYTHONPATH": SRC}
    fake = subprocess.Popen([sys.executable, "-m", "inferlab", "fake-server", "--port", "0", "--ttft", "5ms",
                             "--itl", "20ms"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = fake.stdout.readline().split()[4]
        out = tmp_path / "run"
        proc = subprocess.Popen([sys.executable, "-m", "inferlab", "bench", "--base-url", url, "--concurrency", "2",
                                 "--num-requests", "1000", "--input-len", "8", "--output-len", "10", "--quiet",
                                 "--output-dir", str(out), "--workers", str(workers)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until some requests have completed
            if any(p.stat().st_size > 0 for p in out.glob("records*.jsonl")):
                break
            time.sleep(0.2)
        time.sleep(1.5)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does: to bench and its workers alike
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stderr
        res = json.loads((out / "results.json").read_text())
        run = res["runs"][0]
        assert res["interrupted"] and run["interrupted"]
        assert run["counts"]["completed"] > 0 and run["counts"]["cancelled"] <= 2
        recs = list(read_records(out / "records.jsonl"))
        assert len(recs) == run["counts"]["completed"] + run["counts"]["cancelled"]
        assert {r.worker for r in recs} == set(range(workers))
        assert (out / "report.html").exists()
    finally:
        fake.terminate()
        fake.wait()


def test_bench_does_not_import_torch_or_the_engine(fake):
    url, _ = fake(ttft=0.002, itl=0.001)
    code = (
        "import sys\n"
        "from inferlab.cli import main\n"
        f"rc = main(['bench', '--base-url', {url!r}, '--num-requests', '2', '--input-len', '8', '--output-len', '2',"
        " '--quiet', '--output-dir', sys.argv[1]])\n"
        "import importlib, pkgutil, inferlab.bench\n"  # every bench module, not only those a run loads
        "for m in pkgutil.iter_modules(inferlab.bench.__path__): importlib.import_module('inferlab.bench.' + m.name)\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('inferlab.engine', 'inferlab.server',\n"
        "                                                              'inferlab.models', 'inferlab.lab'))]\n"
        "assert rc == 0 and not bad, (rc, bad)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, ""], env={**os.environ, "PYTHONPATH": SRC},
                          capture_output=True, text=True, cwd=Path(SRC).parent)
    assert proc.returncode == 0, proc.stderr


def test_compare_shows_deltas(fake, bench, capsys):
    url, _ = fake(ttft=0.002, itl=0.001)
    _, _, a = bench("--base-url", url, "--concurrency", "1", "--num-requests", "3", "--input-len", "8",
                    "--output-len", "2")
    _, _, b = bench("--base-url", url, "--concurrency", "2", "--num-requests", "3", "--input-len", "8",
                    "--output-len", "2")
    from inferlab.cli import main

    capsys.readouterr()
    assert main(["compare", str(a), str(b / "results.json"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)[0]["rows"]
    tput = next(r for r in rows if r["metric"] == "requests/s")
    assert tput["delta"] == pytest.approx(tput["b"] - tput["a"])
    assert main(["compare", str(a), str(b)]) == 0
    assert "TTFT p99" in capsys.readouterr().out


def test_trace_replay_follows_the_timestamps(fake, bench, tmp_path):
    url, _ = fake(ttft=0.002, itl=0.001)
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps({"timestamp": t, "input_length": 16, "output_length": 3})
                           for t in (1000, 1100, 1300, 1350)))
    rc, res, out = bench("--base-url", url, "--dataset", str(p), "--dataset-format", "trace",
                         "--trace-time-unit", "ms")
    assert rc == 0 and res["runs"][0]["load"]["kind"] == "trace"
    recs = sorted(read_records(out / "records.jsonl"), key=lambda r: r.index)
    assert [r.scheduled for r in recs] == pytest.approx([0.0, 0.1, 0.3, 0.35])
    assert [r.prompt_tokens for r in recs] == [16] * 4 and [r.output_tokens for r in recs] == [3] * 4


def test_without_streaming_only_e2e_is_measured(fake, bench):
    url, _ = fake(ttft=0.01, itl=0.002)
    rc, res, _ = bench("--base-url", url, "--no-stream", "--endpoint", "chat", "--concurrency", "2",
                       "--num-requests", "4", "--input-len", "8", "--output-len", "5")
    lat = res["runs"][0]["latency"]
    assert rc == 0 and lat["e2e"]["count"] == 4 and lat["ttft"]["count"] == 0
    assert res["runs"][0]["tokens"]["output"]["mean"] == 5


def test_duration_bounds_sending_in_both_loops(fake, bench):
    url, _ = fake(ttft=0.002, itl=0.001)
    rc, res, out = bench("--base-url", url, "--rate", "20", "--arrival", "constant", "--duration", "1s",
                         "--input-len", "8", "--output-len", "2")
    recs = list(read_records(out / "records.jsonl"))
    assert rc == 0 and sorted(r.scheduled for r in recs) == pytest.approx([i / 20 for i in range(20)])
    rc, res, out = bench("--base-url", url, "--concurrency", "2", "--duration", "0.5s", "--input-len", "8",
                         "--output-len", "2")
    recs = list(read_records(out / "records.jsonl"))
    assert rc == 0 and recs and all(r.sent < 0.5 for r in recs)  # nothing is sent after the duration
    assert res["runs"][0]["counts"]["completed"] == len(recs)


def test_a_client_stalled_past_the_duration_sends_nothing(fake, bench, monkeypatch):
    """A user that passed the duration check and then stalled (a busy machine descheduling the client) must not
    send once the duration is over: the second request's preparation blocks past the end, so only the first is sent.
    """
    import inferlab.bench.client as client

    real, calls = client.build_body, []

    def stalled(target, spec):
        calls.append(1)
        if len(calls) == 2:
            time.sleep(0.35)
        return real(target, spec)

    monkeypatch.setattr(client, "build_body", stalled)
    url, _ = fake(ttft=0.002, itl=0.001)
    rc, res, out = bench("--base-url", url, "--concurrency", "1", "--duration", "0.3s", "--input-len", "8",
                         "--output-len", "2")
    recs = list(read_records(out / "records.jsonl"))
    assert rc == 0 and len(calls) >= 2 and [r.index for r in recs] == [0] and recs[0].sent < 0.3
    assert res["runs"][0]["counts"]["completed"] == 1


def test_open_loop_cap_counts_the_wait_as_client_delay(fake, bench):
    url, _ = fake(ttft=0.05, itl=0.005)
    rc, res, out = bench("--base-url", url, "--rate", "inf", "--num-requests", "6", "--max-concurrency", "2",
                         "--input-len", "8", "--output-len", "2")
    recs = sorted(read_records(out / "records.jsonl"), key=lambda r: r.sent)
    assert rc == 0 and all(r.scheduled == 0.0 for r in recs)
    # the last four waited for a slot, which frees no sooner than the server's 50 ms first token
    assert all(r.sent - r.scheduled >= 0.05 for r in recs[2:])
    for r in recs:  # and the wait is inside TTFT: the clock started at the schedule
        assert r.chunk_times[0] - r.scheduled >= r.sent - r.scheduled
    assert res["runs"][0]["latency"]["client_delay"]["count"] == 6
