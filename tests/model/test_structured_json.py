"""Structured output is JSON in every dialect (issue 47 item 1): at temperature 1, 32 requests of a
JSON-schema answer in each (128 in all, through one grammar) parse with json.loads and match the
schema, read through the real SDKs.
Before the fix, SmolLM2 wrote a raw newline inside a string on 3 of 64 seeds (OpenAI's
response_format): `{ "name" : "},\\n","age": 25 }`."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

from server_harness import MODEL, model_server

pytestmark = pytest.mark.model

N = 32
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
ASK = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf) as live:
        yield live


def openai_chat(url: str, seed: int) -> str:
    from openai import OpenAI

    r = OpenAI(base_url=url + "/v1", api_key="x").chat.completions.create(
        model=MODEL, messages=ASK, seed=seed, temperature=1.0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    return r.choices[0].message.content


def responses(url: str, seed: int) -> str:
    from openai import OpenAI

    r = OpenAI(base_url=url + "/v1", api_key="x").responses.create(
        model=MODEL, input="Describe a person.", temperature=1.0, max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}})
    return r.output_text


def ollama(url: str, seed: int) -> str:
    import ollama as ollama_sdk

    r = ollama_sdk.Client(host=url).chat(model=MODEL, messages=ASK, format=SCHEMA,
                                         options={"seed": seed, "temperature": 1.0, "num_predict": 200})
    return r.message.content


def anthropic(url: str, seed: int) -> str:
    import anthropic as anthropic_sdk

    r = anthropic_sdk.Anthropic(base_url=url, api_key="x").messages.create(
        model=MODEL, messages=ASK, max_tokens=200,  # this SDK release takes no temperature: 1 is the default
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    return "".join(block.text for block in r.content if block.type == "text")


DIALECTS: dict[str, Callable[[str, int], str]] = {
    "openai": openai_chat, "responses": responses, "ollama": ollama, "anthropic": anthropic}


def matches(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age"} and isinstance(value["name"], str)
            and len(value["name"]) <= 40 and isinstance(value["age"], int))


@pytest.mark.parametrize("dialect", DIALECTS)
def test_structured_output_is_json_on_32_seeds_at_temperature_1(server, dialect: str) -> None:
    ask = DIALECTS[dialect]
    first = list(DIALECTS).index(dialect) * N  # each dialect its own seeds: 128 through the one grammar
    seeds = range(first, first + N)
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda seed: ask(server.url, seed), seeds))
    bad = []
    for seed, text in zip(seeds, texts):
        try:
            if not matches(json.loads(text)):
                bad.append((seed, text))
        except ValueError:
            bad.append((seed, text))
    assert not bad, bad[:3]
