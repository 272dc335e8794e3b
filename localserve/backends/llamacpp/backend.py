"""The llama.cpp backend: one model, one context whose KV cache holds many sequences (one stream
per sequence, as the product runs it, or one unified pool: see LlamaCppBackend.load).

Built on llama-cpp-python's low-level ctypes API (pinned: its signatures move between releases).
Everything that could make llama.cpp abort the process (more than n_batch tokens in one decode,
sequence ids out of range in KV calls, sampling rows that produced no logits) is checked here first
and raised as a Python error, so one bad request never takes the daemon down.

Threading: `decode`, `Sampler.sample` and the KV calls belong to one thread (the engine's step
loop); the logits of a decode are valid only until the next one. `tokenize`, `token_to_bytes`,
`is_eog` read the immutable vocabulary and are safe from any thread. `embed` runs on its own
context behind its own lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Generator, Iterator, Sequence

import llama_cpp
import numpy as np

from ...protocol.requests import LoraSet, SamplingParams
from ...errors import BackendError, InvalidRequestError
from ...protocol.media import AudioInput, ImageInput, MediaInput
from ..base import Backend, BatchToken, Capabilities, DecodeInterrupted, KVFullError, KVRequest, KVSizing
from .batch import PackedBatch, media_calls, stream_groups
from ..common.grammar import GRAMMAR_CONSTRAINTS
from ..common.threads import default_threads
from .pooled import PooledContexts, close_all
from .info import read_model_info
from .interrupt import InterruptFlag, available as interrupt_available
from .offload import OffloadFacts, parse_load_log
from .lora import LoraAdapters
from .loading import GpuSplit, check_load_args, context_params, load_model, make_context
from .runtime import ensure_runtime, error_count, last_error_since
from .sampling import LlamaCppSampler
from .tokenizer import LlamaTokenizer
from . import kv_pages, seq_copy, sizing

if TYPE_CHECKING:  # media.py loads libmtmd: only a model with a projector needs it
    from .media import Projector

log = logging.getLogger(__name__)

def _free_native(model, ctx, pooled: list, projector_box: list) -> None:
    # Order matters: contexts (the projector's too) reference the model.
    close_all(pooled)
    if projector_box and projector_box[0] is not None:
        projector_box[0].close()
    if ctx:
        llama_cpp.llama_free(ctx)
    if model:
        llama_cpp.llama_model_free(model)


class LlamaCppBackend(LlamaTokenizer, Backend):
    exact_attention = False  # see load() and loading.context_params
    adjustable_threads = True  # llama_set_n_threads, between decodes

    def __init__(self, model, ctx, path: Path, *, n_threads: int, kv_unified: bool) -> None:
        self.model = model
        self.ctx = ctx
        self.kv_unified = kv_unified  # what the context was created with (load)
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.memory = llama_cpp.llama_get_memory(ctx)
        self.n_ctx = llama_cpp.llama_n_ctx(ctx)
        self.n_ctx_seq = llama_cpp.llama_n_ctx_seq(ctx)  # cells one sequence may hold
        self.n_batch = llama_cpp.llama_n_batch(ctx)
        self.n_ubatch = llama_cpp.llama_n_ubatch(ctx)
        self.n_seq_max = llama_cpp.llama_n_seq_max(ctx)
        self._cell_copy = seq_copy.cell_copy_possible(model)  # kv_copy across streams, cell by cell
        self._pages: kv_pages.StreamKeeper | None = None  # load() sets it where streams' pages can go back
        self.n_threads = n_threads
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_embd = llama_cpp.llama_model_n_embd(model)
        self.token_ids = np.arange(self.n_vocab, dtype=np.int32)  # read-only helper for samplers
        self.token_ids.flags.writeable = False
        self._row_type = ctypes.c_float * self.n_vocab
        self._packed = PackedBatch(self.n_batch)
        self._part = PackedBatch(self.n_batch)  # one llama_decode call's share of a batch (stream_groups)
        self._outputs = np.zeros(self.n_batch, dtype=np.int8)  # which rows of the last decode have logits
        self._n_out = 0  # rows of the last successful decode (0: no logits valid)
        # Where a batch row's logits are after a decode that took several llama_decode calls: rows of
        # the last call are read in place (_row_in_call), earlier calls' rows were copied (_held).
        self._row_in_call = np.arange(self.n_batch)
        self._held: dict[int, np.ndarray] = {}
        self._interrupt = InterruptFlag(ctx)
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._pooled = PooledContexts(model, n_ctx_seq=self.n_ctx_seq, n_batch=self.n_batch, n_seq_max=self.n_seq_max,
                                      n_threads=n_threads, n_embd=self.n_embd, n_vocab=self.n_vocab)
        self._projector_box: list[Projector | None] = [None]  # load(mmproj=...) attaches one
        self._embd_part: PackedBatch | None = None  # a call's image rows, as embeddings
        self._loras = LoraAdapters([], [])  # load(loras=...) loads them
        self._closed = False
        self._finalizer = weakref.finalize(self, _free_native, model, ctx, self._pooled.contexts, self._projector_box)
        self.info = read_model_info(model, self.vocab, path, n_vocab=self.n_vocab, n_embd=self.n_embd)
        self.offload = OffloadFacts()  # load() fills it in from the load's log lines
        self._capabilities = self._read_capabilities()

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @classmethod
    def plan_kv(cls, want: KVRequest) -> KVSizing:
        """llama.cpp's streams-or-unified layout, 256-cell padding and id limit (sizing.py)."""
        return sizing.plan_kv(want)

    def _read_capabilities(self) -> Capabilities:
        """The scheduler's rules for this context, from its parameters."""
        return Capabilities(
            max_batch_tokens=self.n_batch,
            kv_cells=self.n_ctx,
            kv_cells_per_seq=self.n_ctx_seq,
            max_seqs=self.n_seq_max,
            # A unified pool shares a copied prefix's cells; with streams kv_copy copies them.
            prefix_sharing="share" if self.kv_unified else "copy",
            # With streams llama.cpp's splitter (split_equal) batches only consecutive ids together:
            # other ids cost a pass over the weights each (batching/kvpool.py has the numbers).
            consecutive_ids=not self.kv_unified,
            micro_batch=self.n_ubatch,
            # A lone prompt row of a sequence in a micro-batch takes the GEMV kernels, which round
            # differently from a GEMM over several rows (stream_groups): two keep answers exact.
            min_chunk=min(2, self.n_ubatch),
            min_recompute=2,
            constraints=GRAMMAR_CONSTRAINTS,  # grammar.py compiles schemas to GBNF
            embeddings=True,  # a second, pooling context on first use (llamacpp_embed.py)
            interruptible=interrupt_available(),  # set_offload turns it off for GPU layers
            # Rejected drafts are removed with seq_rm of a suffix, which a recurrent or hybrid
            # model's state cannot do (llama-server probes the same and turns speculation off).
            speculation=not (llama_cpp.llama_model_is_recurrent(self.model)
                             or llama_cpp.llama_model_is_hybrid(self.model)),
        )

    # --- lifecycle ------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        n_ctx: int,
        n_seq_max: int,
        n_batch: int,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        cpu_moe_layers: int = 0,
        split: GpuSplit = GpuSplit(),
        embeddings: bool = False,
        exact_attention: bool = False,
        kv_unified: bool = True,
        flash_attention: bool = True,
        kv_type: str = "f16",
        extra_buffers: bool | None = None,
        mmproj: str | os.PathLike[str] | None = None,
        loras: Sequence[str | os.PathLike[str]] = (),
    ) -> LlamaCppBackend:
        """Load a GGUF model and create its batching context.

        n_ctx: KV cells of all sequences together: one pool (kv_unified, so kv_copy can share
            prefixes) or n_seq_max streams of n_ctx / n_seq_max cells each.
        n_seq_max: sequence ids 0..n_seq_max-1 (llama.cpp allows at most 256).
        n_batch: the most tokens one decode may carry (the scheduler's step budget must not exceed it).
        cpu_moe_layers: the first N layers' MoE experts stay in RAM (--n-cpu-moe N; -1: all, --cpu-moe).
        split: the layers over several GPUs (--split-mode, --main-gpu, --tensor-split; moe.py, loading.py).
        embeddings: create the embeddings context now instead of at the first embed() call.
        exact_attention, kv_unified, flash_attention, kv_type: the KV cache's precision and layout
            and the attention kernel; loading.context_params says what each changes in answers
            and memory (measured), and why the product loads per-sequence streams.
        extra_buffers: llama.cpp's extra CPU buffer types (AMX, repacked Q4_0/Q4_K layouts). False
            where the build's AMX path kills the process here (probe.py); None, the default, follows
            this build's recorded probe verdict on this machine (no probe is run).
        mmproj: the model's projector file (llama.cpp's mtmd); with it the model takes images
            where mtmd says the projector sees (`info.vision`, `info.audio`; media.py).
        loras: LoRA adapter files, ids 0, 1, ... (`info.loras`); set_adapters picks the decodes' set.
        """
        path = Path(path)
        check_load_args(path, n_ctx, n_seq_max, n_batch, kv_type)
        ensure_runtime()
        n_threads = n_threads or default_threads()
        model, load_lines = load_model(path, n_gpu_layers, extra_buffers, cpu_moe_layers, split)
        cparams = context_params(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch, n_threads=n_threads,
                                 kv_unified=kv_unified, kv_type=kv_type, flash_attention=flash_attention,
                                 exact_attention=exact_attention)
        ctx, context_lines, pages = make_context(model, cparams, path)
        backend = cls(model, ctx, path, n_threads=n_threads, kv_unified=kv_unified)
        backend._pages = kv_pages.StreamKeeper(pages, backend.memory) if pages else None
        backend.set_offload(parse_load_log(load_lines + context_lines))
        backend.exact_attention = exact_attention
        with backend._closed_on_error():
            backend._attach_loras(loras)
            if mmproj is not None:
                backend._attach_projector(mmproj, use_gpu=n_gpu_layers != 0)
        if embeddings:
            backend._pooled.embedder()
        return backend

    @contextlib.contextmanager
    def _closed_on_error(self) -> Iterator[None]:
        """Frees the model and its context where a step after the context's creation fails: the
        caller never got the backend, so nobody else would."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def _attach_loras(self, paths: Sequence[str | os.PathLike[str]]) -> None:
        self._loras = LoraAdapters.load(self.model, paths)
        self.info.loras = self._loras.paths

    def _attach_projector(self, mmproj: str | os.PathLike[str], *, use_gpu: bool) -> None:
        from .media import Projector  # libmtmd: only a model with a projector loads it

        projector = Projector.load(mmproj, self.model, self.n_embd, self.n_threads, use_gpu=use_gpu)
        self._projector_box[0] = projector
        self.info.vision = projector.vision
        self.info.audio = projector.audio

    def set_adapters(self, adapters: LoraSet) -> None:
        self._loras.apply(self.ctx, adapters)

    def set_offload(self, facts: OffloadFacts) -> None:
        """Record where the load put the model (its log lines' facts) in `info`."""
        self.offload = facts
        self.info.gpu_layers = facts.gpu_layers
        self.info.offloadable_layers = facts.offloadable_layers
        self.info.gpu_memory_bytes = facts.gpu_memory_bytes
        self.info.moe_layers_in_ram = facts.moe_layers_in_ram
        self.info.gpu_memory_by_device = dict(facts.bytes_by_device) if facts.gpu_layers else {}
        if facts.gpu_layers:  # GPU backends never call the abort callback (llamacpp_interrupt.py)
            self._capabilities = dataclasses.replace(self._capabilities, interruptible=False)

    def close(self) -> None:
        self._closed = True
        self._n_out = 0
        self._finalizer()  # idempotent

    def __enter__(self) -> LlamaCppBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the model has been unloaded")

    # --- compute --------------------------------------------------------------------------
    def decode(self, batch: Sequence[BatchToken], interruptible: bool = False) -> None:
        self._check_open()
        self._packed.fill_tokens(batch)
        self._run(self._packed, interruptible and self._capabilities.interruptible)

    def set_threads(self, n: int) -> None:
        self._check_open()
        n = max(1, min(self.n_threads, n))
        llama_cpp.llama_set_n_threads(self.ctx, n, n)
        self._pooled.set_threads(n)

    def interrupt(self) -> None:
        self._interrupt.set()

    def clear_interrupt(self) -> None:
        self._interrupt.clear()

    def compute_ticks(self) -> int:
        """Graph nodes computed, counted by llama.cpp's abort callback as a decode runs (interrupt.py),
        for change only; 0 where it cannot count. Any thread: a worker's heartbeat reads it mid-step."""
        return self._interrupt.ticks()

    def decode_arrays(self, tokens, seq_ids, positions, logits) -> None:
        """decode() for callers that already hold columns (numpy arrays or lists): no BatchToken objects."""
        self._check_open()
        self._packed.fill(tokens, seq_ids, positions, logits)
        self._run(self._packed)

    def _run(self, packed: PackedBatch, interruptible: bool = False) -> None:
        packed.check_ids(self.n_vocab, self.n_seq_max)
        n = packed.n_tokens
        self._n_out = 0  # the previous step's rows are gone whatever happens next
        self._held.clear()
        self._interrupt.arm(interruptible)
        if interruptible and self._interrupt.is_set():
            raise DecodeInterrupted("decode interrupted before it started")
        groups = None if self.kv_unified else stream_groups(packed.seq[:n])
        media = packed.media_rows()
        images: dict[int, np.ndarray] = {}
        if media.any():  # image rows: calls of their own, their embeddings ready before the first
            groups = media_calls(groups, n, media)
            images = self._image_rows(packed, groups)
        errors_before = error_count()
        if groups is None:
            self._row_in_call[:n] = np.arange(n)
            self._decode_call(packed, packed, 0, errors_before)
        else:
            last = len(groups) - 1
            for k, rows in enumerate(groups):
                part = self._part
                if k in images:
                    part = self._embd_part
                    part.fill_embeddings(images[k], packed.seq[rows], packed.pos[rows], packed.logits[rows])
                else:
                    part.fill(packed.token[rows], packed.seq[rows], packed.pos[rows], packed.logits[rows])
                self._decode_call(packed, part, k, errors_before)
                if k < last:  # the next call overwrites llama.cpp's logits: keep this call's
                    for j in np.flatnonzero(part.logits[: part.n_tokens]):
                        held = self._ctx_row(int(j)).copy()
                        held.flags.writeable = False
                        self._held[int(rows[j])] = held
                else:
                    self._row_in_call[rows] = np.arange(len(rows))
        if self._pages is not None:
            self._pages.decoded()
        self._outputs[:n] = packed.logits[:n]
        self._n_out = n

    def _image_rows(self, packed: PackedBatch, calls: list[np.ndarray]) -> dict[int, np.ndarray]:
        """call index -> the embeddings of its image rows, encoding what is not yet (media.py)."""
        projector = self._projector_box[0]
        if projector is None:
            raise ValueError("negative token ids (image positions) in a batch for a model without a projector")
        if self._embd_part is None:
            self._embd_part = PackedBatch(self.n_batch, self.n_embd)
        return {k: projector.embeddings(packed.ids[rows]) for k, rows in enumerate(calls) if packed.ids[rows[0]] < 0}

    def _decode_call(self, packed: PackedBatch, part: PackedBatch, k: int, errors_before: int) -> None:
        """One llama_decode of `part` (call k of `packed`); on failure nothing of `packed` is kept."""
        rc = llama_cpp.llama_decode(self.ctx, part.struct)
        if rc == 0:
            return
        if k > 0 or rc not in (1, -1):
            # Earlier calls of this batch were kept, and 2 (aborted) and < -1 (compute error) keep
            # the micro-batches already processed: drop them so every sequence is back where it
            # was (1 and -1 on the first call mean nothing was processed).
            self._rollback(packed)
        if rc == 1:
            raise KVFullError(f"no room in the KV cache for a batch of {packed.n_tokens} tokens")
        if rc == 2 and self._interrupt.is_set():
            raise DecodeInterrupted(f"decode of {packed.n_tokens} tokens interrupted")
        reason = last_error_since(errors_before)
        raise BackendError(f"decode failed (llama.cpp code {rc})" + (f": {reason}" if reason else ""))

    def _rollback(self, packed: PackedBatch) -> None:
        n = packed.n_tokens
        seqs, pos = packed.seq[:n], packed.pos[:n]
        for s in np.unique(seqs):
            llama_cpp.llama_memory_seq_rm(self.memory, int(s), int(pos[seqs == s].min()), -1)

    def logits_row(self, batch_index: int) -> np.ndarray:
        """A read-only view of the logits of `batch_index` in the last decode; valid until the next one."""
        if not 0 <= batch_index < self._n_out or not self._outputs[batch_index]:
            # llama.cpp returns NULL here in release builds but GGML_ASSERTs inside llama_sampler_sample.
            raise ValueError(f"batch row {batch_index} produced no logits in the last decode")
        held = self._held.get(batch_index)
        if held is not None:
            return held
        return self._ctx_row(int(self._row_in_call[batch_index]))

    def _ctx_row(self, row_in_call: int) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, row_in_call)
        if not ptr:
            raise BackendError(f"no logits for batch row {row_in_call}")
        # frombuffer over a cached ctypes array type: a third of np.ctypeslib.as_array's cost, and
        # this runs once per sequence per step.
        row = np.frombuffer(self._row_type.from_address(ctypes.addressof(ptr.contents)), dtype=np.float32)
        row.flags.writeable = False
        return row

    def logits(self, batch_index: int) -> np.ndarray:
        """A copy of the logits of `batch_index` in the last decode."""
        return self.logits_row(batch_index).copy()

    def new_sampler(self, params: SamplingParams, prompt_tokens: Sequence[int]) -> LlamaCppSampler:
        self._check_open()
        return LlamaCppSampler(self, params, prompt_tokens)

    # --- images (media.py) -------------------------------------------------------------------
    def tokenize_media(self, text: str, images: Sequence[MediaInput], add_special: bool = True) -> list[int]:
        return self._projector_for(images).tokenize(text, images, add_special)

    def hold_media(self, tokens: Sequence[int], images: Sequence[MediaInput]) -> object:
        return self._projector_for(images).hold(tokens, images)

    def release_media(self, held: object) -> None:
        projector = self._projector_box[0]
        if projector is not None and isinstance(held, list):
            projector.release(held)

    def _projector_for(self, media: Sequence[MediaInput]) -> Projector:
        """The projector, where it takes every kind in `media`; InvalidRequestError naming the kind."""
        self._check_open()
        projector = self._projector_box[0]
        if any(isinstance(m, ImageInput) for m in media) and not (projector and projector.vision):
            raise InvalidRequestError(f"{self.info.name} takes no images: it was loaded without a projector "
                                      "that sees", param="model")
        if any(isinstance(m, AudioInput) for m in media) and not (projector and projector.audio):
            raise InvalidRequestError(f"{self.info.name} takes no audio: it was loaded without a projector "
                                      "that hears", param="model")
        if projector is None:
            raise InvalidRequestError(f"{self.info.name} was loaded without a projector", param="model")
        return projector

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        self._check_open()
        if not inputs:
            return []
        return self._pooled.embedder().embed(inputs)

    def embed_steps(self, inputs: Sequence[Sequence[int]]) -> Generator[bool, None, list[list[float]]]:
        self._check_open()
        if not inputs:
            return []
        return (yield from self._pooled.embedder().embed_steps(inputs))

    def rank_steps(self, inputs: Sequence[Sequence[int]],
                   room: Callable[[int], int] | None = None) -> Generator[bool, None, list[float]]:
        self._check_open()
        if not inputs:
            return []
        return (yield from self._pooled.ranker().score_steps(inputs, room))

    # --- KV cache -------------------------------------------------------------------------
    def _check_seq(self, seq_id: int) -> None:
        # Out-of-range ids are GGML_ASSERTs (process abort) inside llama_memory_seq_*.
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"sequence id {seq_id} out of range 0..{self.n_seq_max - 1}")

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        self._check_open()
        self._check_seq(seq_id)
        held = self._pages is not None and llama_cpp.llama_memory_seq_pos_max(self.memory, seq_id) >= 0
        if not llama_cpp.llama_memory_seq_rm(self.memory, seq_id, p0, p1):
            raise BackendError("this model's cache cannot drop part of a sequence")
        if held:
            self._pages.removed(seq_id)  # an emptied stream's pages go back to the OS

    def kv_copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._check_open()
        self._check_seq(src)
        self._check_seq(dst)
        if self.kv_unified:
            llama_cpp.llama_memory_seq_cp(self.memory, src, dst, p0, p1)
            return
        # Separate streams: llama.cpp's seq_cp copies only whole streams (a range GGML_ASSERTs and
        # aborts the process), and seq_copy.py copies all of src's cells: either way all of src,
        # then what lies past the wanted prefix is dropped.
        if p0 > 0:
            raise ValueError("with per-sequence KV streams only a prefix from position 0 can be copied")
        small = self.kv_pos_max(src) + 1 < self.n_ctx_seq // 2
        if not (self._cell_copy and small and seq_copy.copy_cells(self.ctx, src, dst)):
            llama_cpp.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
            if self._pages is not None:
                self._pages.stream_copy(src)
        if p1 >= 0:
            self.kv_remove(dst, p1, -1)

    def kv_pos_max(self, seq_id: int) -> int:
        self._check_open()
        self._check_seq(seq_id)
        return llama_cpp.llama_memory_seq_pos_max(self.memory, seq_id)

    def release_idle_memory(self, now: float) -> float | None:
        if self._pages is None or self._closed:
            return None
        return self._pages.release_due(now)  # kv_pages.StreamKeeper: streams left empty

    def kv_pos_min(self, seq_id: int) -> int:
        self._check_open()
        self._check_seq(seq_id)
        return llama_cpp.llama_memory_seq_pos_min(self.memory, seq_id)

    def kv_clear(self) -> None:
        self._check_open()
        # With pages to give back, they are the data clear: writing zeros would commit them all.
        llama_cpp.llama_memory_clear(self.memory, self._pages is None)
        if self._pages is not None:
            self._pages.cleared()
        self._n_out = 0
