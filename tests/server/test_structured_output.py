"""Structured output over the API with the official `openai` client: `chat.completions.parse` returns a parsed
pydantic object for every one of 20 schemas (nested objects, enums, literals, arrays, optional fields), greedy on
the bundled 135M model, whose unconstrained output is rarely valid JSON; regex and choice constraints hold; bad
schemas get a 400 naming the field."""

from __future__ import annotations

import enum
import json
import re
from typing import Annotated, Literal

import httpx
import pytest
from pydantic import BaseModel, Field


pytestmark = pytest.mark.slow


# Arrays carry maxItems and strings maxLength (pydantic's max_length), which the grammar enforces: greedy decoding
# of a 135M model otherwise repeats list items or words until max_tokens (seen: a 380-token recipe name). With the
# bounds, the grammar itself guarantees that every schema here closes within MAX_TOKENS.
def Few(t):  # noqa: N802 - reads as a type
    return Annotated[list[t], Field(max_length=4)]


Text = Annotated[str, Field(max_length=40)]


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Genre(str, enum.Enum):
    fiction = "fiction"
    history = "history"
    science = "science"


class Person(BaseModel):
    name: Text
    age: int


class Paint(BaseModel):
    color: Color


class Tags(BaseModel):
    tags: Few(Text)


class Address(BaseModel):
    street: Text
    city: Text
    zip: Text


class Customer(BaseModel):
    name: Text
    address: Address


class Movie(BaseModel):
    title: Text
    year: int | None


class Feature(BaseModel):
    name: Text
    enabled: bool


class Point(BaseModel):
    x: float
    y: float


class Item(BaseModel):
    name: Text
    quantity: int


class Order(BaseModel):
    items: Few(Item)


class Status(BaseModel):
    state: Literal["open", "closed"]


class Company(BaseModel):
    name: Text
    ceo: Person


class Scores(BaseModel):
    values: Few(int)


class Profile(BaseModel):
    user: Person
    manager: Person | None


class Palette(BaseModel):
    colors: Few(Color)


class Event(BaseModel):
    name: Text
    day: Literal["mon", "tue", "wed", "thu", "fri"]
    attendees: Few(Text)


class Book(BaseModel):
    title: Text
    author: Text
    pages: int
    genre: Genre


class Weather(BaseModel):
    city: Text
    temperature: float
    conditions: Literal["sunny", "rainy", "cloudy"]


class Recipe(BaseModel):
    name: Text
    ingredients: Few(Text)
    steps: Few(Text)


class Task(BaseModel):
    title: Text
    done: bool
    priority: int


class Matrix(BaseModel):
    rows: Few(Few(int))


SCHEMAS = [Person, Paint, Tags, Customer, Movie, Feature, Point, Order, Status, Company, Scores, Profile, Palette,
           Event, Book, Weather, Recipe, Task, Matrix, Address]
assert len(SCHEMAS) == 20


@pytest.mark.parametrize("schema", SCHEMAS, ids=[m.__name__ for m in SCHEMAS])
def test_parse_returns_the_pydantic_object(api, llm_fp32, schema):
    r = api.chat.completions.parse(
        model=llm_fp32.engine.model_name, response_format=schema, temperature=0, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": f"Give an example {schema.__name__} as JSON."}])
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, schema)


MAX_TOKENS = 384


def test_regex_choice_and_json_object(api, llm_fp32):
    model = llm_fp32.engine.model_name
    msgs = [{"role": "user", "content": "What is the date of the moon landing?"}]
    r = api.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=20,
                                    extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].message.content)
    r = api.completions.create(model=model, prompt="The sky is", temperature=0, max_tokens=10,
                               extra_body={"structured_outputs": {"choice": ["green", "violet", "plaid"]}})
    assert r.choices[0].text in ("green", "violet", "plaid")
    r = api.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=MAX_TOKENS,
                                    response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "invalid json schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "must be a JSON schema"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one output constraint"),
])
def test_invalid_constraints_are_a_400_naming_the_field(server, body, param, words):
    r = httpx.post(server.base + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
