"""Reasoning streamed apart from the answer, in either delta field: the fake server writes N reasoning tokens
then the answer, so time to first reasoning token is its TTFT and the answer starts N tokens later; token
counts are exact. Bounds as in test_bench_accuracy.py."""

import httpx
import pytest

from inferlab.bench.records import read_records


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_ttfts_and_token_counts(fake, bench, field):
    url, _ = fake(ttft=0.03, itl=0.01, reasoning_tokens=4, reasoning_field=field)
    rc, res, out = bench("--base-url", url, "--endpoint", "chat", "--concurrency", "2", "--num-requests", "6",
                         "--input-len", "8", "--output-len", "10")
    assert rc == 0
    run = res["runs"][0]
    origin = run["clock_origin"]
    server = {s["id"]: s for s in httpx.get(url + "/stats").json()["requests"]}
    reasoning_err, answer_err = [], []
    for r in read_records(out / "records.jsonl"):
        s = server[r.request_id]
        assert r.reasoning and r.reasoning_tokens == 4 and r.output_tokens == 10
        # write 0 carries the first reasoning token, write 4 the first answer token (one token per write)
        reasoning_err.append((r.first_reasoning - r.sent) - (s["writes"][0] - s["arrival"]))
        answer_err.append((r.first_content - r.sent) - (s["writes"][4] - s["arrival"]))
        assert origin + r.first_reasoning >= s["writes"][0] - 1e-4 and origin + r.first_content >= s["writes"][4] - 1e-4
    for err in (reasoning_err, answer_err):
        assert min(err) > -0.001 and sorted(err)[len(err) // 2] < 0.05
    lat = run["latency"]
    assert lat["ttft_reasoning"]["count"] == 6 and lat["ttft_content"]["count"] == 6
    assert lat["ttft_reasoning"]["p50"] == pytest.approx(0.03, abs=0.02)
    assert lat["ttft_content"]["p50"] == pytest.approx(0.03 + 4 * 0.01, abs=0.02)
    rs = run["reasoning"]
    assert rs["requests"] == 6 and rs["reasoning_tokens"]["mean"] == 4 and rs["answer_tokens"]["mean"] == 6


def test_no_reasoning_no_reasoning_metrics(fake, bench):
    url, _ = fake(ttft=0.01, itl=0.002)
    rc, res, _ = bench("--base-url", url, "--endpoint", "chat", "--concurrency", "1", "--num-requests", "2",
                       "--input-len", "8", "--output-len", "3")
    run = res["runs"][0]
    assert rc == 0 and run["reasoning"] is None and run["latency"]["ttft_reasoning"]["count"] == 0
