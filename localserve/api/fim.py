"""Fill-in-the-middle prompts, built from the model's own FIM tokens as llama.cpp's server builds them.

Code completion in an editor sends the text before the cursor (prefix), the text after it (suffix)
and, from llama.vscode, chunks of other files (extra). The model was trained on one layout:

    [BOS] extra... <fim_pre> prefix <fim_suf> suffix <fim_mid> [middle so far]

where extra is `<fim_rep> myproject\\n` and `<fim_sep> NAME\\n TEXT` per chunk, then `<fim_sep>
filename\\n` for the file being edited, when the model has those tokens (llama.cpp's
`format_prompt_infill` uses the same placeholder names: a model trained on them expects some name
there). When the prompt must be cut to fit the context, the prefix keeps its end (the code right
before the cursor), the suffix its start, and the extra chunks whatever room is left, nearest last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import InvalidRequestError
from ..protocol.engine import ModelEngine

REQUIRED = ("pre", "suf", "mid")
REPO_NAME = "myproject"
CURRENT_FILE = "filename"
SUFFIX_SHARE = 4  # the suffix gets at most a quarter of the room, as llama.cpp's n_batch / 4
DEFAULT_ANSWER = 128  # room an answer gets when the request does not say (llama.vscode always does)


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
    """The prompt's tokens within `budget` (the context left after the room to generate)."""
    fim = require_fim(engine, model, param)

    def tok(text: str) -> list[int]:
        return list(engine.tokenize(text, add_special=False)) if text else []

    bos = list(engine.tokenize("", add_special=True))
    pre, suf, mid_tail = tok(prefix), tok(suffix), tok(middle)
    room = budget - len(bos) - 3 - len(mid_tail)
    if room < 1:
        raise InvalidRequestError(f"the context leaves no room for a fill-in-the-middle prompt ({budget} tokens)",
                                  param=param)
    take_suf = min(len(suf), room // SUFFIX_SHARE)
    take_pre = min(len(pre), room - take_suf)
    take_suf = min(len(suf), room - take_pre)  # a short prefix leaves the suffix more
    context = _extra_tokens(fim, extra, tok)
    extra_room = room - take_pre - take_suf
    kept = context[len(context) - extra_room:] if len(context) > extra_room else context
    tokens = (bos + kept + [fim["pre"]] + pre[len(pre) - take_pre:] + [fim["suf"]] + suf[:take_suf]
              + [fim["mid"]] + mid_tail)
    return FimPrompt(tokens, take_pre < len(pre) or take_suf < len(suf) or len(kept) < len(context))


def _extra_tokens(fim: dict[str, int], extra: Sequence[tuple[str, str]], tok) -> list[int]:
    if not extra:
        return []
    out: list[int] = []
    if "rep" in fim:
        out += [fim["rep"]] + tok(f"{REPO_NAME}\n")
    for filename, text in extra:
        if "sep" in fim:
            out += [fim["sep"]] + tok(f"{filename}\n")
        out += tok(text)
    if "sep" in fim:
        out += [fim["sep"]] + tok(f"{CURRENT_FILE}\n")
    return out
