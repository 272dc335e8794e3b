"""The device check's model: a Llama-architecture GGUF of a real model's shape, made on the spot.

The device machine takes at most 64 MiB of files and has no network, so a 1-8B model cannot travel:
it is written there from seeded random weights (decode speed depends on shapes and bytes, not on
what the weights say) with a real tokenizer (SmolLM2's vocabulary, read once from the test GGUF
into a small JSON that travels), then quantized to Q4_K_M.

Weights are drawn from one seeded pool of N(0, 0.02) values (a real init's scale: activations stay
finite through RMSNorm, so no NaN logits reach the sampler) read from a different offset per
tensor: drawing billions of values one by one would take longer than the model's whole serving run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")
LLAMA_FTYPE_MOSTLY_F16, LLAMA_FTYPE_MOSTLY_Q4_K_M = 1, 15


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    context: int = 8192  # not 128K: localserve gives each of its sequences the trained context


# Llama 3.x shapes (1B and 3B tie the output to the embeddings; 8B has its own output matrix).
# tiny: the CPU twin's, every row a multiple of 256 so Q4_K applies as on the real shapes.
SHAPES = {
    "tiny": Shape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, context=2048),
    "1b": Shape(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192),
    "3b": Shape(n_layer=28, n_embd=3072, n_head=24, n_head_kv=8, n_ff=8192),
    "8b": Shape(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336),
}


def extract_tokenizer(gguf_path: Path, dest: Path) -> Path:
    """The tokenizer's keys of a GGUF, as JSON (a few MB, where the GGUF it comes from is 94 MB)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    data = {key: fields[key].contents() for key in TOKENIZER_KEYS if key in fields}
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(data))
    return dest


def _add_tokenizer(writer, tokenizer: dict) -> None:  # type: ignore[no-untyped-def]
    writer.add_tokenizer_model(tokenizer["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(tokenizer["tokenizer.ggml.pre"])
    writer.add_token_list(tokenizer["tokenizer.ggml.tokens"])
    writer.add_token_types(tokenizer["tokenizer.ggml.token_type"])
    writer.add_token_merges(tokenizer["tokenizer.ggml.merges"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id), ("padding_token_id", writer.add_pad_token_id),
                     ("add_bos_token", writer.add_add_bos_token), ("add_space_prefix", writer.add_add_space_prefix)):
        if f"tokenizer.ggml.{key}" in tokenizer:
            add(tokenizer[f"tokenizer.ggml.{key}"])
    if "tokenizer.chat_template" in tokenizer:
        writer.add_chat_template(tokenizer["tokenizer.chat_template"])


def _tensor_shapes(shape: Shape, n_vocab: int, tied: bool) -> dict[str, tuple[int, ...]]:
    """Name -> numpy shape (rows = output features) of every tensor of a Llama model."""
    head_dim = shape.n_embd // shape.n_head
    kv = shape.n_head_kv * head_dim
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, shape.n_embd), "output_norm.weight": (shape.n_embd,)}
    if not tied:
        out["output.weight"] = (n_vocab, shape.n_embd)
    for i in range(shape.n_layer):
        out |= {f"blk.{i}.attn_norm.weight": (shape.n_embd,), f"blk.{i}.ffn_norm.weight": (shape.n_embd,),
                f"blk.{i}.attn_q.weight": (shape.n_embd, shape.n_embd), f"blk.{i}.attn_k.weight": (kv, shape.n_embd),
                f"blk.{i}.attn_v.weight": (kv, shape.n_embd), f"blk.{i}.attn_output.weight": (shape.n_embd, shape.n_embd),
                f"blk.{i}.ffn_gate.weight": (shape.n_ff, shape.n_embd), f"blk.{i}.ffn_up.weight": (shape.n_ff, shape.n_embd),
                f"blk.{i}.ffn_down.weight": (shape.n_embd, shape.n_ff)}
    return out


@dataclass(frozen=True)
class MoeShape:
    """A Qwen3-MoE (llama.cpp's qwen3moe): attention with per-head Q/K norms, a router and expert stacks."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    context: int = 8192


# The MoE stage's models: Qwen3-30B-A3B's attention and expert shapes (head 128, experts of 768,
# 8 of 128 used), with 8 of its 48 layers and 32 of its experts, 1.5B parameters, so that it is
# written and quantized in about a minute there; the twin's is tiny.
MOE_SHAPES = {
    "moe-tiny": MoeShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=4, n_expert_used=2,
                         n_ff_exp=256, context=2048),
    "moe": MoeShape(n_layer=8, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=32, n_expert_used=8,
                    n_ff_exp=768),
}


def _moe_tensor_shapes(shape: MoeShape, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Name -> numpy shape of every tensor of a Qwen3-MoE (output tied to the embeddings)."""
    q, kv = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, shape.n_embd), "output_norm.weight": (shape.n_embd,)}
    for i in range(shape.n_layer):
        out |= {f"blk.{i}.attn_norm.weight": (shape.n_embd,), f"blk.{i}.ffn_norm.weight": (shape.n_embd,),
                f"blk.{i}.attn_q.weight": (q, shape.n_embd), f"blk.{i}.attn_k.weight": (kv, shape.n_embd),
                f"blk.{i}.attn_v.weight": (kv, shape.n_embd), f"blk.{i}.attn_output.weight": (shape.n_embd, q),
                f"blk.{i}.attn_q_norm.weight": (shape.head_dim,), f"blk.{i}.attn_k_norm.weight": (shape.head_dim,),
                f"blk.{i}.ffn_gate_inp.weight": (shape.n_expert, shape.n_embd),
                f"blk.{i}.ffn_gate_exps.weight": (shape.n_expert, shape.n_ff_exp, shape.n_embd),
                f"blk.{i}.ffn_up_exps.weight": (shape.n_expert, shape.n_ff_exp, shape.n_embd),
                f"blk.{i}.ffn_down_exps.weight": (shape.n_expert, shape.n_embd, shape.n_ff_exp)}
    return out


def _writer(dest: Path, arch: str, shape_name: str, shape: Shape | MoeShape, n_ff: int,
            tokenizer_json: Path):  # type: ignore[no-untyped-def]
    """A GGUFWriter with the keys every shape has, the tokenizer's JSON and its vocabulary size."""
    from gguf import GGUFWriter

    tokenizer = json.loads(tokenizer_json.read_text())
    writer = GGUFWriter(str(dest), arch)
    writer.add_name(f"gpu-check-{shape_name}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    return writer, tokenizer, len(tokenizer["tokenizer.ggml.tokens"])


def write_moe_f16_model(dest: Path, shape_name: str, tokenizer_json: Path, seed: int = 0) -> Path:
    """A Qwen3-MoE GGUF of MOE_SHAPES[shape_name] in F16 (norms F32)."""
    shape = MOE_SHAPES[shape_name]
    writer, tokenizer, n_vocab = _writer(dest, "qwen3moe", shape_name, shape, shape.n_ff_exp, tokenizer_json)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(shape.n_expert)
    writer.add_expert_used_count(shape.n_expert_used)
    writer.add_expert_feed_forward_length(shape.n_ff_exp)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(LLAMA_FTYPE_MOSTLY_F16)
    _add_tokenizer(writer, tokenizer)
    _write_tensors(writer, _moe_tensor_shapes(shape, n_vocab), seed)
    return dest


def _write_tensors(writer, tensors: dict[str, tuple[int, ...]], seed: int) -> None:  # type: ignore[no-untyped-def]
    """Every tensor from the seeded pool (norm gains of 1, F32), then the file is written and closed."""
    rng = np.random.default_rng(seed)
    pool = rng.normal(0.0, 0.02, size=1 << 22).astype(np.float16)
    for name, dims in tensors.items():
        if len(dims) == 1:
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))  # RMSNorm gains of 1
            continue
        count = int(np.prod(dims))
        start = int(rng.integers(0, pool.size))
        writer.add_tensor(name, np.resize(np.roll(pool, -start), count).reshape(dims))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_f16_model(dest: Path, shape_name: str, tokenizer_json: Path, seed: int = 0) -> Path:
    """A Llama GGUF of SHAPES[shape_name] in F16 (norms F32, as converters write them)."""
    shape = SHAPES[shape_name]
    writer, tokenizer, n_vocab = _writer(dest, "llama", shape_name, shape, shape.n_ff, tokenizer_json)
    writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(LLAMA_FTYPE_MOSTLY_F16)
    _add_tokenizer(writer, tokenizer)
    _write_tensors(writer, _tensor_shapes(shape, n_vocab, tied=shape_name != "8b"), seed)
    return dest


def quantize_with_binding(src: Path, dest: Path, threads: int) -> None:
    """Q4_K_M through llama-cpp-python's llama_model_quantize: the CPU twin has no llama-quantize
    build (compiling one would cost CI minutes), and this is the same llama.cpp code."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dest).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed on {src}")


def weight_bytes(gguf_path: Path) -> int:
    """Bytes of all tensors: what one decode step reads at batch 1 (every weight once; the KV
    cache of a short context is small beside it). localserve's own header reader: gguf's
    GGUFReader parses the 49,152-token vocabulary item by item, 10 s on a busy 2-core machine."""
    from localserve.store.gguf_facts import read_gguf_facts

    return read_gguf_facts(gguf_path).weights_bytes


def file_type(gguf_path: Path) -> int | None:
    from localserve.store.gguf_facts import read_gguf_facts

    return read_gguf_facts(gguf_path).file_type_id
