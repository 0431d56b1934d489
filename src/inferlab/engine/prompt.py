"""Prompts -> token ids: plain text, token ids, or chat messages through the model's chat template.

Its own object, apart from the engine, because disaggregated serving tokenizes in the API process, which holds a
tokenizer but no model (server/disagg_engine.py); LLMEngine uses the same one.
"""

from __future__ import annotations

import json
from typing import Any

from inferlab.common.errors import InvalidRequestError

Prompt = str | list[int] | list[dict] | dict  # dict: {"prompt_token_ids"} or {"messages", "tools"}


class PromptTokenizer:
    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def tokenize(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Safe to call from any thread (the server tokenizes on a small pool, off the engine's thread): it only
        reads the tokenizer, whose Rust encode releases the GIL, and the chat template is pure Python."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False), prompt
        tools = None
        if isinstance(prompt, dict) and "messages" in prompt:  # chat with tools: {"messages": [...], "tools": [...]}
            prompt, tools = prompt["messages"], prompt.get("tools")
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            try:
                text = self.render_chat(prompt, tools)
            except Exception as e:  # jinja raises TemplateError, KeyError, TypeError... on malformed messages
                raise InvalidRequestError(f"cannot apply the chat template to these messages: {e}", "messages") from e
            return self.tokenizer.encode(text, add_special_tokens=False), text
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is out of the vocabulary range [0, {vocab})", "prompt")
            return list(prompt), None
        raise InvalidRequestError("a prompt must be a string, a list of token ids, or a list of chat messages", "prompt")

    def render_chat(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The chat template's text. Tools go to the template; one that ignores them (renders the same text
        without) gets them as a leading system message naming each function and its JSON schema instead."""
        render = self.tokenizer.apply_chat_template
        text = render(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        if tools and text == render(messages, tokenize=False, add_generation_prompt=True):
            listing = "\n".join(json.dumps(t["function"]) for t in tools)
            note = {"role": "system", "content": "You may call these functions. To call one, answer with "
                                                 '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.\n' + listing}
            text = render([note, *messages], tokenize=False, add_generation_prompt=True)
        return text
