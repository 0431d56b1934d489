"""Workload cards: the documented example loads; bad cards fail with messages naming the field and the fix."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from inferlab.lab.card import CardError, card_from_dict, card_schema, evaluate, load_card, stat_at

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "card-chat.yaml"


def base() -> dict:
    return {
        "name": "t",
        "traffic": {"arrival": "poisson", "rate": "2/s", "requests": 10, "input_len": 100, "output_len": 20},
        "objectives": {"ttft": {"p99": "500ms"}, "tpot": {"p50": "20ms", "p99": "50ms"}, "e2e": {"p99": "5s"}},
    }


def problems(d: dict) -> list[str]:
    with pytest.raises(CardError) as e:
        card_from_dict(d)
    return e.value.problems


def with_(path: str, value, d: dict | None = None) -> dict:
    d = copy.deepcopy(d or base())
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return d


def test_schema_is_valid_json_schema():
    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(card_schema())


def test_example_card_loads():
    card = load_card(EXAMPLE)
    assert card.name == "chat-assistant" and card.streaming and card.endpoint == "chat"
    t = card.traffic
    assert t.arrival == "poisson" and t.rate == 2.0 and t.concurrency == 16 and t.requests == 60 and t.warmup == 4
    assert t.input_len.bench_arg() == "lognormal:250,0.3" and t.output_len.bench_arg() == "uniform:32,128"
    assert t.prefix_groups == 2 and t.prefix_len == round(0.2 * 250 * 2.718281828 ** (0.3**2 / 2))
    o = card.objectives
    assert o.latency["ttft"] == {"p50": 0.3, "p99": 1.5}
    assert o.request_slos() == {"ttft": 1.5, "tpot": 0.08, "e2e": 12.0}  # itl is per token, not per request
    assert card.memory_budget == 4 * 2**30 and card.hardware == "this machine"
    assert card.server.kind == "inferlab" and card.server.config == {"max_num_seqs": 16, "quantization": "none"}
    assert card.quality["perplexity_max_increase_pct"] == 5


def test_unknown_fields_are_named_with_a_suggestion():
    d = with_("traffic.ratee", "3/s")
    d["objectivs"] = {}
    d["objectives"]["ttft"]["p99"] = "500ms"
    got = problems(d)
    assert "objectivs: unknown field (did you mean 'objectives'?)" in got
    assert "traffic.ratee: unknown field (did you mean 'rate'?)" in got
    assert any("contract.quality.ppl_max: unknown field" in p
               for p in problems(with_("contract.quality", {"ppl_max": 3})))


def test_missing_units_are_refused():
    for value in ("500", 500, 0.5):
        got = problems(with_("objectives.ttft", {"p99": value}))
        assert got == [f"objectives.ttft.p99: {value!r} has no unit; write e.g. '{value}ms' or '{value}s'"]
    assert "has no unit" in problems(with_("traffic.rate", 2))[0]
    assert "has no unit" in problems(with_("constraints.memory_budget", "8"))[0]
    assert "unknown time unit 'sec'" in problems(with_("objectives.e2e", {"p99": "5sec"}))[0]


def test_impossible_objectives():
    assert problems(with_("objectives.ttft", {"p99": "-5ms"})) == ["objectives.ttft.p99: '-5ms' must be positive"]
    assert "percentile 101 is outside 0..100" in problems(with_("objectives.ttft", {"p101": "1s"}))[0]
    assert "percentile 0 is outside" in problems(with_("objectives.ttft", {"p0": "1s"}))[0]
    assert "'P99' is not a percentile" in problems(with_("objectives.ttft", {"P99": "1s"}))[0]
    got = problems(with_("objectives.tpot", {"p99": "10s"}))
    assert any("tpot p99 (10s) exceeds e2e p99 (5s)" in p and "units swapped" in p for p in got)
    got = problems(with_("objectives.ttft", {"p50": "800ms", "p99": "500ms"}))
    assert any("p99 limit (500ms) is below the p50 limit (800ms)" in p for p in got)
    got = problems(with_("objectives.throughput", {"min_requests_per_s": 5}))  # offered load is 2/s
    assert any("more than the offered load" in p for p in got)
    assert any("between 0 and 1" in p for p in problems(with_("objectives.goodput", {"min_share": 95})))
    assert any("between 0 and 1" in p for p in problems(with_("objectives.max_error_rate", 5)))


def test_traffic_consistency():
    closed = with_("traffic.arrival", "closed")
    got = problems(closed)
    assert any("closed-loop traffic needs a number of concurrent users" in p for p in got)
    assert any("closed-loop traffic has no rate" in p for p in got)
    d = base()
    del d["traffic"]["rate"]
    assert any("poisson arrivals need a rate" in p for p in problems(d))
    assert any("only gamma arrivals have a burstiness" in p for p in problems(with_("traffic.burstiness", 0.5)))
    got = problems(with_("traffic.input_len", {"dist": "uniform", "min": 10, "sigma": 2}))
    assert "traffic.input_len: a uniform length needs 'max'" in got
    assert any("'sigma' is not used by a uniform length" in p for p in got)
    assert any("write a token count" in p and "bogus" in p
               for p in problems(with_("traffic.input_len", {"dist": "uniform", "min": 1, "max": 2, "bogus": 1})))
    assert "min 50 exceeds max 10" in problems(with_("traffic.input_len", {"dist": "uniform", "min": 50,
                                                                          "max": 10}))[0]
    d = with_("contract.context", {"max_input_tokens": 64})
    assert any("traffic.input_len: reaches 100 tokens, beyond the contract's 64" in p for p in problems(d))
    assert any("does not fit in prompts as short as 100" in p
               for p in problems(with_("traffic.prefix", {"share": 0.999, "groups": 2})))
    ok = card_from_dict(with_("traffic.prefix", {"share": 0.5, "groups": 4}))
    assert ok.traffic.prefix_len == 50


def test_streaming_off_allows_only_e2e():
    got = problems(with_("contract.streaming", False))
    assert any(p.startswith("objectives.ttft: needs streaming") for p in got)
    d = with_("contract.streaming", False)
    d["objectives"] = {"e2e": {"p99": "5s"}}
    assert card_from_dict(d).streaming is False


def test_server_section():
    got = problems(with_("server", {"kind": "command", "command": "vllm serve m"}))
    assert any("must contain {port}" in p for p in got)
    assert any("needs a base URL" in p for p in problems(with_("server", {"kind": "endpoint"})))
    assert any("only used with kind endpoint" in p
               for p in problems(with_("server", {"kind": "inferlab", "url": "http://x:1"})))
    got = problems(with_("server", {"config": {"max_num_seq": 4}}))
    assert got == ["server.config.max_num_seq: not an `inferlab serve` option (did you mean 'max_num_seqs'?)"]
    assert "'docker' is not one of inferlab, command, endpoint" in problems(with_("server", {"kind": "docker"}))[0]
    card = card_from_dict(with_("server", {"kind": "command", "command": "vllm serve m --port {port}",
                                           "config": {"max-num-seqs": 8}, "ready_timeout": "10min"}))
    assert card.server.ready_timeout == 600.0


def test_all_problems_reported_at_once(tmp_path):
    d = with_("objectives.ttft", {"p99": "500"})
    d["traffic"]["rate"] = "fast"
    d["server"] = {"kind": "command", "command": "x"}
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(CardError) as e:
        load_card(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: 3 problems:")
    assert "has no unit" in msg and "cannot read 'fast' as a rate" in msg and "{port}" in msg


def test_unreadable_cards(tmp_path):
    with pytest.raises(CardError, match="cannot read the card"):
        load_card(tmp_path / "missing.yaml")
    (tmp_path / "a.yaml").write_text("name: [unclosed")
    with pytest.raises(CardError, match="not valid YAML"):
        load_card(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("- just\n- a list\n")
    with pytest.raises(CardError, match="a card is a YAML mapping"):
        load_card(tmp_path / "b.yaml")
    assert "missing required field 'traffic'" in problems({"name": "x", "objectives": {}})[0]


def test_evaluate_against_a_run_summary():
    card = card_from_dict(with_("objectives.ttft", {"p99": "500ms", "p99.9": "800ms"}))
    card.objectives.max_error_rate = 0.01
    card.objectives.goodput_min_share = 0.9
    cdf = [i / 100 for i in range(101)]  # quantile q% = q/100 seconds
    run = {
        "latency": {"ttft": {"p99": 0.4, "cdf": cdf}, "tpot": {"p50": 0.019, "p99": 0.06}, "e2e": {"p99": 4.0}},
        "throughput": {"requests_per_s": 1.9},
        "goodput": {"share": 0.85, "requests_per_s": 1.6},
        "counts": {"error_rate": 0.0},
    }
    checks = {c.objective: c for c in evaluate(card.objectives, run)}
    assert checks["ttft p99 <= 500 ms"].passed is True
    p999 = checks["ttft p99.9 <= 800 ms"]
    assert p999.measured == pytest.approx(0.999) and p999.passed is False and "interpolated" in p999.note
    assert checks["tpot p50 <= 20 ms"].passed is True and checks["tpot p99 <= 50 ms"].passed is False
    assert checks["goodput >= 0.9 of requests"].passed is False
    assert checks["error rate <= 1.00%"].passed is True
    assert stat_at({"p50": None, "cdf": []}, "p50") == (None, "")

