"""Security review 4, findings 5 and 9, on the real server and model.

#5: megabytes of text to the fill-in-the-middle routes (and /completion) were tokenized on the
event loop, stalling every client for seconds. Now the FIM prompt cuts each text to what can fit
before tokenizing it (the prefix from its end, the suffix from its start, the extra chunks nearest
last) and tokenizes in a worker thread when the texts are long. Proved structurally, not by timing:
the cut prompt is token for token what tokenizing everything and then cutting gives, only a bounded
window of each text reaches the tokenizer, every tokenizer call of a big request runs off the
server's loop thread, and /health answers while that tokenizer call is held mid-request (a
tokenizer on the loop would hold /health off until the test gave up).

#9: a 5,000-digit integer inside tool-call arguments (a string, so the body's integer bound does
not see it) was a 500 on every chat-shaped dialect; the arguments are now kept as they came.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import pytest

from localserve.api.fim import CHARS_PER_TOKEN_GUESS, CUT_MARGIN_TOKENS, SUFFIX_SHARE, fim_prompt, prompt_budget
from localserve.api.llamacpp import MAX_EXTRA_CHARS
from localserve.errors import InvalidRequestError
from server_harness import MODEL
from test_fim import SUFFIX, engine_of, fim_gguf, server  # noqa: F401 - the FIM model's fixtures

pytestmark = pytest.mark.model
MIB = 1 << 20
BIG_INT_ARGS = '{"n": ' + "9" * 5000 + "}"


def code(chars: int, tag: str = "") -> str:
    """Python source of about `chars` characters, every line its own (no two windows alike)."""
    line = "def f{0}{1}(x):\n    return x + {0}  # {1}\n\n"
    out, size, i = [], 0, 0
    while size < chars:
        out.append(line.format(i, tag))
        size += len(out[-1])
        i += 1
    return "".join(out)[:chars]


def reference_prompt(engine: Any, prefix: str, suffix: str, budget: int,
                     extra: Sequence[tuple[str, str]] = (), middle: str = "") -> list[int]:
    """The FIM prompt as it was built before the fix: every text tokenized whole, then cut. The
    cut-first prompt must equal it token for token."""
    fim = engine.info.fim_tokens

    def tok(text: str) -> list[int]:
        return list(engine.tokenize(text, add_special=False)) if text else []

    bos = list(engine.tokenize("", add_special=True))
    pre, suf, mid = tok(prefix), tok(suffix), tok(middle)
    room = budget - len(bos) - 3 - len(mid)
    take_suf = min(len(suf), room // SUFFIX_SHARE)
    take_pre = min(len(pre), room - take_suf)
    take_suf = min(len(suf), room - take_pre)
    context = [fim["rep"]] + tok("myproject\n") if extra else []
    for name, text in extra:
        context += [fim["sep"]] + tok(f"{name}\n") + tok(text)
    context += [fim["sep"]] + tok("filename\n") if extra else []
    extra_room = room - take_pre - take_suf
    kept = context[len(context) - extra_room:] if len(context) > extra_room else context
    return bos + kept + [fim["pre"]] + pre[len(pre) - take_pre:] + [fim["suf"]] + suf[:take_suf] + [fim["mid"]] + mid


class TokenizerWatch:
    """The loaded engine's tokenize, wrapped: each call's thread and text are recorded. With `hold`,
    the first call waits until the test has had /health answered (release()), so a tokenizer running
    on the server's event loop would keep /health from answering."""

    def __init__(self, engine: Any, hold: bool = False) -> None:
        self.engine = engine
        self.original = engine.tokenize
        self.hold = hold
        self.calls: list[tuple[threading.Thread, str]] = []
        self.started = threading.Event()
        self._release = threading.Event()

    def _tokenize(self, text: str, add_special: bool = True) -> list[int]:
        self.calls.append((threading.current_thread(), text))
        if self.hold and not self.started.is_set():
            self.started.set()
            self._release.wait(20)
        return self.original(text, add_special=add_special)

    def release(self) -> None:
        self._release.set()

    @property
    def chars(self) -> int:
        return sum(len(text) for _, text in self.calls)

    def __enter__(self) -> "TokenizerWatch":
        self.engine.tokenize = self._tokenize
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        del self.engine.tokenize  # the instance attribute; the class's method again


def window(need: int) -> int:
    """The characters a first cut for `need` tokens takes (fim.edge_tokens' first guess)."""
    return (need + CUT_MARGIN_TOKENS) * CHARS_PER_TOKEN_GUESS


# --- the cut, on the real tokenizer ----------------------------------------------------------------
def test_a_7mb_prefix_gives_the_tokens_of_its_end_alone(server) -> None:  # noqa: F811
    engine = engine_of(server)
    budget = prompt_budget(engine, 16)
    big = code(7_000_000)
    with TokenizerWatch(engine) as watch:
        cut = fim_prompt(engine, MODEL, big, SUFFIX, budget=budget)
    assert cut.truncated
    assert cut.tokens == reference_prompt(engine, big, SUFFIX, budget)
    # Only the prefix's last window reached the tokenizer: the same prompt as from that end alone.
    longest = max((text for _, text in watch.calls), key=len)
    assert big.endswith(longest) and len(longest) <= window(budget)
    assert watch.chars <= window(budget) + len(SUFFIX) + 64
    assert fim_prompt(engine, MODEL, longest, SUFFIX, budget=budget).tokens == cut.tokens


def test_a_mebibyte_each_side_gives_the_same_prompt(server) -> None:  # noqa: F811
    """1 MiB prefix and suffix: the suffix keeps its start; neither leaves room for extra chunks,
    which are then never tokenized."""
    engine = engine_of(server)
    budget = prompt_budget(engine, 16)
    prefix, suffix = code(MIB, "pre"), code(MIB, "suf")
    extra = [(f"src/mod{i}.py", code(28_000, f"x{i}")) for i in range(8)]
    with TokenizerWatch(engine) as watch:
        cut = fim_prompt(engine, MODEL, prefix, suffix, budget=budget, extra=extra)
    assert cut.truncated and len(cut.tokens) <= budget
    assert cut.tokens == reference_prompt(engine, prefix, suffix, budget, extra)
    tokenized = [text for _, text in watch.calls]
    assert any(suffix.startswith(text) and len(text) > 1000 for text in tokenized)
    assert not any(f"# x{i}\n" in text for text in tokenized for i in range(8))
    assert watch.chars <= 3 * window(budget)
    # A short prefix leaves the suffix the room: still the same prompt.
    short = fim_prompt(engine, MODEL, "x = ", suffix, budget=budget)
    assert short.tokens == reference_prompt(engine, "x = ", suffix, budget)


def test_extra_chunks_nearest_the_end_fill_the_room_and_the_rest_are_never_tokenized(server) -> None:  # noqa: F811
    engine = engine_of(server)
    budget = prompt_budget(engine, 16)
    prefix, suffix = code(1200, "p"), code(300, "s")
    extra = [(f"src/mod{i}.py", code(28_000 if i % 2 else 300, f"x{i}")) for i in range(64)]
    for chunks in (extra, extra[:-1]):  # the last chunk cut, or whole and then the one before it cut
        with TokenizerWatch(engine) as watch:
            cut = fim_prompt(engine, MODEL, prefix, suffix, budget=budget, extra=chunks)
        assert cut.truncated and len(cut.tokens) == budget
        assert cut.tokens == reference_prompt(engine, prefix, suffix, budget, chunks)
        tokenized = [text for _, text in watch.calls]
        assert not any(f"# x{i}\n" in text for text in tokenized for i in range(60))
        assert watch.chars <= 2 * window(budget)


def test_text_of_long_tokens_widens_the_cut_until_it_holds_enough(server) -> None:  # noqa: F811
    """Runs of spaces are a few long tokens each: the first window holds too few, and the cut widens
    rather than give the prompt fewer tokens than the whole text would."""
    engine = engine_of(server)
    budget = 256
    prefix = "".join(f"{i}" + " " * 200 + "\n" for i in range(12_000))  # ~2.5 MB, ~25 characters a token
    assert len(engine.tokenize(prefix[-window(budget):], add_special=False)) < budget + CUT_MARGIN_TOKENS
    with TokenizerWatch(engine) as watch:
        cut = fim_prompt(engine, MODEL, prefix, SUFFIX, budget=budget)
    assert cut.tokens == reference_prompt(engine, prefix, SUFFIX, budget)
    assert len([text for _, text in watch.calls if len(text) > 1000]) >= 2  # it widened
    assert watch.chars < len(prefix) // 10


def test_a_middle_past_the_budget_is_refused_from_its_start(server) -> None:  # noqa: F811
    engine = engine_of(server)
    budget = prompt_budget(engine, 16)
    with TokenizerWatch(engine) as watch, pytest.raises(InvalidRequestError) as refused:
        fim_prompt(engine, MODEL, "a", "b", budget=budget, middle=code(MIB), param="input_suffix")
    assert refused.value.param == "input_suffix" and watch.chars <= window(budget) + 8


def test_inputs_that_fit_are_not_cut(server) -> None:  # noqa: F811
    engine = engine_of(server)
    budget = prompt_budget(engine, 16)
    prefix, suffix = code(800, "p"), code(300, "s")
    extra = [("a.py", code(200, "a")), ("b.py", code(150, "b"))]
    with TokenizerWatch(engine) as watch:
        fitted = fim_prompt(engine, MODEL, prefix, suffix, budget=budget, extra=extra, middle="    ret")
    assert fitted.tokens == reference_prompt(engine, prefix, suffix, budget, extra, "    ret")
    assert not fitted.truncated
    assert {prefix, suffix, extra[0][1], extra[1][1]} <= {text for _, text in watch.calls}  # tokenized whole


# --- the routes, on the live server ----------------------------------------------------------------
def held_request(server, path: str, body: dict) -> tuple[int, Any, TokenizerWatch]:  # noqa: F811
    """POST `body` while its first tokenizer call is held, ask /health meanwhile, then let it go on.
    /health must answer during the hold, and every tokenizer call must run off the loop's thread."""
    engine = engine_of(server)
    answer: dict[str, Any] = {}
    with TokenizerWatch(engine, hold=True) as watch:
        worker = threading.Thread(target=lambda: answer.update(r=server.json("POST", path, body, timeout=300)))
        worker.start()
        try:
            assert watch.started.wait(120), f"{path} never tokenized"
            health_status, health = server.json("GET", "/health", timeout=15)  # while the tokenizer is held
        finally:
            watch.release()
            worker.join(300)
    assert health_status == 200 and health["status"] == "ok"
    assert watch.calls and all(thread is not server.thread for thread, _ in watch.calls), \
        [(thread.name, len(text)) for thread, text in watch.calls]
    status, data = answer["r"]
    return status, data, watch


FIM_ROUTES = [
    pytest.param("/infill", {"input_prefix": code(MIB, "p"), "input_suffix": code(MIB, "s"), "n_predict": 2},
                 id="infill 1 MiB prefix + 1 MiB suffix"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": code(6_000_000), "suffix": code(MIB, "s"),
                                     "max_tokens": 2}, id="completions 6 MB prompt + 1 MiB suffix"),
    pytest.param("/v1/fim/completions", {"model": MODEL, "prompt": code(6_000_000), "suffix": code(MIB, "s"),
                                         "max_tokens": 2}, id="fim/completions 6 MB prompt + 1 MiB suffix"),
    pytest.param("/api/generate", {"model": MODEL, "prompt": code(MIB, "p"), "suffix": code(MIB, "s"),
                                   "stream": False, "options": {"num_predict": 2}},
                 id="api/generate 1 MiB prompt + 1 MiB suffix"),
]


@pytest.mark.parametrize("path,body", FIM_ROUTES)
def test_big_fim_requests_answer_and_tokenize_off_the_loop(server, path: str, body: dict) -> None:  # noqa: F811
    status, answer, watch = held_request(server, path, body)
    assert status == 200, answer
    budget = prompt_budget(engine_of(server), 2)
    assert watch.chars <= 4 * window(budget)  # megabytes sent, a few windows tokenized
    used = answer.get("tokens_evaluated") or answer.get("prompt_eval_count") or answer["usage"]["prompt_tokens"]
    assert budget - 16 <= used <= budget  # the context filled, as before the fix


def test_input_extra_is_bounded_before_any_work(server) -> None:  # noqa: F811
    """The review's 256 chunks of 28 KB: 400 naming input_extra, nothing tokenized. Just under the
    bound: 200, with only the chunks nearest the cursor tokenized, off the loop."""
    chunk = code(28_000)
    over = {"input_prefix": "def f(", "input_suffix": SUFFIX, "n_predict": 2,
            "input_extra": [{"filename": f"m{i}.py", "text": chunk} for i in range(256)]}
    with TokenizerWatch(engine_of(server)) as watch:
        status, answer = server.json("POST", "/infill", over)
    assert status == 400 and answer["error"]["param"] == "input_extra", answer
    assert str(MAX_EXTRA_CHARS) in answer["error"]["message"] and not watch.calls

    fits = MAX_EXTRA_CHARS // 28_100
    under = {**over, "input_extra": [{"filename": f"m{i}.py", "text": code(28_000, f"c{i}")} for i in range(fits)]}
    status, answer, watch = held_request(server, "/infill", under)
    assert status == 200 and answer["truncated"] is True, answer
    assert not any(f"# c{i}\n" in text for _, text in watch.calls for i in range(fits - 4))


def test_a_7mb_completion_prompt_is_tokenized_off_the_loop(server) -> None:  # noqa: F811
    """/completion takes a raw prompt (a client-side FIM template): nothing to cut by role, so it is
    tokenized whole, in a thread, and refused for the context as before."""
    status, answer, watch = held_request(server, "/completion", {"prompt": code(7_000_000), "n_predict": 2})
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    assert "context" in answer["error"]["message"]
    assert max(len(text) for _, text in watch.calls) == 7_000_000


# --- finding 9: tool-call arguments Python cannot hold ---------------------------------------------
BIGINT_REQUESTS = [
    pytest.param("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": BIG_INT_ARGS}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, id="chat"),
    pytest.param("/v1/responses", {"model": MODEL, "max_output_tokens": 2, "store": False, "input": [
        {"role": "user", "content": "add"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": BIG_INT_ARGS},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}, id="responses"),
    pytest.param("/api/chat", {"model": MODEL, "stream": False, "options": {"num_predict": 2}, "messages": [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": BIG_INT_ARGS}}]},
        {"role": "tool", "content": "ok"}]}, id="ollama chat"),
]


@pytest.mark.parametrize("path,body", BIGINT_REQUESTS)
def test_a_5000_digit_integer_in_tool_call_arguments_is_not_a_500(server, path: str, body: dict) -> None:  # noqa: F811
    status, answer = server.json("POST", path, body)
    assert status == 200, answer
