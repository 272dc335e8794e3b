"""The Ollama face as the editor plugins check it (issue 23, item 4), replayed against the real server
and model: what each client calls first, and what it reads from the answers
(`../shared/notes/clients-and-anchors.md` section 4 has each client's calls and sources)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server_harness import MODEL, model_server

pytestmark = pytest.mark.model
SERVED = 1024  # the harness's context_length: what a request gets here


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf, context_length=SERVED) as live:
        yield live


def numeric_version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))  # ValueError: not numeric, as Copilot refuses it


def test_copilot_discovery(server) -> None:
    """GitHub Copilot Chat's Ollama provider: version >= 0.6.4, then tags, then show per model."""
    from localserve import __version__

    status, version = server.json("GET", "/api/version")
    assert status == 200 and numeric_version(version["version"]) >= (0, 6, 4)
    assert version["localserve"] == __version__
    status, _, _ = server.request("HEAD", "/")  # some clients probe HEAD / first
    assert status == 200
    status, tags = server.json("GET", "/api/tags")
    (entry,) = tags["models"]
    status, show = server.json("POST", "/api/show", {"model": entry["model"]})
    assert status == 200
    info = show["model_info"]
    arch = info["general.architecture"]
    assert arch == "llama" and info["general.basename"] == MODEL
    assert info[f"{arch}.context_length"] == SERVED  # Copilot sizes max output as min(4096, ctx / 2)
    assert set(show["capabilities"]) <= {"completion", "tools", "vision", "thinking", "insert"}


def test_roo_and_continue_read_the_served_context(server) -> None:
    status, show = server.json("POST", "/api/show", {"model": MODEL})
    # Roo Code: the first model_info key holding context_length; Continue: num_ctx in parameters.
    first = next(v for k, v in show["model_info"].items() if "context_length" in k)
    assert first == SERVED and f"num_ctx {SERVED}" in show["parameters"]
    # Once loaded, the engine says the same.
    server.json("POST", "/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                          "options": {"num_predict": 2, "temperature": 0}})
    _, ps = server.json("GET", "/api/ps")
    assert ps["models"][0]["context_length"] == SERVED
    _, again = server.json("POST", "/api/show", {"model": MODEL})
    assert again["model_info"]["llama.context_length"] == SERVED


def test_num_ctx_from_three_clients_keeps_one_load_and_says_what_each_got(server) -> None:
    """Continue, Cline and Zed send their own num_ctx; none causes a reload. Less than served is kept
    within what was asked; more gets the served context and a warning on the final line."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "stream": False}
    loads = []
    for num_ctx in (2048, 32768, 4096):
        status, answer = server.json("POST", "/api/chat", {**chat, "options": {"num_ctx": num_ctx, "num_predict": 4,
                                                                                "temperature": 0}})
        assert status == 200, answer
        assert answer["context_length"] == SERVED and str(num_ctx) in answer["warning"]
        loads.append(server.call(_loaded_at(server)))
    assert len(set(loads)) == 1  # one load served all three

    # Asking for less than served: the answer stops within it, and a prompt over it is refused by name.
    status, small = server.json("POST", "/api/chat", {**chat, "options": {"num_ctx": 40, "temperature": 0}})
    assert status == 200 and small["prompt_eval_count"] + small["eval_count"] <= 40 and "warning" not in small
    status, refused = server.json("POST", "/api/chat", {**chat, "options": {"num_ctx": 4}})
    assert status == 400 and refused["error"].startswith("the request's num_ctx is 4 tokens")

    # Streamed: the note is on the final line.
    status, _, data = server.request("POST", "/api/chat", {**chat, "stream": True,
                                                           "options": {"num_ctx": 32768, "num_predict": 3}})
    last = json.loads(data.splitlines()[-1])
    assert last["done"] and last["context_length"] == SERVED and "32768" in last["warning"]


async def _loaded_at(server) -> float:
    (row,) = [r for r in server.manager.status() if r.get("state") == "loaded"]
    return row["loaded_at"]


@pytest.mark.parametrize("keep_alive", [-1, 300, "5m", "1h30m", "-1"])
def test_keep_alive_in_every_form(server, keep_alive) -> None:
    status, answer = server.json("POST", "/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                                           "keep_alive": keep_alive,
                                                           "options": {"num_predict": 1}})
    assert status == 200, answer
    _, ps = server.json("GET", "/api/ps")
    (row,) = ps["models"]
    assert row["expires_at"].endswith("Z")
