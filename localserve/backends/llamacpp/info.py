"""A loaded GGUF's facts (ModelInfo) as llama.cpp reads them: name, sizes, chat template, special
tokens and the short metadata values. Shared by the llama.cpp backend and the vocab-only load that
other backends tokenize with (llamacpp_vocab.py), so both describe a model the same way."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import llama_cpp

from ...protocol.engine import RerankFormat
from ..base import ModelInfo

_META_VALUE_MAX = 4096  # longer metadata values (token lists, merges) are not worth carrying around


def read_model_info(model, vocab, path: Path, *, n_vocab: int, n_embd: int) -> ModelInfo:
    meta = _metadata(model)
    template = llama_cpp.llama_model_chat_template(model, None)
    return ModelInfo(
        name=meta.get("general.name") or path.stem,
        architecture=meta.get("general.architecture", ""),
        n_ctx_train=llama_cpp.llama_model_n_ctx_train(model),
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_params=llama_cpp.llama_model_n_params(model),
        chat_template=template.decode("utf-8", errors="replace") if template else None,
        bos_token=_special_text(vocab, llama_cpp.llama_vocab_bos(vocab)),
        eos_token=_special_text(vocab, llama_cpp.llama_vocab_eos(vocab)),
        metadata=meta,
        fim_tokens=fim_tokens(vocab),
        rerank=rerank_format(model, vocab, meta),
    )


def rerank_format(model, vocab, meta: dict[str, Any]) -> RerankFormat | None:
    """How a reranker lays out a pair, as llama-server's format_prompt_rerank reads the model;
    None unless the GGUF's pooling is rank (a classification head on the last or first token)."""
    arch = meta.get("general.architecture", "")
    if meta.get(f"{arch}.pooling_type") != str(llama_cpp.LLAMA_POOLING_TYPE_RANK):
        return None
    template = llama_cpp.llama_model_chat_template(model, b"rerank")
    if template:
        return RerankFormat(template=template.decode("utf-8", errors="replace"))
    eos = llama_cpp.llama_vocab_eos(vocab)
    sep = llama_cpp.llama_vocab_sep(vocab)
    if eos < 0:
        eos = sep  # llama-server: SEP stands in for a missing EOS
    add_bos = llama_cpp.llama_vocab_get_add_bos(vocab) and llama_cpp.llama_vocab_bos(vocab) >= 0
    add_eos = llama_cpp.llama_vocab_get_add_eos(vocab) and eos >= 0
    add_sep = llama_cpp.llama_vocab_get_add_sep(vocab) and sep >= 0
    return RerankFormat(
        prefix=(llama_cpp.llama_vocab_bos(vocab),) if add_bos else (),
        middle=((eos,) if add_eos else ()) + ((sep,) if add_sep else ()),
        suffix=(eos,) if add_eos else (),
    )


FIM_ROLES = ("pre", "suf", "mid", "pad", "rep", "sep")


def fim_tokens(vocab) -> dict[str, int]:
    """llama.cpp's FIM tokens: from the GGUF's tokenizer.ggml.fim_*_token_id, or found by their
    text (<fim_prefix>, <|fim_prefix|>, <PRE>, ...) when the converter wrote none."""
    found = {role: getattr(llama_cpp, f"llama_vocab_fim_{role}")(vocab) for role in FIM_ROLES}
    return {role: int(t) for role, t in found.items() if t is not None and t >= 0}


def _special_text(vocab, token: int) -> str | None:
    if token < 0:
        return None
    text = llama_cpp.llama_vocab_get_text(vocab, token)
    return text.decode("utf-8", errors="replace") if text else None


def _metadata(model) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    buf = ctypes.create_string_buffer(_META_VALUE_MAX)
    for i in range(llama_cpp.llama_model_meta_count(model)):
        if llama_cpp.llama_model_meta_key_by_index(model, i, buf, _META_VALUE_MAX) < 0:
            continue
        key = buf.value.decode("utf-8", errors="replace")
        n = llama_cpp.llama_model_meta_val_str_by_index(model, i, buf, _META_VALUE_MAX)
        if 0 <= n < _META_VALUE_MAX:
            meta[key] = buf.value.decode("utf-8", errors="replace")
    return meta
