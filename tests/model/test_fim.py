"""Fill-in-the-middle on every route the editor plugins call (issue 23, item 1), on the real model.

No small GGUF with FIM tokens ships in a package these machines can reach, and SmolLM2 names none
(llama.cpp finds only its <reponame>). So the test model is SmolLM2 copied with llama.cpp's FIM
metadata keys pointing at special tokens it has (its StarCoder-style <file_sep> and <reponame> are
the real repo-level ones): the prompt assembly, the routes, the cache and the refusals are what is
tested; the completions themselves are whatever SmolLM2 makes of that layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fim_model import FIM_IDS, with_fim_tokens
from server_harness import MODEL, model_server

pytestmark = pytest.mark.model
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def fim_gguf(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_fim_tokens(smollm2_gguf, tmp_path_factory.mktemp("fim") / "smollm2-fim.gguf")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, fim_gguf: Path, smollm2_gguf: Path):
    from localserve.store.cache import ModelStore

    with model_server(tmp_path_factory.mktemp("home"), fim_gguf) as live:
        ModelStore(live.settings).register_local(smollm2_gguf, "plain", "latest")
        yield live


def engine_of(server, ref: str = f"{MODEL}:Q4_1"):
    async def get():
        async with server.manager.use(ref) as loaded:
            return loaded.engine

    return server.call(get())


def test_the_prompt_is_the_models_own_layout(server) -> None:
    from localserve.api.fim import fim_prompt

    engine = engine_of(server)
    assert {k: engine.info.fim_tokens[k] for k in FIM_IDS} == FIM_IDS
    tok = lambda text: list(engine.tokenize(text, add_special=False))  # noqa: E731
    bos = list(engine.tokenize("", add_special=True))
    plain = fim_prompt(engine, MODEL, PREFIX, SUFFIX, budget=512)
    assert plain.tokens == bos + [11] + tok(PREFIX) + [12] + tok(SUFFIX) + [13] and not plain.truncated
    extra = fim_prompt(engine, MODEL, PREFIX, SUFFIX, budget=512, extra=[("util.py", "X = 1\n")], middle="return")
    assert extra.tokens == (bos + [4] + tok("myproject\n") + [5] + tok("util.py\n") + tok("X = 1\n") + [5]
                            + tok("filename\n") + [11] + tok(PREFIX) + [12] + tok(SUFFIX) + [13] + tok("return"))
    # Cut to fit: the prefix keeps its end (next to the cursor), the suffix its start.
    long_prefix = "x = 1\n" * 200
    cut = fim_prompt(engine, MODEL, long_prefix, SUFFIX, budget=64)
    assert cut.truncated and len(cut.tokens) <= 64
    assert cut.tokens[cut.tokens.index(11) + 1:cut.tokens.index(12)] == tok(long_prefix)[-len(
        cut.tokens[cut.tokens.index(11) + 1:cut.tokens.index(12)]):]


def test_openai_completions_with_suffix_and_continues_routes(server) -> None:
    body = {"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0}
    answers = []
    for route in ("/v1/completions", "/v1/fim/completions", "/fim/completions"):
        status, answer = server.json("POST", route, body)
        assert status == 200, answer
        answers.append(answer["choices"][0]["text"])
        assert answer["usage"]["prompt_tokens"] > len(PREFIX) // 8
    assert len(set(answers)) == 1  # one request path, greedy: one answer
    # The FIM prompt is what the engine got: the same tokens through /infill give the same text.
    status, infill = server.json("POST", "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                                     "n_predict": 8, "temperature": 0})
    assert status == 200 and infill["content"] == answers[0]


def test_ollama_generate_with_suffix_and_show_says_insert(server) -> None:
    status, show = server.json("POST", "/api/show", {"model": MODEL})
    assert "insert" in show["capabilities"] and ".Suffix" in show["template"]
    status, plain = server.json("POST", "/api/show", {"model": "plain"})
    assert "insert" not in plain["capabilities"] and ".Suffix" not in plain["template"]
    status, answer = server.json("POST", "/api/generate", {"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX,
                                                           "stream": False, "raw": True,
                                                           "options": {"num_predict": 8, "temperature": 0}})
    assert status == 200, answer
    _, openai = server.json("POST", "/v1/completions", {"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX,
                                                        "max_tokens": 8, "temperature": 0})
    assert answer["response"] == openai["choices"][0]["text"]


def test_infill_as_llama_vscode_calls_it(server) -> None:
    """Warm-up after an edit (n_predict 0), then keystrokes on a growing prefix: the cache serves
    the shared start, and the answer carries what the plugin reads."""
    extra = [{"filename": "util.py", "text": "def helper():\n    return 42\n" * 4}]
    source = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(20)) + PREFIX
    warm = {"input_prefix": source, "input_suffix": SUFFIX, "input_extra": extra, "n_predict": 0}
    status, first = server.json("POST", "/infill", warm)
    assert status == 200 and first["content"] == "" and first["tokens_predicted"] == 0
    for typed in ("r", "re", "ret"):
        status, answer = server.json("POST", "/infill", {**warm, "input_prefix": source + typed, "n_predict": 4,
                                                         "temperature": 0, "cache_prompt": True})
        assert status == 200, answer
        assert answer["stop"] is True and answer["truncated"] is False and "timings" in answer
        # Everything before the cursor comes from the cache; what follows it (the keystroke, the
        # suffix and <fim_mid>, ~20 tokens here) is computed again.
        assert answer["tokens_cached"] >= 0.9 * answer["tokens_evaluated"], answer
    status, _, data = server.request("POST", "/infill", {**warm, "n_predict": 4, "stream": True, "temperature": 0})
    frames = [json.loads(line[6:]) for line in data.splitlines() if line.startswith(b"data: ")]
    assert frames[-1]["stop"] is True and all(f["stop"] is False for f in frames[:-1])


def test_a_model_without_fim_tokens_is_refused_by_name(server) -> None:
    body = {"model": "plain", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4}
    status, answer = server.json("POST", "/v1/completions", body)
    assert status == 400 and "'plain" in answer["error"]["message"] and "fill-in-the-middle" in answer["error"]["message"]
    assert answer["error"]["param"] == "suffix"
    status, answer = server.json("POST", "/api/generate", {"model": "plain", "prompt": PREFIX, "suffix": SUFFIX,
                                                           "stream": False})
    assert status == 400 and "fill-in-the-middle" in answer["error"]
    status, answer = server.json("POST", "/infill", {"model": "plain", "input_prefix": PREFIX})
    assert status == 400 and answer["error"]["param"] == "input_suffix"
    status, answer = server.json("POST", "/v1/completions", {**body, "model": MODEL, "prompt": [1, 2, 3]})
    assert status == 400 and answer["error"]["param"] == "prompt"


def test_a_newer_request_for_the_same_id_slot_ends_the_last(server) -> None:
    """llama.vim's request shape (lines above the cursor as input_prefix, the cursor's line so far as
    `prompt`, id_slot 0): the next keystroke's request ends the previous one, streamed or not, and
    reuses its cells; another client's id_slot 0 is its own."""
    import asyncio

    import aiohttp

    source = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(20))
    body = {"input_prefix": source, "input_suffix": SUFFIX, "prompt": "    ret", "id_slot": 0, "temperature": 0,
            "n_predict": 400, "stop": []}

    async def run() -> None:
        vim = {"User-Agent": "curl/8.5.0"}
        async with aiohttp.ClientSession(server.url) as http:
            async with http.post("/infill", json={**body, "stream": True, "ignore_eos": True}, headers=vim) as first:
                frames = first.content.__aiter__()
                assert json.loads((await anext(frames))[6:])["stop"] is False  # it is generating
                # Another client's slot 0 does not touch it.
                async with http.post("/infill", json={**body, "n_predict": 2}, headers={"User-Agent": "vscode"}) as other:
                    assert other.status == 200 and (await other.json())["stop"] is True
                async with http.post("/infill", json={**body, "prompt": "    retu", "n_predict": 4}, headers=vim) as next_:
                    answer = await next_.json()
                rest = [json.loads(line[6:]) async for line in frames if line.startswith(b"data: ")]
            assert next_.status == 200 and 0 < answer["tokens_predicted"] <= 4
            # The first request's prompt and answer so far were parked: all but the keystroke came from cache.
            assert answer["tokens_cached"] >= answer["tokens_evaluated"] - 4, answer
            assert rest[-1]["error"]["type"] == "invalid_request_error", rest[-1]
            assert "superseded" in rest[-1]["error"]["message"] and len(rest) < 100

            # Not streamed: the superseded request answers 409 in the same error format.
            slow = asyncio.ensure_future(http.post("/infill", json={**body, "ignore_eos": True}, headers=vim))
            await asyncio.sleep(0.3)
            async with http.post("/infill", json={**body, "n_predict": 1}, headers=vim) as last:
                assert last.status == 200
            async with await slow as superseded:
                error = await superseded.json()
            assert superseded.status == 409 and "id_slot 0" in error["error"]["message"], error

    asyncio.run(run())
