"""Incremental detokenization and stop-string handling.

Text is decoded over a small window of recent tokens (prefix_offset..end) and only the part beyond the window's
previously read text is emitted; a window that ends inside a multi-byte UTF-8 character decodes to U+FFFD and is held
until the character completes. When stop strings are set, the last (longest stop - 1) characters are held back from
streaming so that a stop string spanning tokens is never partly sent.
"""

from __future__ import annotations

from inferlab.engine.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def update(self, seq: Sequence) -> None:
        """Append the text of seq's newest output tokens to seq.output_text."""
        out = seq.output_token_ids
        if seq.read_offset >= len(out):
            return
        decode = self.tokenizer.decode
        prefix = decode(out[seq.prefix_offset:seq.read_offset], skip_special_tokens=True)
        full = decode(out[seq.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            seq.output_text += full[len(prefix):]
            seq.prefix_offset = seq.read_offset
            seq.read_offset = len(out)

    @staticmethod
    def check_stop_strings(seq: Sequence, old_len: int) -> bool:
        """Finish seq if a stop string appeared in text added since old_len; truncate the text at it."""
        stops = seq.params.stop
        if not stops:
            return False
        longest = max(len(s) for s in stops)
        start = max(0, old_len - longest + 1)
        best: tuple[int, str] | None = None
        for s in stops:
            j = seq.output_text.find(s, start)
            if j != -1 and (best is None or j < best[0]):
                best = (j, s)
        if best is None:
            return False
        j, s = best
        seq.output_text = seq.output_text[: j + len(s)] if seq.params.include_stop_str_in_output else seq.output_text[:j]
        seq.finish_reason, seq.stop_reason = "stop", s
        return True

    @staticmethod
    def take_new_text(seq: Sequence, finished: bool) -> str:
        """Text not yet handed out, minus what must be held back while a stop string could still be forming."""
        end = len(seq.output_text)
        if not finished and seq.params.stop:
            end = max(seq.emitted_text_len, end - (max(len(s) for s in seq.params.stop) - 1))
        new = seq.output_text[seq.emitted_text_len:end]
        seq.emitted_text_len = end
        return new
