"""Workloads: exact prompt lengths (checked by re-encoding with the same tokenizer), shared prefixes, file formats
and the errors bad files get."""

import json

import numpy as np
import pytest

from inferlab.bench.tokenizer import load_tokenizer
from inferlab.bench.workload import LengthDist, WorkloadError, jsonl, sharegpt, synthetic, trace


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def test_synthetic_prompts_have_exact_token_lengths(tok):
    wl = synthetic(60, LengthDist.parse("uniform:20,300"), LengthDist.parse(16), tok, seed=1)
    lens = [r.input_len for r in wl.requests]
    assert [tok.count(r.prompt) for r in wl.requests] == lens
    assert min(lens) >= 20 and max(lens) <= 300 and len(set(lens)) > 10
    assert all(r.output_len == 16 for r in wl.requests)
    assert wl.cache_free and not wl.warnings
    assert len({r.prompt[:40] for r in wl.requests}) == 60  # distinct from the first words: no shared prefix


def test_same_seed_same_workload(tok):
    a = synthetic(5, LengthDist.parse(50), LengthDist.parse("normal:30,5"), tok, seed=4)
    b = synthetic(5, LengthDist.parse(50), LengthDist.parse("normal:30,5"), tok, seed=4)
    c = synthetic(5, LengthDist.parse(50), LengthDist.parse("normal:30,5"), tok, seed=5)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert [r.output_len for r in a.requests] == [r.output_len for r in b.requests]
    assert a.requests[0].prompt != c.requests[0].prompt


def test_a_text_seed_keeps_the_lengths_and_changes_the_words(tok):
    """--text-seed: the same seed's lengths (and prefix groups) with other words, so a second run of one draw finds
    nothing of the first in the server's prefix cache; the same text seed gives the same words."""
    args = (30, LengthDist.parse("uniform:40,200"), LengthDist.parse("uniform:4,40"), tok)
    plain = synthetic(*args, seed=4, prefix_groups=3, prefix_len=20)
    a = synthetic(*args, seed=4, prefix_groups=3, prefix_len=20, text_seed=1)
    b = synthetic(*args, seed=4, prefix_groups=3, prefix_len=20, text_seed=2)
    again = synthetic(*args, seed=4, prefix_groups=3, prefix_len=20, text_seed=1)
    for wl in (a, b):
        assert [r.input_len for r in wl.requests] == [r.input_len for r in plain.requests]
        assert [r.output_len for r in wl.requests] == [r.output_len for r in plain.requests]
        assert [tok.count(r.prompt) for r in wl.requests] == [r.input_len for r in wl.requests]
    assert [r.group for r in a.requests] == [r.group for r in b.requests] and len({r.group for r in a.requests}) == 3
    firsts = lambda wl: {tok.encode(r.prompt)[:16].__repr__() for r in wl.requests}
    assert not firsts(a) & firsts(b) and not firsts(a) & firsts(plain)  # no first block in common
    assert [r.prompt for r in again.requests] == [r.prompt for r in a.requests]
    assert synthetic(*args, seed=4).requests[0].prompt == synthetic(*args, seed=4, text_seed=None).requests[0].prompt


def test_shared_prefix_groups(tok):
    wl = synthetic(40, LengthDist.parse(120), LengthDist.parse(8), tok, seed=2, prefix_groups=3, prefix_len=100)
    assert not wl.cache_free
    assert all(tok.count(r.prompt) == 120 for r in wl.requests)
    by_group = {}
    for r in wl.requests:
        by_group.setdefault(r.group, []).append(tok.encode(r.prompt))
    assert set(by_group) == {0, 1, 2}
    for ids in by_group.values():
        assert all(x[:100] == ids[0][:100] for x in ids)  # the first 100 tokens are shared within a group
    heads = [v[0][:100] for v in by_group.values()]
    assert heads[0] != heads[1] != heads[2]
    with pytest.raises(WorkloadError, match="exceed --prefix-len"):
        synthetic(4, LengthDist.parse(50), LengthDist.parse(8), tok, seed=2, prefix_groups=2, prefix_len=50)


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("lognormal:200,0.5").sample(20000, rng).mean() == pytest.approx(200 * np.exp(0.125), rel=0.03)
    x = LengthDist.parse("normal:100,10").sample(20000, rng)
    assert x.mean() == pytest.approx(100, rel=0.01) and x.std() == pytest.approx(10, rel=0.05)
    u = LengthDist.parse("uniform:3,5").sample(1000, rng)
    assert set(u.tolist()) == {3, 4, 5}
    for bad in ("zero", "uniform:5", "gauss:1,2", "0", "uniform:9,3"):
        with pytest.raises(WorkloadError):
            LengthDist.parse(bad, "--input-len")


def test_jsonl_prompts_and_messages(tmp_path, tok):
    p = tmp_path / "w.jsonl"
    p.write_text(json.dumps({"prompt": "Hello there", "output_len": 5}) + "\n\n"
                 + json.dumps({"messages": [{"role": "user", "content": "Hi you"}]}) + "\n")
    wl = jsonl(p, tok, default_output=7)
    assert [r.output_len for r in wl.requests] == [5, 7]
    assert wl.requests[0].input_len == tok.count("Hello there")
    assert wl.requests[1].messages == [{"role": "user", "content": "Hi you"}]


@pytest.mark.parametrize("line,msg", [
    ("{not json", "w.jsonl:1: not valid JSON"),
    ('{"text": "x"}', "w.jsonl:1: needs a 'prompt'"),
    ('{"prompt": "x", "output_len": -3}', "'output_len' must be a positive integer"),
    ('{"messages": [{"role": "user"}]}', "'messages' must be"),
    ("[1, 2]", "JSON object"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, msg):
    p = tmp_path / "w.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(WorkloadError, match=msg.replace("{", r"\{").replace("[", r"\[")):
        jsonl(p, None, 8)


def test_sharegpt_uses_every_assistant_turn(tmp_path, tok):
    data = [{"id": "a", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "What is one plus one?"},
        {"from": "gpt", "value": "Two."},
        {"from": "human", "value": "And two plus two?"},
        {"from": "gpt", "value": "Four, as it happens."},
    ]}, {"conversations": [{"from": "gpt", "value": "orphan reply"}]}]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    wl = sharegpt(p, tok, output_len=None)
    assert len(wl.requests) == 2
    first, second = wl.requests
    assert [m["role"] for m in first.messages] == ["system", "user"]
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "user"]
    assert second.output_len == tok.count("Four, as it happens.")
    assert sharegpt(p, tok, output_len=9).requests[0].output_len == 9
    p.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(WorkloadError, match="JSON list"):
        sharegpt(p, tok, None)


def test_trace_replay_times_lengths_and_shared_blocks(tmp_path, tok):
    rows = [
        {"timestamp": 1500, "input_length": 70, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 60, "output_length": 3, "hash_ids": [1, 3]},
        {"timestamp": 2500, "prompt": "a literal prompt", "output_len": 2},
    ]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    wl = trace(p, tok, seed=0, time_unit="ms", block_size=32)
    assert wl.schedule == pytest.approx([0.0, 0.5, 1.5])
    a, b, c = wl.requests
    assert (a.input_len, b.input_len) == (60, 70)
    assert tok.count(a.prompt) == 60 and tok.count(b.prompt) == 70
    ia, ib = tok.encode(a.prompt), tok.encode(b.prompt)
    assert ia[:30] == ib[:30] and ia[40:50] != ib[40:50]  # block 1 shared, then blocks 3 and 2 differ
    assert c.prompt == "a literal prompt"
    p.write_text('{"input_len": 5}\n')
    with pytest.raises(WorkloadError, match="timestamp"):
        trace(p, tok, seed=0)


def test_missing_file():
    with pytest.raises(WorkloadError, match="not found"):
        jsonl("/nonexistent/w.jsonl", None, 8)
