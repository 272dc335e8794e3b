"""Per-sequence sampling on llama.cpp sampler chains.

Each sequence owns one chain (logit_bias -> penalties -> top_k -> top_p -> min_p -> temperature ->
dist(seed), or greedy) plus, for constrained output, a grammar sampler applied grammar-last (see
_sample_chain). Its RNG, penalty history and grammar state are its own: a seeded request samples
the same tokens whether it runs alone or inside a shared batch.

We apply the chain to our own candidate buffer (`llama_sampler_apply`) instead of calling
`llama_sampler_sample`, because the latter GGML_ASSERTs (aborts the process) when no candidate is
left, and accepting an end-of-generation token that the grammar forbids is a GGML_ABORT: both can
be reached from user input (a grammar plus a logit_bias banning what it needs). Here we check the
choice before `llama_sampler_accept` and raise an error for that one request instead.

Plain greedy requests (no penalties or grammar) skip llama.cpp entirely: numpy argmax over the
logits row, with any logit_bias added in float32 first, picks the same token (first maximum) as
llama.cpp's logit_bias + greedy chain, and is the engine's hot path. (A chain filled a 49k-entry
candidate array per sequence per step: a few ms a step with 8 greedy requests banning EOS.)
"""

from __future__ import annotations

import ctypes
import logging
import math
import weakref
from typing import Protocol, Sequence

import llama_cpp
import numpy as np

from ...protocol.requests import SamplingParams, TokenLogprob
from ...errors import BackendError, InvalidRequestError
from ..base import SampledToken, Sampler
from ..common import sampler_thread
from ..common.grammar import grammar_text
from ..common.logprobs import token_logprob
from .runtime import error_count, last_error_since, native_stderr_captured


class ChainHost(Protocol):
    """What a LlamaCppSampler reads from its backend: LlamaCppBackend, or numpy logits seen through
    llama.cpp's vocabulary (onnx/sampling.py's LlamaVocabLogits, for the ONNX backend's grammars)."""

    vocab: object  # the llama_vocab pointer the grammar sampler is built on
    n_vocab: int
    n_ctx: int
    token_ids: np.ndarray  # 0..n_vocab-1 as int32, read-only: the candidates' ids

    def logits_row(self, batch_index: int) -> np.ndarray: ...

    def token_text(self, token: int) -> str: ...


# Must match `struct llama_token_data { llama_token id; float logit; float p; }`.
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)

log = logging.getLogger(__name__)

_MAX_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp reads it as "pick a random seed"


def _penalties_active(p: SamplingParams) -> bool:
    return p.penalty_last_n != 0 and (
        p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    )


def _penalty_window(backend: ChainHost, p: SamplingParams) -> int:
    """Tokens the penalties look back over: -1 means the context. Capped, because llama.cpp
    allocates a ring buffer of that many tokens: a client's 10**9 must not become one."""
    return backend.n_ctx if p.penalty_last_n < 0 else min(p.penalty_last_n, backend.n_ctx)


def _seed(seed: int | None) -> int:
    return _MAX_SEED if seed is None else seed % _MAX_SEED


class _Chain:
    """Builds a sampler chain; frees everything it made if a step fails."""

    def __init__(self) -> None:
        self.ptr = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if not self.ptr:
            raise BackendError("could not create a sampler chain")

    def add(self, smpl) -> object:
        if not smpl:
            raise BackendError("could not create a sampler")
        llama_cpp.llama_sampler_chain_add(self.ptr, smpl)  # the chain now owns it
        return smpl

    def free(self) -> None:
        llama_cpp.llama_sampler_free(self.ptr)


_PARSE_ERROR = "parse: error parsing grammar: "


def _parse_grammar(backend: ChainHost, grammar: str) -> tuple[object, str]:
    with native_stderr_captured() as captured:
        g = llama_cpp.llama_sampler_init_grammar(backend.vocab, grammar.encode("utf-8"), b"root")
    return g, captured[0]


def _grammar_sampler(backend: ChainHost, grammar: str, param: str):
    errors_before = error_count()
    # llama.cpp's parser recurses per nested group: parse on a big-stack thread (sampler_thread),
    # whatever thread builds this sampler. schema_bounds keeps the depth far below a crash anyway.
    g, stderr_text = sampler_thread.run(_parse_grammar, backend, grammar)
    reason = ""
    for line in stderr_text.splitlines():
        if line.startswith(_PARSE_ERROR) and not reason:
            reason = line[len(_PARSE_ERROR):].strip()
        elif line.strip():
            log.debug("native stderr during grammar parsing: %s", line)
    if not g:
        reason = reason or last_error_since(errors_before).removeprefix("llama_grammar_init_impl: ")
        raise InvalidRequestError("invalid grammar" + (f": {reason}" if reason else ""), param=param)
    return g


def _build_chain(backend: ChainHost, p: SamplingParams) -> tuple[object, object | None]:
    """The chain without the grammar. Returns (chain, penalties sampler inside it or None)."""
    chain = _Chain()
    try:
        if p.logit_bias:
            biases = (llama_cpp.llama_logit_bias * len(p.logit_bias))(
                *[llama_cpp.llama_logit_bias(token=t, bias=b) for t, b in p.logit_bias.items()]
            )
            chain.add(llama_cpp.llama_sampler_init_logit_bias(backend.n_vocab, len(p.logit_bias), biases))
        penalties = None
        if _penalties_active(p):
            penalties = chain.add(
                llama_cpp.llama_sampler_init_penalties(
                    backend.n_vocab, _penalty_window(backend, p), p.repeat_penalty, p.frequency_penalty,
                    p.presence_penalty,
                )
            )
        if p.greedy:
            chain.add(llama_cpp.llama_sampler_init_greedy())
        else:
            if p.top_k > 0:
                chain.add(llama_cpp.llama_sampler_init_top_k(p.top_k))
            if p.top_p < 1.0:
                chain.add(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
            if p.min_p > 0.0:
                chain.add(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
            chain.add(llama_cpp.llama_sampler_init_temp(p.temperature))
            chain.add(llama_cpp.llama_sampler_init_dist(_seed(p.seed)))
    except BaseException:
        chain.free()
        raise
    return chain.ptr, penalties


def _free_all(samplers: list) -> None:
    for smpl in samplers:
        llama_cpp.llama_sampler_free(smpl)


class _Candidates:
    """A llama_token_data_array over a numpy buffer, refilled from a logits row."""

    def __init__(self, size: int) -> None:
        self.buf = np.empty(size, dtype=TOKEN_DATA)
        self.array = llama_cpp.llama_token_data_array()
        self.ref = ctypes.byref(self.array)
        self._ptr = self.buf.ctypes.data_as(llama_cpp.llama_token_data_p)

    def fill(self, ids: np.ndarray, logits: np.ndarray) -> None:
        self.buf["id"] = ids  # samplers sort candidates in place: reset every time
        self.buf["logit"] = logits
        arr = self.array
        arr.data = self._ptr  # samplers may also repoint data/size
        arr.size = self.buf.size
        arr.selected = -1
        arr.sorted = False

    def selected(self) -> tuple[int, float]:
        arr = self.array
        if not 0 <= arr.selected < arr.size:
            raise InvalidRequestError("no token can be sampled under these constraints")
        chosen = arr.data[arr.selected]
        return int(chosen.id), chosen.logit


def _biased_argmax(row: np.ndarray, ids: np.ndarray, bias: np.ndarray) -> int:
    biased = row.copy()
    biased[ids] += bias  # float32, as llama.cpp adds it
    token = int(biased.argmax())
    if not math.isfinite(float(biased[token])):
        raise InvalidRequestError("no token is allowed by the grammar and logit_bias together")
    return token


class LlamaCppSampler(Sampler):
    def __init__(self, backend: ChainHost, params: SamplingParams, prompt_tokens: Sequence[int]) -> None:
        params.validate(backend.n_vocab)  # the same bounds the server checks before any model load
        self._backend = backend
        self._n_logprobs = params.logprobs
        self._chain = None
        self._grammar = None
        self._finalizer: weakref.finalize | None = None
        self._bias: tuple[np.ndarray, np.ndarray] | None = None
        grammar = grammar_text(params)
        if params.greedy and not _penalties_active(params) and grammar is None:
            if params.logit_bias:  # numpy argmax fast path, biased as llama.cpp's sampler does
                self._bias = (np.fromiter(params.logit_bias, dtype=np.int64),
                              np.fromiter(params.logit_bias.values(), dtype=np.float32))
            return
        owned: list = []
        self._finalizer = weakref.finalize(self, _free_all, owned)
        if grammar is not None:
            param = "grammar" if params.grammar is not None else params.constraint_param
            self._grammar = _grammar_sampler(backend, grammar, param)
            owned.append(self._grammar)
        self._chain, penalties = _build_chain(backend, params)
        owned.append(self._chain)
        if penalties is not None:
            # Prime the penalty history with the prompt, as llama-server does. Only the penalties:
            # the grammar must never see prompt tokens (a mismatch aborts the process).
            for t in prompt_tokens[-_penalty_window(backend, params):]:
                if t >= 0:  # an image's positions are no tokens to penalise (media.py)
                    llama_cpp.llama_sampler_accept(penalties, int(t))
        self._cand = _Candidates(backend.n_vocab)
        self._one = _Candidates(1) if self._grammar is not None else None

    def sample(self, batch_index: int) -> SampledToken:
        row = self._backend.logits_row(batch_index)
        if self._bias is not None:
            token = _biased_argmax(row, *self._bias)
        elif self._chain is None:
            token = int(row.argmax())
        else:
            token = self._sample_chain(row)
        logprob = self._logprob(row, token) if self._n_logprobs is not None else None
        return SampledToken(token=token, logprob=logprob)

    def _sample_chain(self, row: np.ndarray) -> int:
        if self._finalizer is None or not self._finalizer.alive:
            raise ValueError("sampler is closed")
        cand, ids = self._cand, self._backend.token_ids
        cand.fill(ids, row)
        llama_cpp.llama_sampler_apply(self._chain, cand.ref)
        token, logit = cand.selected()
        if self._grammar is not None and not self._grammar_allows(token, logit):
            # Grammar-last, as llama.cpp's common sampler does: checking one token is cheap, masking
            # the whole vocabulary (~50k tokens through the grammar stacks) is not, so only resample
            # with the grammar applied first when the free choice breaks it.
            cand.fill(ids, row)
            llama_cpp.llama_sampler_apply(self._grammar, cand.ref)
            llama_cpp.llama_sampler_apply(self._chain, cand.ref)
            token, logit = cand.selected()
        if not math.isfinite(logit):
            # Every candidate was banned (grammar + logit_bias): accepting would abort the process.
            raise InvalidRequestError("no token is allowed by the grammar and logit_bias together")
        llama_cpp.llama_sampler_accept(self._chain, token)
        if self._grammar is not None:
            llama_cpp.llama_sampler_accept(self._grammar, token)
        return token

    def _grammar_allows(self, token: int, logit: float) -> bool:
        one = self._one
        one.fill(np.array([token], dtype=np.int32), np.array([logit], dtype=np.float32))
        llama_cpp.llama_sampler_apply(self._grammar, one.ref)
        return math.isfinite(float(one.buf["logit"][0]))

    def _logprob(self, row: np.ndarray, token: int) -> TokenLogprob:
        return token_logprob(row, token, self._n_logprobs or 0, self._backend.token_text)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # frees the native samplers once; later calls are no-ops
