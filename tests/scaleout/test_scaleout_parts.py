"""The scale-out pieces without a cluster: what the router reads from a request, the merged /metrics (read back
with prometheus_client's parser as the oracle), the replica options' checks and the round-robin order."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install 'inferlab[ray]' (make install does)")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from inferlab.scaleout.application import ReplicaOptions  # noqa: E402
from inferlab.scaleout.messages import routing_text  # noqa: E402
from inferlab.scaleout.metrics_board import merge_expositions  # noqa: E402
from inferlab.scaleout.routers import RoundRobinRouter  # noqa: E402


def _body(**kw) -> bytes:
    return json.dumps(kw).encode()


def test_routing_text_is_the_prompt_or_the_messages_text():
    assert routing_text(_body(prompt="You are a pirate. Hi")) == "You are a pirate. Hi"
    assert routing_text(_body(prompt=["first", "second"])) == "first"
    assert routing_text(_body(prompt=[1, 22, 333])) == "1 22 333"
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}]}]
    assert routing_text(_body(messages=chat)) == "Be brief.Hi"
    assert routing_text(_body(prompt="x" * 10_000), max_chars=100) == "x" * 100
    for junk in (b"", b"not json", b"[1,2]", _body(model="m")):
        assert routing_text(junk) == ""


def _exposition(waiting: float, hits: float) -> str:
    return (
        "# HELP vllm:num_requests_waiting Number of requests waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="m",engine="0"}} {waiting}\n'
        "# HELP vllm:prefix_cache_hits_total Hits.\n# TYPE vllm:prefix_cache_hits_total counter\n"
        f'vllm:prefix_cache_hits_total{{model_name="m",engine="0"}} {hits}\n'
        "# HELP vllm:e2e_request_latency_seconds E2E.\n# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{model_name="m",engine="0",le="1.0"} 1.0\n'
        'vllm:e2e_request_latency_seconds_bucket{model_name="m",engine="0",le="+Inf"} 2.0\n'
        'vllm:e2e_request_latency_seconds_sum{model_name="m",engine="0"} 3.5\n'
        'vllm:e2e_request_latency_seconds_count{model_name="m",engine="0"} 2.0\n')


def test_merged_metrics_keep_each_replicas_series_under_a_replica_label():
    text = merge_expositions({"a1": _exposition(3, 10), "b2": _exposition(5, 0)})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["inferlab:replicas"].samples[0].value == 2
    waiting = {s.labels["replica"]: s.value for s in families["vllm:num_requests_waiting"].samples}
    assert waiting == {"a1": 3, "b2": 5}
    hits = families["vllm:prefix_cache_hits"]
    assert hits.type == "counter" and {s.name for s in hits.samples} == {"vllm:prefix_cache_hits_total"}
    assert sum(s.value for s in hits.samples) == 10
    e2e = families["vllm:e2e_request_latency_seconds"]
    assert e2e.type == "histogram"
    counts = {s.labels["replica"]: s.value for s in e2e.samples if s.name.endswith("_count")}
    assert counts == {"a1": 2, "b2": 2}
    assert all(s.labels["model_name"] == "m" for f in families.values() for s in f.samples if s.labels)
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text


@pytest.mark.parametrize("opts, flag", [
    (ReplicaOptions(replicas=0), "--replicas"),
    (ReplicaOptions(threads=0), "--num-threads"),
    (ReplicaOptions(router="random"), "--router"),
    (ReplicaOptions(affinity_imbalance=-1), "--affinity-imbalance"),
    (ReplicaOptions(max_ongoing_requests=0), "--max-ongoing-requests"),
    (ReplicaOptions(target_ongoing_requests=0), "--target-ongoing-requests"),
    (ReplicaOptions(replicas=5, min_replicas=1, max_replicas=4), "--max-replicas"),
    (ReplicaOptions(replicas=1, min_replicas=2, max_replicas=4), "--min-replicas"),
])
def test_bad_replica_options_name_the_flag(opts, flag):
    with pytest.raises(ValueError, match=flag):
        opts.check()


def test_round_robin_takes_the_replicas_in_turn_whatever_order_they_come_in():
    router = RoundRobinRouter.__new__(RoundRobinRouter)  # the policy only: no deployment, no handle
    router.initialize_state()
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("b", "c", "a")]

    async def picks(n: int) -> list[str]:
        out = []
        for i in range(n):
            shuffled = replicas[i % 3:] + replicas[:i % 3]
            (rank,) = await router.choose_replicas(shuffled)
            out.append(rank[0].replica_id.unique_id)
        return out

    assert asyncio.run(picks(7)) == ["a", "b", "c", "a", "b", "c", "a"]
    assert asyncio.run(router.choose_replicas([])) == []


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--min-replicas", "3", "--max-replicas", "4"], "must lie within"),
    (["--replicas", "2", "--model", "/nonexistent/model.gguf"], "--model /nonexistent/model.gguf: no such file"),
    (["--replicas", "2", "--max-queue", "-1"], "--max-queue must be >= 0"),
])
def test_bad_serve_flags_exit_2_before_any_cluster_starts(flags, message, capsys):
    from inferlab.cli import main

    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err
    import ray

    assert not ray.is_initialized()


def _replica_on(app):
    """The replica's forwarding on any ASGI app: the deployment's class without Ray (no engine, no actor)."""
    from inferlab.scaleout.replica import EngineReplica

    class Bare(EngineReplica.func_or_class):
        def __del__(self) -> None:  # the deployment's (async) shutdown of an engine this one does not have
            pass

    replica = Bare.__new__(Bare)
    replica.app, replica.replica_id = app, "r1"
    return replica


async def _collect(replica, request) -> list:
    return [item async for item in replica.forward(request)]


def test_forward_streams_the_apps_response_head_first_then_each_body_chunk():
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from inferlab.scaleout.messages import ForwardedRequest, ResponseHead

    async def echo(request: Request):
        body = await request.body()

        async def parts():
            for word in body.split():
                yield b"data: " + word + b"\n\n"

        return StreamingResponse(parts(), status_code=201, media_type="text/event-stream",
                                 headers={"x-seen-auth": request.headers["authorization"]})

    replica = _replica_on(Starlette(routes=[Route("/v1/echo", echo, methods=["POST"])]))
    items = asyncio.run(_collect(replica, ForwardedRequest("POST", "/v1/echo", "", [("Authorization", "Bearer k")],
                                                           b"one two three")))
    head, body = items[0], items[1:]
    assert isinstance(head, ResponseHead) and head.status == 201
    headers = dict(head.headers)
    assert headers["x-seen-auth"] == "Bearer k" and headers["x-inferlab-replica"] == "r1"
    assert headers["content-type"].startswith("text/event-stream")
    assert body == [b"data: one\n\n", b"data: two\n\n", b"data: three\n\n"]


def test_forward_raises_when_the_app_fails_mid_response_instead_of_ending_quietly():
    from inferlab.scaleout.messages import ForwardedRequest, ResponseHead

    async def broken(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: a\n\n", "more_body": True})
        raise ValueError("boom")

    got: list = []

    async def run():
        async for item in _replica_on(broken).forward(ForwardedRequest("POST", "/x", "", [], b"")):
            got.append(item)

    with pytest.raises(RuntimeError, match="failed mid-response.*boom"):
        asyncio.run(run())
    assert isinstance(got[0], ResponseHead) and got[1:] == [b"data: a\n\n"]
