"""Images end to end (issue 43): the official openai (a data URL), anthropic (a base64 block) and
ollama (`images`) clients send a picture to the real server, whose model has a projector
(tests/vision_model.py: SmolLM2 with a SmolVLM-shaped idefics3 projector from seeded weights,
registered as `add --mmproj` registers one), and get an answer; the same picture asked again is
answered the same and read from the prefix cache; /api/show says `vision`. What SmolLM2 says
about random image embeddings means nothing; that every dialect reaches the same image path and
answers is what these tests hold."""

from __future__ import annotations

import base64
import json
import urllib.request

import anthropic
import ollama
import openai
import pytest

import vision_model
from localserve.store.cache import ModelStore
from server_harness import MODEL, MODEL_TAG, LiveServer, server_settings

pytestmark = pytest.mark.model

PICTURE = base64.b64encode(vision_model.test_image(1)).decode()
OTHER = base64.b64encode(vision_model.test_image(2)).decode()


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_gguf):
    out = tmp_path_factory.mktemp("vision")
    model, projector = vision_model.write_text_model(smollm2_gguf, out), vision_model.write_projector(out)
    settings = server_settings(tmp_path_factory.mktemp("home"))
    ModelStore(settings).register_local(model, MODEL, MODEL_TAG, mmproj=projector)
    with LiveServer(settings) as server:
        yield server


def openai_chat(live, picture: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=6, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                     {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{picture}"}}]}])


def test_the_openai_sdk_sends_a_data_url_and_the_same_picture_is_read_from_the_cache(live):
    first = openai_chat(live, PICTURE)
    again = openai_chat(live, PICTURE)
    assert first.choices[0].message.content and first.usage.completion_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    # The picture's positions (two 64-position tiles) and the text around it: all but the last
    # tokens come from the cells the first request left.
    assert first.usage.prompt_tokens > 2 * vision_model.TOKENS_PER_IMAGE
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 4
    other = openai_chat(live, OTHER)
    # Another picture shares only the text before it.
    assert other.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 2 * vision_model.TOKENS_PER_IMAGE


def test_the_anthropic_sdk_sends_a_base64_block(live):
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=300)
    message = client.messages.create(model=MODEL, max_tokens=6, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PICTURE}},
            {"type": "text", "text": "What is in this picture?"}]}])
    assert message.content[0].text and message.usage.output_tokens > 0
    assert message.usage.input_tokens > 2 * vision_model.TOKENS_PER_IMAGE


def test_the_ollama_client_sends_images_and_show_says_vision(live):
    client = ollama.Client(host=live.url, timeout=300)
    answer = client.chat(model=MODEL, options={"temperature": 0, "num_predict": 6},
                         messages=[{"role": "user", "content": "What is in this picture?", "images": [PICTURE]}])
    assert answer.message.content and answer.eval_count > 0
    assert answer.prompt_eval_count > 2 * vision_model.TOKENS_PER_IMAGE
    request = urllib.request.Request(live.url + "/api/show", data=json.dumps({"model": MODEL}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert "vision" in json.loads(response.read())["capabilities"]
