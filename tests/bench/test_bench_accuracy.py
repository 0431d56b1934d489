"""Bench against the fake server at low concurrency: every chunk bench stamped is matched with the server's
recorded write of it (same machine, same monotonic clock). Tolerances are generous for a loaded CI machine; the
tight figures come from benchmarks/bench_accuracy.py. No speed is asserted."""

import httpx
import numpy as np
import pytest

from inferlab.bench.records import read_records


def matched(url, out, results):
    origin = results["runs"][0]["clock_origin"]
    server = {s["id"]: s for s in httpx.get(url + "/stats").json()["requests"]}
    recs = [r for r in read_records(out / "records.jsonl")]
    return origin, server, recs


@pytest.mark.parametrize("tokens_per_chunk,endpoint", [(1, "completions"), (3, "chat")])
def test_chunk_times_and_token_counts_match_the_server(fake, bench, tokens_per_chunk, endpoint):
    url, _ = fake(ttft=0.04, itl=0.02, tokens_per_chunk=tokens_per_chunk)
    rc, res, out = bench("--base-url", url, "--endpoint", endpoint, "--concurrency", "4", "--num-requests", "12",
                         "--input-len", "20", "--output-len", "10")
    assert rc == 0 and res["runs"][0]["counts"]["completed"] == 12
    origin, server, recs = matched(url, out, res)
    errors, ttft_err, gap_err = [], [], []
    for r in recs:
        s = server[r.request_id]
        toks = [k for k in r.chunk_tokens if k]
        times = [origin + t for t, k in zip(r.chunk_times, r.chunk_tokens) if k]
        assert toks == s["tokens_per_write"]  # exact, with multi-token chunks
        assert r.output_tokens == 10 and r.token_source == "usage" and r.prompt_tokens == 20
        for t, w in zip(times, s["writes"]):
            # Causality: nothing arrives before the server wrote it. The client's stamp is the kernel's receive
            # time (CLOCK_REALTIME) mapped onto the monotonic clock, a mapping good to some microseconds.
            assert t >= w - 1e-4
            errors.append(t - w)
        # bench's TTFT against the server's: first write minus request arrival at the server
        ttft_err.append((times[0] - (origin + r.sent)) - (s["writes"][0] - s["arrival"]))
        gap_err += list(np.diff(times) - np.diff(s["writes"]))
    assert np.median(errors) < 0.05
    assert min(ttft_err) > -0.001 and np.median(ttft_err) < 0.05
    assert np.median(np.abs(gap_err)) < 0.05
    itl = res["runs"][0]["latency"]["itl"]
    assert itl["count"] == 12 * 9  # output tokens - 1 samples per request
    assert itl["p50"] == pytest.approx(0.02, abs=0.015)


def test_token_counts_by_tokenizer_and_by_chunk_when_the_server_gives_no_usage(fake, bench):
    url, _ = fake(ttft=0.01, itl=0.005, tokens_per_chunk=2)
    rc, res, out = bench("--base-url", url, "--concurrency", "2", "--num-requests", "4", "--input-len", "16",
                         "--output-len", "7", "--no-usage-stats")
    assert rc == 0
    recs = list(read_records(out / "records.jsonl"))
    assert {r.token_source for r in recs} == {"tokenizer"}
    assert all(r.chunk_tokens == [2, 2, 2, 1] and r.output_tokens == 7 for r in recs)
    assert res["runs"][0]["tokens"]["token_source"] == {"tokenizer": 4}
    rc, res, out = bench("--base-url", url, "--concurrency", "2", "--num-requests", "4", "--input-len", "16",
                         "--output-len", "7", "--no-usage-stats", "--tokenizer", "none", "--dataset",
                         str(_prompts(out.parent)))
    recs = list(read_records(out / "records.jsonl"))
    assert {r.token_source for r in recs} == {"chunks"} and all(r.output_tokens == 4 for r in recs)
    assert any("one token per chunk" in w for w in res["runs"][0]["warnings"])


def _prompts(folder):
    p = folder / "prompts.jsonl"
    p.write_text('{"prompt": "hello there"}\n{"prompt": "how are you"}\n')
    return p


def test_open_loop_clock_starts_at_the_schedule(fake, bench):
    url, _ = fake(ttft=0.03, itl=0.01)
    rc, res, out = bench("--base-url", url, "--rate", "20", "--arrival", "constant", "--num-requests", "10",
                         "--input-len", "8", "--output-len", "4")
    assert rc == 0
    recs = sorted(read_records(out / "records.jsonl"), key=lambda r: r.index)
    assert [r.scheduled for r in recs] == pytest.approx([i / 20 for i in range(10)])
    run = res["runs"][0]
    assert all(r.sent >= r.scheduled for r in recs)
    assert run["latency"]["client_delay"]["count"] == 10
    ttft = sorted(r.chunk_times[0] - r.scheduled for r in recs)
    assert run["latency"]["ttft"]["max"] == pytest.approx(ttft[-1], abs=1e-6)  # records keep 0.1 us


def test_reasoning_streamed_apart_gives_answer_ttft(fake, bench):
    url, _ = fake(ttft=0.02, itl=0.01, reasoning_tokens=3)
    rc, res, out = bench("--base-url", url, "--endpoint", "chat", "--concurrency", "2", "--num-requests", "4",
                         "--input-len", "8", "--output-len", "6")
    lat = res["runs"][0]["latency"]
    assert lat["ttft_content"]["count"] == 4
    # the answer starts 3 tokens (30 ms nominal) after the first reasoning token
    assert lat["ttft_content"]["p50"] - lat["ttft"]["p50"] == pytest.approx(0.03, abs=0.02)
