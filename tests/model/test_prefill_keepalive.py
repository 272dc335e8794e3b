"""A long prefill looks alive to each client's own idle guard (issue 47 item 2): the keepalives are
items the SDK hands up (an empty-delta chunk, an empty done:false line, Anthropic's ping,
Responses' response.in_progress), so the longest gap between items the client reads stays under a
guard that the prefill itself is longer than (checked: the test fails if the prefill is short)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

from server_harness import MODEL, model_server

pytestmark = pytest.mark.model

PING_S = 0.1
# The client's idle guard (Qwen Code's 240 s) scaled down, so the prefill that must outlast it twice
# costs seconds of compute, not minutes: 12 pings, room for a loaded 2-core machine.
GUARD_S = 1.2
LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 90  # ~1,250 tokens


def ask(dialect: str) -> list[dict[str, str]]:
    """The long prompt, its first words the dialect's own so no test reads another's from the prefix cache."""
    return [{"role": "user", "content": f"{dialect}: {LONG}\nSay hi."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):
    # Small prompt steps, so the prefill takes seconds on any machine.
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf, context_length=2048, batch_tokens=16,
                      max_sequences=1, sse_ping_interval=PING_S) as live:
        live.backend_class(MODEL)  # loaded before any test times its stream
        yield live


def openai_items(url: str, messages: list) -> Iterable[Any]:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="x").chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True)


def responses_items(url: str, messages: list) -> Iterable[Any]:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="x").responses.create(
        model=MODEL, input=messages[0]["content"], max_output_tokens=4, temperature=0, stream=True)


def ollama_items(url: str, messages: list) -> Iterable[Any]:
    import ollama

    return ollama.Client(host=url).chat(model=MODEL, messages=messages, stream=True, options={"num_predict": 4})


def anthropic_items(url: str, messages: list) -> Iterable[Any]:
    import anthropic

    # Its SDK's iterator skips `ping` events; Claude Code's guard sees them on the wire: read the events.
    with anthropic.Anthropic(base_url=url, api_key="x").messages.with_streaming_response.create(
            model=MODEL, messages=messages, max_tokens=4, stream=True) as response:
        yield from (line for line in response.iter_lines() if line.startswith("event: "))


DIALECTS: dict[str, Callable[[str, list], Iterable[Any]]] = {
    "openai": openai_items, "responses": responses_items, "ollama": ollama_items, "anthropic": anthropic_items}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_long_prefill_never_trips_the_clients_idle_guard(server, dialect: str) -> None:
    start = last = None  # the guard watches the stream once it began, as Qwen Code's does
    longest, items = 0.0, 0
    for _ in DIALECTS[dialect](server.url, ask(dialect)):
        now = time.monotonic()
        if start is None:
            start = last = now
        longest, last, items = max(longest, now - last), now, items + 1
    assert start is not None and last is not None
    assert last - start > 2 * GUARD_S, "the prefill was too short to test the guard"
    assert items > (last - start) / GUARD_S  # items came all along, not only at the end
    assert longest < GUARD_S, longest
