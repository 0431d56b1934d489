"""The HTTP layer on a deterministic fake engine: protocol shape, errors, auth, admission, timeouts, cancellation,
metrics and shutdown. Fast; the behaviour on the real model is in test_server_engine.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from server_testkit import FakeEngine, LiveServer, fuzz_openapi, metric

CHAT = [{"role": "user", "content": "say something"}]


def _eventually(pred, deadline_s: float = 30.0, what: str = "condition"):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} did not happen within {deadline_s} s")


def _client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def _sse(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n\n") if line]


# ---------------------------------------------------------------- protocol


def test_completion_and_chat_shapes_through_openai_client(fake_server):
    s = fake_server()
    c = _client(s)
    r = c.completions.create(model="fake-model", prompt="one two three", max_tokens=3)
    assert r.choices[0].text == " w0 w1 w2"
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 3, 6)

    r = c.chat.completions.create(model="fake-model", messages=CHAT, max_completion_tokens=2)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == " w0 w1"
    assert r.usage.prompt_tokens == 4  # 2 words + 2 for the message

    chunks = list(c.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " w0 w1 w2 w3"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert len({ch.id for ch in chunks}) == 1

    chunks = list(c.completions.create(model="fake-model", prompt=[1, 2], max_tokens=3, stream=True))
    assert [ch.choices[0].text for ch in chunks] == [" w0", " w1", " w2"]  # one chunk per engine step
    assert chunks[-1].usage is None


def test_model_may_be_omitted_and_models_lists_it(fake_server):
    s = fake_server()
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "a b", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "fake-model"
    models = _client(s).models.list().data
    assert [m.id for m in models] == ["fake-model"]
    assert httpx.get(s.base + "/health").status_code == 200


def test_sse_wire_format_ends_with_done(fake_server):
    s = fake_server()
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r.text)
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [" w0", " w1"]


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "a"}),
                                       ("/v1/chat/completions", {"messages": CHAT})])
def test_every_sse_event_is_a_chunk_model_with_the_fields_openai_clients_read(fake_server, path, body):
    from inferlab.server.protocol import ChatCompletionChunk, CompletionChunk

    s = fake_server()
    r = httpx.post(s.base + path, json={**body, "max_tokens": 3, "stream": True,
                                        "stream_options": {"include_usage": True}})
    events = _sse(r.text)
    assert events[-1] == "[DONE]"
    model = CompletionChunk if path == "/v1/completions" else ChatCompletionChunk
    chunks = [model.model_validate_json(e) for e in events[:-1]]
    raw = [json.loads(e) for e in events[:-1]]
    assert len({(c.id, c.object, c.created, c.model) for c in chunks}) == 1 and chunks[0].model == "fake-model"
    for c, d in zip(chunks[:-1], raw):
        assert c.usage is None and d["usage"] is None
        assert set(d["choices"][0]) >= {"index", "logprobs", "finish_reason", "stop_reason"}
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    if model is ChatCompletionChunk:
        assert raw[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [d["choices"][0]["delta"] for d in raw[1:-1]] == [{"content": f" w{i}"} for i in range(3)]
    else:
        assert [d["choices"][0]["text"] for d in raw[:-1]] == [f" w{i}" for i in range(3)]


def test_sampling_params_reach_the_engine(fake_server):
    s = fake_server()
    _client(s).completions.create(model="fake-model", prompt="a b", max_tokens=5, temperature=0.7, top_p=0.9, seed=11,
                                  stop=["x", "y"], extra_body={"top_k": 20, "ignore_eos": True})
    _, _, params, salt = s.engine.added[-1]
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.max_tokens) == (0.7, 0.9, 20, 11, 5)
    assert params.stop == ["x", "y"] and params.ignore_eos and salt is None


def test_chat_without_max_tokens_fills_the_context(fake_server):
    s = fake_server(FakeEngine(max_model_len=20))
    r = _client(s).chat.completions.create(model="fake-model", messages=CHAT)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 16
    assert r.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- errors


BAD_REQUESTS = [
    # (path, raw body, status, param, words in the message)
    ("/v1/completions", "{not json", 400, None, "malformed JSON"),
    ("/v1/completions", "[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", "", 400, None, "body is required"),
    ("/v1/completions", '{"max_tokens": 3}', 400, "prompt", "prompt: Field required"),
    ("/v1/completions", '{"prompt": 5}', 400, "prompt", "string or a list of token ids"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": "many"}', 400, "max_tokens", "valid integer"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": -1}', 400, "max_tokens", "greater than or equal to 0"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 0}', 400, "max_tokens", "needs echo=true and logprobs"),
    ("/v1/completions", '{"prompt": "a", "temperature": -1}', 400, "temperature", "temperature"),
    ("/v1/completions", '{"prompt": "a", "top_p": 0}', 400, "top_p", "top_p"),
    ("/v1/completions", '{"prompt": "a", "stop": [""]}', 400, "stop", "non-empty"),
    ("/v1/completions", '{"prompt": "a", "n": 0}', 400, "n", "greater than or equal to 1"),
    ("/v1/completions", '{"prompt": "a", "logprobs": 21}', 400, "logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", json.dumps({"messages": CHAT, "top_logprobs": 3}), 400, "top_logprobs",
     "needs logprobs set to true"),
    ("/v1/completions", '{"prompt": "a", "presence_penalty": 0.5}', 400, "presence_penalty", "not supported"),
    ("/v1/completions", '{"prompt": ["a", "b"]}', 400, "prompt", "batch of 2 prompts"),
    ("/v1/completions", '{"prompt": []}', 400, "prompt", "empty"),
    ("/v1/completions", '{"prompt": [99999]}', 400, "prompt", "out of the vocabulary range [0, 1000)"),
    ("/v1/completions", json.dumps({"prompt": "w " * 300}), 400, "prompt", "exceeds the context"),
    ("/v1/completions", '{"prompt": "a", "model": "gpt-4"}', 404, "model", "`gpt-4` does not exist"),
    ("/v1/completions", '{"prompt": "a", "stream_options": {"include_usage": true}}', 400, "stream_options",
     "only allowed when stream"),
    ("/v1/completions", '{"prompt": "a", "cache_salt": ""}', 400, "cache_salt", "non-empty"),
    ("/v1/chat/completions", '{"messages": []}', 400, "messages", "at least 1 item"),
    ("/v1/chat/completions", '{"messages": [{"role": "robot", "content": "x"}]}', 400, "messages", "role"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 7}]}', 400, "messages", "content"),
    ("/v1/chat/completions", '{"messages": "hello"}', 400, "messages", "valid list"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "w " * 300}]}), 400, "messages",
     "maximum context length is 256 tokens"),
    ("/v1/chat/completions", json.dumps({"messages": CHAT, "tools": [{"type": "function"}]}), 400, "tools",
     "tools.0.function: Field required"),
    ("/v1/nothing-here", "{}", 404, None, "Not Found"),
]


@pytest.fixture(scope="module")
def shared_fake():
    from inferlab.server.api import build_app

    with LiveServer(build_app(FakeEngine(max_num_seqs=4))) as s:
        yield s


@pytest.mark.parametrize("path,body,status,param,words", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_input_gets_an_openai_error_then_a_good_request_succeeds(shared_fake, path, body, status, param, words):
    s = shared_fake
    r = httpx.post(s.base + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], err
    assert err["param"] == param
    good = httpx.post(s.base + "/v1/completions", json={"prompt": "a b", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == " w0 w1"


def test_bad_input_through_the_openai_client_raises_its_typed_errors(fake_server):
    c = _client(fake_server())
    with pytest.raises(openai.BadRequestError, match="less than or equal to 64"):
        c.chat.completions.create(model="fake-model", messages=CHAT, n=65)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.chat.completions.create(model="nope", messages=CHAT)
    assert c.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=1).choices[0].message.content


# ---------------------------------------------------------------- auth and tenants


def test_api_key_guards_v1_but_not_health(fake_server):
    s = fake_server(api_keys={"sk-right": None, "sk-acme": "acme"})
    assert httpx.get(s.base + "/health").status_code == 200
    assert httpx.get(s.base + "/metrics").status_code == 200
    r = httpx.get(s.base + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        _client(s, api_key="sk-wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        _client(s, api_key="sk-right").completions.create(model="fake-model", prompt="a", max_tokens=1,
                                                          extra_headers={"Authorization": "Basic sk-right"})
    assert _client(s, api_key="sk-right").models.list().data[0].id == "fake-model"


def test_tenant_becomes_the_cache_salt(fake_server):
    s = fake_server(api_keys={"sk-a": "acme", "sk-b": "bolt", "sk-plain": None})
    for key, salt in [("sk-a", None), ("sk-b", None), ("sk-a", "x"), ("sk-plain", "acme"), ("sk-plain", None)]:
        _client(s, api_key=key).completions.create(model="fake-model", prompt="a", max_tokens=1,
                                                   extra_body={"cache_salt": salt} if salt else None)
    salts = [added[3] for added in s.engine.added]
    assert salts == ['["acme", null]', '["bolt", null]', '["acme", "x"]', '[null, "acme"]', None]
    assert len(set(salts)) == 5  # a keyless salt can never equal a tenant's


# ---------------------------------------------------------------- admission control


def test_queue_bound_gives_429_with_retry_after_and_accepted_requests_complete(fake_server):
    engine = FakeEngine(max_num_seqs=2, step_delay=0.02)
    s = fake_server(engine, max_queue=3)

    async def burst():
        async with httpx.AsyncClient(base_url=s.base, timeout=60) as c:
            return await asyncio.gather(*[
                c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 8}) for _ in range(20)])

    responses = asyncio.run(burst())
    rejected = [r for r in responses if r.status_code == 429]
    accepted = [r for r in responses if r.status_code == 200]
    assert len(rejected) + len(accepted) == 20
    assert rejected and len(accepted) >= 2 + 3
    for r in rejected:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and "--max-queue 3" in r.json()["error"]["message"]
    for r in accepted:
        assert r.json()["choices"][0]["text"] == "".join(f" w{i}" for i in range(8))
    m = httpx.get(s.base + "/metrics").text
    assert metric(m, "inferlab:requests_rejected_total", reason="queue_full") == len(rejected)
    assert metric(m, "vllm:request_success_total", finished_reason="length") == len(accepted)


# ---------------------------------------------------------------- timeouts


def test_request_timeout_aborts_with_clear_errors(fake_server):
    engine = FakeEngine(step_delay=0.02)
    s = fake_server(engine, request_timeout=0.3)
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "a", "max_tokens": 200})
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    assert "--request-timeout 0.3" in r.json()["error"]["message"]

    stream = _client(s).chat.completions.create(model="fake-model", messages=CHAT, max_tokens=200, stream=True)
    got = []
    with pytest.raises(openai.APIError, match="did not finish within"):
        for chunk in stream:
            got.append(chunk)
    assert len(got) >= 1  # the error came in-stream, after the stream had started
    _eventually(lambda: len(engine.aborted) == 2, what="both timed-out requests aborted in the engine")
    assert metric(httpx.get(s.base + "/metrics").text, "inferlab:request_timeouts_total") == 2
    assert _client(s).completions.create(model="fake-model", prompt="a", max_tokens=2).choices[0].text == " w0 w1"


# ---------------------------------------------------------------- cancellation


def test_stream_disconnect_aborts_the_request(fake_server):
    engine = FakeEngine(max_model_len=100_000, step_delay=0.01)
    s = fake_server(engine)
    with httpx.Client(base_url=s.base, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 50_000,
                                                       "stream": True}) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    rid = first["id"]
    _eventually(lambda: rid in engine.aborted, what="abort after disconnect")
    m = httpx.get(s.base + "/metrics").text
    _eventually(lambda: metric(httpx.get(s.base + "/metrics").text, "vllm:num_requests_running") == 0)
    assert metric(m, "vllm:request_success_total", finished_reason="abort") == 1


def test_non_streaming_disconnect_aborts_the_request(fake_server):
    engine = FakeEngine(max_model_len=100_000, step_delay=0.01)
    s = fake_server(engine)
    body = json.dumps({"prompt": "a", "max_tokens": 50_000}).encode()
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        _eventually(lambda: engine.added, what="request reached the engine")
    _eventually(lambda: engine.aborted == [engine.added[0][0]], what="abort after disconnect")


# ---------------------------------------------------------------- metrics, failures, shutdown


def test_metrics_use_vllm_names_and_labels(fake_server):
    s = fake_server()
    _client(s).completions.create(model="fake-model", prompt="a b c", max_tokens=4)
    m = httpx.get(s.base + "/metrics").text
    labels = {"model_name": "fake-model", "engine": "0"}
    assert metric(m, "vllm:num_requests_running", **labels) == 0
    assert metric(m, "vllm:num_requests_waiting", **labels) == 0
    assert metric(m, "vllm:kv_cache_usage_perc", **labels) == 0
    assert metric(m, "vllm:prompt_tokens_total", **labels) == 3
    assert metric(m, "vllm:generation_tokens_total", **labels) == 4
    assert metric(m, "vllm:request_success_total", finished_reason="length", **labels) == 1
    assert metric(m, "vllm:time_to_first_token_seconds_count", **labels) == 1
    assert metric(m, "vllm:inter_token_latency_seconds_count", **labels) == 3
    assert metric(m, "vllm:e2e_request_latency_seconds_count", **labels) == 1
    assert metric(m, "vllm:request_queue_time_seconds_count", **labels) == 1
    for name in ["vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "inferlab:kv_cache_bytes", "inferlab:weight_bytes",
                 "inferlab:packed_weight_bytes"]:
        assert metric(m, name, **labels) == 0, name
    assert metric(m, "inferlab:peak_rss_bytes") > 0
    assert "_created" not in m


def test_metrics_carry_what_an_inference_gateways_endpoint_picker_reads(fake_server):
    """The Gateway API Inference Extension's model-server protocol (docs/scaleout.md): queue depth and running
    requests, KV-cache utilisation under both its names (vLLM v1's and v0's), LoRA info (no adapters) and the KV
    block size for prefix-aware scoring; read back with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    s = fake_server()
    _client(s).completions.create(model="fake-model", prompt="a b c", max_tokens=4)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(s.base + "/metrics").text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info"):
        assert families[name].type == "gauge", name
    kv = [f.samples[0].value for f in (families["vllm:kv_cache_usage_perc"], families["vllm:gpu_cache_usage_perc"])]
    assert kv[0] == kv[1]
    (lora,) = families["vllm:lora_requests_info"].samples
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert lora.value > 1.7e9  # a Unix timestamp: the picker keeps the newest series
    (cache,) = families["vllm:cache_config_info"].samples
    assert cache.labels["block_size"] == str(s.engine.config.block_size) and cache.value == 1


def test_engine_crash_fails_requests_clearly_and_health_reports_it(fake_server):
    engine = FakeEngine(fail_on_step=True)
    s = fake_server(engine)
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 503 and "simulated engine crash" in r.json()["error"]["message"]
    assert httpx.get(s.base + "/health").status_code == 503
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_shutdown_lets_running_streams_finish(fake_server):
    engine = FakeEngine(step_delay=0.01)
    s = fake_server(engine)
    got: list[str] = []
    started = threading.Event()

    def reader():
        with httpx.Client(base_url=s.base, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 60, "stream": True}) as r:
                for line in r.iter_lines():
                    started.set()
                    got.append(line)

    t = threading.Thread(target=reader)
    t.start()
    assert started.wait(30)
    s.stop()  # what uvicorn does on SIGTERM: stop accepting, wait for in-flight responses (grace), then exit
    t.join(30)
    events = [line[6:] for line in got if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "".join(f" w{i}" for i in range(60))
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.base + "/health")


def test_openapi_schema_documents_the_routes(fake_server):
    schema = httpx.get(fake_server().base + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    post = schema["paths"]["/v1/chat/completions"]["post"]
    assert {"200", "400", "401", "404", "429", "504"} <= set(post["responses"])
    assert "text/event-stream" in post["responses"]["200"]["content"]


def test_fuzzing_the_openapi_schema_finds_no_server_error(fake_server):
    s = fake_server(FakeEngine(max_model_len=4096), request_timeout=30)
    problems = fuzz_openapi(s.base, max_examples=60, negative=True)
    assert not problems, "\n\n".join(problems[:5])
    assert httpx.post(s.base + "/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


# ---------------------------------------------------------------- the CLI's own checks


def test_api_keys_file_maps_keys_to_tenants_and_rejects_bad_files(tmp_path):
    from inferlab.server.cli import load_api_keys

    good = tmp_path / "keys.yaml"
    good.write_text("sk-a: acme\nsk-b: bolt\n")
    assert load_api_keys("sk-admin", good) == {"sk-admin": None, "sk-a": "acme", "sk-b": "bolt"}
    assert load_api_keys(None, None) == {}
    for text, words in [("[1, 2]", "mapping"), ("sk-a: ''", "non-empty"), ("sk-a: [x]", "KEY: TENANT"), (":", "mapping")]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=words):
            load_api_keys(None, bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(None, tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="empty"):
        load_api_keys("  ", None)


@pytest.mark.parametrize("argv,words", [
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--api-key", ""], "--api-key is empty"),
    (["--model", "/nonexistent/model.gguf"], "cannot load the model"),
])
def test_serve_refuses_bad_options_with_a_clear_message(argv, words, capsys):
    import argparse

    from inferlab.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(argv)) == 2
    assert words in capsys.readouterr().err


def test_n_choices_each_finish_with_their_index(fake_server):
    c = _client(fake_server())
    r = c.completions.create(model="fake-model", prompt="a b", n=3, max_tokens=2)
    assert [(ch.index, ch.text, ch.finish_reason) for ch in r.choices] == [(i, " w0 w1", "length") for i in range(3)]
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 2
    seen: dict[int, str] = {}
    for ch in c.chat.completions.create(model="fake-model", messages=CHAT, n=2, max_tokens=2, stream=True):
        for choice in ch.choices:
            seen[choice.index] = seen.get(choice.index, "") + (choice.delta.content or "")
    assert seen == {0: " w0 w1", 1: " w0 w1"}
