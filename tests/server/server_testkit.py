"""Shared pieces of the server tests: a live server on a free loopback port, a deterministic fake engine that
satisfies the server's EngineClient (for the fast HTTP-layer tests; the behaviour tests use the real engine), a
metrics reader and the OpenAPI fuzz. A uniquely named module rather than conftest, which every test folder has."""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import uvicorn

from inferlab.common.errors import InvalidRequestError
from inferlab.engine.config import EngineConfig
from inferlab.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from inferlab.engine.sampling_params import SamplingParams


class LiveServer:
    """The app served as `inferlab serve` serves it (server/cli.py): uvicorn on one thread, the engine stepped by
    run_engine() on another (there the main thread, here a second background one); `base` is http://127.0.0.1:PORT."""

    def __init__(self, app, **config):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        self.engine_thread = threading.Thread(target=app.state.server.engine.run_engine, daemon=True,
                                              kwargs={"should_stop": lambda: not self.thread.is_alive()})
        self.engine_thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """What SIGTERM does to `inferlab serve`: uvicorn drains and exits, its shutdown stops the engine loop."""
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.engine_thread.join(timeout=60)

    def __enter__(self) -> "LiveServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (labels must all match)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name = head.split("{", 1)[0]
        if metric_name != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    raise KeyError(f"{name} {labels} not in metrics")


# ---------------------------------------------------------------- fake engine


class FakeTokenizer:
    """Word-level: one token per whitespace-separated word; a chat message costs its words plus 2."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))

    def apply_chat_template(self, messages):
        return list(range(sum(len(str(m["content"]).split()) + 2 for m in messages)))


@dataclass(slots=True)
class _Req:
    request_id: str
    num_prompt: int
    params: SamplingParams
    metrics: RequestMetrics
    generated: int = 0
    text: str = ""
    index: int = 0  # the choice, with n > 1


@dataclass
class FakeEngine:
    """Token i of every request reads ` w{i}`; one token per running request per step; max_num_seqs slots;
    KV usage = tokens held / capacity. Every method but tokenize_prompt asserts it runs on one thread: the server's
    contract."""

    max_model_len: int = 256
    max_num_seqs: int = 4
    vocab_size: int = 1000
    max_token_chars: int = 32
    step_delay: float = 0.0
    kv_capacity: int = 4096
    model_name: str = "fake-model"
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    last_step_time: float = 0.0
    fail_on_step: bool = False

    def __post_init__(self) -> None:
        self.config = EngineConfig(max_num_seqs=self.max_num_seqs)  # what the server reads of it
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.aborted: list[str] = []
        self.added: list[tuple[str, object, SamplingParams, str | None]] = []
        self.num_steps = 0
        self.generated_total = 0
        self.prompt_total = 0
        self._thread: int | None = None

    def _same_thread(self) -> None:
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        assert self._thread == me, "the engine was called from two threads"

    def tokenize_prompt(self, prompt) -> tuple[list[int], str | None]:  # any thread, as the contract says
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, dict):  # chat with tools
            prompt = prompt["messages"]
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(prompt), None
        if any(t >= 1000 for t in prompt):
            raise InvalidRequestError("token id out of range: the vocabulary has 1000 tokens", "prompt")
        return list(prompt), None

    def add_request(self, request_id, prompt, params, arrival_time=None, cache_salt=None) -> int:
        self._same_thread()
        n = len(self.tokenize_prompt(prompt)[0])
        if n == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                                      f"of {self.max_model_len} tokens", "prompt")
        self.added.append((request_id, prompt, params, cache_salt))
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self.waiting.extend(_Req(request_id, n, params, RequestMetrics(arrival), index=i) for i in range(params.n))
        return n

    def abort(self, request_id: str) -> bool:
        self._same_thread()
        found = [r for q in (self.running, self.waiting) for r in q if r.request_id == request_id]
        for r in found:
            (self.running if r in self.running else self.waiting).remove(r)
        if found:
            self.aborted.append(request_id)
        return bool(found)

    def has_work(self) -> bool:
        self._same_thread()
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        self._same_thread()
        t0 = time.perf_counter()
        if self.fail_on_step:
            raise RuntimeError("simulated engine crash")
        if self.step_delay:
            time.sleep(self.step_delay)
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.popleft()
            r.metrics.first_scheduled_time = t0
            self.prompt_total += r.num_prompt
            self.running.append(r)
        now = time.perf_counter()
        outs = []
        for r in list(self.running):
            piece = f" w{r.generated}"
            r.generated += 1
            self.generated_total += 1
            r.metrics.token_times.append(now)
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            finished = r.generated >= r.params.max_tokens
            if finished:
                r.metrics.finished_time = now
                self.running.remove(r)
            outs.append(RequestOutput(r.request_id, [r.generated], piece, finished, "length" if finished else None,
                                      None, r.num_prompt, r.generated, 0, None, r.metrics if finished else None,
                                      index=r.index))
        self.num_steps += 1
        self.last_step_time = time.perf_counter() - t0
        return outs

    def stats(self) -> EngineStats:
        self._same_thread()
        held = sum(r.num_prompt + r.generated for r in self.running)
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting),
                           kv_cache_usage=held / self.kv_capacity, prompt_tokens_total=self.prompt_total,
                           generation_tokens_total=self.generated_total, num_steps_total=self.num_steps)


def fuzz_openapi(base: str, max_examples: int, negative: bool) -> list[str]:
    """Generate requests from the server's own OpenAPI schema (schemathesis) and return every one that got a 5xx
    or a response that contradicts the schema. max_tokens is capped at 4: the fuzz is about the HTTP layer."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    checks = [not_a_server_error, response_schema_conformance, content_type_conformance, status_code_conformance]
    modes = [schemathesis.GenerationMode.POSITIVE] + ([schemathesis.GenerationMode.NEGATIVE] if negative else [])
    problems: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() != "POST" and not op.path.startswith("/v1"):
            continue  # /health and /metrics take no input
        for mode in modes:
            @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case) -> None:
                if isinstance(case.body, dict):
                    for key in ("max_tokens", "max_completion_tokens"):
                        if isinstance(case.body.get(key), int) and not isinstance(case.body[key], bool) \
                                and case.body[key] > 4:
                            case.body[key] = 4
                    if "messages" in case.body and case.body.get("max_tokens") is None:
                        case.body.setdefault("max_completion_tokens", 4)
                try:
                    case.call_and_validate(checks=checks, timeout=300)
                except Exception as e:  # noqa: BLE001 - collect every distinct failure, report them all
                    problems.append(f"{op.method.upper()} {op.path}: {str(e)[:800]}")

            check()
    return problems
