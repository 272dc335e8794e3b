"""Images sent to the real server and SmolLM2, which has no vision projector (issue 43, API half):
every dialect's image shape reaches the one image path, a good image is a 400 naming the model in
that dialect's error shape (through the official openai, anthropic and ollama clients), each bad
input is a 400 naming its field before any model work, the Batch API's lines answer the same, and
the server keeps answering text requests meanwhile."""

from __future__ import annotations

import base64
import io
from typing import Any

import anthropic
import openai
import pytest
from PIL import Image

from server_harness import MODEL, model_server
from test_batches import contents, line, submit, wait

pytestmark = pytest.mark.model


def png(size: tuple[int, int] = (16, 16)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, "purple").save(out, format="PNG")
    return out.getvalue()


PNG64 = base64.b64encode(png()).decode()
DATA_URL = f"data:image/png;base64,{PNG64}"
TRUNCATED64 = base64.b64encode(png((64, 64))[:-30]).decode()
BOMB64 = base64.b64encode(png((6000, 6000))).decode()  # a few kB declaring 36M pixels
TEXT64 = base64.b64encode(b"plain text, not a picture").decode()
NO_VISION = "takes no images"


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_gguf):
    with model_server(tmp_path_factory.mktemp("images"), smollm2_gguf, max_images_per_request=2,
                      max_image_pixels=25_000_000) as server:
        yield server


@pytest.fixture(scope="module")
def oai(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_with(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_openai_sdk_image_to_a_model_without_projector_names_the_model(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=chat_with(DATA_URL), max_tokens=4)
    error = e.value.body
    assert MODEL in error["message"] and NO_VISION in error["message"]
    assert error["param"] == "messages[0].content[1].image_url.url"


def test_anthropic_sdk_image_block_and_tool_result_screenshot_name_the_model(live):
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG64}}
    for content in ([{"type": "text", "text": "What is this?"}, image],
                    [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]):
        messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
        if content[0]["type"] == "tool_result":
            messages = [{"role": "user", "content": "Take a screenshot."},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
                        *messages]
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=MODEL, max_tokens=4, messages=messages)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert MODEL in e.value.body["error"]["message"] and NO_VISION in e.value.body["error"]["message"]


def test_ollama_client_images_name_the_model(live):
    import ollama

    client = ollama.Client(host=live.url, timeout=120)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "What is this?", "images": [png()]}])
    assert e.value.status_code == 400 and MODEL in e.value.error and NO_VISION in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="What is this?", images=[png()])
    assert e.value.status_code == 400 and MODEL in e.value.error and "images[0]" in e.value.error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": DATA_URL}]}]},
     "input[0].content[1].image_url"),
    ("/completion", {"model": MODEL, "prompt": {"prompt_string": "What is <__media__>?", "multimodal_data": [PNG64]},
                     "n_predict": 4}, "prompt.multimodal_data[0]"),
    ("/completion", {"model": MODEL, "prompt": "What is <__media__>?", "multimodal_data": [PNG64], "n_predict": 4},
     "multimodal_data[0]"),
])
def test_responses_and_llamacpp_images_name_the_model(live, path, body, param):
    status, answer = live.json("POST", path, body)
    assert status == 400, answer
    message = answer["error"]["message"]
    assert MODEL in message and NO_VISION in message and param in message


def bad_chat(url: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": chat_with(url), "max_tokens": 4}


PARAM = "messages[0].content[1].image_url.url"


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/chat/completions", bad_chat(f"data:image/png;base64,{TEXT64}"), PARAM, "is not an image"),
    ("/v1/chat/completions", bad_chat(f"data:image/png;base64,{TRUNCATED64}"), PARAM, "truncated"),
    ("/v1/chat/completions", bad_chat(f"data:image/png;base64,{BOMB64}"), PARAM, "max_image_pixels"),
    ("/v1/chat/completions", bad_chat("data:image/png;base64,@@@@"), PARAM, "not valid base64"),
    ("/v1/chat/completions", bad_chat("data:text/html;base64,PGI+"), PARAM, "not an image"),
    ("/v1/chat/completions", bad_chat("https://127.0.0.1/x.png"), PARAM, "loopback, private"),
    ("/v1/chat/completions", bad_chat("https://192.168.1.20/x.png"), PARAM, "loopback, private"),
    ("/v1/chat/completions", bad_chat("http://example.com/x.png"), PARAM, "http://"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": DATA_URL}}] * 3}]},
     "messages[0].content[2].image_url.url", "max_images_per_request"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "see <__media__>"}, {"type": "image_url", "image_url": {"url": DATA_URL}}]}]},
     "messages", "<__media__>"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": TRUNCATED64}}]}]},
     "messages[0].content[0].source.data", "truncated"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://10.1.2.3/shot.png"}}]}]},
     "messages[0].content[0].source.url", "loopback, private"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "text/plain", "data": PNG64}}]}]},
     "messages[0].content[0].source.media_type", "image type"),
    ("/api/chat", {"model": MODEL, "stream": False, "messages": [
        {"role": "user", "content": "hi", "images": [BOMB64]}]}, "messages[0].images[0]", "max_image_pixels"),
    ("/api/generate", {"model": MODEL, "stream": False, "prompt": "hi", "images": [TEXT64]}, "images[0]",
     "is not an image"),
    ("/api/generate", {"model": MODEL, "stream": False, "prompt": "hi", "images": ["not base64!"]}, "images[0]",
     "not valid base64"),
    ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": f"data:image/png;base64,{TRUNCATED64}"}]}]},
     "input[0].content[0].image_url", "truncated"),
    ("/completion", {"model": MODEL, "prompt": "What is this?", "multimodal_data": [PNG64]}, "prompt", "markers"),
    ("/completion", {"model": MODEL, "prompt": "<__media__>", "multimodal_data": [TEXT64]}, "multimodal_data[0]",
     "is not an image"),
])
def test_bad_image_input_is_a_400_naming_its_field(live, path, body, param, words):
    status, answer = live.json("POST", path, body)
    assert status == 400, answer
    error = answer["error"]
    message = error if isinstance(error, str) else error["message"]  # Ollama's error is a string
    assert param in message and words in message, message
    if path.startswith("/v1/chat"):
        assert error["param"] == param
    assert NO_VISION not in message  # refused for what it is, before the model is asked


def test_text_requests_still_answer(oai):
    answer = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                         max_tokens=4, temperature=0)
    assert answer.choices[0].message.content


def test_a_batch_line_with_an_image_fails_as_the_request_would(oai):
    lines = [line("ok", "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "Say hi."}]}),
             line("img", "/v1/chat/completions", bad_chat(DATA_URL)),
             line("bad", "/v1/chat/completions", bad_chat(f"data:image/png;base64,{TRUNCATED64}"))]
    done = wait(oai, submit(oai, lines, "/v1/chat/completions").id)
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 2)
    errors = {e["custom_id"]: e["response"] for e in contents(oai, done.error_file_id)}
    assert errors["img"]["status_code"] == 400 and MODEL in errors["img"]["body"]["error"]["message"]
    assert errors["bad"]["body"]["error"]["param"] == PARAM


def test_show_models_and_props_say_vision_from_the_projector(live, tmp_path, smollm2_gguf):
    from localserve.store.cache import ModelStore
    from projector_gguf import projector_bytes

    live.json("POST", "/api/generate", {"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 1}})
    status, show = live.json("POST", "/api/show", {"model": MODEL})  # loaded, no projector: ModelInfo.vision
    assert status == 200 and "vision" not in show["capabilities"]
    projector = tmp_path / "mmproj-seer-f16.gguf"
    projector.write_bytes(projector_bytes())
    ModelStore(live.settings).register_local(smollm2_gguf, "seer", mmproj=projector)
    status, show = live.json("POST", "/api/show", {"model": "seer"})  # not loaded: the store's projector
    assert status == 200 and "vision" in show["capabilities"]
    _, models = live.json("GET", "/v1/models")
    vision = {m["id"]: m["vision"] for m in models["data"]}
    assert vision["seer:latest"] is True and vision[next(k for k in vision if k.startswith(MODEL))] is False
    _, props = live.json("GET", "/props?model=seer")
    assert props["modalities"] == {"vision": True, "audio": False}
