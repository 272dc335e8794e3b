"""SmolLM2 as a reranker (llama.cpp's rank pooling), for tests/model/test_rerank.py.

No reranker GGUF can be fetched on these machines, so this builds the smallest real one from the
SmolLM2 test model, laid out as llama.cpp's converter lays out Qwen3-Reranker:

- architecture `qwen3`: llama.cpp's rank pooling reads the first token of a sequence for every
  architecture but Qwen3, where it reads the last one (llm_graph_input_cls::set_input). SmolLM2 is
  causal, so under `llama` every pair would score the same (the first token sees only itself).
  Qwen3 is llama's block plus a per-head RMS norm of Q and K, here with weights of one;
- `cls.output.weight`: a seeded two-row classification head (Qwen3-Reranker's is the LM head's
  rows of "yes" and "no"), `qwen3.classifier.output_labels` naming them, and
  `qwen3.pooling_type` = rank; llama.cpp then returns softmax(head . h_last)[0] as the score;
- `tokenizer.chat_template.rerank`: Qwen3-Reranker's rerank prompt, `{query}` and `{document}`
  filled in by the server (llama-server's format_prompt_rerank).

What SmolLM2 makes of it as a language model is beside the point (Qwen3 rotates Q/K in NEOX
order, so generation is garbage); the scores are a deterministic function of the pair, which
every server computes alike.

    python tests/rerank_model.py OUT_DIR    # writes OUT_DIR/smollm2-rerank.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ARCH = "qwen3"
FILE_NAME = "smollm2-rerank.gguf"
LABELS = ["yes", "no"]
SEED = 45
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
_POOLING_RANK = 4  # llama_pooling_type: LLAMA_POOLING_TYPE_RANK


def with_rank_head(gguf_path: Path, out: Path, *, template: bool = True) -> Path:
    """`out`: `gguf_path` (a llama-architecture GGUF) as a qwen3 reranker; `template=False` leaves
    the rerank template out, so a server falls back to BOS query EOS SEP document EOS."""
    import gguf

    reader = gguf.GGUFReader(gguf_path, "r")
    old_arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(out, arch=ARCH, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        name = ARCH + field.name[len(old_arch):] if field.name.startswith(old_arch + ".") else field.name
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    n_embd = int(reader.get_field(f"{old_arch}.embedding_length").contents())
    n_head = int(reader.get_field(f"{old_arch}.attention.head_count").contents())
    n_layer = int(reader.get_field(f"{old_arch}.block_count").contents())
    writer.add_key_value(f"{ARCH}.pooling_type", _POOLING_RANK, gguf.GGUFValueType.UINT32)
    writer.add_key_value(f"{ARCH}.classifier.output_labels", LABELS, gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.STRING)
    if template:
        writer.add_key_value("tokenizer.chat_template.rerank", RERANK_TEMPLATE, gguf.GGUFValueType.STRING)

    extra = {f"blk.{i}.attn_{qk}_norm.weight": np.ones(n_embd // n_head, dtype=np.float32)
             for i in range(n_layer) for qk in ("q", "k")}
    rng = np.random.default_rng(SEED)
    # Scaled so the two logits differ by a few units: softmax scores spread over (0, 1) instead
    # of sticking to 0 or 1, where float32 rounding would tie documents.
    extra["cls.output.weight"] = (rng.standard_normal((len(LABELS), n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    for name, array in extra.items():
        writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    for array in extra.values():
        writer.write_tensor_data(array)
    writer.close()
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: python {argv[0]} OUT_DIR", file=sys.stderr)
        return 2
    here = Path(__file__).resolve().parent.parent
    source = here / ".test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf"
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    print(with_rank_head(source, out_dir / FILE_NAME))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
