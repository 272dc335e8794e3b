"""GGUF -> an onnxruntime-genai (OGA) folder: the layout AMD, Qualcomm and Intel publish NPU builds in.

The folder holds the GQA decoder (graph_oga.py) with its weights in model.onnx.data (the packed
converter's weight writer), genai_config.json (what OGA 0.18 accepted on this project's CPU runs:
research notes §2.5), and tokenizer.json + tokenizer_config.json built from the GGUF's own
vocabulary and chat template (tokenizer_files.py). localserve serves it with OGA's own batching
engine (backends/oga_engine.py), so it is also how a user tries OGA on a model we can convert.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ..store.model_dirs import OGA_CONFIG_FILE, OGA_TOKENIZER_FILE
from .graph_oga import INPUT_NAMES, OUTPUT_NAMES, build_oga_graph, check_oga_spec
from .spec import ModelSpec, open_reader, read_spec
from .tokenizer_files import check_tokenizer, special_ids, tokenizer_config, tokenizer_json

# Bump when the graph, the config or the tokenizer files change: cached conversions are then redone.
OGA_CONVERTER_VERSION = 2  # 2: int4 weights possible
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def check_oga_convertible(gguf_path: Path) -> ModelSpec:
    """The model's spec, or UnsupportedModelError / GGUFError: no work done, nothing written."""
    reader = open_reader(gguf_path)
    spec = read_spec(reader)
    check_oga_spec(spec)
    check_tokenizer(reader)
    return spec


def convert_gguf_oga(gguf_path: Path, out_dir: Path, *, weights: str = "fp32",
                     progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write the OGA folder `out_dir` (new; whole or not at all); returns its genai_config.json.
    `weights`: "fp32" (dequantized) or "int4" (MatMulNBits blocks, as the packed converter's)."""
    from .staging import staged_folder, write_graphs
    from . import WEIGHTS
    from .weights import WeightSource

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)} (got {weights!r})")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir.name} already exists")
    spec = check_oga_convertible(gguf_path)  # every refusal happens here, before any work
    reader = open_reader(gguf_path)
    with staged_folder(out_dir) as partial:
        source = WeightSource(reader, spec, weights)
        graph = build_oga_graph(spec, source.name, source.nbits)
        write_graphs(partial, {MODEL_FILE: graph}, source, DATA_FILE, progress)
        ids = special_ids(reader, gguf_path)
        config = genai_config(spec, ids)
        files = {OGA_CONFIG_FILE: config, OGA_TOKENIZER_FILE: tokenizer_json(reader),
                 TOKENIZER_CONFIG_FILE: tokenizer_config(reader, spec, ids)}
        for name, data in files.items():
            (partial / name).write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
    return config


def genai_config(spec: ModelSpec, ids: dict[str, Any]) -> dict[str, Any]:
    """genai_config.json for the graph. search.max_length is only the file's default: the loader
    overlays the context the plan sizes (backends/oga_loader.py), since OGA allocates each
    request's KV cache at max_length up front."""
    return {
        "model": {
            "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
            "context_length": spec.n_positions, "type": spec.arch, "vocab_size": spec.n_vocab,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE, "head_size": spec.head_dim, "hidden_size": spec.n_embd,
                "num_attention_heads": spec.n_head, "num_hidden_layers": spec.n_layer,
                "num_key_value_heads": spec.n_head_kv, "inputs": dict(INPUT_NAMES), "outputs": dict(OUTPUT_NAMES),
            },
        },
        "search": {"max_length": min(spec.n_positions, 4096), "min_length": 0, "do_sample": False, "num_beams": 1,
                   "past_present_share_buffer": True, "top_k": 1, "top_p": 1.0, "temperature": 1.0,
                   "repetition_penalty": 1.0},
    }
