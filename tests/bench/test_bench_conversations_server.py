"""Conversations against inferlab's own server (the bundled model, prefix caching on), started by bench's
launcher: the hit rate bench reports is the server's own counters over the run, and TTFT falls after the first
turn because each later turn's history is served from the prefix cache (only the new user turn and the last
answer are prefilled)."""

import os
import sys

import httpx
import pytest

from inferlab.bench.launcher import free_port, inferlab_argv, launch
from inferlab.bench.scrape import parse

pytestmark = pytest.mark.slow


def counters(url: str) -> tuple[float, float]:
    m = parse(httpx.get(url + "/metrics", timeout=30).text)
    return m["prefix_cache_hits_total"], m["prefix_cache_queries_total"]


def test_conversation_hit_rate_matches_the_server_and_ttft_falls_with_the_turn(bench, tmp_path):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    srv = launch(inferlab_argv(port, config={"enable_prefix_caching": True, "max_num_seqs": 4}), port,
                 ready_timeout=900, log_path=tmp_path / "server.log", env=env)
    try:
        hits0, queries0 = counters(srv.base_url)
        rc, res, _ = bench("--base-url", srv.base_url, "--dataset-format", "conversations", "--concurrency", "1",
                           "--num-requests", "8", "--turns", "4", "--first-turn-len", "768", "--input-len", "16",
                           "--output-len", "4", "--scrape-interval", "0.5")
        hits1, queries1 = counters(srv.base_url)
    finally:
        srv.stop()
    assert rc == 0
    run = res["runs"][0]
    assert run["counts"]["completed"] == 8
    sm = run["server_metrics"]
    # nothing else spoke to the server: the scraped deltas are the counters' own
    assert sm["prefix_cache_hits"] == hits1 - hits0 and sm["prefix_cache_queries"] == queries1 - queries0
    assert sm["prefix_cache_hit_rate"] == pytest.approx((hits1 - hits0) / (queries1 - queries0))
    assert sm["prefix_cache_hit_rate"] > 0.5  # 3 of every 4 turns resend a history of 780+ tokens
    turns = {t["turn"]: t for t in run["by_turn"]}
    assert sorted(turns) == [1, 2, 3, 4]
    assert all(turns[t]["input_tokens_mean"] > turns[t - 1]["input_tokens_mean"] for t in (2, 3, 4))
    # One user at a time, so no turn waits behind another session's prefill: turn 1 prefills 768+ tokens, later
    # turns ~30 (the rest is cached), a margin of an order of magnitude that machine noise does not close.
    first = turns[1]["ttft"]["p50"]
    assert all(turns[t]["ttft"]["p50"] < first for t in (2, 3, 4)), {t: v["ttft"]["p50"] for t, v in turns.items()}
