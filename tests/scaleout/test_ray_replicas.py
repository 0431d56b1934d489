"""Two engine replicas on a real local Ray cluster behind one endpoint (`inferlab serve --replicas 2`), driven by
the official openai client: streaming works through the one endpoint, and when one replica's process is killed
its in-flight streams end cleanly (they finish, or end with an error the client raises), new requests keep
succeeding, and Ray starts a replacement.

CPU only, 1 thread per replica, a small KV pool. Every wait has a generous deadline so a broken cluster fails the
test instead of hanging it; the cluster is torn down in every case. No timing is asserted."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from inferlab.bench.launcher import free_port

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'inferlab[ray]' (make install does)")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[2] / "src"
STARTUP_DEADLINE = 900.0  # seconds: a cold start may compile the C++ kernels (minutes on a busy 2-core machine)
RESTART_DEADLINE = 600.0
REPLICA_CLASS = "ServeReplica:inferlab:EngineReplica"


def _wait_for(predicate, deadline_s: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"`inferlab serve --replicas` exited {proc.returncode} while waiting for {what}:\n"
                        + (log.read_text()[-4000:] if log else ""))
        value = predicate()
        if value:
            return value
        time.sleep(1.0)
    pytest.fail(f"gave up after {deadline_s:.0f} s waiting for {what}" + (
        ":\n" + log.read_text()[-4000:] if log else ""))


@contextlib.contextmanager
def _serve_replicas(log: Path, router: str, scale: tuple[str, ...] = ("--replicas", "2")):
    """`inferlab serve --replicas 2 --router ROUTER` in its own session; yields (base_url, gcs_address)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           # Ray's own OOM killer compares the whole machine's memory with a threshold; on a shared machine other
           # people's processes would make it kill our replicas. The kernel's OOM killer still applies.
           "RAY_memory_monitor_refresh_ms": "0"}
    cmd = [sys.executable, "-m", "inferlab", "serve", *scale, "--num-threads", "1", "--port", str(port),
           "--router", router, "--kv-cache-memory", "48MiB", "--max-num-seqs", "8", "--max-model-len", "1024",
           "--object-store-memory", "96MiB"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_for(lambda: " on http://" in log.read_text(), STARTUP_DEADLINE, "the replicas to start", proc, log)
        yield f"http://127.0.0.1:{port}", re.search(r"Ray at (\S+)", log.read_text()).group(1)
    finally:
        proc.send_signal(signal.SIGINT)  # the CLI drains, stops Serve and the local cluster
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the cluster is left (its processes share the session)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@pytest.fixture
def replicas(tmp_path):
    """Round-robin routing: both replicas get streams in flight when one is killed. (base_url, gcs, log)."""
    log = tmp_path / "serve.log"
    with _serve_replicas(log, "round-robin") as (base, gcs):
        yield base, gcs, log


# Ray's state API, from a short-lived driver of its own: the CLI's local cluster uses Ray's default token auth
# (~/.ray/auth_token), which a client must opt into before Ray is first imported.
_LIST_REPLICAS = f"""
import json, sys
import ray
from ray.util.state import list_actors
ray.init(address=sys.argv[1], logging_level="error", log_to_driver=False)
actors = list_actors(filters=[("class_name", "=", "{REPLICA_CLASS}"), ("state", "=", "ALIVE")], detail=True)
print(json.dumps({{a.name: a.pid for a in actors if a.pid}}))
"""


@pytest.fixture
def ray_state(replicas):
    """() -> {replica actor name: PID} of the live engine replicas, from Ray's state API."""
    _, gcs, _ = replicas
    env = {**os.environ, "RAY_AUTH_MODE": "token"}

    def alive() -> dict[str, int]:
        r = subprocess.run([sys.executable, "-c", _LIST_REPLICAS, gcs], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    return alive


def _client(base: str):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


def _stream(client, prompt: str, max_tokens: int, first_chunk: threading.Semaphore | None = None):
    """('ok', finish_reason, text) or ('error', exception) for one streaming completion; `first_chunk` is released
    when its first chunk arrives."""
    text, finish = "", None
    try:
        for chunk in client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=max_tokens,
                                               stream=True, temperature=0, extra_body={"ignore_eos": True}):
            if first_chunk is not None and not text and finish is None:
                first_chunk.release()
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    except openai.APIError as e:
        return ("error", e)
    return ("ok", finish, text)


def test_two_replicas_serve_one_endpoint_and_survive_a_killed_replica(replicas, ray_state):
    base, _, log = replicas
    client = _client(base)
    pids = _wait_for(lambda: p if len(p := ray_state()) == 2 else None, 120, "two live replica actors")

    # Streaming through the one endpoint: every stream ends with its finish reason and the tokens it asked for.
    with cf.ThreadPoolExecutor(4) as pool:
        first = list(pool.map(lambda i: _stream(client, f"Request {i}: the capital of France is", 8), range(4)))
    assert all(r[0] == "ok" and r[1] == "length" and r[2] for r in first), first

    # Six streams in flight, three on each replica (round-robin), each past its first chunk; then one replica's
    # process is killed.
    victim_name, victim_pid = sorted(pids.items())[0]
    victim = victim_name.rsplit("#", 1)[1]
    first_chunks = threading.Semaphore(0)
    with cf.ThreadPoolExecutor(8) as pool:
        in_flight = [pool.submit(_stream, client, f"Story {i}: once upon a time", 256, first_chunks) for i in range(6)]
        for _ in in_flight:
            assert first_chunks.acquire(timeout=600), "a stream got no first chunk"
        _wait_for(lambda: _running(_metrics(base), victim) >= 1, 300, "streams running on the replica to kill")
        os.kill(victim_pid, signal.SIGKILL)
        results = [f.result(timeout=600) for f in in_flight]
    # Clean ends only: the streams on the dead replica end with its error, which the openai client raises (never a
    # silent cut), and the others complete.
    failed = [r for r in results if r[0] == "error"]
    assert failed, results
    assert all(isinstance(r[1], openai.APIError) and "replica" in str(r[1]) for r in failed), failed
    assert all(r[1] == "length" and r[2] for r in results if r[0] == "ok"), results
    assert len(failed) < len(results), results
    # New requests keep succeeding while Ray replaces the dead replica.
    with cf.ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda i: _stream(client, f"After {i}: the sky is", 8), range(6)))
    assert all(r[0] == "ok" and r[1] == "length" for r in after), after

    # Ray starts a replacement: two live replicas again, the killed process not among them.
    new = _wait_for(lambda: p if len(p := ray_state()) == 2 and victim_pid not in p.values() else None,
                    RESTART_DEADLINE, "Ray to restart the killed replica", log=log)
    assert victim_name not in new
    with cf.ThreadPoolExecutor(4) as pool:
        later = list(pool.map(lambda i: _stream(client, f"Later {i}: water is", 8), range(4)))
    assert all(r[0] == "ok" and r[1] == "length" for r in later), later
    # /metrics serves the live replicas' series, each labelled with its replica id (actor names are
    # SERVE_REPLICA::<app>#<deployment>#<replica id>); the dead one's leave once it stops posting.
    live = {name.rsplit("#", 1)[1] for name in new}
    _wait_for(lambda: _labelled(_metrics(base)) == live, 120, f"/metrics to show exactly the replicas {live}")


def _labelled(text: str) -> set[str]:
    return set(re.findall(r'^vllm:num_requests_waiting\{[^}]*replica="([^"]+)"', text, re.M))


def _metrics(base: str) -> str:
    try:
        return httpx.get(base + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return ""


def _running(text: str, replica: str) -> float:
    pattern = r'^vllm:num_requests_running\{[^}]*replica="' + re.escape(replica) + r'"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_prefix_affinity_sends_requests_with_a_shared_prefix_to_one_replica(tmp_path):
    """Ray's PrefixCacheAffinityRouter through our ingress: sequential requests (balanced load) of one prefix group
    are all answered by the replica that served the group's first one (the x-inferlab-replica header), and that
    replica's prefix cache hits on them."""
    with _serve_replicas(tmp_path / "serve.log", "prefix-affinity") as (base, _):
        client = _client(base)
        groups = {g: f"Document {g}. " + " ".join(f"{g}-{w}" for w in range(120)) for g in ("alpha", "beta")}
        served: dict[str, list[str]] = {g: [] for g in groups}
        for i in range(4):
            for g, prefix in groups.items():
                raw = client.completions.with_raw_response.create(
                    model="SmolLM2-135M-Instruct", prompt=f"{prefix}\nQuestion {i}: what is {g}?", max_tokens=2)
                assert raw.parse().choices[0].finish_reason in ("length", "stop")
                served[g].append(raw.headers["x-inferlab-replica"])
        assert all(len(set(replicas)) == 1 for replicas in served.values()), served
        # each group's replica reused the group's prefix (its series reach /metrics within a second or two)
        chosen = {replicas[0] for replicas in served.values()}
        _wait_for(lambda: all(_hits_by_replica(_metrics(base)).get(r, 0) > 0 for r in chosen), 120,
                  f"prefix-cache hits on each of {chosen} in /metrics")


def _hits_by_replica(text: str) -> dict[str, float]:
    return {r: float(v) for r, v in re.findall(
        r'^vllm:prefix_cache_hits_total\{[^}]*replica="([^"]+)"[^}]*\} (\S+)$', text, re.M)}


def test_autoscaling_adds_a_replica_when_requests_queue(tmp_path):
    """--min-replicas 1 --max-replicas 2 with a target of 2 ongoing requests per replica: 8 streams at once make
    Ray Serve's autoscaler start the second replica (within its bounds), and every stream completes."""
    scale = ("--replicas", "1", "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "2")
    with _serve_replicas(tmp_path / "serve.log", "power-of-two", scale) as (base, _):
        client = _client(base)
        _wait_for(lambda: "inferlab:replicas 1" in _metrics(base), 120, "the first replica in /metrics")
        stop = threading.Event()

        def keep_streaming(i: int) -> list:
            results = []
            while not stop.is_set():
                results.append(_stream(client, f"Stream {i} asks again", 48))
            return results

        with cf.ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(keep_streaming, i) for i in range(8)]
            try:
                _wait_for(lambda: "inferlab:replicas 2" in _metrics(base), RESTART_DEADLINE,
                          "the autoscaler to add a second replica", log=tmp_path / "serve.log")
            finally:
                stop.set()
            results = [r for f in streams for r in f.result(timeout=600)]
        bad = [r if r[0] == "error" else r[:2] for r in results if not (r[0] == "ok" and r[1] == "length")]
        assert results and not bad, (len(bad), len(results), bad[:5])
