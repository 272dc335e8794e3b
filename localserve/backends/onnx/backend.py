"""The ONNX Runtime backend: our converter's packed decoder graph (convert/graph.py) under our scheduler.

One `session.run` computes a packed batch of any sequences' tokens side by side with no padding:
the scheduler's mixed prompt chunks and decodes. The KV cache is one pool of slots
(onnx_kv.SlotTable) held in OrtValues that are bound as both the graph's cache inputs and its
cache outputs, so each run writes its new rows in place and nothing is copied per step. The
tokenizer is llama.cpp's own (llamacpp_vocab), the chat template the GGUF's, and sampling has the
llama.cpp backend's parameters and semantics (sampling.py; grammars and JSON schemas through
llama.cpp's own grammar sampler). Embeddings come from the graph's embeddings output, pooled as the
llama.cpp backend pools them (onnx_embed).

Threading as for every backend: decode, sampling and KV calls on the engine thread; tokenize,
token_to_bytes and is_eog are safe from any thread.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Generator, Sequence

import numpy as np

from ...errors import BackendError
from ...protocol.requests import SamplingParams
from ..base import Backend, BatchToken, Capabilities, DecodeInterrupted, Sampler
from ..llamacpp.vocab import LlamaVocab
from ..common.grammar import GRAMMAR_CONSTRAINTS
from .sampling import LlamaVocabLogits, numpy_sampler
from .embed import OnnxEmbedder, has_embeddings
from .kv import SlotTable
from .session import MODEL_FILE, bind_caches, open_session, open_vocab

log = logging.getLogger(__name__)

class OnnxBackend(Backend):
    sink_rows = 0  # cache rows past the n_ctx slots (the static flavour's padding sink)

    def __init__(self, session, meta: dict, vocab: LlamaVocab, *, n_ctx: int, n_seq_max: int,
                 n_batch: int, n_threads: int) -> None:
        import onnxruntime as ort

        self._ort = ort
        self.session = session
        self.meta = meta
        self.vocab = vocab
        self.info = vocab.info
        self.n_vocab = int(meta["n_vocab"])
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        self.n_threads = n_threads
        self.n_layer = int(meta["n_layer"])
        self.max_pos = int(meta["context_length"])  # the rope tables' length
        self.slots = SlotTable(n_ctx, n_seq_max)
        shape = (int(meta["n_head_kv"]), n_ctx + self.sink_rows, int(meta["head_dim"]))
        self._io = session.io_binding()
        # Kept here so the OrtValues live as long as a binding names them.
        self._caches = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=np.float32))
                        for _ in range(2 * self.n_layer)]
        bind_caches(self._io, self._caches)
        self._logits = np.zeros((0, self.n_vocab), dtype=np.float32)
        self._row_of = np.full(n_batch, -1, dtype=np.int64)  # batch index -> logits row, -1: none
        self._n_out = 0
        self._closed = False
        self._embedder: OnnxEmbedder | None = None  # made on the first embed call
        self._grammar_host = LlamaVocabLogits(self, vocab.vocab)  # constrained samplers read through it
        # interrupt() sets `terminate` on the options of interruptible runs; ORT checks it between
        # the graph's nodes. An EP that compiles the graph into one node (an NPU's) would check it
        # only at the end, so only the CPU EP declares itself interruptible.
        self._stoppable_run = ort.RunOptions()
        self._capabilities = Capabilities(
            max_batch_tokens=n_batch,
            kv_cells=n_ctx,
            kv_cells_per_seq=n_ctx,
            max_seqs=n_seq_max,
            prefix_sharing="share",  # kv_copy shares slots (reference-counted)
            consecutive_ids=False,  # any sequences go in one run: ids do not matter
            micro_batch=n_batch,  # one run per decode, whatever its length
            # The matmuls run every row through the same kernels whatever the batch's shape, so a
            # lone prompt row is computed like any other: no chunk rule is needed.
            min_chunk=1,
            min_recompute=1,
            constraints=GRAMMAR_CONSTRAINTS,
            # Converters before the embeddings output made graphs without it; the static flavour's
            # fixed cache shapes leave no room for the embedder's own per-group cache.
            embeddings=has_embeddings(session) and meta.get("flavour") == "dynamic",
            interruptible=session.get_providers()[0] == "CPUExecutionProvider",
        )

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @classmethod
    def open(cls, model_dir: Path, meta: dict, gguf_path: str | os.PathLike[str], *, n_ctx: int, n_seq_max: int,
             n_batch: int, n_threads: int, providers: Sequence[str]) -> OnnxBackend:
        """A dynamic folder's backend (load.py reads the folder's flavour and calls this)."""
        session = open_session(model_dir / MODEL_FILE, n_threads, providers)
        return cls(session, meta, open_vocab(gguf_path, meta), n_ctx=n_ctx, n_seq_max=n_seq_max,
                   n_batch=n_batch, n_threads=n_threads)

    def close(self) -> None:
        self._closed = True
        self._n_out = 0
        self._caches.clear()
        if self._embedder is not None:
            self._embedder.close()
        self.vocab.close()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the model has been unloaded")

    # --- compute --------------------------------------------------------------------------
    def decode(self, batch: Sequence[BatchToken], interruptible: bool = False) -> None:
        self._check_open()
        n = len(batch)
        if not 0 < n <= self.n_batch:
            raise ValueError(f"a batch holds 1..{self.n_batch} tokens (got {n})")
        tokens = np.fromiter((b.token for b in batch), np.int64, n)
        seqs = np.fromiter((b.seq_id for b in batch), np.int64, n)
        pos = np.fromiter((b.pos for b in batch), np.int64, n)
        want = np.fromiter((b.logits for b in batch), bool, n)
        self.decode_arrays(tokens, seqs, pos, want, interruptible and self._capabilities.interruptible)

    def interrupt(self) -> None:
        self._stoppable_run.terminate = True

    def clear_interrupt(self) -> None:
        self._stoppable_run.terminate = False

    def decode_arrays(self, tokens: np.ndarray, seqs: np.ndarray, pos: np.ndarray, want: np.ndarray,
                      interruptible: bool = False) -> None:
        """decode() for callers that hold columns already."""
        n = tokens.size
        self._check_batch(tokens, seqs, pos)
        slots = self.slots.plan(n)  # KVFullError before anything runs
        rows = np.flatnonzero(want)
        io = self._io
        io.bind_cpu_input("input_ids", tokens)
        io.bind_cpu_input("positions", pos)
        io.bind_cpu_input("slots", slots)
        io.bind_cpu_input("attn_bias", self.slots.bias(seqs, pos, slots))
        io.bind_cpu_input("logits_idx", rows.astype(np.int64))
        io.bind_output("logits", "cpu")  # its row count changes per step: a fresh output each run
        # On failure the rows it wrote sit in slots nobody holds: every sequence is as it was.
        self._run_session(self.session, io, interruptible)
        self.slots.commit(seqs, pos, slots)
        self._logits = io.get_outputs()[-1].numpy()  # bound last: the caches are bound first
        self._row_of[:n] = -1
        self._row_of[rows] = np.arange(rows.size)
        self._n_out = n

    def _run_session(self, session, io, interruptible: bool) -> None:
        """One run of a bound session; BackendError or DecodeInterrupted when it fails."""
        try:
            session.run_with_iobinding(io, self._stoppable_run if interruptible else None)
        except Exception as e:  # noqa: BLE001 - ORT's errors carry paths and internals
            if interruptible and self._stoppable_run.terminate:
                raise DecodeInterrupted("decode interrupted") from None
            log.warning("onnxruntime run failed: %s", e)
            raise BackendError(f"decode failed in onnxruntime ({type(e).__name__})") from None

    def _check_batch(self, tokens: np.ndarray, seqs: np.ndarray, pos: np.ndarray) -> None:
        """ValueError for ids out of range, before anything runs; the previous step's rows are gone."""
        self._check_open()
        self._n_out = 0
        if ((tokens < 0) | (tokens >= self.n_vocab)).any():
            raise ValueError("token id out of the vocabulary")
        if ((seqs < 0) | (seqs >= self.n_seq_max)).any():
            raise ValueError(f"sequence id out of range 0..{self.n_seq_max - 1}")
        if ((pos < 0) | (pos >= self.max_pos)).any():
            raise ValueError(f"position out of range 0..{self.max_pos - 1}")

    def logits_row(self, batch_index: int) -> np.ndarray:
        """The logits of `batch_index` in the last decode (read-only; valid until the next one)."""
        if not 0 <= batch_index < self._n_out or self._row_of[batch_index] < 0:
            raise ValueError(f"batch row {batch_index} produced no logits in the last decode")
        row = self._logits[self._row_of[batch_index]]
        row.flags.writeable = False
        return row

    def logits(self, batch_index: int) -> np.ndarray:
        return self.logits_row(batch_index).copy()

    def new_sampler(self, params: SamplingParams, prompt_tokens: Sequence[int]) -> Sampler:
        self._check_open()
        return numpy_sampler(self, self._grammar_host, params, prompt_tokens)

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        self._check_open()
        return self._get_embedder().embed(inputs) if inputs else []

    def embed_steps(self, inputs: Sequence[Sequence[int]]) -> Generator[bool, None, list[list[float]]]:
        self._check_open()
        if not inputs:
            return []
        return (yield from self._get_embedder().embed_steps(inputs))

    def _get_embedder(self) -> OnnxEmbedder:
        if not self.capabilities.embeddings:
            raise BackendError("this ONNX graph has no embeddings output; convert the model again")
        if self._embedder is None:  # only the engine thread embeds: no lock needed
            m = self.meta
            self._embedder = OnnxEmbedder(
                self.session, n_layer=self.n_layer, n_head_kv=int(m["n_head_kv"]), head_dim=int(m["head_dim"]),
                n_ctx=self.capabilities.kv_cells_per_seq, n_batch=self.n_batch,
                n_seq_max=min(self.n_seq_max, 64), n_embd=int(m["n_embd"]), n_vocab=self.n_vocab)
        return self._embedder

    # --- KV cache -------------------------------------------------------------------------
    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"sequence id {seq_id} out of range 0..{self.n_seq_max - 1}")

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        self._check_seq(seq_id)
        self.slots.remove(seq_id, p0, p1)

    def kv_copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._check_seq(src)
        self._check_seq(dst)
        self.slots.copy(src, dst, p0, p1)

    def kv_pos_max(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return self.slots.pos_max(seq_id)

    # --- tokenizer ------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.vocab.tokenize(text, add_special, parse_special)

    def token_to_bytes(self, token: int, special: bool = False) -> bytes:
        return self.vocab.token_to_bytes(token, special)

    def token_text(self, token: int) -> str:
        return self.vocab.token_text(token)

    def is_eog(self, token: int) -> bool:
        return self.vocab.is_eog(token)
