"""Structured output: per-request grammars turned into token masks on the logits, with xgrammar.

Chosen by measurement (benchmarks/grammar_mask.py, docs/benchmarks.md): on this CPU, for the bundled tokenizer's
49,152 tokens and a nested JSON schema, xgrammar computes a next-token mask in ~3 us, llguidance in ~12-18 us and
outlines-core (returning the allowed ids) in ~700 us; vLLM and SGLang default to xgrammar too.

A request's grammar is compiled when it is added (a bad schema is an InvalidRequestError naming the problem, the
compiler caches by grammar text), its matcher lives on the Sequence, and each step fills one bitmask for the rows that
have a grammar and applies it to the logits in one call before sampling. Since the matcher admits end-of-sequence only
once the document is complete, a request that ends by EOS ends with valid output. Speculative proposals are not
verified under a grammar: such requests decode one token a step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from inferlab.common.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

GuideKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(slots=True, frozen=True)
class Guide:
    """What a request's output must match: a JSON schema (JSON text), any JSON object, a regex, one of a list of
    strings (JSON list text), or an EBNF grammar (GBNF, as llama.cpp's and xgrammar's)."""

    kind: GuideKind
    spec: str = ""
    param: str = "response_format"  # the request field it came from, for error messages


class StructuredOutput:
    """The grammar compiler for one tokenizer, and the per-step mask."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)  # the engine thread shares 2 cores with OpenMP

    def matcher(self, guide: Guide) -> Any:
        """A fresh matcher for `guide`; InvalidRequestError when it does not compile."""
        c = self.compiler
        try:
            if guide.kind == "json_schema":
                compiled = c.compile_json_schema(guide.spec, any_whitespace=False)
            elif guide.kind == "json_object":
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False)  # OpenAI's: an object
            elif guide.kind == "regex":
                compiled = c.compile_regex(guide.spec)
            elif guide.kind == "choice":
                compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(guide.spec)))
            else:
                compiled = c.compile_grammar(guide.spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises these on bad schemas and grammars
            raise InvalidRequestError(f"invalid {guide.kind.replace('_', ' ')} for {guide.param}: {e}",
                                      guide.param) from None
        return self._xgr.GrammarMatcher(compiled)

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Mask (-inf), in place, the tokens each row's grammar forbids next."""
        xgr = self._xgr
        mask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for r, m in zip(rows, matchers):
            m.fill_next_token_bitmask(mask, r)
        xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device), vocab_size=self.vocab_size, indices=rows)
