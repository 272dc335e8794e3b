"""What chat UIs and client libraries send, replayed against the real server and model (issue 47,
items 5-7): the Ollama dialect as Open WebUI, llm-ollama and ollama-ai-provider-v2 use it (trimming,
copy, create, capabilities, top-level options), Open WebUI's 36 built-in tools on a template without
tool support, and langchain-openai's token-id embeddings. Each is driven with the client's own
package where it installs here (ollama, openai), else with the body the client sends."""

from __future__ import annotations

import math
from pathlib import Path

import openai
import pytest

from server_harness import MODEL, model_server

pytestmark = pytest.mark.model
# "hello world" in OpenAI's cl100k tokenizer, as langchain-openai's OpenAIEmbeddings sends it by
# default (check_embedding_ctx_length=True tokenizes with tiktoken and posts the ids).
CL100K_HELLO_WORLD = [15339, 1917]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf, context_length=2048) as live:
        yield live


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# --- item 7: token-id embeddings ------------------------------------------------------------------
def test_langchain_cl100k_ids_are_refused_by_name(client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=[CL100K_HELLO_WORLD])  # base64, as the SDK asks
    body = refused.value.body
    assert body["param"] == "input" and "embed_token_ids" in body["message"]
    assert "check_embedding_ctx_length=False" in body["message"]  # the client-side way out
    # Text is embedded as ever.
    assert len(client.embeddings.create(model=MODEL, input=["hello world"]).data[0].embedding) == 576


def test_the_setting_takes_ids_as_this_models_own(tmp_path: Path, smollm2_gguf: Path) -> None:
    with model_server(tmp_path, smollm2_gguf, embed_token_ids=True) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        text = client.embeddings.create(model=MODEL, input="hello world").data[0].embedding
        own_ids = live.call(_tokenize(live, "hello world"))
        ids = client.embeddings.create(model=MODEL, input=[own_ids]).data[0].embedding
    cosine = sum(a * b for a, b in zip(text, ids)) / math.sqrt(sum(a * a for a in text) * sum(b * b for b in ids))
    assert cosine > 0.999  # the same text, as ids of this model's own tokenizer


async def _tokenize(live, text: str) -> list[int]:
    async with live.manager.use(MODEL) as loaded:
        return list(loaded.engine.tokenize(text, add_special=True))
