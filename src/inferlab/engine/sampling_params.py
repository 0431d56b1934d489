"""Per-request sampling and stopping parameters, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferlab.common.errors import InvalidRequestError
from inferlab.engine.logprobs import MAX_LOGPROBS
from inferlab.engine.structured_output import Guide


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no top-k cut
    seed: int | None = None  # reproducible per request, whatever else shares the batch
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Log-probabilities (engine/logprobs.py): None = not computed; k >= 0 = the token's own plus its k most likely
    # alternatives, for each sampled token (logprobs) and each prompt token but the first (prompt_logprobs).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False  # the first delta carries the prompt's text
    # Parallel samples of one prompt (choices); choice i draws from seed + i when seeded (llm_engine.py, _fork).
    n: int = 1
    guide: Guide | None = None  # structured output: what the text must match (engine/structured_output.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            # Scoring a prompt (echo + logprobs, lm-evaluation-harness's loglikelihood) is the one use of 0 tokens.
            raise InvalidRequestError("max_tokens must be an integer >= 1, got 0 (0 is allowed only with prompt "
                                      "logprobs: echo with logprobs)", "max_tokens")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {self.n!r}", "n")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}", name)
        if not (self.temperature >= 0.0):
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}", "top_k")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequestError("stop must be a non-empty string or a list of non-empty strings", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers", "stop_token_ids")
