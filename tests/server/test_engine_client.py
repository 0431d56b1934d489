"""The server/engine boundary: LLMEngine and the tests' fake both satisfy EngineClient (the real instance is checked
in test_server_engine.py, which loads the model), and the per-token SSE splice says what pydantic would."""

from __future__ import annotations

import inspect
import json

import pytest

from inferlab.server.engine_client import EngineClient
from inferlab.server.protocol import (ChatCompletionChunk, ChatStreamChoice, CompletionChoice, CompletionChunk,
                                      DeltaMessage, sse, sse_with_text)
from server_testkit import FakeEngine

METHODS = [n for n, v in vars(EngineClient).items() if inspect.isfunction(v) and not n.startswith("_")]


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_engine_client_lists_what_the_server_uses():
    assert sorted(METHODS) == ["abort", "add_request", "has_work", "stats", "step", "tokenize_prompt"]
    assert set(EngineClient.__annotations__) == {"model_name", "max_model_len", "vocab_size", "max_token_chars", "config"}


@pytest.mark.parametrize("engine_class", ["LLMEngine", "FakeEngine"])
def test_engines_have_every_method_with_its_parameters(engine_class):
    if engine_class == "LLMEngine":
        from inferlab.engine.llm_engine import LLMEngine as cls
    else:
        cls = FakeEngine
    for name in METHODS:
        assert _parameters(getattr(cls, name)) == _parameters(getattr(EngineClient, name)), name


def test_the_fake_engine_is_an_engine_client():
    engine = FakeEngine(max_num_seqs=3)
    assert isinstance(engine, EngineClient)
    assert engine.config.max_num_seqs == 3


TEXTS = ["", " w0", 'say "hi"\n', "back\\slash", "héllo ✓ 你好", "\x00", "\u2028", "🙂"]


@pytest.mark.parametrize("text", TEXTS)
def test_the_per_token_splice_equals_the_models_own_json(text):
    def chat(t: str) -> ChatCompletionChunk:
        return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m\"odel", choices=[
            ChatStreamChoice(delta=DeltaMessage(content=t), finish_reason=None)])

    def completion(t: str) -> CompletionChunk:
        return CompletionChunk(id="cmpl-1", created=7, model="m",
                               choices=[CompletionChoice(text=t, finish_reason=None)])

    for chunk in (chat, completion):
        line = sse_with_text(chunk)(text)
        assert line.startswith("data: ") and line.endswith("\n\n") and line.count("\n") == 2
        assert json.loads(line[6:]) == json.loads(sse(chunk(text))[6:])
        assert type(chunk(text)).model_validate_json(line[6:]) == chunk(text)
