"""Disaggregated serving end to end (server/disagg_engine.py): a prefill and a decode worker process on the
bundled model in float32. Greedy outputs identical to colocated serving and to transformers; aborts and client
disconnects free blocks in both pools and the transfer buffer; a full decode side makes prefill wait without
losing anything; a dying worker fails the requests in flight with an error naming it.

Waits are bounded by generous deadlines (the machine is shared); nothing asserts a duration."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from inferlab.engine.config import EngineConfig
from inferlab.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

DEADLINE = 900.0  # seconds: loading two models and running on a busy 2-core machine
FP32 = dict(dtype="float32", kv_cache_memory=128 * 2**20)


def _engine(transfer_buffer: int = 64 * 2**20, **config):
    from inferlab.server.disagg_engine import DisaggEngine

    return DisaggEngine(EngineConfig(**{**FP32, **config}), transfer_buffer)


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    e = _engine(step_trace=str(tmp_path_factory.mktemp("trace") / "steps.jsonl"))
    yield e
    e.close()


def drive(engine, requests: dict[str, tuple], until=None) -> dict[str, list[int]]:
    """Add requests {id: (prompt, params)}, step until all have finished (or `until()` holds); token ids by id."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    open_ = set(requests)
    deadline = time.monotonic() + DEADLINE
    while open_ and not (until and until(tokens)):
        assert time.monotonic() < deadline, f"requests {sorted(open_)} did not finish"
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.finish_reason == "length", (out.request_id, out.finish_reason, out.error)
                open_.discard(out.request_id)
    return tokens


def wait_for(engine, condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, what
        engine.step()


def all_free(engine) -> bool:
    s = engine.stats().by_role
    p, d = s["prefill"], s["decode"]
    return (p.num_free_kv_blocks == p.num_kv_blocks > 0 and d.num_free_kv_blocks == d.num_kv_blocks > 0
            and p.kv_transfer_free_blocks == engine.transfer_blocks
            and p.kv_transfer_pending == d.kv_transfer_pending == p.num_running == d.num_running == 0)


LONG = ("In the beginning the workshop made clocks, and every clock was wound by hand each morning. " * 40).strip()


def test_greedy_outputs_identical_to_colocated_and_transformers(disagg, llm_fp32, hf_model):
    from inferlab.server.engine_client import EngineClient

    assert isinstance(disagg, EngineClient)
    prompts = ["The capital of France is", LONG, LONG + " Then", "def fibonacci(n):"]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = drive(disagg, {f"g{i}": (p, greedy) for i, p in enumerate(prompts)})
    colocated = llm_fp32.generate(prompts, greedy)
    tok = llm_fp32.engine.tokenizer
    assert len(tok.encode(LONG, add_special_tokens=False)) > 512  # chunked prefill on the prefill worker
    for i, (p, c) in enumerate(zip(prompts, colocated)):
        assert got[f"g{i}"] == c.token_ids, p[:40]
        ids = torch.tensor([c.prompt_token_ids])
        hf = hf_model.generate(ids, do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
        assert got[f"g{i}"] == hf[0, ids.shape[1]:].tolist(), p[:40]
    # the third prompt extends the second: prefill served its prefix from its prefix cache, and decode took the
    # blocks it already held from its own instead of copying them again
    roles = disagg.stats().by_role
    assert roles["prefill"].prefix_cache_hits_total > 0 and roles["decode"].prefix_cache_hits_total > 0
    assert roles["prefill"].kv_transfers_total >= len(prompts)
    assert roles["decode"].kv_transfer_bytes_total < roles["prefill"].kv_transfer_bytes_total
    # --step-trace: a trace per worker; the prefill worker's steps carry the prompts, within the step budget (the
    # long prompt split across steps), and the decode worker's only single-token queries (it receives every
    # prompt's KV whole).
    from inferlab.engine.step_trace import read_step_trace

    _, pre = read_step_trace(disagg.config.step_trace + ".prefill0")
    _, dec = read_step_trace(disagg.config.step_trace + ".decode0")
    chunks = [n for r in pre for _, n, _ in r["p"]]
    assert all(sum(n for _, n, _ in r["p"]) + r["d"] <= 512 for r in pre) and len(chunks) > len(prompts)
    assert dec and all(not r["p"] for r in dec) and sum(r["d"] for r in dec) >= 9 * len(prompts)


def test_seeded_sampling_continues_across_the_hand_off(disagg, llm_fp32):
    """The decode worker draws from the generator state the prefill worker's first draw left."""
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    got = drive(disagg, {"s": ("Tell me a story about a cat", params)})
    assert got["s"] == llm_fp32.generate(["Tell me a story about a cat"], params)[0].token_ids


def test_abort_frees_blocks_on_both_sides_and_the_transfer_buffer(disagg):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    reqs = {f"a{i}": (f"{i} " + LONG[: 1200 + 40 * i], params) for i in range(5)}
    where = disagg._where
    drive(disagg, reqs, until=lambda _: {r.value for r in where.values()} >= {"prefill", "decode"})
    for rid in reqs:
        disagg.abort(rid)
    # Idle, not only free: the workers' stats can show every block free one step before the last message sent to
    # a worker (an abort, a release) is answered, and until then has_work() is rightly true.
    wait_for(disagg, lambda: all_free(disagg) and not disagg.has_work(),
             "blocks still held, or work left, after aborting every request")
    assert all_free(disagg)


def test_client_disconnect_frees_blocks_and_metrics_carry_the_role(disagg):
    import httpx
    import openai

    from inferlab.server.api import build_app
    from server_testkit import LiveServer, metric

    with LiveServer(build_app(disagg)) as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=DEADLINE)
        stream = client.completions.create(model=disagg.model_name, prompt=LONG, max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:  # tokens 2.. come from the decode worker
                break
        stream.close()
        deadline = time.monotonic() + DEADLINE
        while True:
            text = httpx.get(server.base + "/metrics", timeout=120).text
            free = {role: metric(text, "inferlab:num_free_kv_blocks", role=role) for role in ("prefill", "decode")}
            total = {role: metric(text, "inferlab:num_kv_blocks", role=role) for role in ("prefill", "decode")}
            if free == total and metric(text, "vllm:num_requests_running", role="decode") == 0:
                break
            assert time.monotonic() < deadline, f"blocks still held after the client left: {free} of {total}"
            time.sleep(0.2)
        assert metric(text, "inferlab:kv_transfer_bytes_total", role="prefill") > 0
        assert metric(text, "inferlab:kv_transfer_bytes_total", role="decode") > 0
        assert metric(text, "vllm:generation_tokens_total", role="decode") > 0
        assert metric(text, "vllm:prompt_tokens_total", role="prefill") > 0


def test_full_decode_side_makes_prefill_wait_and_loses_nothing(llm_fp32):
    """One running sequence on the decode side and a transfer buffer for one prompt: prefill must hold finished
    prefills until decode takes them. Every request still completes, token for token as colocated."""
    block_bytes = 30 * 2 * 3 * 16 * 64 * 4  # SmolLM2-135M float32: layers, K/V, kv heads, block, head_dim, bytes
    engine = _engine(transfer_buffer=12 * block_bytes, max_num_seqs=1)
    try:
        assert engine.transfer_blocks == 12
        prompts = [f"Request {i}: " + LONG[:500] for i in range(4)]  # ~100 tokens: 7 blocks each
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        got = drive(engine, {f"b{i}": (p, params) for i, p in enumerate(prompts)})
        assert engine.stats().by_role["prefill"].kv_transfer_stalls_total > 0  # prefill did wait
        for i, c in enumerate(llm_fp32.generate(prompts, params)):
            assert got[f"b{i}"] == c.token_ids
        wait_for(engine, lambda: all_free(engine), "blocks still held after every request finished")
    finally:
        engine.close()


def test_dying_worker_fails_requests_in_flight_with_a_clear_error():
    import httpx

    from inferlab.server.api import build_app
    from inferlab.server.disagg_engine import WorkerDiedError
    from server_testkit import LiveServer

    engine = _engine()
    try:
        with LiveServer(build_app(engine)) as server:
            body = {"model": engine.model_name, "prompt": LONG, "max_tokens": 2000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=DEADLINE) as resp:
                lines = resp.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        break  # the first token is out: the request is on its way to decode
                os.kill(engine.worker_pids["decode"], signal.SIGKILL)
                rest = "\n".join(lines)
            assert "the decode worker" in rest and "was killed by signal 9" in rest, rest[-500:]
            assert isinstance(server.app.state.server.engine.error, WorkerDiedError)
            r = httpx.post(server.base + "/v1/completions", json={**body, "stream": False}, timeout=DEADLINE)
            assert r.status_code == 503 and "decode worker" in r.text
    finally:
        engine.close()
