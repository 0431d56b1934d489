"""A served request's time to first token in parts, from bench's records and the step trace's request lines: the
parts of known synthetic requests come back exactly; records pair in order of sending, by prompt length."""

from __future__ import annotations

import pytest

from inferlab.bench.records import RequestRecord
from inferlab.lab.ttft_split import split_ttft

ORIGIN = 1000.0  # bench's clock origin, absolute


def request(index, sent, prompt, http, taken, engine, out, warmup=False):
    """A record and the trace line of one request with the given parts (seconds), sent `sent` after the origin."""
    a = ORIGIN + sent + http
    f = a + taken + engine
    rec = RequestRecord(index=index, sent=sent, scheduled=sent, warmup=warmup, prompt_tokens=prompt,
                        chunk_times=[f + out - ORIGIN], chunk_tokens=[1], end=f + out - ORIGIN + 1)
    return rec, {"req": f"cmpl-{index}", "n": prompt, "o": 8, "a": a, "q": a + taken, "s": a + taken, "f": f,
                 "e": f + 1}


def test_each_part_of_a_request_comes_back():
    reqs = [request(0, 0.0, 100, 0.002, 0.001, 0.050, 0.003),
            request(1, 0.010, 100, 0.004, 0.020, 0.200, 0.001),  # same length, sent after: paired second
            request(2, 0.011, 37, 0.001, 0.0, 0.030, 0.002),
            request(3, 0.5, 64, 0.001, 0.001, 0.010, 0.001, warmup=True)]
    records = [r for r, _ in reqs]
    served = [row for _, row in reversed(reqs)]  # finished in another order
    parts = split_ttft(records, ORIGIN, served)
    assert sorted(parts) == [0, 1, 2]  # the warmup is not measured
    for i, (http, taken, engine, out) in {0: (0.002, 0.001, 0.050, 0.003), 1: (0.004, 0.020, 0.200, 0.001),
                                           2: (0.001, 0.0, 0.030, 0.002)}.items():
        p = parts[i]
        assert (p.http, p.taken, p.engine, p.out) == pytest.approx((http, taken, engine, out), abs=1e-9)
        assert p.outside == pytest.approx(http + taken + out, abs=1e-9)


def test_a_record_the_server_has_no_request_for_is_left_out():
    rec, row = request(0, 0.0, 100, 0.002, 0.001, 0.050, 0.003)
    other, _ = request(1, 0.1, 55, 0.002, 0.001, 0.050, 0.003)  # never reached the engine's trace
    assert sorted(split_ttft([rec, other], ORIGIN, [row])) == [0]
    early = {**row, "a": ORIGIN - 0.5, "q": ORIGIN - 0.5}  # received before bench sent it: another request
    assert split_ttft([rec], ORIGIN, [early]) == {}


def test_a_record_never_pairs_with_a_request_served_after_its_first_token():
    rec, _ = request(0, 0.0, 100, 0.002, 0.001, 0.050, 0.003)  # its own line is missing from the trace
    _, later = request(1, 52.0, 100, 0.002, 0.001, 0.050, 0.003)  # a later run's request of the same length
    assert split_ttft([rec], ORIGIN, [later]) == {}
    _, own = request(0, 0.0, 100, 0.002, 0.001, 0.050, 0.003)
    assert split_ttft([rec], ORIGIN, [later, own])[0].out == pytest.approx(0.003, abs=1e-9)
