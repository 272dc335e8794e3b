"""Images inside the continuous batch, on a real projector (issue 43's engine half).

tests/vision_model.py builds a SmolVLM-shaped projector for SmolLM2 from seeded weights, so
llama.cpp's whole vision path runs: mtmd's tokenizer lays each image out (a 64-position tile, its
overview, idefics3's tokens around them), the projector encodes it, and its embeddings enter the
sequence as prompt chunks the scheduler plans like any other. What SmolLM2 answers about random
image embeddings means nothing; that it answers the same way every time, from the same cells, and
differently for another image, is what these tests hold.

The engine runs as the product loads it (one KV stream per sequence, flash attention off), so a
request's greedy answer does not depend on what else runs beside it.
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

from localserve.backends.llamacpp.backend import LlamaCppBackend
from localserve.batching.limits import EngineLimits
from localserve.engine.local import Engine
from localserve.errors import InvalidRequestError
from localserve.protocol.media import MEDIA_MARKER, ImageInput, MediaInput
from localserve.protocol.requests import GenerationRequest, SamplingParams

import vision_model
from test_engine_llamacpp import run, running_engine  # its step budget (48) and defaults
from worker_locks import THREADS

GREEDY = SamplingParams(temperature=0.0)


def image(seed: int) -> ImageInput:
    data = vision_model.test_image(seed)
    return ImageInput(data=data, sha256=hashlib.sha256(data).hexdigest(), width=96, height=96, format="png")


@pytest.fixture(scope="module")
def vision_files(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("vision")
    return vision_model.write_text_model(smollm2_gguf, out), vision_model.write_projector(out)


@pytest.fixture(scope="module")
def backend(vision_files):
    model, projector = vision_files
    b = LlamaCppBackend.load(model, n_ctx=16 * 1024, n_seq_max=16, n_batch=512, n_threads=THREADS,
                             kv_unified=False, flash_attention=False, mmproj=projector)
    yield b
    b.close()


def prompt(question: str, n_images: int = 1) -> str:
    return f"<|im_start|>user\n{MEDIA_MARKER * n_images}\n{question}<|im_end|>\n<|im_start|>assistant\n"


def image_request(engine: Engine, question: str, images: list[ImageInput], max_tokens: int = 12) -> GenerationRequest:
    tokens = engine.tokenize_media(prompt(question, len(images)), images)
    return GenerationRequest(tokens, GREEDY, max_tokens=max_tokens, ignore_eos=True, images=images)


def test_the_projector_loads_and_sees(backend):
    assert backend.info.vision is True and backend.info.audio is False


def test_an_image_takes_its_positions_as_ids_of_its_own(backend):
    one, two = image(1), image(2)
    tokens = backend.tokenize_media(prompt("What is this?"), [one])
    media = [t for t in tokens if t < 0]
    # idefics3's layout: the tile and the overview, 64 positions each, with text tokens around them.
    assert len(media) == 2 * vision_model.TOKENS_PER_IMAGE
    assert len(set(media)) == len(media)
    assert backend.tokenize_media(prompt("What is this?"), [one]) == tokens  # the same image, the same ids
    other = [t for t in backend.tokenize_media(prompt("What is this?"), [two]) if t < 0]
    assert not set(other) & set(media)  # another image shares none
    text = [t for t in tokens if t >= 0]
    assert text[:len(backend.tokenize("<|im_start|>user\n"))] == backend.tokenize("<|im_start|>user\n")


def test_markers_and_images_must_pair_up(backend):
    with pytest.raises(InvalidRequestError):
        backend.tokenize_media(prompt("Two?", 2), [image(1)])
    with pytest.raises(InvalidRequestError):
        backend.tokenize_media(prompt("Broken?"), [ImageInput(b"not an image", "0" * 64, 1, 1, "png")])


async def test_the_same_image_twice_answers_alike_and_the_second_reads_its_cells(backend):
    with running_engine(backend) as engine:
        first, _, last1 = await run(engine, image_request(engine, "Describe the picture.", [image(1)]))
        second, _, last2 = await run(engine, image_request(engine, "Describe the picture.", [image(1)]))
        n_prompt = last2.usage.prompt_tokens
    assert first == second and len(first) == 12
    assert last1.usage.cached_tokens == 0
    # Everything but the last min_recompute tokens comes from the first request's cells, image and all.
    assert last2.usage.cached_tokens == n_prompt - 2


async def test_a_second_question_about_the_same_image_reuses_its_cells(backend):
    with running_engine(backend) as engine:
        await run(engine, image_request(engine, "Describe the picture.", [image(1)]))
        request = image_request(engine, "What colour is it?", [image(1)])
        _, _, last = await run(engine, request)
    first_media = next(i for i, t in enumerate(request.prompt_tokens) if t < 0)
    last_media = max(i for i, t in enumerate(request.prompt_tokens) if t < 0)
    assert last.usage.cached_tokens > last_media > first_media  # the whole image was read from the cache


async def test_a_different_image_shares_no_cells_and_answers_from_its_own(backend):
    with running_engine(backend) as engine:
        one, _, _ = await run(engine, image_request(engine, "Describe the picture.", [image(1)], max_tokens=16))
        request = image_request(engine, "Describe the picture.", [image(3)], max_tokens=16)
        two, _, last = await run(engine, request)
    first_media = next(i for i, t in enumerate(request.prompt_tokens) if t < 0)
    assert last.usage.cached_tokens <= first_media  # only the text before the image was shared
    assert one != two


def logits_after(backend: LlamaCppBackend, question: str, media: MediaInput) -> np.ndarray:
    """The logits after a one-image (or one-clip) prompt, decoded on sequence 0 and removed after."""
    from llamacpp_helpers import prompt_batch

    tokens = backend.tokenize_media(prompt(question), [media])
    held = backend.hold_media(tokens, [media])
    try:
        backend.kv_remove(0)
        backend.decode(prompt_batch(tokens, 0))
        return backend.logits(len(tokens) - 1)
    finally:
        backend.release_media(held)
        backend.kv_remove(0)


def test_different_images_give_different_logits(backend):
    """Below the answer: the logits after the prompt differ with the image (its embeddings really
    entered the sequence), and are the same for the same image."""
    a, b, a_again = (logits_after(backend, "Describe the picture.", image(seed)) for seed in (1, 4, 1))
    assert np.array_equal(a, a_again)
    assert float(np.abs(a - b).max()) > 0.1


async def beside_four_chats(backend: LlamaCppBackend, question: str, media: MediaInput,
                            max_tokens: int) -> tuple[list[int], object]:
    """The answer's tokens and last event for a one-image (or one-clip) question asked while four
    48-token chats decode (no prefix cache: nothing read from an earlier answer)."""
    chats = [backend.tokenize(f"<|im_start|>user\nTell me a long story about {topic}.<|im_end|>\n"
                              "<|im_start|>assistant\n") for topic in ("rivers", "bread", "owls", "tea")]
    with running_engine(backend, prefix_cache=False) as engine:
        running = [asyncio.ensure_future(run(engine, GenerationRequest(c, GREEDY, max_tokens=48, ignore_eos=True)))
                   for c in chats]
        while engine.stats().running < 4:
            await asyncio.sleep(0.01)
        beside, _, last = await run(engine, image_request(engine, question, [media], max_tokens=max_tokens))
        stories = await asyncio.gather(*running)
        assert engine.stats().running == 0
    assert all(len(tokens) == 48 for tokens, _, _ in stories)
    return beside, last


async def test_an_image_alone_and_beside_four_running_chats_answers_alike(backend):
    with running_engine(backend, prefix_cache=False) as engine:
        alone, _, _ = await run(engine, image_request(engine, "Describe the picture.", [image(5)], max_tokens=16))
    beside, last = await beside_four_chats(backend, "Describe the picture.", image(5), max_tokens=16)
    assert beside == alone
    assert last.finish_reason == "length"


async def test_two_images_in_one_prompt(backend):
    with running_engine(backend) as engine:
        both, _, last = await run(engine, image_request(engine, "Compare them.", [image(1), image(2)]))
        swapped, _, _ = await run(engine, image_request(engine, "Compare them.", [image(2), image(1)]))
    assert len(both) == 12 and last.finish_reason == "length"
    assert both != swapped


async def test_image_positions_without_their_images_are_refused(backend):
    with running_engine(backend) as engine:
        tokens = engine.tokenize_media(prompt("Describe the picture."), [image(1)])
        with pytest.raises(InvalidRequestError):
            engine.submit(GenerationRequest(tokens, GREEDY, max_tokens=4))  # no images: negative ids refused
        with pytest.raises(InvalidRequestError):
            engine.submit(GenerationRequest(tokens, GREEDY, max_tokens=4, images=[image(6)]))  # not its image


def test_a_model_without_a_projector_does_not_see(smollm2_gguf):
    plain = LlamaCppBackend.load(smollm2_gguf, n_ctx=512, n_seq_max=1, n_batch=64, n_threads=1)
    try:
        assert plain.info.vision is False and plain.info.audio is False
        with pytest.raises(InvalidRequestError):
            plain.tokenize_media(prompt("What is this?"), [image(1)])
    finally:
        plain.close()


def load_vision_engine(model: str, projector: str) -> Engine:
    """The loader an engine worker runs (a module-level function: the worker imports it by name)."""
    backend = LlamaCppBackend.load(model, n_ctx=4096, n_seq_max=4, n_batch=256, n_threads=1, kv_unified=False,
                                   flash_attention=False, mmproj=projector)
    engine = Engine(backend, EngineLimits(max_sequences=4, batch_tokens=48, n_ctx=4096, n_ctx_seq=1024,
                                          prefix_cache=True), name="smolvlm")
    engine.start()
    return engine


async def test_images_through_an_engine_worker(vision_files, tmp_path):
    """As the daemon runs a model: the worker holds the projector, says `vision` in its ready
    message, tokenizes the images (a round trip: the daemon has only the vocabulary), and the
    images travel with the request over the pipe."""
    from localserve.api.generation import tokenize_async
    from localserve.engine.worker.proxy import WorkerEngine

    model, projector = vision_files
    worker = await asyncio.to_thread(WorkerEngine.start, "smolvlm", load_vision_engine, (str(model), str(projector)),
                                     log_path=tmp_path / "engine.log", vocab_gguf=model)
    try:
        assert worker.info.vision is True
        answers = []
        for _ in range(2):
            tokens = await tokenize_async(worker, prompt("Describe the picture."), images=[image(1)])
            assert sum(t < 0 for t in tokens) == 2 * vision_model.TOKENS_PER_IMAGE
            stream = await worker.generate(GenerationRequest(tokens, GREEDY, max_tokens=8, ignore_eos=True,
                                                             images=[image(1)]))
            out, last = [], None
            async for event in stream:
                out += event.token_ids
                last = event
            answers.append((out, last.usage.cached_tokens, len(tokens)))
        (first, cached1, _), (second, cached2, n) = answers
        assert first == second and len(first) == 8
        assert cached1 == 0 and cached2 == n - 2
        with pytest.raises(InvalidRequestError):  # markers and images that do not pair up: the worker's 400
            await tokenize_async(worker, prompt("Two?", 2), images=[image(1)])
    finally:
        await asyncio.to_thread(worker.shutdown)
