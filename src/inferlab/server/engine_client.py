"""What the server uses of an engine, and nothing more: LLMEngine satisfies it, and so does the tests' fake.

Every method but tokenize_prompt runs on the one thread that steps the engine (server/async_engine.py);
tokenize_prompt runs on the server's tokenizer pool, concurrently with the engine. The attributes are read once when
the app is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from inferlab.engine.config import EngineConfig
from inferlab.engine.outputs import EngineStats, RequestOutput
from inferlab.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # llm_engine imports torch and the model stack; the server needs only the name
    from inferlab.engine.llm_engine import Prompt


@runtime_checkable
class EngineClient(Protocol):
    model_name: str
    max_model_len: int  # prompt + output tokens of one request
    vocab_size: int  # token ids, top_k and stop_token_ids are checked against it before anything reaches the engine
    max_token_chars: int  # no token decodes to more characters: bounds a prompt's length in characters
    config: EngineConfig  # the server reads max_num_seqs: admission control counts free running slots with it

    def tokenize_prompt(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Token ids and the text they came from; raises InvalidRequestError on a prompt it cannot take. Must be
        safe to call from any thread."""

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> int:
        """Queues a request and returns its prompt length; raises InvalidRequestError when it cannot run."""

    def abort(self, request_id: str) -> bool: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """One step: a delta for every request that moved, the finishing one with finished=True."""

    def stats(self) -> EngineStats: ...
