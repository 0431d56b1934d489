"""Faults: before load, bench stops with a clear message; during load, failures are counted by kind with a
sample message, kept out of latency statistics, and the run goes on."""

import httpx
import pytest

from inferlab.bench.launcher import free_port
from inferlab.bench.records import read_records


def test_unreachable_server_fails_fast_before_load(bench, capsys):
    port = free_port()  # nothing listens there
    rc, res, out = bench("--base-url", f"http://127.0.0.1:{port}", "--num-requests", "5", "--input-len", "8")
    assert rc == 2
    assert "cannot reach the server" in capsys.readouterr().err
    assert res is None and not (out / "records.jsonl").exists()


def test_refused_api_key_fails_fast(fake, bench, capsys):
    url, server = fake(api_key="right")
    rc, res, _ = bench("--base-url", url, "--api-key", "wrong", "--num-requests", "5", "--input-len", "8")
    assert rc == 2 and res is None
    assert "refused the API key (HTTP 401" in capsys.readouterr().err
    assert server.log == []  # no load was sent
    rc, res, _ = bench("--base-url", url, "--api-key", "right", "--num-requests", "3", "--input-len", "8",
                       "--output-len", "2")
    assert rc == 0 and res["runs"][0]["counts"]["completed"] == 3


@pytest.mark.parametrize("fault,kind", [("http500", "http_500"), ("drop", "connection_dropped"),
                                        ("malformed", "malformed_sse")])
def test_mid_run_faults_are_counted_by_kind_and_the_run_goes_on(fake, bench, fault, kind):
    url, _ = fake(ttft=0.005, itl=0.002, faults={fault: 0.3}, seed=3)
    rc, res, out = bench("--base-url", url, "--concurrency", "4", "--num-requests", "30", "--input-len", "8",
                         "--output-len", "8")
    assert rc == 0
    server = httpx.get(url + "/stats").json()["requests"]
    injected = sum(1 for s in server if s["fault"] == fault)
    assert 0 < injected < 30
    run = res["runs"][0]
    assert run["counts"]["failed"] == injected and run["counts"]["completed"] == 30 - injected
    assert list(run["errors"]) == [kind] and run["errors"][kind]["count"] == injected
    assert run["errors"][kind]["sample"]
    # failed requests are out of the latency statistics
    assert run["latency"]["e2e"]["count"] == 30 - injected
    failed = {s["id"] for s in server if s["fault"] == fault}
    recs = list(read_records(out / "records.jsonl"))
    assert {r.request_id for r in recs if r.error_kind == kind} == failed


def test_a_stalled_stream_times_out(fake, bench):
    url, _ = fake(ttft=0.005, itl=0.002, faults={"stall": 0.5}, seed=1)
    rc, res, _ = bench("--base-url", url, "--concurrency", "4", "--num-requests", "6", "--input-len", "8",
                       "--output-len", "4", "--timeout", "1s")
    run = res["runs"][0]
    assert run["errors"]["timeout"]["count"] == 6 - run["counts"]["completed"] > 0
    assert "1 s" in run["errors"]["timeout"]["sample"]


def test_the_embedded_server_path_fails_with_a_clear_message(bench, capsys):
    # A flag `inferlab serve` cannot know: bench must stop with the server's own complaint, not hang or crash.
    rc, res, out = bench("--serve-args=--no-such-flag-for-bench-tests", "--server-timeout", "120",
                         "--num-requests", "1")
    err = capsys.readouterr().err
    assert rc == 2 and res is None
    assert "exited with code 2 before it was ready" in err
    assert "unrecognized arguments: --no-such-flag-for-bench-tests" in err  # the tail of its log
    assert (out / "server.log").exists()
