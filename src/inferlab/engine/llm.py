"""The offline API, in vLLM's shape: `LLM(...).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import itertools
from dataclasses import fields

from inferlab.engine.config import EngineConfig
from inferlab.engine.llm_engine import LLMEngine, Prompt
from inferlab.engine.outputs import CompletionOutput
from inferlab.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        names = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_options) - names
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(names))}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 arrival_times: list[float] | None = None) -> list[CompletionOutput]:
        """Run every prompt to completion; outputs come back in input order. A prompt is text, a list of chat
        messages, a list of token ids, or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)
                                        and "role" in prompts[0]) or isinstance(prompts, dict):
            prompts = [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        order: list[str] = []
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, p, sp, arrival_time=arrival_times[i] if arrival_times else None)
            order.append(rid)
        return self._drain(order)

    def _drain(self, order: list[str]) -> list[CompletionOutput]:
        seqs = {rid: self.engine.requests[rid] for rid in order}
        texts = {rid: [] for rid in order}
        done: dict[str, CompletionOutput] = {}
        while len(done) < len(order):
            for out in self.engine.step():
                if out.request_id not in texts:
                    continue
                texts[out.request_id].append(out.new_text)
                if out.finished:
                    seq = seqs[out.request_id]
                    done[out.request_id] = CompletionOutput(
                        request_id=out.request_id,
                        prompt=seq.prompt_text,
                        prompt_token_ids=seq.prompt_token_ids,
                        token_ids=seq.output_token_ids,
                        text="".join(texts[out.request_id]),
                        finish_reason=out.finish_reason,
                        metrics=out.metrics,
                        num_cached_tokens=seq.num_cached_tokens,
                        spec_proposed=seq.spec_proposed,
                        spec_accepted=seq.spec_accepted,
                        error=out.error,
                    )
        return [done[rid] for rid in order]

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None) -> list[CompletionOutput]:
        batch = messages if messages and isinstance(messages[0], list) else [messages]
        return self.generate(batch, params)

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1, computed with the engine's own model (for perplexity). The
        sequence must fit the model's context."""
        eng = self.engine
        if not 2 <= len(token_ids) <= eng.max_model_len:
            raise ValueError(f"score needs 2..{eng.max_model_len} tokens, got {len(token_ids)}")
        return eng.runner.score(token_ids)
