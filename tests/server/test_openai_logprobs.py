"""logprobs, top_logprobs and echo over the API with the official `openai` client, against transformers.

Tolerance: 1e-3 per log-probability. Both run the same weights in float32; the differences are kernel rounding
(~1e-5 measured), well inside it, while a wrong row, position or distribution (e.g. after temperature) is off by far
more.
"""

from __future__ import annotations

import pytest
import torch


pytestmark = pytest.mark.slow

TOL = 1e-3
CHAT = [{"role": "user", "content": "Name three fruits that are red."}]
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find"


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is log p(. | ids[:i+1])."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(hf_logprobs(hf_model, out)[-1].argmax()))
    return out[len(ids):]


def assert_top_matches(top: dict[str, float], ref_row: torch.Tensor, decode, k: int) -> None:
    """Our k alternatives have transformers' top-k values, and each names a token that has its value there."""
    ref_v, ref_i = ref_row.topk(k + 5)
    ours = sorted(top.values(), reverse=True)[:k]
    assert max(abs(a - b) for a, b in zip(ours, ref_v[:k].tolist())) < TOL
    near = {decode([i]): v for i, v in zip(ref_i.tolist(), ref_v.tolist())}
    for tok, v in top.items():
        assert tok in near and abs(near[tok] - v) < TOL, (tok, v)


def test_chat_top_logprobs_agree_with_transformers(api, llm_fp32, hf_model):
    eng = llm_fp32.engine
    prompt_ids, _ = eng.tokenize_prompt(CHAT)
    n = 8
    r = api.chat.completions.create(model=eng.model_name, messages=CHAT, temperature=0, max_tokens=n,
                                    logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    gen = hf_greedy(hf_model, prompt_ids, n)
    ref = hf_logprobs(hf_model, prompt_ids + gen)[len(prompt_ids) - 1:-1]
    decode = eng.tokenizer.decode
    assert [c.token for c in content] == [decode([t]) for t in gen]
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c, t, row in zip(content, gen, ref):
        assert abs(c.logprob - row[t].item()) < TOL
        assert bytes(c.bytes) == c.token.encode()
        assert len(c.top_logprobs) == 5
        assert_top_matches({x.token: x.logprob for x in c.top_logprobs}, row, decode, 5)

    # Streamed: the same tokens and values, split over the chunks.
    chunks = api.chat.completions.create(model=eng.model_name, messages=CHAT, temperature=0, max_tokens=n,
                                         logprobs=True, top_logprobs=5, stream=True, extra_body={"ignore_eos": True})
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    # Values within TOL, not rounded equal: the two requests may run in differently shaped batches (rounding ~1e-5
    # can straddle a 4th-decimal boundary, as it did once in CI).
    assert [c.token for c in streamed] == [c.token for c in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < TOL


def test_echo_logprobs_equal_the_transformers_log_likelihood(api, llm_fp32, hf_model):
    eng = llm_fp32.engine
    ids, _ = eng.tokenize_prompt(TEXT)
    ref = hf_logprobs(hf_model, ids)
    want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    # max_tokens 0: lm-evaluation-harness's loglikelihood of a prompt.
    r = api.completions.create(model=eng.model_name, prompt=TEXT, max_tokens=0, echo=True, logprobs=2)
    (choice,) = r.choices
    lp = choice.logprobs
    assert choice.text == TEXT and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want.tolist())) < TOL
    assert abs(sum(lp.token_logprobs[1:]) - want.sum().item()) < TOL * len(ids)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    for i in range(1, len(ids)):  # the token itself plus its 2 alternatives
        top = lp.top_logprobs[i]
        assert top[lp.tokens[i]] == lp.token_logprobs[i] and len(top) in (2, 3)

    # With generated tokens, streamed: prompt first (echo), then each new token, offsets running on.
    n = 5
    gen = hf_greedy(hf_model, ids, n)
    stream = api.completions.create(model=eng.model_name, prompt=ids, max_tokens=n, echo=True, logprobs=1,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    text, tokens, values, offsets = "", [], [], []
    for ch in stream:
        for c in ch.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    full = hf_logprobs(hf_model, ids + gen)
    want_all = full[:-1].gather(1, torch.tensor(ids[1:] + gen)[:, None]).squeeze(1).tolist()
    assert len(values) == len(ids) + n and values[0] is None
    assert max(abs(a - b) for a, b in zip(values[1:], want_all)) < TOL
    assert text == "".join(tokens) and offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert text.startswith(eng.tokenizer.decode(ids))


def test_plain_requests_carry_no_logprobs(api, llm_fp32):
    r = api.completions.create(model=llm_fp32.engine.model_name, prompt=TEXT, max_tokens=2)
    assert r.choices[0].logprobs is None and not r.choices[0].text.startswith(TEXT)
