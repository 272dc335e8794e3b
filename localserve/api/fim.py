"""Fill-in-the-middle prompts, built from the model's own FIM tokens as llama.cpp's server builds them.

Code completion in an editor sends the text before the cursor (prefix), the text after it (suffix)
and, from llama.vscode, chunks of other files (extra). The model was trained on one layout:

    [BOS] extra... <fim_pre> prefix <fim_suf> suffix <fim_mid> [middle so far]

where extra is `<fim_rep> myproject\\n` and `<fim_sep> NAME\\n TEXT` per chunk, then `<fim_sep>
filename\\n` for the file being edited, when the model has those tokens (llama.cpp's
`format_prompt_infill` uses the same placeholder names: a model trained on them expects some name
there). When the prompt must be cut to fit the context, the prefix keeps its end (the code right
before the cursor), the suffix its start, and the extra chunks whatever room is left, nearest last.

Text that cannot fit is cut before it is tokenized (edge_tokens), so a megabyte prefix costs the
tokenizer about what fits the context; what is left to tokenize is tokenized in a worker thread
when it is long (fim_prompt_async), as the chat path does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import InvalidRequestError
from ..protocol.engine import ModelEngine
from .generation import off_loop_if_long

REQUIRED = ("pre", "suf", "mid")
REPO_NAME = "myproject"
CURRENT_FILE = "filename"
SUFFIX_SHARE = 4  # the suffix gets at most a quarter of the room, as llama.cpp's n_batch / 4
DEFAULT_ANSWER = 128  # room an answer gets when the request does not say (llama.vscode always does)
# Cutting text to a token count before tokenizing it. A token's length in characters has no useful
# fixed bound (code vocabularies hold runs of 64+ spaces or '=' as one token; CJK and byte-fallback
# run under 1 character per token), so the cut takes a first guess, counts what it got, and widens
# the window fourfold until it holds the tokens needed or the whole text: a guess too low costs
# another pass, never a shorter prompt. Most code and prose run 3-4 characters per token.
CHARS_PER_TOKEN_GUESS = 8
# Tokens kept past the count needed at a cut: the tokenizer sees a word cut in two (and a
# SentencePiece vocabulary a new text start) only at the cut itself, so the tokens this far away
# from it are the ones the whole text has.
CUT_MARGIN_TOKENS = 32

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True)
class FimPrompt:
    tokens: list[int]
    truncated: bool  # some prefix, suffix or extra text did not fit the context


def can_fim(engine: ModelEngine) -> bool:
    return all(role in engine.info.fim_tokens for role in REQUIRED)


def require_fim(engine: ModelEngine, model: str, param: str) -> dict[str, int]:
    if not can_fim(engine):
        raise InvalidRequestError(f"model {model!r} has no fill-in-the-middle tokens; use a model trained for code "
                                  "completion (its GGUF names fim_pre, fim_suf and fim_mid tokens)", param=param)
    return engine.info.fim_tokens


def prompt_budget(engine: ModelEngine, answer_tokens: int | None) -> int:
    """Tokens the FIM prompt may take: the context less the answer's room (at most half of it)."""
    n_ctx = engine.n_ctx_per_seq
    return n_ctx - min(answer_tokens or DEFAULT_ANSWER, n_ctx // 2)


def fim_prompt(engine: ModelEngine, model: str, prefix: str, suffix: str, *, budget: int, param: str = "suffix",
               extra: Sequence[tuple[str, str]] = (), middle: str = "") -> FimPrompt:
    """The prompt's tokens within `budget` (the context left after the room to generate). Blocking:
    from the event loop, await fim_prompt_async."""
    fim = require_fim(engine, model, param)

    def tok(text: str) -> list[int]:
        return list(engine.tokenize(text, add_special=False)) if text else []

    bos = list(engine.tokenize("", add_special=True))
    # The middle is kept whole: past the budget it is a refusal, which its start alone can tell.
    mid_tail = edge_tokens(tok, middle, budget, at_end=False)
    room = budget - len(bos) - 3 - len(mid_tail)
    if room < 1:
        raise InvalidRequestError(f"the context leaves no room for a fill-in-the-middle prompt ({budget} tokens)",
                                  param=param)
    # Neither side can take more than `room`; a side cut here still holds more than that, so the
    # shares below come out as they would from the whole text.
    pre, suf = edge_tokens(tok, prefix, room, at_end=True), edge_tokens(tok, suffix, room, at_end=False)
    take_suf = min(len(suf), room // SUFFIX_SHARE)
    take_pre = min(len(pre), room - take_suf)
    take_suf = min(len(suf), room - take_pre)  # a short prefix leaves the suffix more
    kept, extra_cut = _extra_tail(fim, extra, tok, room - take_pre - take_suf)
    tokens = (bos + kept + [fim["pre"]] + pre[len(pre) - take_pre:] + [fim["suf"]] + suf[:take_suf]
              + [fim["mid"]] + mid_tail)
    return FimPrompt(tokens, take_pre < len(pre) or take_suf < len(suf) or extra_cut)


async def fim_prompt_async(engine: ModelEngine, model: str, prefix: str, suffix: str, *, budget: int,
                           param: str = "suffix", extra: Sequence[tuple[str, str]] = (),
                           middle: str = "") -> FimPrompt:
    """fim_prompt, in a worker thread when the texts are long, so the event loop keeps serving."""
    chars = len(prefix) + len(suffix) + len(middle) + sum(len(name) + len(text) for name, text in extra)
    return await off_loop_if_long(chars, fim_prompt, engine, model, prefix, suffix, budget=budget, param=param,
                                  extra=extra, middle=middle)


def edge_tokens(tok: Tokenize, text: str, need: int, *, at_end: bool) -> list[int]:
    """The tokens of `text`, or, when it is longer than `need` tokens can be, of a piece cut from
    its end (`at_end`) or start that holds more than `need`: their last (first) `need` tokens are
    those of the whole text. What is tokenized is the first guess's window or, where that held too
    few tokens, under six times the characters the tokens kept span (the windows grow fourfold)."""
    window = (need + CUT_MARGIN_TOKENS) * CHARS_PER_TOKEN_GUESS
    while len(text) > window:
        tokens = tok(text[len(text) - window:] if at_end else text[:window])
        if len(tokens) >= need + CUT_MARGIN_TOKENS:
            return tokens
        window *= 4
    return tok(text)


def _extra_tail(fim: dict[str, int], extra: Sequence[tuple[str, str]], tok: Tokenize,
                room: int) -> tuple[list[int], bool]:
    """The last `room` tokens of the extra context (the repo line, each chunk's separator, name and
    text, then the current file's separator), built from the end: chunks that cannot fit are never
    tokenized. Also whether any of it was left out."""
    parts = _extra_parts(fim, extra)
    kept: list[int] = []
    while parts and len(kept) < room:
        part = parts.pop()
        kept[:0] = [part] if isinstance(part, int) else edge_tokens(tok, part, room - len(kept), at_end=True)
    left_out = len(kept) > room or any(isinstance(part, int) or part for part in parts)
    return kept[len(kept) - room:] if len(kept) > room else kept, left_out


def _extra_parts(fim: dict[str, int], extra: Sequence[tuple[str, str]]) -> list[int | str]:
    """The extra context in order, as FIM token ids and texts to tokenize (each on its own, as
    llama.cpp's format_prompt_infill does)."""
    if not extra:
        return []
    parts: list[int | str] = []
    if "rep" in fim:
        parts += [fim["rep"], f"{REPO_NAME}\n"]
    for filename, text in extra:
        if "sep" in fim:
            parts += [fim["sep"], f"{filename}\n"]
        parts.append(text)
    if "sep" in fim:
        parts += [fim["sep"], f"{CURRENT_FILE}\n"]
    return parts
