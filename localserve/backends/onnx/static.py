"""The static flavour on the ONNX backend: fixed shapes for NPU execution providers, run and tested
on the CPU EP too.

A static folder (convert_gguf(flavour="static")) holds one graph per token bucket T (1, 16, 64 by
default), all reading one weights file and all with S KV slots plus one sink row, R = T logits
rows: every shape is fixed, as NPU compilers need. The scheduler still hands us packed batches of
any length; each is cut into runs of at most the largest bucket, and each run goes through the
smallest bucket that holds it, padded up to T. A decode-only step of a few sequences thus runs the
1- or 16-token graph rather than paying for 64 rows.

Padding: a padding row (token 0 at position 0) writes its K/V into the sink row S, which no
sequence ever holds, and attends only the sink. So it
- pollutes no live slot: a real token's row never reads the sink (its mask is -inf there), and
  the sink's contents are finite (the padding rows attend something, so their softmax is not
  0/0 = NaN, and a NaN anywhere in the cache would reach every row through its masked score);
- costs no slot of the pool: the sink sits past the S slots the scheduler accounts for. Writing
  padding into free pool slots instead would work only while some slot is free, i.e. not for the
  batch that fills the pool;
- cannot race a real write: the scatter's indices of real rows are distinct slots, and several
  padding rows writing the one sink collide only with each other (whichever wins is discarded).
The padding rows' logits are computed (R = T) and dropped.

The slot table, masks, sampling, tokenizer and KV calls are the dynamic backend's (backend.py); only
session setup and `decode_arrays` differ.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...errors import BackendError
from ..llamacpp.vocab import LlamaVocab
from .backend import OnnxBackend
from .session import bind_caches, open_session, open_vocab

_PAD_TOKEN = 0  # any valid id: its K/V land in the sink and its logits are dropped


@dataclass(frozen=True)
class StaticLayout:
    """The static graphs of a folder: bucket T -> graph file, and the fixed slot count S."""

    buckets: tuple[int, ...]
    slots: int
    graphs: dict[int, str]

    @classmethod
    def from_meta(cls, meta: dict[str, Any], model_dir: Path) -> StaticLayout:
        """The layout localserve-onnx.json describes; BackendError naming what is wrong."""
        static = meta.get("static")
        try:
            buckets = tuple(sorted(int(t) for t in static["tokens"]))
            slots = int(static["slots"])
            graphs = {int(t): str(f) for t, f in static["graphs"].items()}
            sink = int(static["sink_rows"])
        except (TypeError, KeyError, ValueError, AttributeError):
            raise BackendError("the static ONNX folder's localserve-onnx.json lacks a valid 'static' entry "
                               "(tokens, slots, sink_rows, graphs); convert the model again") from None
        if not buckets or min(buckets) < 1 or slots < max(buckets) or sink != 1 or set(graphs) != set(buckets):
            raise BackendError(f"the static ONNX folder's layout is inconsistent (tokens {list(buckets)}, "
                               f"slots {slots}, graphs for {sorted(graphs)}); convert the model again")
        for name in graphs.values():
            if Path(name).name != name or not (model_dir / name).is_file():
                raise BackendError(f"the static ONNX folder has no graph file {name[:60]!r}; convert the model again")
        return cls(buckets, slots, graphs)

    def bucket(self, n: int) -> int:
        """The smallest bucket holding `n` tokens (n <= the largest)."""
        return next(t for t in self.buckets if t >= n)


def shared_weights(graph_path: Path) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The graphs' external weights as OrtValues over one read-only memory map of the data file, for
    every bucket's session to use in place, and the arrays under them, which must outlive every
    session (the OrtValues do not keep them alive: a freed map crashed the process). Each session loading the file itself held its own copy:
    SmolLM2 with buckets 1,16,64 took 1,940 MiB against the dynamic flavour's 687."""
    import onnx
    import onnxruntime as ort

    proto = onnx.load(str(graph_path), load_external_data=False)
    dtypes = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.UINT8: np.uint8}  # what the converter writes
    maps: dict[str, np.memmap] = {}
    shared: dict[str, Any] = {}
    arrays: list[np.ndarray] = []
    try:
        for t in proto.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            ext = {e.key: e.value for e in t.external_data}
            path = graph_path.parent / ext["location"]
            if Path(ext["location"]).name != ext["location"] or t.data_type not in dtypes:
                raise ValueError(ext["location"])
            data = maps.setdefault(ext["location"], np.memmap(path, dtype=np.uint8, mode="r"))
            dtype = np.dtype(dtypes[t.data_type])  # uint8: int4 folders' MatMulNBits blocks
            arrays.append(np.frombuffer(data, dtype, int(ext["length"]) // dtype.itemsize, int(ext["offset"]))
                          .reshape(tuple(t.dims)))
            shared[t.name] = ort.OrtValue.ortvalue_from_numpy(arrays[-1])
    except (OSError, KeyError, ValueError) as e:
        raise BackendError(f"the static ONNX folder's weights cannot be read ({type(e).__name__}); "
                           "convert the model again") from None
    return shared, arrays


class StaticOnnxBackend(OnnxBackend):
    sink_rows = 1  # cache row S: where padding rows write (module docstring)

    def __init__(self, sessions: dict[int, Any], layout: StaticLayout, meta: dict, vocab: LlamaVocab, *,
                 n_seq_max: int, n_batch: int, n_threads: int) -> None:
        largest = layout.buckets[-1]
        super().__init__(sessions[largest], meta, vocab, n_ctx=layout.slots, n_seq_max=n_seq_max,
                         n_batch=n_batch, n_threads=n_threads)
        self.layout = layout
        self.sessions = sessions
        self._bindings = {largest: self._io}
        for t, session in sessions.items():
            if t != largest:  # every bucket's graph reads and writes the same cache buffers
                self._bindings[t] = session.io_binding()
                bind_caches(self._bindings[t], self._caches)
        # Each bucket's logits land in one fixed buffer: no allocation per run.
        self._out = {t: np.zeros((t, self.n_vocab), dtype=np.float32) for t in layout.buckets}
        for t, io in self._bindings.items():
            io.bind_output("logits", "cpu", element_type=np.float32, shape=self._out[t].shape,
                           buffer_ptr=self._out[t].ctypes.data)
        self.runs_by_bucket = dict.fromkeys(layout.buckets, 0)  # session.run calls per graph, for tests
        self._capabilities = dataclasses.replace(self._capabilities, micro_batch=min(largest, n_batch))

    @classmethod
    def open(cls, model_dir: Path, meta: dict, gguf_path: str | os.PathLike[str], *, n_seq_max: int,
             n_batch: int, n_threads: int, providers: Sequence[str]) -> StaticOnnxBackend:
        """A static folder's backend (load.py dispatches here): one session per bucket."""
        layout = StaticLayout.from_meta(meta, model_dir)
        shared, arrays = shared_weights(model_dir / layout.graphs[layout.buckets[-1]])
        # MatMulNBits runs its fast kernels only on blocks it prepacked (unpacked: float activations,
        # 9x slower on SmolLM2 int8, and other greedy tokens than the dynamic folder), so an
        # int4/int8 folder's sessions each pack their own copy; fp32 ones share the floats unpacked.
        # The price, SmolLM2 int8 with buckets 1,16,64: +991 MiB RSS at load (fp32: +50 MiB, pages
        # come in as runs touch them); ORT's shared prepacked-weights container would avoid it.
        prepack = meta.get("weights", "fp32") != "fp32"
        sessions = {t: open_session(model_dir / layout.graphs[t], n_threads, providers, shared, prepack)
                    for t in layout.buckets}
        backend = cls(sessions, layout, meta, open_vocab(gguf_path, meta), n_seq_max=n_seq_max, n_batch=n_batch,
                      n_threads=n_threads)
        backend._weights = (shared, arrays)  # for as long as the sessions read them
        return backend

    def decode_arrays(self, tokens: np.ndarray, seqs: np.ndarray, pos: np.ndarray, want: np.ndarray,
                      interruptible: bool = False) -> None:
        """decode() in runs of at most the largest bucket; each run sees the KV its predecessors
        wrote. A failed run rolls the slot table back to before the call: every sequence is as it
        was (the rows earlier runs wrote sit in slots nobody holds)."""
        n = tokens.size
        self._check_batch(tokens, seqs, pos)
        slots = self.slots.plan(n)  # KVFullError before anything runs; runs take their share in order
        before = self.slots.snapshot()
        rows: list[np.ndarray] = []
        try:
            for start in range(0, n, self.layout.buckets[-1]):
                part = slice(start, min(n, start + self.layout.buckets[-1]))
                logits = self._run(tokens[part], seqs[part], pos[part], slots[part], interruptible)
                self.slots.commit(seqs[part], pos[part], slots[part])
                # Boolean indexing copies: the buffer is the next run's output. Padding rows drop here.
                rows.append(logits[:part.stop - part.start][want[part]])
        except BaseException:
            self.slots.restore(before)
            raise
        wanted = np.flatnonzero(want)
        self._logits = np.concatenate(rows) if rows else np.zeros((0, self.n_vocab), np.float32)
        self._row_of[:n] = -1
        self._row_of[wanted] = np.arange(wanted.size)
        self._n_out = n

    def _run(self, tokens: np.ndarray, seqs: np.ndarray, pos: np.ndarray, slots: np.ndarray,
             interruptible: bool) -> np.ndarray:
        """One session.run of the smallest bucket holding these tokens, padded; its logits [T, vocab]."""
        n, S = tokens.size, self.layout.slots
        t = self.layout.bucket(n)
        ids = np.full(t, _PAD_TOKEN, dtype=np.int64)
        positions = np.zeros(t, dtype=np.int64)
        rows = np.full(t, S, dtype=np.int64)  # padding writes the sink row S
        ids[:n], positions[:n], rows[:n] = tokens, pos, slots
        bias = np.full((t, S + 1), -np.inf, dtype=np.float32)
        bias[:n, :S] = self.slots.bias(seqs, pos, slots)
        bias[n:, S] = 0.0  # padding attends the sink only
        io = self._bindings[t]
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("positions", positions)
        io.bind_cpu_input("slots", rows)
        io.bind_cpu_input("attn_bias", bias)
        io.bind_cpu_input("logits_idx", np.arange(t, dtype=np.int64))
        self.runs_by_bucket[t] += 1
        self._run_session(self.sessions[t], io, interruptible)
        return self._out[t]
