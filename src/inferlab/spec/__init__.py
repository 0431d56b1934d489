"""Speculative decoding: a proposer drafts tokens, the target verifies them all in one forward pass.

`make_proposer` builds the proposer the engine config asks for (None when speculation is off).
"""

from __future__ import annotations

from inferlab.engine.config import EngineConfig
from inferlab.engine.model_runner import ModelRunner
from inferlab.spec.draft import DraftProposer
from inferlab.spec.ngram import NgramProposer
from inferlab.spec.proposer import Proposer, SpecCounters, SpecPolicy, SpeculativeConfigError, StepContext

__all__ = ["DraftProposer", "NgramProposer", "Proposer", "SpecCounters", "SpecPolicy", "SpeculativeConfigError",
           "StepContext", "make_proposer"]


def make_proposer(config: EngineConfig, runner: ModelRunner, tokenizer,
                  policy: SpecPolicy | None = None) -> Proposer | None:
    method, k = config.speculative, config.num_speculative_tokens
    if method is None:
        if config.draft_model is not None or config.draft_layers is not None:
            raise SpeculativeConfigError("--draft-model and --draft-layers need --speculative draft")
        return None
    if not isinstance(k, int) or k < 1:
        raise SpeculativeConfigError(f"--num-speculative-tokens must be an integer >= 1, got {k!r}")
    if method == "ngram":
        if not 1 <= config.ngram_min <= config.ngram_max:
            raise SpeculativeConfigError(f"need 1 <= --ngram-min <= --ngram-max, got {config.ngram_min} and "
                                         f"{config.ngram_max}")
        return NgramProposer(k, config.ngram_min, config.ngram_max, policy)
    if method == "draft":
        return DraftProposer(runner, tokenizer, config, policy)
    raise SpeculativeConfigError(f"--speculative must be ngram or draft, got {method!r}")
