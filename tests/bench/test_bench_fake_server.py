"""The fake server speaks the OpenAI API (checked with the official `openai` client) and keeps its schedule."""

import httpx
import openai
import pytest

from inferlab.bench.fake_server import FakeConfig, WORDS
from inferlab.bench.scrape import parse


def test_openai_client_streams_chat_and_completions(fake):
    url, server = fake(ttft=0.005, itl=0.002, tokens_per_chunk=2, model="m1")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["m1"]
    chunks = list(client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "say hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(WORDS[:5])
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == 2
    done = client.completions.create(model="m1", prompt="one two three", max_tokens=4)
    assert done.choices[0].text == "".join(WORDS[:4]) and done.usage.prompt_tokens == 3
    streamed = list(client.completions.create(model="m1", prompt="x", max_tokens=3, stream=True))
    assert [c.choices[0].finish_reason for c in streamed] == [None, "length"]


def test_api_key_is_enforced(fake):
    url, _ = fake(api_key="secret")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong").models.list()
    assert openai.OpenAI(base_url=url + "/v1", api_key="secret").models.list().data[0].id == "fake-model"


def test_schedule_is_absolute_and_writes_are_recorded(fake):
    url, server = fake(ttft=0.02, itl=0.005, tokens_per_chunk=3, jitter=0.002, seed=1)
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "a b", "max_tokens": 10, "stream": True},
                      headers={"X-Request-Id": "r1"}) as r:
        body = r.read().decode()
    assert body.rstrip().endswith("data: [DONE]")
    stats = httpx.get(url + "/stats").json()["requests"]
    (s,) = [x for x in stats if x["id"] == "r1"]
    assert s["tokens_per_write"] == [3, 3, 3, 1]
    nominal = [s["admitted"] + 0.02 + j * 3 * 0.005 for j in range(4)]
    for d, n, w in zip(s["deadlines"], nominal, s["writes"]):
        assert n <= d < n + 0.002 + 1e-9  # jitter only delays, never accumulates
        assert w >= d  # a write never precedes its deadline
    # the same request id gets the same jitter
    httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 10, "stream": True},
               headers={"X-Request-Id": "r1"})
    again = [x for x in httpx.get(url + "/stats").json()["requests"] if x["id"] == "r1"][1]
    assert [d - again["admitted"] for d in again["deadlines"]] == pytest.approx(
        [d - s["admitted"] for d in s["deadlines"]], abs=1e-9)


def test_max_concurrency_queues_and_metrics_report_it(fake):
    url, server = fake(ttft=0.01, itl=0.01, max_concurrency=1)
    import concurrent.futures as cf

    def one(i):
        return httpx.post(url + "/v1/completions", json={"prompt": "same prompt", "max_tokens": 3},
                          timeout=10).json()

    with cf.ThreadPoolExecutor(3) as ex:
        list(ex.map(one, range(3)))
    reqs = httpx.get(url + "/stats").json()["requests"]
    spans = sorted((r["admitted"], r["writes"][-1]) for r in reqs)
    assert all(spans[i + 1][0] >= spans[i][1] for i in range(2))  # one at a time
    m = parse(httpx.get(url + "/metrics").text)
    assert m["request_queue_time_seconds_count"] == 3 and m["request_queue_time_seconds_sum"] > 0
    assert m["prefix_cache_queries_total"] == 6 and m["prefix_cache_hits_total"] == 4  # the same prompt, thrice


def test_bad_requests_get_clear_errors(fake):
    url, _ = fake()
    r = httpx.post(url + "/v1/completions", content=b"{nope")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/nothing").status_code == 404


def test_config_validation():
    with pytest.raises(ValueError, match="unknown fault"):
        FakeConfig(faults={"explode": 0.1})
    with pytest.raises(ValueError, match="add up"):
        FakeConfig(faults={"http500": 0.7, "drop": 0.7})
