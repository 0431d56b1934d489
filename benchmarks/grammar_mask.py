"""Token-mask cost of the structured-output libraries on this CPU: xgrammar, llguidance and outlines-core, for the
bundled SmolLM2 tokenizer (49,152 tokens) and a nested JSON schema. Walks a valid document token by token and times
computing the next-token mask plus advancing the matcher, per token; also the one-off grammar compile.

    PYTHONPATH=src python benchmarks/grammar_mask.py [--repeat 5]

Prints one JSON line per library. On a shared machine the numbers are contended: compare them with each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "poetry"],
                  "address": {"city": "London", "zip": "W1"}})


def bench_xgrammar(tok, ids, repeat):
    import torch
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    per = []
    for _ in range(repeat):
        m = xgr.GrammarMatcher(compiled)
        t0 = time.perf_counter()
        for t in ids:
            m.fill_next_token_bitmask(mask)
            assert m.accept_token(t), t
        per.append((time.perf_counter() - t0) / len(ids))
    return compile_s, per


def bench_llguidance(tok, ids, repeat):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    m = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    per = []
    for _ in range(repeat):
        m = llguidance.LLMatcher(lltok, grammar)
        t0 = time.perf_counter()
        for t in ids:
            llguidance.torch.fill_next_token_bitmask(m, mask, 0)
            assert m.consume_token(t), (t, m.get_error())
        per.append((time.perf_counter() - t0) / len(ids))
    return compile_s, per


def bench_outlines_core(tok, ids, repeat):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    # outlines-core matches token *bytes*: map each byte-level BPE token back to its bytes (GPT-2's byte alphabet:
    # printable bytes stand for themselves, the others for chr(256 + k)).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    dec, k = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            dec[chr(256 + k)] = b
            k += 1
    eos = tok.eos_token_id
    vocab: dict[bytes, list[int]] = {}
    for s, i in tok.get_vocab().items():
        if i == eos:
            continue
        try:
            vocab.setdefault(bytes(dec[c] for c in s), []).append(i)
        except KeyError:
            continue  # special tokens
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos, vocab))
    compile_s = time.perf_counter() - t0
    per = []
    for _ in range(repeat):
        g = Guide(index)
        t0 = time.perf_counter()
        for t in ids:
            allowed = g.get_tokens()
            g.advance(t)
        per.append((time.perf_counter() - t0) / len(ids))
        assert allowed
    return compile_s, per


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from inferlab.models.loader import load_tokenizer

    tok = load_tokenizer(None)
    ids = tok.encode(DOC, add_special_tokens=False)
    for name, fn in [("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance),
                     ("outlines-core", bench_outlines_core)]:
        try:
            compile_s, per = fn(tok, ids, args.repeat)
        except Exception as e:  # noqa: BLE001 - report a library that cannot run here instead of stopping
            print(json.dumps({"library": name, "error": f"{type(e).__name__}: {e}"[:300]}))
            continue
        print(json.dumps({"library": name, "tokens": len(ids), "compile_ms": round(compile_s * 1e3, 1),
                          "mask_us_per_token_median": round(statistics.median(per) * 1e6, 1),
                          "mask_us_per_token_min": round(min(per) * 1e6, 1)}))


if __name__ == "__main__":
    main()
