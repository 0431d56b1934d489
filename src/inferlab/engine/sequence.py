"""Per-request state. A request has no prefill or decode phase: it has `num_computed_tokens`, and each step the
scheduler assigns it tokens until it catches up with `num_tokens` (vLLM v1's model; it covers chunked prefill,
prefix caching, preemption by recompute and speculative decoding alike)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from inferlab.engine.outputs import RequestMetrics
from inferlab.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Disaggregated prefill: prompt computed and first token sampled, out of the schedule, its blocks kept until
    # the KV has been copied out for a decode engine (engine/kv_transfer.py).
    HANDING_OFF = "handing_off"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    cache_salt: str | None = None
    prompt_text: str | None = None
    group_id: str | None = None  # choice `index` > 0 of request `group_id` (n > 1); its outputs carry that id
    index: int = 0
    grammar: Any = None  # the structured-output matcher (engine/structured_output.py), when params.guide is set
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify in the next step
    spec_proposed: int = 0
    spec_accepted: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Prompt logprobs collected so far (entry j: the token at position j + 1), over one or more prefill chunks.
    prompt_logprobs: list = field(default_factory=list)
    # Detokenizer state (see detokenizer.py).
    output_text: str = ""
    emitted_text_len: int = 0
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
