"""Shared by the ONNX tests: the real model converted once per checkout, and tiny crafted GGUFs.

`smollm2_onnx` converts the test model into .test-cache/onnx/<gguf sha>-v<converter version>-fp32, so
the suite converts once per machine (about 10 s) and again only when the GGUF or the converter
changes. `write_tiny_gguf` writes a random-weight llama/qwen2 GGUF with the gguf package's own
writer (for refusals and for checking the graph against a numpy forward pass).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from localserve.backends.base import BatchToken
from conftest import SMOLLM2_SHA256, TEST_CACHE
from worker_locks import filling


def converted_smollm2(gguf: Path, weights: str = "fp32") -> Path:
    """The test model's conversion in the persistent test cache (converted on first use). The
    suite's default is fp32 weights, the closest to llama.cpp's logits; tests of the int4 folder
    (the CPU EP's default) ask for it."""
    from localserve.convert import CONVERTER_VERSION, convert_gguf

    out = TEST_CACHE / "onnx" / f"{SMOLLM2_SHA256[:16]}-v{CONVERTER_VERSION}-{weights}"
    return cached_folder(out, "localserve-onnx.json",
                         lambda dest: convert_gguf(gguf, dest, gguf_sha256=SMOLLM2_SHA256, weights=weights))


def cached_folder(out: Path, marker: str, convert: Callable[[Path], object]) -> Path:
    """`out`, made by `convert(out)` unless it already holds `marker` (a finished conversion)."""
    with filling(out.parent.name):
        if not (out / marker).is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                convert(out)
            except OSError:
                if not (out / marker).is_file():  # another run converted it meanwhile
                    raise
    return out


@pytest.fixture(scope="session")
def smollm2_onnx(smollm2_gguf) -> Path:
    return converted_smollm2(smollm2_gguf)


TINY = dict(n_layer=2, n_embd=64, n_ff=96, n_head=4, n_head_kv=2, n_vocab=50, n_ctx=64)


def tiny_weights(arch: str = "llama", seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in numpy [out, in] order, as GGUF tensors hold them after dequantization."""
    rng = np.random.default_rng(seed)
    d, f, hd = TINY["n_embd"], TINY["n_ff"], TINY["n_embd"] // TINY["n_head"]
    kv = TINY["n_head_kv"] * hd

    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"token_embd.weight": w(TINY["n_vocab"], d, scale=1.0), "output_norm.weight": 1 + w(d, scale=0.1)}
    for i in range(TINY["n_layer"]):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": 1 + w(d, scale=0.1), p + "ffn_norm.weight": 1 + w(d, scale=0.1),
                  p + "attn_q.weight": w(d, d), p + "attn_k.weight": w(kv, d), p + "attn_v.weight": w(kv, d),
                  p + "attn_output.weight": w(d, d), p + "ffn_gate.weight": w(f, d), p + "ffn_up.weight": w(f, d),
                  p + "ffn_down.weight": w(d, f)})
        if arch == "qwen2":
            t.update({p + "attn_q.bias": w(d), p + "attn_k.bias": w(kv), p + "attn_v.bias": w(kv)})
    return t


def write_tiny_gguf(path: Path, arch: str = "llama", weights: dict[str, np.ndarray] | None = None,
                    raw: dict[str, tuple[np.ndarray, object]] | None = None, **meta) -> Path:
    """A GGUF with TINY's shape; `raw` adds tensors as raw bytes of a given GGML type."""
    import gguf

    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_block_count(meta.get("block_count", TINY["n_layer"]))
    w.add_embedding_length(TINY["n_embd"])
    w.add_feed_forward_length(TINY["n_ff"])
    # `meta` may claim another layout than the tensors have (the converter's attack tests).
    w.add_head_count(meta.get("head_count", TINY["n_head"]))
    w.add_head_count_kv(meta.get("head_count_kv", TINY["n_head_kv"]))
    w.add_context_length(meta.get("context_length", TINY["n_ctx"]))
    if "key_length" in meta:
        w.add_key_length(meta["key_length"])
    w.add_rope_freq_base(meta.get("rope_base", 10000.0))
    w.add_layer_norm_rms_eps(1e-5)
    for name, value in (weights if weights is not None else tiny_weights(arch)).items():
        w.add_tensor(name, value)
    for name, (data, qtype) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_logits(weights: dict[str, np.ndarray], ids: list[int], arch: str = "llama",
                     rope_base: float = 10000.0) -> np.ndarray:
    """The tiny model's logits: its final hidden states through the tied head."""
    return reference_hidden(weights, ids, arch, rope_base) @ weights["token_embd.weight"].astype(np.float64).T


def reference_hidden(weights: dict[str, np.ndarray], ids: list[int], arch: str = "llama",
                     rope_base: float = 10000.0) -> np.ndarray:
    """A plain numpy forward pass of the tiny model (causal, GQA, llama.cpp's rope conventions:
    adjacent pairs for llama's permuted q/k, halves for qwen2's NEOX), float64 throughout, up to
    the final norm: llama.cpp's per-token embeddings."""
    d, h, kvh = TINY["n_embd"], TINY["n_head"], TINY["n_head_kv"]
    hd = d // h
    W = {k: v.astype(np.float64) for k, v in weights.items()}
    T = len(ids)
    pos = np.arange(T)
    ang = np.outer(pos, rope_base ** (-np.arange(hd // 2) * 2.0 / hd))
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # x [T, heads, hd]
        if arch == "llama":
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w

    x = W["token_embd.weight"][ids]
    causal = np.where(np.tril(np.ones((T, T))) > 0, 0.0, -np.inf)
    for i in range(TINY["n_layer"]):
        p = f"blk.{i}."
        y = rms(x, W[p + "attn_norm.weight"])
        proj = {c: y @ W[p + f"attn_{c}.weight"].T + (W[p + f"attn_{c}.bias"] if arch == "qwen2" else 0)
                for c in "qkv"}
        q = rope(proj["q"].reshape(T, h, hd))
        k = np.repeat(rope(proj["k"].reshape(T, kvh, hd)), h // kvh, axis=1)
        v = np.repeat(proj["v"].reshape(T, kvh, hd), h // kvh, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + causal
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", pr, v).reshape(T, d)
        x = x + o @ W[p + "attn_output.weight"].T
        y = rms(x, W[p + "ffn_norm.weight"])
        g, u = y @ W[p + "ffn_gate.weight"].T, y @ W[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    return rms(x, W["output_norm.weight"])


def chat(backend, text: str) -> list[int]:
    """SmolLM2's chat template around one user turn, tokenized."""
    return backend.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def prefill(backend, seq: int, ids: list[int], start: int = 0, chunk: int | None = None) -> np.ndarray:
    """Feed `ids` at positions start.. (in decodes of at most `chunk` tokens); the last one's logits."""
    chunk = chunk or len(ids)
    for at in range(0, len(ids), chunk):
        part = ids[at:at + chunk]
        backend.decode([BatchToken(t, seq, start + at + i, at + i == len(ids) - 1) for i, t in enumerate(part)])
    return backend.logits(len(part) - 1)


def greedy(backend, ids: list[int], n: int = 8) -> list[int]:
    """n greedy tokens after the prompt, on sequence 0 (left empty afterwards)."""
    backend.kv_remove(0)
    row, out = prefill(backend, 0, ids), []
    for k in range(n):
        out.append(int(row.argmax()))
        backend.decode([BatchToken(out[-1], 0, len(ids) + k, True)])
        row = backend.logits(0)
    backend.kv_remove(0)
    return out


def tie_gap_at_divergence(backend, ids: list[int], answer: list[int]) -> float:
    """How far below its own top choice `backend` (llama.cpp, greedy) ranks the first token of
    `answer` it would not have picked; 0.0 when it would have picked them all. Two runtimes that
    round differently may part only where the top two logits nearly tie."""
    backend.kv_remove(0)
    row = prefill(backend, 0, ids)
    try:
        for k, token in enumerate(answer):
            if int(row.argmax()) != token:
                return float(row.max() - row[token])
            backend.decode([BatchToken(token, 0, len(ids) + k, True)])
            row = backend.logits(0)
        return 0.0
    finally:
        backend.kv_remove(0)


async def answer(engine, ids: list[int], max_tokens: int) -> list[int]:
    """One greedy request's tokens through the engine."""
    from localserve.protocol.requests import GenerationRequest, SamplingParams

    tokens: list[int] = []
    async for event in await engine.generate(GenerationRequest(ids, SamplingParams(temperature=0),
                                                               max_tokens=max_tokens)):
        tokens += event.token_ids
    return tokens


def engine_answers(backend, limits, prompts: list[list[int]], together: bool, max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer from a fresh Engine over `backend`: all submitted at once, or one
    after another (each alone)."""
    from localserve.engine.local import Engine

    async def run() -> list[list[int]]:
        engine = Engine(backend, limits, name="onnx-test")
        engine.start()
        try:
            if together:
                return list(await asyncio.gather(*[answer(engine, p, max_tokens) for p in prompts]))
            return [await answer(engine, p, max_tokens) for p in prompts]
        finally:
            engine.shutdown()

    return asyncio.run(run())
