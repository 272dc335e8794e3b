"""Audio in, on a real projector that hears (issue 43, item 2's `input_audio`).

tests/audio_model.py builds an Ultravox-shaped projector for SmolLM2 from seeded weights, so
llama.cpp's whole audio path runs: the WAV or MP3 decoded and resampled (miniaudio), the log-mel
spectrogram, the Whisper-style encoder, and a 30-second window's 375 embeddings entering the
sequence as prompt chunks the scheduler plans like an image's. What SmolLM2 answers about random
audio embeddings means nothing; that it answers the same way every time, from the same cells,
differently for another clip, alone or beside running chats, through each dialect that carries
audio, is what these tests hold.
"""

from __future__ import annotations

import base64
import json
import urllib.request

import numpy as np
import openai
import pytest

import audio_model
import vision_model
from localserve.api.audio_checks import check_audio
from localserve.backends.llamacpp.backend import LlamaCppBackend
from localserve.errors import InvalidRequestError
from localserve.protocol.media import MEDIA_MARKER, AudioInput
from localserve.store.cache import ModelStore
from server_harness import MODEL, MODEL_TAG, LiveServer, server_settings
from test_engine_llamacpp import run, running_engine
from test_vision import beside_four_chats, image, image_request, logits_after, prompt
from worker_locks import THREADS

pytestmark = pytest.mark.model

WINDOW = audio_model.TOKENS_PER_WINDOW


def clip(seed: int) -> AudioInput:
    return check_audio(audio_model.test_audio(seed), "wav", "clip")


@pytest.fixture(scope="module")
def projector(tmp_path_factory):
    return audio_model.write_projector(tmp_path_factory.mktemp("audio"))


@pytest.fixture(scope="module")
def backend(smollm2_gguf, projector):
    b = LlamaCppBackend.load(smollm2_gguf, n_ctx=8 * 2048, n_seq_max=8, n_batch=512, n_threads=THREADS,
                             kv_unified=False, flash_attention=False, mmproj=projector)
    yield b
    b.close()


def test_the_projector_hears_and_does_not_see(backend):
    assert backend.info.audio and not backend.info.vision
    tokens = backend.tokenize_media(prompt("What is this sound?"), [clip(1)])
    media = [t for t in tokens if t < 0]
    assert len(media) == WINDOW and len(set(media)) == WINDOW  # one window, a row id each
    assert backend.tokenize_media(prompt("What is this sound?"), [clip(1)]) == tokens  # the same clip, the same ids
    assert not set(media) & {t for t in backend.tokenize_media(prompt("What is this sound?"), [clip(2)]) if t < 0}
    with pytest.raises(InvalidRequestError, match="takes no images: it was loaded without a projector that sees"):
        backend.tokenize_media(prompt("What is this?"), [image(1)])


def test_different_clips_give_different_logits(backend):
    """Below the answer (SmolLM2 says much the same of any random embeddings): the logits after the
    prompt differ with the clip, so its embeddings really entered the sequence, and are the same
    for the same clip."""
    a, b, a_again = (logits_after(backend, "What is this sound?", clip(seed)) for seed in (1, 2, 1))
    assert np.array_equal(a, a_again)
    assert float(np.abs(a - b).max()) > 0.1


async def test_a_clip_answers_alike_alone_again_and_beside_four_running_chats(backend):
    with running_engine(backend) as engine:
        alone, _, _ = await run(engine, image_request(engine, "What is this sound?", [clip(3)], max_tokens=12))
        again, _, second = await run(engine, image_request(engine, "What is this sound?", [clip(3)], max_tokens=12))
        _, _, third = await run(engine, image_request(engine, "What is this sound?", [clip(4)], max_tokens=12))
    assert again == alone
    # The second read the clip's cells from the prefix cache; another clip shares only the text before it.
    assert second.usage.cached_tokens >= WINDOW and third.usage.cached_tokens < WINDOW
    beside, _ = await beside_four_chats(backend, "What is this sound?", clip(3), max_tokens=12)
    assert beside == alone


# --- the server: dialects, what it says it takes, refusals ----------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_gguf, projector):
    settings = server_settings(tmp_path_factory.mktemp("home"), max_audio_seconds=5.0)
    ModelStore(settings).register_local(smollm2_gguf, MODEL, MODEL_TAG, mmproj=projector)
    with LiveServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def oai(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def ask(oai: openai.OpenAI, *parts: dict) -> openai.types.chat.ChatCompletion:
    return oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=6, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this sound?"}, *parts]}])


def test_the_openai_sdk_sends_wav_and_mp3_and_the_same_clip_is_read_from_the_cache(oai):
    first = ask(oai, audio_part(audio_model.test_audio(1)))
    again = ask(oai, audio_part(audio_model.test_audio(1)))
    assert first.choices[0].message.content and first.usage.completion_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    assert first.usage.prompt_tokens > WINDOW
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 4
    mp3 = ask(oai, audio_part(audio_model.silent_mp3(), "mp3"))  # decoded by miniaudio, resampled to 16 kHz
    assert mp3.usage.prompt_tokens == first.usage.prompt_tokens and mp3.usage.completion_tokens > 0


def test_the_responses_api_takes_an_input_audio_part(oai):
    response = oai.responses.create(model=MODEL, temperature=0, max_output_tokens=6, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is this sound?"},
                                     audio_part(audio_model.test_audio(1))]}])
    assert response.output_text and response.usage.input_tokens > WINDOW


def post(live, path: str, body: dict) -> dict:
    request = urllib.request.Request(live.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_llama_cpp_completion_takes_audio_in_multimodal_data_and_props_say_audio(live):
    wav = base64.b64encode(audio_model.test_audio(1)).decode()
    answer = post(live, "/completion", {"prompt": f"Sound: {MEDIA_MARKER} It is", "multimodal_data": [wav],
                                        "n_predict": 4, "temperature": 0})
    assert answer["content"] and answer["tokens_evaluated"] > WINDOW
    with urllib.request.urlopen(live.url + "/props", timeout=60) as response:
        assert json.loads(response.read())["modalities"] == {"vision": False, "audio": True}
    capabilities = post(live, "/api/show", {"model": MODEL})["capabilities"]
    assert "audio" in capabilities and "vision" not in capabilities
    with urllib.request.urlopen(live.url + "/v1/models", timeout=60) as response:
        entry = json.loads(response.read())["data"][0]
    assert entry["audio"] is True and entry["vision"] is False


@pytest.mark.parametrize("part, param, words", [
    (audio_part(audio_model.test_audio(1)[:9000]), "messages[0].content[1].input_audio.data", "truncated WAV file"),
    (audio_part(audio_model.test_audio(1, seconds=6)), "messages[0].content[1].input_audio.data",
     "brings the request's audio to 6.0 seconds, more than the 5 it may have (setting max_audio_seconds)"),
    (audio_part(audio_model.silent_mp3(), "wav"), "messages[0].content[1].input_audio.data",
     "is MP3 audio, but its format says 'wav'"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "flac"}},
     "messages[0].content[1].input_audio.format", "must be \"wav\" or \"mp3\""),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                         + base64.b64encode(vision_model.test_image(1)).decode()}},
     "messages[0].content[1].image_url.url", f"the model '{MODEL}:{MODEL_TAG}' takes no images"),
])
def test_bad_audio_and_an_image_to_a_model_that_only_hears_are_400s_naming_the_field(oai, part, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai, part)
    assert e.value.body["param"] == param and words in e.value.body["message"]
    assert ask(oai).choices[0].message.content  # and the server answers on

