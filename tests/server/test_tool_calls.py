"""Tool calls over the API with the official `openai` client: a forced (named) call's arguments parse into its
pydantic model (`chat.completions.parse` with `pydantic_function_tool`), streamed as tool_calls deltas that add up
to the same call; `required` gives calls that validate against their tools' schemas; the tools reach the prompt."""

from __future__ import annotations

import enum
import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field


pytestmark = pytest.mark.slow


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: Annotated[str, Field(max_length=30)]  # bounded, so the grammar closes the JSON within max_tokens
    unit: Unit


class BookTable(BaseModel):
    """Reserve a restaurant table."""

    restaurant: Annotated[str, Field(max_length=30)]
    people: int


TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(BookTable)]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_forced_tool_call_parses_against_its_schema(api, llm_fp32):
    model = llm_fp32.engine.model_name
    forced = {"type": "function", "function": {"name": "GetWeather"}}
    r = api.chat.completions.parse(model=model, messages=ASK, tools=TOOLS, tool_choice=forced, temperature=0,
                                   max_tokens=128)
    msg = r.choices[0].message
    assert msg.content is None and r.choices[0].finish_reason == "stop"
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)

    # Streamed: the first delta names the call, the arguments arrive in pieces and add up to the same JSON.
    stream = api.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=forced, temperature=0,
                                         max_tokens=128, stream=True)
    deltas = [tc for ch in stream for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "GetWeather" and len(deltas) > 2
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments


def test_required_tool_calls_validate_against_their_schemas(api, llm_fp32):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    r = api.chat.completions.create(model=llm_fp32.engine.model_name, temperature=0, max_tokens=256, tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False,  # one call: bounded
                                    messages=[{"role": "user", "content": "Book a table for two at Luigi's."}])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tools_reach_the_prompt(llm_fp32):
    """The bundled template ignores `tools`, so they arrive as a system message listing each function's schema."""
    eng = llm_fp32.engine
    plain, _ = eng.tokenize_prompt(ASK)
    ids, text = eng.tokenize_prompt({"messages": ASK, "tools": TOOLS})
    assert len(ids) > len(plain)
    for t in TOOLS:
        assert json.dumps(t["function"]) in text


@pytest.mark.parametrize("body,param,words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "Nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(server, body, param, words):
    r = httpx.post(server.base + "/v1/chat/completions", timeout=60, json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
