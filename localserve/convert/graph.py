"""The packed, unified-KV decoder graph (llama / qwen2) built with onnx.helper.

One `session.run` computes any mix of sequences' tokens side by side, with no padding:

    inputs   input_ids[T] int64, positions[T] int64 (each token's position in its sequence),
             slots[T] int64 (the KV row each token writes), attn_bias[T, S] float32 (0 where a
             token may attend a KV row, -inf elsewhere), logits_idx[R] int64 (rows needing logits),
             cache.{i}.key / cache.{i}.value [n_head_kv, S, head_dim] float32
    outputs  logits[R, n_vocab], cache_out.{i}.key / .value (the caches with this step's rows
             written; the backend binds them to the input buffers, so the cache is updated in place),
             embeddings[T, n_embd] (every token's hidden state after the final norm: llama.cpp's
             per-token embeddings, which the backend pools; a norm of T rows costs next to nothing
             beside the layers, so generation steps compute it unasked rather than need an input)

Attention uses standard ops plus com.microsoft's RotaryEmbedding and FusedMatMul: the caches are
kept head-major ([n_kv, S, hd]) so no layer transposes the whole cache each step; K is read
transposed by FusedMatMul(transB) with the 1/sqrt(hd) scale folded in. Grouped-query heads attend
as [n_kv, T*G, hd] against [n_kv, S, hd] without repeating K/V. The LM head runs only on the
logits_idx rows (Gather before the final norm).

`dims` names T, S and R: strings give the dynamic flavour; integers freeze every shape (the static
flavour NPU execution providers need), from the same code.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from .nbits import Layout
from .spec import ModelSpec

OPSET = 17  # DirectML runs opsets up to 17 well (research notes); nothing here needs newer
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class Dims:
    tokens: int | str = "T"
    slots: int | str = "S"
    rows: int | str = "R"


class _Nodes:
    """Collects nodes with unique output names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self._n = 0

    def __call__(self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        self._n += 1
        outs = [f"{op.lower()}_{self._n}_{k}" for k in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, domain=domain, **attrs))
        return outs

    def one(self, op: str, inputs: list[str], domain: str = "", **attrs) -> str:
        return self(op, inputs, 1, domain, **attrs)[0]

    def const(self, name: str, values, dtype=np.int64) -> str:
        self.inits.append(helper.make_tensor(name, TensorProto.INT64 if dtype == np.int64 else TensorProto.FLOAT,
                                             np.shape(values), np.asarray(values, dtype).ravel().tolist()))
        return name


def rope_tables(spec: ModelSpec, factors: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches [n_positions, head_dim/2] for RotaryEmbedding (theta_i = base^(-2i/d),
    divided by llama 3's per-frequency factors when the GGUF has them, as llama.cpp does).
    n_positions, not the claimed n_ctx_train: rows past what serving reaches would only cost
    memory here and disk in the folder (spec.read_spec bounds it)."""
    half = spec.head_dim // 2
    inv_freq = spec.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / spec.head_dim)
    if factors is not None:
        inv_freq = inv_freq / factors.astype(np.float64).ravel()[:half]
    angles = np.outer(np.arange(spec.n_positions, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def matmul(g: _Nodes, weight: Callable[[str], str], nbits: Callable[[str], Layout | None], x: str, key: str,
           k: int, n: int, out: str | None = None) -> str:
    """x [..., k] times the weight `key` (k -> n), into `out` (default: a name of its own): a
    MatMul on the float weight, or MatMulNBits on its blocks when `nbits(key)` gives a layout."""
    layout, out = nbits(key), out or f"linear.{key}"
    if layout is None:
        g.nodes.append(helper.make_node("MatMul", [x, weight(key)], [out]))
    else:
        parts = ("codes", "scales") + (("zero_points",) if layout.zero_points else ())
        g.nodes.append(helper.make_node("MatMulNBits", [x] + [weight(f"{key}.{part}") for part in parts],
                                        [out], domain=MS_DOMAIN, **layout.attrs(k, n)))
    return out


def build_graph(spec: ModelSpec, weight: Callable[[str], str], dims: Dims = Dims(),
                nbits: Callable[[str], Layout | None] = lambda key: None) -> onnx.ModelProto:
    """The decoder graph. `weight(name)` returns the initializer name holding the prepared tensor
    `name` (weights.py writes them: MatMul weights pre-transposed to [in, out], q/k/v and
    gate/up concatenated, rope tables as rope.cos / rope.sin). `nbits(name)` is the MatMulNBits
    layout of a matmul weight (then `name.codes`, `name.scales` and `name.zero_points` are its
    inputs, nbits.py) or None for a float MatMul."""
    g = _Nodes()
    linear = functools.partial(matmul, g, weight, nbits)

    s = spec
    kv, hd, groups = s.n_head_kv, s.head_dim, s.n_head // s.n_head_kv
    T, S, R = dims.tokens, dims.slots, dims.rows
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [T]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, [T]),
        helper.make_tensor_value_info("slots", TensorProto.INT64, [T]),
        helper.make_tensor_value_info("attn_bias", TensorProto.FLOAT, [T, S]),
        helper.make_tensor_value_info("logits_idx", TensorProto.INT64, [R]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [R, s.n_vocab])]
    c = g.const
    shape_tkh = c("shape_t_kv_hd", [-1, kv, hd])
    shape_tkgh = c("shape_t_kv_g_hd", [-1, kv, groups, hd])
    shape_k_tg_h = c("shape_kv_tg_hd", [kv, -1, hd])
    shape_ktgh = c("shape_kv_t_g_hd", [kv, -1, groups, hd])
    shape_td = c("shape_t_d", [-1, s.n_embd])
    axes0 = c("axes_0", [0])
    s_dim = g.one("Slice", [g.one("Shape", ["attn_bias"]), c("one", [1]), c("two", [2])])
    shape_ktgs = g.one("Concat", [c("kv_minus1_g", [kv, -1, groups]), s_dim], axis=0)  # [kv, T, G, S]
    shape_kts = g.one("Concat", [c("kv_minus1", [kv, -1]), s_dim], axis=0)  # [kv, T*G, S]

    x = g.one("Gather", [weight("token_embd"), "input_ids"], axis=0)
    pos2 = g.one("Unsqueeze", ["positions", axes0])  # [1, T]: RotaryEmbedding's position_ids
    bias4 = g.one("Unsqueeze", ["attn_bias", c("axes_0_2", [0, 2])])  # [1, T, 1, S]
    # Every KV row index a token writes, broadcast over heads and head_dim for ScatterElements(axis=1).
    slot3 = g.one("Reshape", ["slots", c("shape_1_t_1", [1, -1, 1])])
    kv_shape = g.one("Concat", [c("kv_dim", [kv]), g.one("Shape", ["slots"]), c("hd_dim", [hd])], axis=0)
    slot_idx = g.one("Expand", [slot3, kv_shape])
    split_qkv = c("split_qkv", [s.n_head * hd, kv * hd, kv * hd])
    split_ff = c("split_ff", [s.n_ff, s.n_ff])
    interleaved = int(s.rope_interleaved)

    for i in range(s.n_layer):
        p = f"blk.{i}."
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"cache.{i}.{kind}", TensorProto.FLOAT, [kv, S, hd]))
            outputs.append(helper.make_tensor_value_info(f"cache_out.{i}.{kind}", TensorProto.FLOAT, [kv, S, hd]))
        h = g.one("SimplifiedLayerNormalization", [x, weight(p + "attn_norm")], axis=-1, epsilon=s.rms_eps)
        qkv = linear(h, p + "attn_qkv", s.n_embd, (s.n_head + 2 * kv) * hd)
        if s.qkv_bias:
            qkv = g.one("Add", [qkv, weight(p + "attn_qkv.bias")])
        q, k, v = g("Split", [qkv, split_qkv], 3, axis=1)
        rotated = []
        for t, heads in ((q, s.n_head), (k, kv)):
            t3 = g.one("Unsqueeze", [t, axes0])  # [1, T, heads*hd]
            rotated.append(g.one("RotaryEmbedding", [t3, pos2, weight("rope.cos"), weight("rope.sin")],
                                 domain=MS_DOMAIN, interleaved=interleaved, num_heads=heads))
        q, k = rotated
        new = {}
        for kind, t in (("key", k), ("value", v)):
            heads_first = g.one("Transpose", [g.one("Reshape", [t, shape_tkh])], perm=[1, 0, 2])  # [kv, T, hd]
            new[kind] = f"cache_out.{i}.{kind}"
            g.nodes.append(helper.make_node("ScatterElements", [f"cache.{i}.{kind}", slot_idx, heads_first],
                                            [new[kind]], axis=1))
        qg = g.one("Reshape", [g.one("Transpose", [g.one("Reshape", [q, shape_tkgh])], perm=[1, 0, 2, 3]),
                               shape_k_tg_h])  # [kv, T*G, hd]
        scores = g.one("FusedMatMul", [qg, new["key"]], domain=MS_DOMAIN, transB=1, alpha=1.0 / math.sqrt(hd))
        scores = g.one("Add", [g.one("Reshape", [scores, shape_ktgs]), bias4])  # [kv, T, G, S]
        probs = g.one("Reshape", [g.one("Softmax", [scores], axis=-1), shape_kts])
        o = g.one("MatMul", [probs, new["value"]])  # [kv, T*G, hd]
        o = g.one("Transpose", [g.one("Reshape", [o, shape_ktgh])], perm=[1, 0, 2, 3])  # [T, kv, G, hd]
        o = linear(g.one("Reshape", [o, shape_td]), p + "attn_output", s.n_head * hd, s.n_embd)
        x = g.one("Add", [x, o])
        h = g.one("SimplifiedLayerNormalization", [x, weight(p + "ffn_norm")], axis=-1, epsilon=s.rms_eps)
        gate, up = g("Split", [linear(h, p + "ffn_gate_up", s.n_embd, 2 * s.n_ff), split_ff], 2, axis=1)
        act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])  # SiLU(gate) * up
        x = g.one("Add", [x, linear(act, p + "ffn_down", s.n_ff, s.n_embd)])

    def final_norm(rows: str, out: str | None = None) -> str:
        name = out or f"final_norm_{rows}"
        g.nodes.append(helper.make_node("SimplifiedLayerNormalization", [rows, weight("output_norm")], [name],
                                        axis=-1, epsilon=s.rms_eps))
        return name

    # A float LM head reads the [vocab, width] matrix transposed: tied models reuse the embedding table.
    head_rows = final_norm(g.one("Gather", [x, "logits_idx"], axis=0))
    if nbits("output") is None:
        g.nodes.append(helper.make_node("Gemm", [head_rows, weight("output")], ["logits"], transB=1))
    else:
        linear(head_rows, "output", s.n_embd, s.n_vocab, out="logits")
    outputs.append(helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, [T, s.n_embd]))
    final_norm(x, "embeddings")
    graph = helper.make_graph(g.nodes, "localserve-decoder", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, 1)],
                              producer_name="localserve-convert")
    model.ir_version = 8  # onnxruntime 1.18 reads up to IR 9/10; 8 is what opset 17 needs
    return model
