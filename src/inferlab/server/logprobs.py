"""The engine's TokenLogprob entries in OpenAI's two response formats (engine/logprobs.py says what they are of)."""

from __future__ import annotations

from inferlab.engine.logprobs import TokenLogprob
from inferlab.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class CompletionLogprobsFormatter:
    """The legacy completions format. text_offset counts from the start of the choice's text, across every chunk
    of a stream, so one formatter serves one choice for its whole life."""

    def __init__(self) -> None:
        self.offset = 0

    def __call__(self, entries: list[TokenLogprob]) -> CompletionLogprobs:
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.token)
        return CompletionLogprobs(
            tokens=[e.token for e in entries],
            token_logprobs=[e.logprob for e in entries],
            # As vLLM's: the alternatives plus the token itself, so "was it the most likely" reads off the dict.
            top_logprobs=[None if e.logprob is None else {**{t: v for _, t, v in e.top}, e.token: e.logprob}
                          for e in entries],
            text_offset=offsets)


def chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=[ChatTokenLogprob(
        token=e.token, logprob=e.logprob, bytes=list(e.token.encode()),
        top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for _, t, v in e.top])
        for e in entries])
