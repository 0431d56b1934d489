"""The depth probe: prompts served one at a time, at lengths up to a few thousand tokens, so that a served
calibration sees prefill attention at depth.

Why. A prefill chunk's attention costs per (query, key) pair, and a card of short prompts never attends deep
enough for the fit to tell that cost from the per-token GEMMs'. Measured on the 2-core machine: a profile fitted
to examples/card-cpu.yaml (prompts 64-256 tokens) priced a pair at 0.98 µs or, with the term left out, folded it
into the per-token cost; either way its TTFT on examples/card-cpu-long.yaml (256-1024 tokens) was 9-17% off. Fitted
with prompts ~970 keys deep, the pair costs 0.58 µs and the per-token cost agrees across both cards (1.03 ms).
A few prompts of 512 to 4,096 tokens, alone on the server so that their chunks are prefill-only steps, pin it
down in ~30 s, and the profile then predicts prompt lengths the card never sent.

The prompts are token ids (the completions API takes them), so each length is exact and needs no tokenizer; each
asks for ASKED tokens, so its last steps also time decodes at that depth, alone. They pin the price of a key a
decode reads, which a card of short prompts leaves to chance: its decodes attend 100-300 keys, and a fit to
examples/card-cpu.yaml's load with one probe decode per prompt priced a key at 0 or at 1.1 µs by the model's
form, where the probe's decodes at 512-2,048 keys took 1.8-2.6 µs a key more than the load's at ~128
(docs/benchmarks.md, "Decodes beside a prefill chunk").

Then each depth again in pairs: the deep prompt streams, and as its first token arrives a short prompt (BESIDE
tokens) follows, so the short one's chunks share steps with a decode at that depth and the two then decode
together. Without them the only deep decodes were alone and the load's decodes beside a chunk were 100-300 keys
deep: the fit traded the key's price against the other terms and set it at 1.1-1.4 µs, where decode-only steps of
each batch size rose by 1.5-2.1 µs a key, and examples/card-cpu-long.yaml's steps (decodes ~650 keys deep) ran
1.02-1.10x the profile against 0.97-1.02x on the card it was fitted to. With the pairs the fit gives 1.71 µs, the
same whether keys beside a chunk have their own price or not (1.73), and the long card's steps run within 1-4% of
the short card's ratio at every depth (docs/benchmarks.md, "Keys beside a chunk").
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import numpy as np

SHALLOWEST = 512
ASKED = 16  # tokens each prompt asks for: the first, then 15 decodes at its depth (~0.3 s a prompt)
BESIDE = 128  # the short prompt of a pair
# The deep prompt of a pair decodes through the short one's prefill (capped beside a decode: a few to ~30 tokens a
# step on the 2-core machine) and its ASKED tokens: 64 leaves it decoding alone again at the end.
PAIR_ASKED = 64


def depth_ladder(deepest: int, context: int) -> list[int]:
    """Prompt lengths from 512 doubling up to `deepest`, each leaving room in the server's context for the ASKED
    tokens."""
    top = min(deepest, context - ASKED)
    lengths, n = [], SHALLOWEST
    while n <= top:
        lengths.append(n)
        n *= 2
    if top >= SHALLOWEST and lengths[-1] < top:
        lengths.append(top)
    return lengths


def probe_depths(base_url: str, deepest: int, repeats: int = 2, api_key: str | None = None, seed: int = 0,
                 log=print) -> list[int]:
    """Serve the ladder `repeats` times, one request at a time, with new random prompts each time (no
    prefix-cache hits), then `repeats` times each depth with a short prompt beside it (probe_pair).
    Returns the prompt lengths served alone. The server must be idle meanwhile: another request's decodes would
    share the probe's steps."""
    model, context = _model(base_url, api_key)
    lengths = depth_ladder(deepest, context)
    if not lengths:
        raise ValueError(f"the depth probe needs room for a prompt of {SHALLOWEST} tokens; the server's context "
                         f"is {context} tokens and the probe was asked for at most {deepest}")
    rng = np.random.default_rng(seed)
    served = []
    for _ in range(repeats):
        for n in lengths:
            # Ids 100-20,000: inside any served vocabulary, past the special tokens.
            body = {"model": model, "prompt": rng.integers(100, 20_000, n).tolist(), "max_tokens": ASKED,
                    "ignore_eos": True, "temperature": 0.0}
            usage = _post(base_url + "/v1/completions", body, api_key)["usage"]
            if usage["prompt_tokens"] != n:
                raise ValueError(f"the depth probe sent {n} token ids and the server counted "
                                 f"{usage['prompt_tokens']}: it does not take token-id prompts as sent")
            served.append(n)
        log(f"depth probe: served prompts of {', '.join(map(str, lengths))} tokens")
    for _ in range(repeats):
        for n in lengths:
            probe_pair(base_url, model, rng.integers(100, 20_000, min(n, context - PAIR_ASKED)).tolist(),
                       rng.integers(100, 20_000, BESIDE).tolist(), api_key)
        log(f"depth probe: served each beside a prompt of {BESIDE} tokens")
    return served


def probe_pair(base_url: str, model: str, deep: list[int], short: list[int], api_key: str | None = None) -> None:
    """Stream `deep`; when its first token arrives (its prefill done, its decodes begun), send `short`. Both run
    to their asked length."""
    body = {"model": model, "prompt": deep, "max_tokens": PAIR_ASKED, "ignore_eos": True, "temperature": 0.0,
            "stream": True}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers=_headers(api_key), method="POST")
    failed: list[Exception] = []

    def send_short():
        try:
            _post(base_url + "/v1/completions", {"model": model, "prompt": short, "max_tokens": ASKED,
                                                  "ignore_eos": True, "temperature": 0.0}, api_key)
        except Exception as e:  # noqa: BLE001 - re-raised in the caller's thread below
            failed.append(e)

    second = threading.Thread(target=send_short, daemon=True)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if second.ident is None and line.startswith(b"data: "):
                    second.start()
    except urllib.error.HTTPError as e:
        raise ValueError(f"the depth probe's streamed request of {len(deep)} tokens failed: HTTP {e.code} "
                         f"{e.read().decode(errors='replace')[:300]}") from None
    if second.ident is not None:
        second.join()
    if failed:
        raise failed[0]
    if second.ident is None:
        raise ValueError(f"the depth probe's streamed request of {len(deep)} tokens returned no event")


def _headers(api_key: str | None) -> dict:
    h = {"Content-Type": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def _model(base_url: str, api_key: str | None) -> tuple[str, int]:
    req = urllib.request.Request(base_url + "/v1/models", headers=_headers(api_key))
    with urllib.request.urlopen(req, timeout=30) as r:
        card = json.load(r)["data"][0]
    if not card.get("max_model_len"):
        raise ValueError(f"{base_url}/v1/models does not say the model's context length (max_model_len); the "
                         f"depth probe needs it to size its prompts")
    return card["id"], int(card["max_model_len"])


def _post(url: str, body: dict, api_key: str | None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=_headers(api_key), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise ValueError(f"the depth probe's request of {len(body['prompt'])} tokens failed: HTTP {e.code} "
                         f"{e.read().decode(errors='replace')[:300]}") from None
