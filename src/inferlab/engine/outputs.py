"""What the engine hands back: a delta per request per step (streaming), and the finished result (offline)."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferlab.engine.logprobs import TokenLogprob


@dataclass(slots=True)
class RequestMetrics:
    """Monotonic timestamps (time.perf_counter seconds) of one request's life in the engine."""

    arrival_time: float
    queued_time: float | None = None  # when the engine took it (the server's arrival is before tokenizing it)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token, in order
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """One request's progress in one engine step: the tokens and text produced since the last delta."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or token id that ended it, if any
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # with finish_reason "error": what failed, for the client
    metrics: RequestMetrics | None = None  # set on the finishing delta
    error_stage: str | None = None  # with finish_reason "error": "sample" | "detokenize" (server: "tokenize", ...)
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked (params.logprobs)
    # On the first delta only, when asked: one per prompt token (the first with logprob None).
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_text: str | None = None  # on the first delta, when params.echo
    index: int = 0  # the choice (n > 1): each choice has its own deltas, the last with finished=True


@dataclass(slots=True)
class CompletionOutput:
    """A finished request, as the offline `LLM.generate` returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None  # with finish_reason "error"
    spec_proposed: int = 0
    spec_accepted: int = 0


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's gauges and monotonically increasing counters (for /metrics and the lab)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # used blocks / total blocks, 0..1 (cached-but-free blocks count as free)
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    kv_cache_bytes: int = 0
    weight_bytes: int = 0
    packed_weight_bytes: int = 0  # what packed copies add, net of plain weights dropped (layers/packed_linear.py)
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens found cached
    spec_num_drafts_total: int = 0
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_accepted_per_pos_total: list[int] = field(default_factory=list)
    num_steps_total: int = 0
    step_time_seconds_total: float = 0.0
    cpu_threads: int = 0  # the engine's intra-op threads now (engine/cpu_threads.py); 0 off the CPU
    cpu_threads_max: int = 0  # the count it returns to when the machine is quiet
    cpu_fallbacks_total: dict[str, int] = field(default_factory=dict)  # reason -> steps down to fewer threads
    cpu_recoveries_total: int = 0  # returns to more threads
    # Disaggregated serving (engine/kv_transfer.py), per role: the prefill side counts what it sent (pool ->
    # staging), the decode side what it received (staging -> pool, blocks its prefix cache held excepted).
    kv_transfers_total: int = 0
    kv_transfer_bytes_total: int = 0
    kv_transfer_seconds_total: float = 0.0
    kv_transfer_stalls_total: int = 0  # sends refused for want of transfer-buffer room (backpressure)
    kv_transfer_pending: int = 0  # requests whose KV waits: to be sent (prefill), to be admitted (decode)
    kv_transfer_free_blocks: int = 0  # prefill: transfer-buffer blocks free (the buffer's free list lives there)
    by_role: dict[str, "EngineStats"] = field(default_factory=dict)  # disaggregated: each worker's own stats
