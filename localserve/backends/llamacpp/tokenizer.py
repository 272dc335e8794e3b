"""llama.cpp's tokenizer over a loaded vocabulary, in one place for the two classes that have one:
the compute backend (backend.py) and the vocab-only load that the ONNX and OGA backends tokenize
with (vocab.py), so the same text becomes the same ids on every backend."""

from __future__ import annotations

import ctypes

import llama_cpp

from ...errors import BackendError, InvalidRequestError

_INT32_MIN = -(2**31)


class LlamaTokenizer:
    """Tokenizing and rendering tokens; the class it is mixed into sets `vocab`, `n_vocab` and an
    empty `_pieces` cache."""

    vocab: llama_cpp.llama_vocab_p
    n_vocab: int
    _pieces: dict[tuple[int, bool], bytes]

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        # errors="replace": a lone surrogate from a JSON "\ud800" must not raise UnicodeEncodeError.
        data = text.encode("utf-8", errors="replace")
        # Most text runs 3-4 bytes per token; CJK and emoji need more tokens than this guess and
        # take the retry with the exact size llama.cpp reports back.
        cap = len(data) // 2 + 8
        for _ in range(2):
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
            if n >= 0:
                return buf[:n]
            if n == _INT32_MIN:
                raise InvalidRequestError("text is too long to tokenize")
            cap = -n  # the negative result is the size needed
        raise BackendError("tokenizer did not converge on a buffer size")

    def token_to_bytes(self, token: int, special: bool = False) -> bytes:
        key = (token, special)
        piece = self._pieces.get(key)
        if piece is None:
            if token < 0:  # an image's position (media.py): no text of its own
                return b""
            if not token < self.n_vocab:
                raise ValueError(f"token id {token} out of range 0..{self.n_vocab - 1}")
            piece = self._piece(token, special)
            self._pieces[key] = piece
        return piece

    def _piece(self, token: int, special: bool) -> bytes:
        size = 32
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, size, 0, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n
        raise BackendError(f"could not render token {token}")

    def token_text(self, token: int) -> str:
        """Display text of a token, special tokens included (for logprobs listings)."""
        return self.token_to_bytes(token, special=True).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))
