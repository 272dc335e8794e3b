"""A small real mixture-of-experts GGUF (llama.cpp's `qwen3moe`), for tests/model/test_cpu_moe.py.

No MoE GGUF small enough ships where these machines can reach it, so this writes one with the
`gguf` library: Qwen3-MoE's layout (per-head Q/K RMS norms, a router `ffn_gate_inp` and the
expert stacks `ffn_{gate,up,down}_exps` that llama-server's --cpu-moe / --n-cpu-moe keep in RAM),
tiny shapes, seeded random F16 weights, and SmolLM2's tokenizer (its tokenizer.* keys copied from
the test model). What it says is noise; greedy answers are a deterministic function of the
weights, so two loads of it (experts in RAM or not) must agree token for token.

    python tests/moe_model.py OUT_DIR    # writes OUT_DIR/tiny-qwen3moe.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from builder_cli import run_builder

ARCH = "qwen3moe"
FILE_NAME = "tiny-qwen3moe.gguf"
SEED = 46
N_LAYER, N_EMBD, N_HEAD, N_KV_HEAD, HEAD_DIM = 3, 64, 4, 2, 16
N_EXPERT, N_EXPERT_USED, N_FF_EXP = 4, 2, 48
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def expert_tensor_names(layers: range) -> list[str]:
    """The expert stacks of `layers`, as llama.cpp names them."""
    return [f"blk.{i}.{t}.weight" for i in layers for t in EXPERT_TENSORS]


def build_moe(tokenizer_gguf: Path, out: Path) -> Path:
    """`out`: the tiny Qwen3-MoE with `tokenizer_gguf`'s tokenizer."""
    import gguf

    reader = gguf.GGUFReader(tokenizer_gguf, "r")
    vocab = len(reader.get_field(gguf.Keys.Tokenizer.LIST).data)
    writer = gguf.GGUFWriter(out, arch=ARCH)
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_name("tiny-qwen3moe")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(N_LAYER)
    writer.add_context_length(2048)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_FF_EXP)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_KV_HEAD)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(N_EXPERT)
    writer.add_expert_used_count(N_EXPERT_USED)
    writer.add_expert_feed_forward_length(N_FF_EXP)
    rng = np.random.default_rng(SEED)

    def tensor(name: str, *shape: int, scale: float = 0.05) -> None:
        # numpy's shape is ggml's reversed: ggml {n_embd, n_vocab} is (n_vocab, n_embd) here.
        writer.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float16))

    def ones(name: str, n: int) -> None:
        writer.add_tensor(name, np.ones(n, dtype=np.float32))

    tensor("token_embd.weight", vocab, N_EMBD, scale=0.5)
    ones("output_norm.weight", N_EMBD)
    for i in range(N_LAYER):
        ones(f"blk.{i}.attn_norm.weight", N_EMBD)
        tensor(f"blk.{i}.attn_q.weight", N_HEAD * HEAD_DIM, N_EMBD)
        tensor(f"blk.{i}.attn_k.weight", N_KV_HEAD * HEAD_DIM, N_EMBD)
        tensor(f"blk.{i}.attn_v.weight", N_KV_HEAD * HEAD_DIM, N_EMBD)
        tensor(f"blk.{i}.attn_output.weight", N_EMBD, N_HEAD * HEAD_DIM)
        ones(f"blk.{i}.attn_q_norm.weight", HEAD_DIM)
        ones(f"blk.{i}.attn_k_norm.weight", HEAD_DIM)
        ones(f"blk.{i}.ffn_norm.weight", N_EMBD)
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight",
                          (rng.standard_normal((N_EXPERT, N_EMBD)) * 0.5).astype(np.float32))
        tensor(f"blk.{i}.ffn_gate_exps.weight", N_EXPERT, N_FF_EXP, N_EMBD, scale=0.2)
        tensor(f"blk.{i}.ffn_up_exps.weight", N_EXPERT, N_FF_EXP, N_EMBD, scale=0.2)
        tensor(f"blk.{i}.ffn_down_exps.weight", N_EXPERT, N_EMBD, N_FF_EXP, scale=0.2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str]) -> int:
    return run_builder(argv, __doc__, lambda smollm2, out_dir: [build_moe(smollm2, out_dir / FILE_NAME)])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
