"""The token routes end to end on the real SmolLM2 through the real HTTP server: llama-server's
/tokenize (ids, pieces), /detokenize and /apply-template, vLLM's /tokenize for a chat and a prompt,
each checked against our own tokenizer and the chat path, and their 400s."""

from __future__ import annotations

import pytest

from server_harness import MODEL, model_server

pytestmark = pytest.mark.model
TEXT = "Héllo wörld, 東京 🙂 <|im_start|>user\nfine"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_gguf):
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf, max_body_bytes=64 * 1024) as server:
        yield server


def engine_tokens(live, text: str, add_special: bool) -> list[int]:
    """The loaded engine's own tokenize, as every generating route calls it."""
    async def run() -> list[int]:
        async with live.manager.use(MODEL) as loaded:
            return loaded.engine.tokenize(text, add_special=add_special)

    return live.call(run())


def post(live, path: str, body: dict) -> dict:
    status, answer = live.json("POST", path, body)
    assert status == 200, answer
    return answer


def test_tokenize_is_our_tokenize_and_detokenize_gives_the_text_back(live):
    tokens = post(live, "/tokenize", {"content": TEXT})["tokens"]
    assert tokens == engine_tokens(live, TEXT, add_special=False)  # llama-server's default: no BOS
    assert 49152 > max(tokens) and tokens.count(1) == 1  # <|im_start|> read as its token, not as text
    assert post(live, "/tokenize", {"content": TEXT, "add_special": True})["tokens"] == engine_tokens(live, TEXT, True)
    back = post(live, "/detokenize", {"tokens": tokens})
    assert back == {"content": TEXT, "prompt": TEXT}  # llama-server's key and vLLM's
    assert post(live, "/detokenize", {"tokens": []})["content"] == ""


def test_pieces_concatenate_to_the_text(live):
    pieces = post(live, "/tokenize", {"content": TEXT, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == post(live, "/tokenize", {"content": TEXT})["tokens"]
    data = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert data.decode("utf-8") == TEXT
    # The emoji's 4 bytes are split between byte-level tokens: those pieces are bytes, as llama-server's.
    split = [p["piece"] for p in pieces if isinstance(p["piece"], list)]
    assert split and all(all(0 <= b < 256 for b in piece) for piece in split)
    assert {"id": 1, "piece": "<|im_start|>"} in pieces


def test_apply_template_is_what_a_chat_request_renders(live):
    prompt = post(live, "/apply-template", {"messages": MESSAGES})["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>") and prompt.endswith("<|im_start|>assistant\n")
    greedy = {"temperature": 0, "max_tokens": 6}
    chat = post(live, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **greedy})
    # The chat request's prompt is exactly these tokens: its usage counts them, and the same text
    # sent raw to /completion answers the same greedy tokens.
    tokens = post(live, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
    assert chat["usage"]["prompt_tokens"] == len(tokens)
    raw = post(live, "/completion", {"prompt": prompt, "n_predict": 6, "temperature": 0})
    assert raw["content"] == chat["choices"][0]["message"]["content"]
    without = post(live, "/apply-template", {"messages": MESSAGES, "add_generation_prompt": False})["prompt"]
    assert prompt == without + "<|im_start|>assistant\n"
    # chat_template_kwargs are template variables (Qwen3's enable_thinking): one this template does
    # not read changes nothing.
    assert post(live, "/apply-template", {"messages": MESSAGES, "chat_template_kwargs": {"x": 1}})["prompt"] == prompt


def test_vllm_tokenize_shapes(live):
    chat = post(live, "/tokenize", {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": True})
    prompt = post(live, "/apply-template", {"messages": MESSAGES})["prompt"]
    assert chat["tokens"] == engine_tokens(live, prompt, add_special=True)
    assert chat["count"] == len(chat["tokens"]) and chat["token_strs"] is None
    assert chat["max_model_len"] == live.json("GET", "/props")[1]["default_generation_settings"]["n_ctx"]
    plain = post(live, "/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    assert plain["tokens"] == engine_tokens(live, "Hello world", add_special=True)
    assert "".join(plain["token_strs"]) == "Hello world" and plain["count"] == len(plain["tokens"])
    # Anthropic's count_tokens counts the same chat the same way (they share api/tokenizing.py's path).
    counted = post(live, "/v1/messages/count_tokens", {"model": MODEL, "system": "Be brief.",
                                                      "messages": MESSAGES[1:]})
    assert counted["input_tokens"] == chat["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, 49152]}, "tokens"),  # outside the vocabulary
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "x", "parse_special": False}, "parse_special"),
    ("/tokenize", {"prompt": ["x"]}, "prompt"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/apply-template", {}, "messages"),
    ("/apply-template", {"messages": MESSAGES, "chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs"),
    ("/apply-template", {"messages": MESSAGES, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ("/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
])
def test_bad_input_is_a_400_naming_the_field(live, path, body, param):
    status, answer = live.json("POST", path, body)
    assert status == 400, answer
    # llama-server's error shape: {"error": {"code": 400, "message", "type"}} (and our param).
    error = answer["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and param in error["message"] + str(
        error["param"])


def test_bodies_are_bounded(live):
    status, answer = live.json("POST", "/tokenize", {"content": "x" * (64 * 1024)})
    assert status == 413 and "max_body_bytes" in answer["error"]["message"]
    status, answer = live.json("POST", "/detokenize", {"tokens": [1] * 40_000})
    assert status == 413 and answer["error"]["code"] == 413
