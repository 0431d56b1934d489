"""Conversations against the fake server: each turn resends the history with the model's actual answers,
per-turn TTFT and ITL match the server's own writes (the bounds of test_bench_accuracy.py), and the prefix-cache
hit rate bench reports is the server's own counters."""

import httpx
import numpy as np
import pytest

from inferlab.bench.conversation import ThinkTime, file_sessions
from inferlab.bench.records import read_records
from inferlab.bench.scrape import parse
from inferlab.bench.workload import WorkloadError


def test_turns_resend_history_and_per_turn_latency_matches_the_server(fake, bench):
    url, srv = fake(ttft=0.03, itl=0.01)
    before = parse(httpx.get(url + "/metrics").text)
    rc, res, out = bench("--base-url", url, "--endpoint", "chat", "--dataset-format", "conversations",
                         "--concurrency", "2", "--num-requests", "8", "--turns", "4", "--first-turn-len", "48",
                         "--input-len", "12", "--output-len", "5", "--think-time", "uniform:5ms,20ms")
    assert rc == 0
    run = res["runs"][0]
    assert run["counts"]["completed"] == 8
    recs = sorted(read_records(out / "records.jsonl"), key=lambda r: (r.session, r.turn))
    assert sorted({(r.session, r.turn) for r in recs}) == [(s, t) for s in (0, 1) for t in (1, 2, 3, 4)]
    # The server saw each turn's prompt grow by the previous answer (5 words) and the new user turn (12 words).
    server = {s.rid: s for s in srv.log}
    for a, b in zip(recs, recs[1:]):
        if a.session == b.session:
            assert server[b.request_id].prompt_tokens == server[a.request_id].prompt_tokens + 5 + 12
            # every earlier full block was served from the fake's cache: the history was resent verbatim
            assert server[b.request_id].cached_tokens >= (server[a.request_id].prompt_tokens // 16) * 16
    origin = run["clock_origin"]
    stats = {s["id"]: s for s in httpx.get(url + "/stats").json()["requests"]}
    by_turn = {t["turn"]: t for t in run["by_turn"]}
    assert sorted(by_turn) == [1, 2, 3, 4] and all(t["count"] == 2 for t in by_turn.values())
    for turn in (1, 2, 3, 4):
        rs = [r for r in recs if r.turn == turn]
        ttft_err, gap_err = [], []
        for r in rs:
            s = stats[r.request_id]
            times = [origin + t for t, k in zip(r.chunk_times, r.chunk_tokens) if k]
            ttft_err.append((times[0] - (origin + r.sent)) - (s["writes"][0] - s["arrival"]))
            gap_err += list(np.diff(times) - np.diff(s["writes"]))
        assert min(ttft_err) > -0.001 and np.median(ttft_err) < 0.05
        assert np.median(np.abs(gap_err)) < 0.05
        assert by_turn[turn]["ttft"]["p50"] == pytest.approx(0.03, abs=0.05)
        assert by_turn[turn]["itl"]["count"] == 2 * 4 and by_turn[turn]["itl"]["p50"] == pytest.approx(0.01, abs=0.015)
    after = parse(httpx.get(url + "/metrics").text)
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    queries = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    sm = run["server_metrics"]  # scraped without asking: a conversation's headline number
    assert sm["prefix_cache_hits"] == hits and sm["prefix_cache_queries"] == queries
    assert sm["prefix_cache_hit_rate"] == pytest.approx(hits / queries) and 0.5 < hits / queries < 1
    assert sm["series"]["t"] and len(sm["series"]["requests_running"]) == sm["scrapes"]


def test_sessions_from_files_and_think_time_forms(tmp_path):
    sg = tmp_path / "chats.json"
    sg.write_text('[{"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi there"},'
                  ' {"from": "gpt", "value": "one two three"}, {"from": "human", "value": "more"},'
                  ' {"from": "gpt", "value": "a b"}]}]')
    (s,) = file_sessions(sg, None, None)
    assert s.system == "be brief" and [t.user for t in s.turns] == ["hi there", "more"]
    jl = tmp_path / "sessions.jsonl"
    jl.write_text('{"turns": ["first", {"user": "second", "output_len": 7}]}\n')
    (s,) = file_sessions(jl, None, 3)
    assert [(t.user, t.output_len) for t in s.turns] == [("first", 3), ("second", 3)]
    jl.write_text('{"turns": [{"text": "x"}]}\n')
    with pytest.raises(WorkloadError, match="turn 0 needs a 'user' string"):
        file_sessions(jl, None, None)
    assert ThinkTime.parse("2s") == ThinkTime("fixed", 2.0)
    assert ThinkTime.parse("exponential:500ms") == ThinkTime("exponential", 0.5)
    assert ThinkTime.parse("uniform:1s,3s") == ThinkTime("uniform", 1.0, 3.0)
    with pytest.raises(WorkloadError, match="write D, exponential:MEAN"):
        ThinkTime.parse("gamma:1s")


def test_conversation_flag_errors(bench, capsys):
    rc, _, _ = bench("--base-url", "http://127.0.0.1:9", "--dataset-format", "conversations", "--rate", "2")
    assert rc == 2 and "runs N users (--concurrency)" in capsys.readouterr().err
    rc, _, _ = bench("--base-url", "http://127.0.0.1:9", "--turns", "3")
    assert rc == 2 and "add --dataset-format conversations" in capsys.readouterr().err
