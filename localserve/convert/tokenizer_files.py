"""tokenizer.json + tokenizer_config.json for an OGA folder, from the GGUF's own vocabulary.

onnxruntime-genai tokenizes with Hugging Face's `tokenizer.json` format, so the converter writes
the GGUF's BPE vocabulary, merges and special tokens in it, with the pre-tokenizer llama.cpp uses
for the GGUF's `tokenizer.ggml.pre`. Only pre-tokenizers whose llama.cpp regexes have an exact
Hugging Face equivalent are accepted; the rest are refused before any work (tests/system/test_oga.py checks
OGA's encoding against llama.cpp's on the test prompts). Which tokens end a generation is asked of
llama.cpp itself (a vocab-only load), so OGA stops where the llama.cpp backend stops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .spec import ModelSpec, UnsupportedModelError, _field

# llama.cpp's pre-tokenizer regexes for these types (llama-vocab.cpp): the GPT-2 split, preceded
# for the starcoder family (SmolLM2 included) by splitting every digit apart.
_GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "gpt-2": _GPT2_BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _GPT2_BYTE_LEVEL]},
}
_PRE_TOKENIZERS["starcoder"] = _PRE_TOKENIZERS["refact"] = _PRE_TOKENIZERS["smollm"]
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types that are matched as whole added tokens


def check_tokenizer(reader) -> None:
    """UnsupportedModelError before any work when the GGUF's tokenizer has no tokenizer.json form here."""
    model = str(_field(reader, "tokenizer.ggml.model", "") or "")
    pre = str(_field(reader, "tokenizer.ggml.pre", "default") or "default")
    if model != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"tokenizer {model or '(none)'}/{pre} is not supported for onnxruntime-genai folders "
            f"(supported: gpt2 BPE with pre-tokenizer {', '.join(sorted(_PRE_TOKENIZERS))})")


def tokenizer_json(reader) -> dict[str, Any]:
    """The Hugging Face tokenizer.json of the GGUF's BPE vocabulary."""
    check_tokenizer(reader)
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == _CONTROL}
             for i, kind in enumerate(types) if kind in (_CONTROL, _USER_DEFINED)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZERS[str(_field(reader, "tokenizer.ggml.pre", "default"))],
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [str(m) for m in _field(reader, "tokenizer.ggml.merges", [])]},
    }


def special_ids(reader, gguf_path: Path) -> dict[str, Any]:
    """bos/pad ids and every id llama.cpp ends a generation on (its EOG set, asked of llama.cpp)."""
    from ..backends.llamacpp.vocab import LlamaVocab

    vocab = LlamaVocab(gguf_path, n_ctx_train=0, n_embd=0, n_params=0)
    try:
        types = list(_field(reader, "tokenizer.ggml.token_type", []))
        eos = int(_field(reader, "tokenizer.ggml.eos_token_id", 0))
        eog = [eos] + [i for i, kind in enumerate(types) if kind == _CONTROL and i != eos and vocab.is_eog(i)]
    finally:
        vocab.close()
    return {"bos": int(_field(reader, "tokenizer.ggml.bos_token_id", eos)), "eos": eog,
            "pad": int(_field(reader, "tokenizer.ggml.padding_token_id", eos))}


def tokenizer_config(reader, spec: ModelSpec, ids: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by text (`ids`: special_ids), whether a BOS is added,
    and the chat template."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    return {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "bos_token": str(tokens[ids["bos"]]), "eos_token": str(tokens[ids["eos"][0]]),
        "pad_token": str(tokens[ids["pad"]]), "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.n_positions,
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
