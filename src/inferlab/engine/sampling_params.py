"""Per-request sampling and stopping parameters, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferlab.common.errors import InvalidRequestError
from inferlab.engine.logprobs import MAX_LOGPROBS
from inferlab.engine.structured_output import Guide

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS). Dividing logits by a smaller temperature overflows
# float32 (1e-300 is 0 in float32, and logits / 0 are inf, whose softmax is NaN), and long before that the tempered
# distribution is one-hot at the argmax anyway: at T = 1e-5 a logit gap of 0.001 is already a factor e^100.
SAMPLING_EPS = 1e-5

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# torch.Generator.manual_seed takes any value in [-2^63, 2^64 - 1] (it reinterprets negatives as uint64).
SEED_MIN, SEED_MAX = INT64_MIN, 2**64 - 1


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # below SAMPLING_EPS (0 included) = greedy
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
        return self.temperature < SAMPLING_EPS

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises InvalidRequestError naming the first bad field. With vocab_size (the engine knows it), top_k and
        stop_token_ids are also checked against the vocabulary: a value the sampler's int64 tensors cannot hold
        must never reach them."""
        if not _is_int(self.max_tokens) or not 0 <= self.max_tokens <= INT64_MAX:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            # Scoring a prompt (echo + logprobs, lm-evaluation-harness's loglikelihood) is the one use of 0 tokens.
            raise InvalidRequestError("max_tokens must be an integer >= 1, got 0 (0 is allowed only with prompt "
                                      "logprobs: echo with logprobs)", "max_tokens")
        if not _is_int(self.n) or not 1 <= self.n <= INT64_MAX:
            raise InvalidRequestError(f"n must be an integer >= 1, got {self.n!r}", "n")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}", name)
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                                      "temperature")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= (vocab_size or INT64_MAX):
            limit = f" and at most the vocabulary size {vocab_size}" if vocab_size else ""
            raise InvalidRequestError(f"top_k must be -1, 0 (disabled) or a positive integer{limit}, got "
                                      f"{self.top_k!r}", "top_k")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(f"seed must be an integer in [-2^63, 2^64 - 1], got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequestError("stop must be a non-empty string or a list of non-empty strings", "stop")
        hi = vocab_size or INT64_MAX + 1
        if any(not _is_int(t) or not 0 <= t < hi for t in self.stop_token_ids):
            where = f" below the vocabulary size {vocab_size}" if vocab_size else ""
            raise InvalidRequestError(f"stop_token_ids must be non-negative integers{where}", "stop_token_ids")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
