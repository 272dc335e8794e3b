"""A GGUF that makes llama.cpp's model loader abort the process (for the native-crash tests).

`aborting_gguf(src, dst)` copies a real GGUF and overwrites one vocabulary entry, in place and at
the same byte length, with the text of another token, so every offset in the file stays valid and
the header still parses (our own `read_gguf_facts` checks pass). llama.cpp's vocab loader
(src/llama-vocab.cpp, `llama_vocab::impl::load`, line 2544 in llama-cpp-python 0.3.36's copy)
fills `token_to_id[word] = i` and `id_to_token[i]` for every token, then checks

    GGML_ASSERT(id_to_token.size() == token_to_id.size());

With two equal strings the map holds one entry fewer than the vector, so the assert fails:
ggml_abort prints "<path>/llama-vocab.cpp:<line>: GGML_ASSERT(id_to_token.size() ==
token_to_id.size()) failed" to stderr and calls abort() (SIGABRT) during `llama_model_load`,
before any Python exception can be raised.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from typing import BinaryIO

_TOKENS_KEY = b"tokenizer.ggml.tokens"
_STRING, _ARRAY = 8, 9
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _u(f: BinaryIO, fmt: str) -> int:
    return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]


def _skip(f: BinaryIO, vtype: int) -> None:
    if vtype == _STRING:
        f.seek(_u(f, "Q"), 1)
    elif vtype == _ARRAY:
        item, n = _u(f, "I"), _u(f, "Q")
        if item in _SCALAR_SIZES:
            f.seek(n * _SCALAR_SIZES[item], 1)
        else:
            for _ in range(n):
                _skip(f, item)
    else:
        f.seek(_SCALAR_SIZES[vtype], 1)


def _token_strings(f: BinaryIO) -> list[tuple[int, bytes]]:
    """(file offset, bytes) of every entry of tokenizer.ggml.tokens (little-endian GGUF v2/v3)."""
    if f.read(4) != b"GGUF" or _u(f, "I") not in (2, 3):
        raise ValueError("not a little-endian GGUF v2/v3 file")
    _u(f, "Q")  # tensor count
    for _ in range(_u(f, "Q")):
        key = f.read(_u(f, "Q"))
        vtype = _u(f, "I")
        if key != _TOKENS_KEY:
            _skip(f, vtype)
            continue
        if vtype != _ARRAY or _u(f, "I") != _STRING:
            raise ValueError("tokenizer.ggml.tokens is not a string array")
        tokens = []
        for _ in range(_u(f, "Q")):
            n = _u(f, "Q")
            tokens.append((f.tell(), f.read(n)))
        return tokens
    raise ValueError("no tokenizer.ggml.tokens in the file")


def aborting_gguf(src: Path, dst: Path) -> Path:
    """Write to `dst` a copy of `src` whose last token's text duplicates the first other token of
    the same byte length; loading it trips llama-vocab.cpp's
    `GGML_ASSERT(id_to_token.size() == token_to_id.size())` and the process aborts (SIGABRT).
    Deterministic: same input, same bytes out. Returns `dst`."""
    with open(src, "rb") as f:
        tokens = _token_strings(f)
    offset, last = tokens[-1]
    twin = next(text for _, text in tokens[:-1] if len(text) == len(last) and text != last)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)  # streamed by the OS (sendfile/copy_file_range on Linux)
    with open(dst, "r+b") as out:
        out.seek(offset)
        out.write(twin)
    return dst
