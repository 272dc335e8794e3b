"""The prompt cache on disk on the real SmolLM2 (issue 42 part 3): a parked conversation is written
at unload and read back by the next engine (cached tokens counted, the greedy answer the one computed
cold); a file from another model or build, a truncated file and a flipped byte are refused and
removed, and the answer stays the cold one; files are 0600 in a 0700 folder; the bound holds while
distinct conversations churn through it; an idle engine gives a parked conversation's memory back
once it is on disk, and the next turn reads it from there."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import sys
import time

import pytest

from conftest import GEMMA3_SHA256, SMOLLM2_SHA256
from localserve.backends.llamacpp import kv_pages
from localserve.backends.llamacpp.backend import LlamaCppBackend
from localserve.backends.llamacpp.seq_state import SeqState, state_key
from localserve.batching.limits import EngineLimits
from localserve.engine.local import Engine
from localserve.engine.prompt_disk import PromptDisk
from localserve.protocol.requests import GenerationRequest, SamplingParams
from localserve.store import prompt_cache
from localserve.store.prompt_cache import PromptDiskCache
from worker_locks import THREADS

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0)
KEY = state_key(kv_unified=False, kv_type="f16", flash_attention=False, exact_attention=False)


@pytest.fixture(scope="module")
def backend(smollm2_gguf):
    # kv_pages' own account of the load, for the one test that needs its pages (it has skipped now
    # and then in full runs, never alone: the reason goes into the skip's line).
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger(kv_pages.__name__)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        b = LlamaCppBackend.load(smollm2_gguf, n_ctx=4 * 2048, n_seq_max=4, n_batch=256, n_threads=THREADS,
                                 kv_unified=False, flash_attention=False)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    b.kv_pages_log = [r.getMessage() for r in records]
    yield b
    b.close()


def start_engine(backend: LlamaCppBackend, home=None, *, key: str = KEY, sha: str = SMOLLM2_SHA256,
                 max_bytes: int = 1 << 30, release_s: float = 0) -> Engine:
    """A fresh engine on an empty cache, as after a load; with `home`, its prompt cache on disk;
    `release_s`: its prefix cache's idle release (0: kept until evicted)."""
    backend.kv_clear()
    disk = None
    if home is not None:
        disk = PromptDisk(PromptDiskCache(home, sha, key, max_bytes).open(), SeqState(backend), min_tokens=64)
    limits = EngineLimits(max_sequences=2, batch_tokens=256, n_ctx=backend.n_ctx, n_ctx_seq=2048, prefix_cache=True,
                          prefix_release_s=release_s)
    engine = Engine(backend, limits, name="smollm2", prompt_disk=disk)
    engine.start()
    return engine


def prompt_of(backend: LlamaCppBackend, topic: str, turns: str = "") -> list[int]:
    system = " ".join([f"You are an assistant that knows {topic} and its many details well."] * 12)
    return backend.tokenize(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
                            f"Tell me about {topic}.<|im_end|>\n<|im_start|>assistant\n{turns}")


async def answer(engine: Engine, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], int]:
    tokens, last = [], None
    async for event in engine.submit(GenerationRequest(prompt, GREEDY, max_tokens=max_tokens, ignore_eos=True)):
        tokens += event.token_ids
        last = event
    return tokens, last.usage.cached_tokens


async def cold_answer(backend: LlamaCppBackend, prompt: list[int]) -> list[int]:
    engine = start_engine(backend)
    try:
        return (await answer(engine, prompt))[0]
    finally:
        engine.shutdown()


def files_of(home) -> list:
    return sorted(prompt_cache.cache_root(home).glob("*/*.kv"))


async def test_a_conversation_outlives_its_engine_and_answers_as_computed_cold(backend, tmp_path):
    first = prompt_of(backend, "rivers")
    engine = start_engine(backend, tmp_path)
    reply, cached = await answer(engine, first)
    assert cached == 0
    engine.shutdown()  # an unload: what is parked is written
    [file] = files_of(tmp_path)
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    assert stat.S_IMODE(file.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(file.parent.parent.stat().st_mode) == 0o700

    follow_up = first + reply + backend.tokenize("<|im_end|>\n<|im_start|>user\nAnd lakes?<|im_end|>\n"
                                                 "<|im_start|>assistant\n", add_special=False)
    engine = start_engine(backend, tmp_path)  # the next load (a restart, a keep_alive unload)
    warm, cached = await answer(engine, follow_up)
    engine.shutdown()
    # The whole first turn came from the file: its prompt and the answer's tokens but the last one
    # sampled (never decoded, so never in the KV).
    assert cached == len(first) + len(reply) - 1
    assert warm == await cold_answer(backend, follow_up)
    # The second turn's file supersedes the first's.
    assert len(files_of(tmp_path)) == 1


def kv_resident(backend: LlamaCppBackend) -> int:
    pages = backend._pages.pages
    return kv_pages.resident_bytes(pages.address, pages.size)


async def test_an_idle_engine_gives_a_parked_conversation_back_and_reads_it_from_disk(backend, tmp_path):
    if backend._pages is None:
        if not sys.platform.startswith("linux"):
            pytest.skip("KV pages go back to the OS on Linux only")
        pytest.skip(f"the load found no KV buffer to give back (memset slot {kv_pages._got_slot()!r}; "
                    f"kv_pages said: {backend.kv_pages_log})")
    first = prompt_of(backend, "mountains")
    engine = start_engine(backend, tmp_path, release_s=1.5)
    try:
        reply, _ = await answer(engine, first)
        held = kv_resident(backend)
        assert held > 4 << 20  # one stream's K and V rows: the parked conversation, in memory
        # While the session is active the next turn hits in memory: nothing read from disk.
        turn2 = first + reply + backend.tokenize("<|im_end|>\n<|im_start|>user\nAnd hills?<|im_end|>\n"
                                                 "<|im_start|>assistant\n", add_special=False)
        reply2, cached = await answer(engine, turn2)
        assert cached == len(first) + len(reply) - 1 and engine.scheduler.cache.disk_hits == 0
        # Quiet for release_s: written to disk, dropped, its stream's pages back to the OS.
        deadline = time.monotonic() + 30
        while engine.scheduler.cache.parked or kv_resident(backend) > held // 4:
            assert time.monotonic() < deadline, (len(engine.scheduler.cache.parked), kv_resident(backend))
            await asyncio.sleep(0.2)
        assert files_of(tmp_path)
        turn3 = turn2 + reply2 + backend.tokenize("<|im_end|>\n<|im_start|>user\nAnd valleys?<|im_end|>\n"
                                                  "<|im_start|>assistant\n", add_special=False)
        warm, cached = await answer(engine, turn3)
        assert cached == len(turn2) + len(reply2) - 1 and engine.scheduler.cache.disk_hits == cached
    finally:
        engine.shutdown()
    assert warm == await cold_answer(backend, turn3)


def flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path) -> None:
    os.truncate(path, path.stat().st_size - 100)


@pytest.mark.parametrize("spoil", [flip_last_byte, truncate], ids=["flipped byte", "truncated"])
async def test_a_spoiled_file_is_removed_and_the_prompt_computed(backend, tmp_path, spoil):
    prompt = prompt_of(backend, "forests")
    engine = start_engine(backend, tmp_path)
    await answer(engine, prompt)
    engine.shutdown()
    [file] = files_of(tmp_path)
    spoil(file)
    again = prompt + backend.tokenize(" Trees", add_special=False)
    engine = start_engine(backend, tmp_path)
    tokens, cached = await answer(engine, again)
    refused = engine.prompt_disk.files.refused
    engine.shutdown()
    assert refused == 1 and cached == 0
    assert file not in files_of(tmp_path)
    assert tokens == await cold_answer(backend, again)


@pytest.mark.parametrize("other", ["build", "model"])
async def test_a_file_from_another_build_or_model_is_refused(backend, tmp_path, other):
    prompt = prompt_of(backend, "mountains")
    if other == "build":
        engine = start_engine(backend, tmp_path, key=KEY.replace("llama-cpp-python", "llama-cpp-python 0.0.1"))
    else:  # written under another model's digest, then moved into this model's folder
        engine = start_engine(backend, tmp_path, sha=GEMMA3_SHA256)
    await answer(engine, prompt)
    engine.shutdown()
    [file] = files_of(tmp_path)
    if other == "model":
        mine = prompt_cache.cache_root(tmp_path) / SMOLLM2_SHA256
        mine.mkdir(mode=0o700)
        file = file.rename(mine / file.name)
    engine = start_engine(backend, tmp_path)
    tokens, cached = await answer(engine, prompt + backend.tokenize(" Peaks", add_special=False))
    refused = engine.prompt_disk.files.refused
    engine.shutdown()
    assert refused == 1 and cached == 0 and not file.exists()


async def test_the_bound_holds_while_conversations_churn(backend, tmp_path):
    engine = start_engine(backend, tmp_path)
    await answer(engine, prompt_of(backend, "topic 0"))
    engine.shutdown()
    [file] = files_of(tmp_path)
    bound = int(file.stat().st_size * 2.5)  # room for two files
    engine = start_engine(backend, tmp_path, max_bytes=bound)
    for i in range(1, 8):  # two parked ids: each new conversation evicts (and writes) an older one
        await answer(engine, prompt_of(backend, f"topic {i}"), max_tokens=2)
        engine.prompt_disk.flush(10)
        assert prompt_cache.usage(tmp_path)[1] <= bound
    engine.shutdown()
    files, used = prompt_cache.usage(tmp_path)
    assert used <= bound and files == 2
    assert engine.prompt_disk.files.written >= 5


def test_rm_and_clear_remove_the_files(tmp_path):
    for sha in (SMOLLM2_SHA256, GEMMA3_SHA256):
        folder = prompt_cache.cache_root(tmp_path) / sha
        folder.mkdir(parents=True)
        (folder / "x.kv").write_bytes(b"12345")
    assert prompt_cache.remove_model(tmp_path, SMOLLM2_SHA256) == 5
    assert prompt_cache.usage(tmp_path) == (1, 5)
    assert prompt_cache.clear(tmp_path) == 5
    assert not prompt_cache.cache_root(tmp_path).exists()
