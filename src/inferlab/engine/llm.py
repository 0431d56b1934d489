"""The offline API, in vLLM's shape: `LLM(...).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import itertools
from dataclasses import fields

import torch

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
                    )
        return [done[rid] for rid in order]

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None) -> list[CompletionOutput]:
        batch = messages if messages and isinstance(messages[0], list) else [messages]
        return self.generate(batch, params)

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1, computed with the engine's own model through a scratch forward
        pass (for perplexity). The sequence must fit the model's context."""
        from inferlab.layers.attention import AttentionMetadata

        eng = self.engine
        if not 2 <= len(token_ids) <= eng.max_model_len:
            raise ValueError(f"score needs 2..{eng.max_model_len} tokens, got {len(token_ids)}")
        model = eng.runner.model
        ids = torch.tensor(token_ids, dtype=torch.long, device=eng.device)
        pos = torch.arange(len(token_ids), device=eng.device)
        # A causal-only pass attends to its own fresh K/V; the slot writes go to a throwaway buffer, not the pool.
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decode_tokens=0,
                                 decode=None, extend=None, causal_only=True)
        hidden = _forward_without_cache(model, ids, pos, meta)
        logp = model.compute_logits(hidden[:-1]).log_softmax(-1)
        return logp.gather(1, ids[1:, None]).squeeze(1).tolist()


def _forward_without_cache(model, ids, pos, meta):
    """Run a causal-only pass with each layer's cache temporarily swapped for a scratch buffer the size of the
    sequence, so scoring never touches the live KV pool."""
    cfg = model.config
    saved = []
    T = ids.shape[0]
    for layer in model.model.layers:
        a = layer.self_attn.attn
        saved.append((a.k_cache, a.v_cache))
        dtype = a.k_cache.dtype if a.k_cache.numel() else torch.float32
        a.k_cache = torch.empty(cfg.num_kv_heads, T, 1, cfg.head_dim, dtype=dtype, device=ids.device)
        a.v_cache = torch.empty_like(a.k_cache)
    meta.slot_mapping = torch.arange(T, device=ids.device)
    try:
        return model(ids, pos, meta)
    finally:
        for layer, (k, v) in zip(model.model.layers, saved):
            layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = k, v
