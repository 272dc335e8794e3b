"""An OGA folder's tokenizer: ids from onnxruntime-genai's own tokenizer, bytes from tokenizer.json.

Encoding goes through `og.Tokenizer`, the tokenizer OGA's runtime itself uses, so the ids we feed
are the ones the folder's publisher tested. Streaming text needs each token's *bytes* (an emoji or a
stop string spans several tokens; batching/text.Detokenizer holds them back until whole), which
OGA's decode cannot give (it returns str, replacing half a character), so they are read from
tokenizer.json's vocabulary: byte-level BPE (GPT-2 style, our converter's) maps characters back to
bytes; SentencePiece-style vocabularies (Llama 2, Phi) use "▁" for a space and <0xNN> byte tokens.
Special tokens render as no text, as llama.cpp's backend renders them.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ModelDirError

_SPIECE_SPACE = "\u2581"


def _byte_level_table() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable character table (the ByteLevel pre-tokenizer's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _uses_byte_level(spec: dict[str, Any]) -> bool:
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)


class OgaVocab:
    """token ids <-> bytes for one folder; `encode` is thread-safe (the server tokenizes long texts
    in worker threads)."""

    def __init__(self, folder: Path, og_tokenizer: Any) -> None:
        try:
            spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
            vocab: dict[str, int] = dict(spec["model"]["vocab"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelDirError(f"tokenizer.json is not a readable tokenizer ({type(e).__name__})") from None
        added = [t for t in spec.get("added_tokens") or [] if isinstance(t, dict)]
        for t in added:
            vocab.setdefault(t["content"], t["id"])
        self.n_vocab = max(vocab.values()) + 1
        self._pieces: list[str] = [""] * self.n_vocab
        for piece, i in vocab.items():
            self._pieces[i] = piece
        self.special = frozenset(t["id"] for t in added if t.get("special"))
        self._byte_level = _uses_byte_level(spec)
        self._chars = _byte_level_table() if self._byte_level else {}
        self._bytes: dict[int, bytes] = {}
        self._og = og_tokenizer
        self._lock = threading.Lock()
        self.bos_added: int | None = None  # the BOS id when OGA's encode prepends one (set by the loader)

    def piece(self, token: int) -> str:
        return self._pieces[token] if 0 <= token < self.n_vocab else ""

    def token_to_bytes(self, token: int) -> bytes:
        data = self._bytes.get(token)
        if data is None:
            data = self._bytes[token] = self._decode_piece(token)
        return data

    def _decode_piece(self, token: int) -> bytes:
        piece = self.piece(token)
        if token in self.special or not piece:
            return b""
        if self._byte_level:
            if all(c in self._chars for c in piece):
                return bytes(self._chars[c] for c in piece)
            return piece.encode("utf-8")  # an added, non-byte-level token: its text as written
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece's byte fallback
        return piece.replace(_SPIECE_SPACE, " ").encode("utf-8")

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return [int(t) for t in np.asarray(self._og.encode(text)).ravel()]
