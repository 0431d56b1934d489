"""Prompts -> token ids: plain text, token ids, or chat messages through the model's chat template.

Its own object, apart from the engine, because disaggregated serving tokenizes in the API process, which holds a
tokenizer but no model (server/disagg_engine.py); LLMEngine uses the same one.
"""

from __future__ import annotations

import json
from typing import Any

from inferlab.common.errors import InvalidRequestError

Prompt = str | list[int] | list[dict] | dict  # dict: {"prompt_token_ids"} or {"messages", "tools"}


def bos_prefix(tokenizer) -> list[int]:
    """[BOS] where the model's tokenizer starts every text with it (Gemma's GGUF says add_bos_token: without it
    Gemma's outputs fall apart), else []. Plain-text prompts get it, as llama.cpp's server and transformers' default
    encoding give it; chat templates write their own."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or tokenizer.encode("a", add_special_tokens=True)[:1] != [bos]:
        return []
    return [] if tokenizer.encode("a", add_special_tokens=False)[:1] == [bos] else [bos]


def check_prompt_fits(n: int, max_tokens: int, max_model_len: int, reason: str) -> None:
    """A request's prompt must hold a token and, with max_tokens more, fit the context; `reason` names what sets
    max_model_len (the model's context, or a KV pool smaller than it)."""
    if n == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"{reason} is {max_model_len} tokens, but {n + max_tokens} were requested ({n} in the prompt, "
            f"{max_tokens} in max_tokens); shorten the prompt or lower max_tokens",
            "prompt" if n >= max_model_len else "max_tokens")


class PromptTokenizer:
    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.text_prefix = bos_prefix(tokenizer)

    def tokenize(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Safe to call from any thread (the server tokenizes on a small pool, off the engine's thread): it only
        reads the tokenizer, whose Rust encode releases the GIL, and the chat template is pure Python."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            return (ids if ids[:1] == self.text_prefix else self.text_prefix + ids), prompt
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
