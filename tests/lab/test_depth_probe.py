"""The depth probe against inferlab's real server: each prompt arrives at its exact length and runs alone, and
the step trace it leaves is deep enough for the fit to price prefill attention."""

import os
import sys

import pytest

from inferlab.bench.launcher import free_port, inferlab_argv, launch
from inferlab.engine.step_trace import read_step_trace
from inferlab.lab.calibrate import PAIR_DEPTH, trace_measurements, unidentified
from inferlab.lab.depth_probe import ASKED, BESIDE, PAIR_ASKED, depth_ladder, probe_depths


def test_the_ladder_doubles_from_512_to_the_deepest_prompt_the_context_holds():
    assert depth_ladder(4096, 8192) == [512, 1024, 2048, 4096]
    assert depth_ladder(4096, 1100) == [512, 1024, 1100 - ASKED]  # room for the tokens asked
    assert depth_ladder(3000, 8192) == [512, 1024, 2048, 3000]
    assert depth_ladder(400, 8192) == []


@pytest.mark.slow
def test_the_probe_serves_each_depth_alone_then_beside_a_short_prompt_and_its_trace_prices_a_pair(tmp_path):
    port = free_port()
    trace = tmp_path / "steps.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    srv = launch(inferlab_argv(port, config={"max_model_len": 1100, "step_trace": str(trace)}), port,
                 ready_timeout=900, log_path=tmp_path / "server.log", env=env)
    try:
        served = probe_depths(srv.base_url, 4096, repeats=1, log=lambda m: None)
        with pytest.raises(ValueError, match="room for a prompt of 512 tokens"):
            probe_depths(srv.base_url, 300, log=lambda m: None)
    finally:
        srv.stop()
    assert served == [512, 1024, 1100 - ASKED]
    _, trace_rows = read_step_trace(trace)
    # The probe's prompts alone come first; the pairs begin with the next prompt started from nothing cached.
    starts = [i for i, r in enumerate(trace_rows) if r["p"] and r["p"][0][0] == 0]
    rows, paired = trace_rows[:starts[len(served)]], trace_rows[starts[len(served)]:]
    prefills = [r for r in rows if r["p"]]
    # Alone on the server: no step carries a prefill chunk and a decode together, and each prompt's chunks add
    # up to its length, the first starting from nothing cached.
    assert all(r["d"] == 0 for r in prefills)
    starts = [i for i, r in enumerate(prefills) if r["p"][0][0] == 0]
    per_prompt = [sum(r["p"][0][1] for r in prefills[a:b]) for a, b in zip(starts, [*starts[1:], None])]
    assert per_prompt == served
    # Each prompt's tokens after its first are decodes at its depth, alone.
    decodes = [r for r in rows if not r["p"]]
    assert [r["da"] for r in decodes] == [n + k for n in served for k in range(1, ASKED)]
    assert all(r["d"] == 1 for r in decodes)
    feats, _, _ = trace_measurements(rows)
    assert max(f.prefill_pairs / f.prefill_tokens for f in feats if f.prefill_tokens) >= PAIR_DEPTH
    assert unidentified(feats) == ()
    # Each depth again, deep prompt first (as much of it as leaves room for its tokens): the short prompt's chunks
    # run beside one decode at that depth, then both decode together.
    for n in [min(n, 1100 - PAIR_ASKED) for n in served]:
        beside = [r for r in paired if r["p"] and r["d"] == 1 and n < r["da"] <= n + PAIR_ASKED]
        assert beside and all(c + k <= BESIDE for r in beside for c, k, _ in r["p"])
        assert sum(k for r in beside for _, k, _ in r["p"]) >= BESIDE - 1  # a last chunk of 1 token is a decode row
        assert any(not r["p"] and r["d"] == 2 and r["da"] > n + BESIDE for r in paired)
