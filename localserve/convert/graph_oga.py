"""The onnxruntime-genai (OGA) decoder graph: the padded, per-sequence-KV layout OGA's runtime drives.

OGA feeds `input_ids[B, S]`, `attention_mask[B, P+S]` and `past_key_values.{i}.key|value
[B, n_kv, P, hd]` and reads `logits[B, S, V]` and `present.{i}.key|value`; with
`past_present_share_buffer` it allocates the cache once at its max length and binds past and
present to the same buffer, which GroupQueryAttention (com.microsoft) updates in place. So every
layer is one GQA node on the packed q|k|v projection, with the rotary embedding fused in (GQA
derives each token's position from `seqlens_k`, so the graph takes no position_ids). This is the
layout OGA's own model builder writes for the CPU EP (research notes §2.5, §3.3).

The weights are the packed graph's (weights.py: q/k/v and gate/up concatenated, MatMul weights
[in, out] or MatMulNBits blocks, rope tables rope.cos / rope.sin), so both share one weight writer
and one matmul builder (graph.matmul).
"""

from __future__ import annotations

import functools
from typing import Callable

import onnx
from onnx import TensorProto, helper

from .graph import MS_DOMAIN, OPSET, _Nodes, matmul
from .nbits import Layout
from .spec import ModelSpec, UnsupportedModelError

# OGA's genai_config names for the graph's inputs and outputs (the model builder's conventions).
INPUT_NAMES = {"input_ids": "input_ids", "attention_mask": "attention_mask",
               "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
OUTPUT_NAMES = {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}


def check_oga_spec(spec: ModelSpec) -> None:
    """UnsupportedModelError, before any work, for what GQA's fused rotary cannot run."""
    if spec.head_dim % 16:
        # The CPU kernel refuses do_rotary with other head sizes (measured: ORT 1.32's error).
        raise UnsupportedModelError(f"head size {spec.head_dim} is not supported by the onnxruntime-genai "
                                    "layout (GroupQueryAttention's rotary needs a multiple of 16)")


def build_oga_graph(spec: ModelSpec, weight: Callable[[str], str],
                    nbits: Callable[[str], Layout | None] = lambda key: None) -> onnx.ModelProto:
    """The decoder graph; `weight(name)` names the prepared initializer and `nbits(name)` a matmul
    weight's MatMulNBits layout (None: float), as for graph.build_graph."""
    g = _Nodes()
    linear = functools.partial(matmul, g, weight, nbits)
    s = spec
    kv, hd = s.n_head_kv, s.head_dim
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total_seq"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", s.n_vocab])]
    c = g.const
    # GQA's per-row lengths: the tokens each row holds, past and new, minus one; and the longest.
    mask_sum = g.one("ReduceSum", ["attention_mask", c("axes_1", [1])], keepdims=0)
    seqlens_k = g.one("Cast", [g.one("Sub", [mask_sum, c("one_i64", 1)])], to=TensorProto.INT32)
    total_len = g.one("Cast", [g.one("Gather", [g.one("Shape", ["attention_mask"]), c("idx_1", 1)], axis=0)],
                      to=TensorProto.INT32)
    x = g.one("Gather", [weight("token_embd"), "input_ids"], axis=0)  # [B, S, D]
    split_ff = c("split_ff", [s.n_ff, s.n_ff])
    for i in range(s.n_layer):
        p = f"blk.{i}."
        past = [INPUT_NAMES[f"past_{kind}_names"] % i for kind in ("key", "value")]
        present = [OUTPUT_NAMES[f"present_{kind}_names"] % i for kind in ("key", "value")]
        for name in past:
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", kv, "past_seq", hd]))
        for name in present:
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", kv, "total_seq", hd]))
        h = g.one("SimplifiedLayerNormalization", [x, weight(p + "attn_norm")], axis=-1, epsilon=s.rms_eps)
        qkv = linear(h, p + "attn_qkv", s.n_embd, (s.n_head + 2 * kv) * hd)  # GQA's packed q|k|v input
        if s.qkv_bias:
            qkv = g.one("Add", [qkv, weight(p + "attn_qkv.bias")])
        attn = f"gqa_{i}"
        g.nodes.append(helper.make_node(
            "GroupQueryAttention",
            [qkv, "", "", past[0], past[1], seqlens_k, total_len, weight("rope.cos"), weight("rope.sin")],
            [attn, present[0], present[1]], domain=MS_DOMAIN, num_heads=s.n_head, kv_num_heads=kv,
            do_rotary=1, rotary_interleaved=int(s.rope_interleaved)))
        x = g.one("Add", [x, linear(attn, p + "attn_output", s.n_head * hd, s.n_embd)])
        h = g.one("SimplifiedLayerNormalization", [x, weight(p + "ffn_norm")], axis=-1, epsilon=s.rms_eps)
        gate, up = g("Split", [linear(h, p + "ffn_gate_up", s.n_embd, 2 * s.n_ff), split_ff], 2, axis=-1)
        act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])  # SiLU(gate) * up
        x = g.one("Add", [x, linear(act, p + "ffn_down", s.n_ff, s.n_embd)])
    h = g.one("SimplifiedLayerNormalization", [x, weight("output_norm")], axis=-1, epsilon=s.rms_eps)
    # A float LM head reads the [vocab, width] matrix transposed (Gemm's transB, so tied models
    # reuse the embedding table with no second copy); Gemm is 2-D, hence the reshapes around it.
    rows = g.one("Reshape", [h, c("shape_rows_d", [-1, s.n_embd])])
    if nbits("output") is None:
        rows = g.one("Gemm", [rows, weight("output")], transB=1)
    else:
        rows = linear(rows, "output", s.n_embd, s.n_vocab)
    logits_shape = g.one("Concat", [g.one("Shape", ["input_ids"]), c("vocab_dim", [s.n_vocab])], axis=0)
    g.nodes.append(helper.make_node("Reshape", [rows, logits_shape], ["logits"]))
    graph = helper.make_graph(g.nodes, "localserve-oga-decoder", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
                              producer_name="localserve-convert")
    model.ir_version = 8
    return model
