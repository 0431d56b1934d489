"""The server on the real engine and the bundled model, with the official `openai` client against a live uvicorn.

The oracle is the offline engine (`LLM.generate`) on the same weights: greedy outputs over the API must be exactly
what it gives. The engine runs in float32 so that greedy near-ties do not depend on batch composition.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_testkit import LiveServer, fuzz_openapi, metric
from inferlab.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 32
PROMPTS = [f"Story {i}: once upon a time, in a village by the sea," for i in range(MAX_NUM_SEQS)]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a primary colour."}]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llm():
    from inferlab.engine.llm import LLM

    return LLM(dtype="float32", kv_cache_memory=256 * 2**20, max_model_len=512, max_num_seqs=MAX_NUM_SEQS,
               max_num_batched_tokens=1024)


def serve(llm, **cfg) -> LiveServer:
    from inferlab.server.api import ServerConfig, build_app

    return LiveServer(build_app(llm.engine, ServerConfig(**cfg)))


def client(s: LiveServer, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=300, **kw)


def aclient(s: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=300)


def offline(llm, prompts, params):
    """The oracle, `LLM.generate`, run on a worker thread like the server's engine thread: torch's OpenMP state is
    per thread, and on a busy 2-core machine the main thread's matmuls are several times slower."""
    result = []
    worker = threading.Thread(target=lambda: result.append(llm.generate(prompts, params)))
    worker.start()
    worker.join()
    assert result, "LLM.generate raised (see the thread's traceback above)"
    return result[0]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def eventually(pred, what: str, deadline_s: float = 120.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {deadline_s} s")


def test_the_engine_is_an_engine_client(llm):
    from inferlab.server.engine_client import EngineClient

    assert isinstance(llm.engine, EngineClient)
    assert llm.engine.config.max_num_seqs == MAX_NUM_SEQS


def test_greedy_outputs_over_the_api_equal_the_offline_engine(llm):
    ids = llm.tokenizer.encode("The capital of France is", add_special_tokens=False)
    want_text, want_ids, want_chat = offline(llm, [PROMPTS[0], ids, CHAT], greedy(8))
    model = "SmolLM2-135M-Instruct"

    async def run(c: openai.AsyncOpenAI):
        async def chunks(stream):
            return [ch async for ch in await stream]

        # Concurrent, so they share engine steps: the API path must not change what each request gets.
        return await asyncio.gather(
            c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0),
            c.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0),
            chunks(c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True,
                                        stream_options={"include_usage": True})),
            c.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=8, temperature=0),
            chunks(c.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, stream=True)))

    with serve(llm) as s:
        assert [m.id for m in client(s).models.list().data] == [model]
        text, by_ids, text_stream, chat, chat_stream = asyncio.run(run(aclient(s)))

    assert text.choices[0].text == want_text.text
    assert text.choices[0].finish_reason == want_text.finish_reason
    assert text.usage.prompt_tokens == len(want_text.prompt_token_ids)
    assert text.usage.completion_tokens == len(want_text.token_ids)
    assert by_ids.choices[0].text == want_ids.text
    assert "".join(ch.choices[0].text for ch in text_stream if ch.choices) == want_text.text
    assert text_stream[-1].usage.completion_tokens == len(want_text.token_ids)
    assert chat.choices[0].message.content == want_chat.text
    assert chat.usage.prompt_tokens == len(want_chat.prompt_token_ids)
    assert chat.choices[0].finish_reason == want_chat.finish_reason
    assert chat_stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chat_stream) == want_chat.text
    assert chat_stream[-1].choices[0].finish_reason == want_chat.finish_reason


def test_stop_strings_and_seeded_sampling_match_the_offline_engine(llm):
    free = offline(llm, PROMPTS[1], greedy(12))[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]  # a string the greedy continuation is known to produce
    sampled = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=6)
    want_stop, want_seeded = offline(llm, [PROMPTS[1], PROMPTS[2]], [greedy(12, stop=[stop]), sampled])
    assert want_stop.finish_reason == "stop"
    model = "SmolLM2-135M-Instruct"

    async def run(c: openai.AsyncOpenAI):
        async def streamed():
            return "".join([ch.choices[0].text async for ch in await c.completions.create(
                model=model, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=stop, stream=True)])

        def seeded(seed: int):
            return c.completions.create(model=model, prompt=PROMPTS[2], max_tokens=6, temperature=1.0, top_p=0.9,
                                        seed=seed, extra_body={"top_k": 50})

        return await asyncio.gather(
            c.completions.create(model=model, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop]),
            streamed(), seeded(1234), seeded(1234), seeded(1), seeded(2), seeded(3))

    with serve(llm) as s:
        stopped, stopped_stream, *seeded = asyncio.run(run(aclient(s)))
    assert stopped.choices[0].text == want_stop.text and stop not in stopped.choices[0].text
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped_stream == want_stop.text
    texts = [r.choices[0].text for r in seeded]
    assert texts[0] == texts[1] == want_seeded.text  # same seed, same text, whatever else shares the batch
    assert len(set(texts)) > 1


def test_32_concurrent_streams_each_get_the_offline_output(llm):
    want = [o.text for o in offline(llm, PROMPTS, greedy(8))]

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8,
                                            temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def run(s: LiveServer) -> list[str]:
        async with aclient(s) as c:
            return await asyncio.gather(*[one(c, p) for p in PROMPTS])

    with serve(llm) as s:
        got = asyncio.run(run(s))
    assert got == want


def test_16_disconnects_free_the_running_slots_and_the_kv_cache(llm):
    with serve(llm) as s:
        idle = metric(httpx.get(s.base + "/metrics").text, "vllm:kv_cache_usage_perc")

        def drop_midway(prompt: str, reached: threading.Barrier) -> None:
            with httpx.Client(timeout=300) as h:
                with h.stream("POST", s.base + "/v1/completions",
                              json={"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                    n = 0
                    for line in r.iter_lines():
                        n += line.startswith("data: ")
                        if n == 3:
                            break
                    reached.wait()  # all 16 are mid-stream at once, then all drop

        barrier = threading.Barrier(16)
        threads = [threading.Thread(target=drop_midway, args=(p, barrier)) for p in PROMPTS[:16]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        def settled() -> bool:
            m = httpx.get(s.base + "/metrics").text
            return (metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:num_requests_waiting") == 0
                    and metric(m, "vllm:kv_cache_usage_perc") == idle)

        eventually(settled, "running back to 0 and KV usage back to idle")
        m = httpx.get(s.base + "/metrics").text
        assert metric(m, "vllm:request_success_total", finished_reason="abort") == 16
        assert metric(m, "inferlab:num_requests_in_flight") == 0
        # Nothing kept computing for nobody: far fewer tokens than the 16 x 400 asked for.
        assert metric(m, "vllm:generation_tokens_total") < 16 * 400 / 2
        # And the server still serves.
        assert client(s).completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2).choices


def test_overload_64_requests_with_max_queue_4(llm):
    async def one(c: openai.AsyncOpenAI, i: int):
        try:
            r = await c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": PROMPTS[i % 32]}])
            return "ok", time.monotonic(), r
        except openai.RateLimitError as e:
            return "429", time.monotonic(), e

    async def run(s: LiveServer):
        async with aclient(s) as c:
            return await asyncio.gather(*[one(c, i) for i in range(64)])

    with serve(llm, max_queue=4) as s:
        results = asyncio.run(run(s))
        m = httpx.get(s.base + "/metrics").text
    ok = [r for kind, _, r in results if kind == "ok"]
    rejected = [(t, e) for kind, t, e in results if kind == "429"]
    assert rejected, "64 simultaneous requests against 32 slots + 4 queue places must see 429s"
    # Every free running slot is used before anything queues: the bound applies to waiting requests only.
    assert len(ok) >= MAX_NUM_SEQS
    for e in [e for _, e in rejected]:
        assert e.response.headers["retry-after"] == "1"
        assert e.body["code"] == "rate_limit_exceeded" and "--max-queue 4" in e.body["message"]
    for r in ok:
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    # Promptly: every 429 arrived before the first accepted request finished its 8 tokens.
    first_done = min(t for kind, t, _ in results if kind == "ok")
    assert max(t for t, _ in rejected) < first_done
    assert metric(m, "inferlab:requests_rejected_total", reason="queue_full") == len(rejected)


BAD = [
    ("/v1/completions", json.dumps({"prompt": "word " * 600, "max_tokens": 4}), 400, "prompt", "maximum context length"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 600}), 400, "max_tokens", "maximum context length"),
    ("/v1/completions", json.dumps({"prompt": [10**7]}), 400, "prompt", "vocabulary"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "word " * 600}]}), 400, "messages",
     "maximum context length"),
    ("/v1/chat/completions", '{"messages": [{"role": "user"', 400, None, "malformed JSON"),
    ("/v1/chat/completions", json.dumps({"messages": CHAT, "model": "llama-70b"}), 404, "model", "does not exist"),
    ("/v1/chat/completions", json.dumps({"messages": CHAT, "n": 65}), 400, "n", "less than or equal to 64"),
    ("/v1/chat/completions", json.dumps({"messages": CHAT, "max_tokens": -1}), 400, "max_tokens", "max_tokens"),
    ("/v1/chat/completions", json.dumps({"model": "SmolLM2-135M-Instruct"}), 400, "messages", "Field required"),
]


def test_bad_input_is_a_clear_4xx_and_the_next_good_request_succeeds(llm):
    want = offline(llm, CHAT, greedy(2))[0].text
    with serve(llm) as s:
        for path, body, status, param, words in BAD:
            r = httpx.post(s.base + path, content=body, headers={"content-type": "application/json"}, timeout=300)
            assert r.status_code == status, (body[:80], r.text)
            err = r.json()["error"]
            assert words in err["message"] and err["param"] == param, (body[:80], err)
            good = client(s).chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=2,
                                                     temperature=0)
            assert good.choices[0].message.content == want


def test_fuzzing_the_openapi_schema_finds_no_server_error(llm):
    with serve(llm, request_timeout=120) as s:
        problems = fuzz_openapi(s.base, max_examples=6, negative=False)
        assert not problems, "\n\n".join(problems[:5])
        assert client(s).chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=2).choices


def test_serve_cli_sigterm_lets_the_stream_finish_and_exits_0(tmp_path):
    """`inferlab serve` end to end: start, stream, SIGTERM mid-stream -> the stream completes, new connections are
    refused, the process exits 0."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    keys = tmp_path / "keys.yaml"
    keys.write_text("sk-acme: acme\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferlab", "serve", "--port", str(port), "--dtype", "float32",
         "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--api-keys-file", str(keys),
         "--shutdown-grace", "120", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(base + "/health").status_code == 200
            except httpx.TransportError:
                return False

        eventually(up, "server start", deadline_s=300)
        assert httpx.get(base + "/v1/models").status_code == 401
        c = openai.OpenAI(base_url=base + "/v1", api_key="sk-acme", max_retries=0, timeout=300)
        stream = c.completions.create(model="SmolLM2-135M-Instruct", prompt="Count: 1, 2, 3,", max_tokens=40,
                                      stream=True, stream_options={"include_usage": True},
                                      extra_body={"ignore_eos": True})
        it = iter(stream)
        first = next(it)
        proc.send_signal(signal.SIGTERM)
        rest = list(it)
        assert rest[-1].usage.completion_tokens == 40  # the in-flight stream ran to its end
        assert first.choices[0].text is not None
        assert proc.wait(timeout=120) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- fault isolation


def test_a_failure_in_one_requests_sampling_or_detokenizing_fails_it_alone(llm, monkeypatch):
    """Faults injected into one request's sampling (seed 666) and another's detokenization (seed 667, at its third
    token): each fails alone, with an error event / a 500 naming it, counted by stage, while a concurrent greedy
    stream gets exactly the tokens it gets alone. (The seeds only mark the requests: greedy ignores them.)"""
    engine = llm.engine
    want = offline(llm, PROMPTS[3], greedy(12))[0].text
    real_sampler, real_update = engine.sampler, engine.detokenizer.update

    def sampler(logits, params, gens):
        if any(p.seed == 666 for p in params):
            raise RuntimeError("injected sampling fault")
        return real_sampler(logits, params, gens)

    def update(seq):
        if seq.params.seed == 667 and seq.num_output_tokens >= 3:
            raise RuntimeError("injected detokenizer fault")
        real_update(seq)

    monkeypatch.setattr(engine, "sampler", sampler)
    monkeypatch.setattr(engine.detokenizer, "update", update)

    async def run(s: LiveServer):
        async with httpx.AsyncClient(base_url=s.base, timeout=300) as h:
            async def stream(body) -> list[str]:
                async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]

            return await asyncio.gather(
                stream({"prompt": PROMPTS[3], "max_tokens": 12, "temperature": 0}),
                stream({"prompt": PROMPTS[4], "max_tokens": 12, "temperature": 0, "seed": 666}),
                h.post("/v1/completions", json={"prompt": PROMPTS[5], "max_tokens": 12, "temperature": 0,
                                                "seed": 667}))

    with serve(llm) as s:
        idle = metric(httpx.get(s.base + "/metrics").text, "vllm:kv_cache_usage_perc")
        good, bad_stream, bad = asyncio.run(run(s))
        m = httpx.get(s.base + "/metrics").text
        assert client(s).completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[3], max_tokens=12,
                                            temperature=0).choices[0].text == want
        eventually(lambda: metric(httpx.get(s.base + "/metrics").text, "vllm:kv_cache_usage_perc") == idle,
                   "KV usage back to idle")
    assert good[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["text"] for e in good[:-1]) == want
    assert bad_stream[-1] == "[DONE]"
    err = json.loads(bad_stream[-2])["error"]
    assert "injected sampling fault" in err["message"] and "failed in sample" in err["message"], err
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert "injected detokenizer fault" in err["message"] and "failed in detokenize" in err["message"]
    assert err["message"].startswith("request cmpl-") and err["code"] == "engine_error"
    assert metric(m, "inferlab:request_errors_total", stage="sample") == 1
    assert metric(m, "inferlab:request_errors_total", stage="detokenize") == 1
    assert metric(m, "vllm:request_success_total", finished_reason="error") == 2


def test_sampling_extremes_on_the_real_engine(llm):
    """The inputs that used to take the engine down or answer garbage: top_k 2^63 (400, then the engine still
    serves), temperature 1e-300 (greedy's answer), the largest seeds torch takes, and top_k = the vocabulary."""
    want = offline(llm, PROMPTS[6], greedy(6))[0].text
    vocab = llm.engine.vocab_size
    with serve(llm) as s:
        def post(**body) -> httpx.Response:
            return httpx.post(s.base + "/v1/completions", json={"prompt": PROMPTS[6], "max_tokens": 6, **body},
                              timeout=300)

        r = post(top_k=2**63)
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
        r = post(top_k=vocab + 1)
        assert r.status_code == 400 and str(vocab) in r.json()["error"]["message"], r.text
        assert post(temperature=0).json()["choices"][0]["text"] == want
        for t in (1e-300, 5e-324, 1e-6):
            assert post(temperature=t).json()["choices"][0]["text"] == want, t
        for seed in (2**64 - 1, -(2**63), 0):
            r = post(temperature=1.0, seed=seed, top_k=vocab)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        r = post(stop_token_ids=[vocab])
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
        assert httpx.get(s.base + "/health").status_code == 200
        assert post(temperature=0).json()["choices"][0]["text"] == want


def _start_serve(tmp_path, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferlab", "serve", "--port", str(port), "--dtype", "float32",
         "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--log-level", "warning", *flags],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, proc.stdout.read()
        try:
            return httpx.get(base + "/health").status_code == 200
        except httpx.TransportError:
            return False

    eventually(up, "server start", deadline_s=300)
    return proc, base


def _sse_events(base: str, body: dict, on_first=None) -> list[str]:
    events: list[str] = []
    with httpx.Client(timeout=300) as h:
        with h.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2 and on_first is not None:
                        on_first()
    return events


def test_serve_exits_1_when_the_engine_thread_dies(tmp_path):
    """INFERLAB_FAULT_INJECT=engine_crash_after_steps:N (test-only, read once at startup) makes step N+1 raise:
    the stream in flight ends with an engine_dead error event and [DONE], and the process exits 1 on its own."""
    proc, base = _start_serve(tmp_path, env={"INFERLAB_FAULT_INJECT": "engine_crash_after_steps:6"})
    try:
        events = _sse_events(base, {"prompt": "Count: 1, 2, 3,", "max_tokens": 100, "ignore_eos": True})
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_dead" and "injected engine crash" in err["message"], err
        assert proc.wait(timeout=120) == 1
        out = proc.stdout.read()
        assert "the engine stopped" in out and "exiting 1" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_second_sigterm_ends_the_drain_with_errors_and_exits_4(tmp_path):
    """First SIGTERM: drain; second: the stream in flight gets a server_shutdown error event and [DONE] at once,
    the log holds no traceback, and the exit code (4) says the drain was cut short."""
    proc, base = _start_serve(tmp_path, "--shutdown-grace", "600")

    def two_signals():
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # not a timing assertion: lets the first signal be handled on its own
        proc.send_signal(signal.SIGTERM)

    try:
        events = _sse_events(base, {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True},
                             on_first=two_signals)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "server_shutdown" and "second SIGTERM" in err["message"], err
        assert len(events) < 400  # cut short, not run to its end
        assert proc.wait(timeout=120) == 4
        out = proc.stdout.read()
        assert "Traceback" not in out and "exiting 4" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_a_kv_pool_smaller_than_one_block_with_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "inferlab", "serve", "--port", "1", "--dtype", "float32", "--kv-cache-memory", "1KiB",
         "--log-level", "warning"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--kv-cache-memory 1024 B holds no KV block" in proc.stderr, proc.stderr[-2000:]
