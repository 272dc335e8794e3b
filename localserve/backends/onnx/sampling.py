"""Per-sequence sampling in numpy, with llama.cpp's chain and semantics, for backends whose logits
live in numpy arrays (ONNX Runtime).

The chain is llama_sampling's order: logit_bias -> penalties -> top_k -> top_p -> min_p ->
temperature -> a seeded draw, or greedy (bias and penalties, then the first maximum). Each step
follows llama.cpp's sampler of the same name (penalties: divide positive / multiply negative logits
by repeat_penalty, then subtract count*frequency + presence, over the last penalty_last_n tokens,
primed with the prompt; top_p and min_p on the untempered distribution). The draw uses numpy's
PCG64, so a seed reproduces a request on this backend (alone or batched), though not the same
tokens llama.cpp's mt19937 would draw.

Constrained output (grammar, JSON schema) is not sampled here: `numpy_sampler` hands such a
request to the llama.cpp backend's own sampler (LlamaCppSampler: its chain with llama.cpp's grammar
sampler, the GBNF from grammar.py) over the same numpy logits row, which llama.cpp's sampler API
takes as a llama_token_data_array. One implementation of grammars, so a schema constrains output
on both backends alike, with the same errors for a bad grammar; a seeded constrained request draws
with llama.cpp's RNG there.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol, Sequence

import numpy as np

from ...errors import InvalidRequestError
from ...protocol.requests import SamplingParams
from ..base import SampledToken, Sampler
from ..common.logprobs import token_logprob
from ..llamacpp.sampling import ChainHost, LlamaCppSampler


class LogitsSource(Protocol):
    n_vocab: int
    n_ctx: int

    def logits_row(self, batch_index: int) -> np.ndarray: ...

    def token_text(self, token: int) -> str: ...


class LlamaVocabLogits:
    """A LogitsSource seen through llama.cpp's vocabulary: the ChainHost a LlamaCppSampler needs
    (the vocab pointer its grammar is parsed against, the candidates' ids) for numpy logits."""

    def __init__(self, source: LogitsSource, vocab_ptr: object) -> None:
        self.vocab = vocab_ptr
        self.n_vocab = source.n_vocab
        self.n_ctx = source.n_ctx
        self.token_ids = np.arange(source.n_vocab, dtype=np.int32)
        self.token_ids.flags.writeable = False
        self.logits_row = source.logits_row
        self.token_text = source.token_text


def numpy_sampler(source: LogitsSource, host: ChainHost, params: SamplingParams,
                  prompt_tokens: Sequence[int]) -> Sampler:
    """The sampler for one sequence: NumpySampler, or llama.cpp's (through `host`) for constrained output."""
    if params.grammar is not None or params.json_schema is not None:
        return LlamaCppSampler(host, params, prompt_tokens)
    return NumpySampler(source, params, prompt_tokens)


class NumpySampler(Sampler):

    def __init__(self, backend: LogitsSource, params: SamplingParams, prompt_tokens: Sequence[int]) -> None:
        params.validate(backend.n_vocab)
        if params.grammar is not None or params.json_schema is not None:
            raise ValueError("NumpySampler samples unconstrained output only; use numpy_sampler()")
        self._backend = backend
        self._p = params
        self._n_logprobs = params.logprobs
        self._bias = None
        if params.logit_bias:
            self._bias = (np.fromiter(params.logit_bias.keys(), np.int64),
                          np.fromiter(params.logit_bias.values(), np.float32))
        self._penalties = params.penalty_last_n != 0 and (
            params.repeat_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0)
        window = backend.n_ctx if params.penalty_last_n < 0 else min(params.penalty_last_n, backend.n_ctx)
        self._history: deque[int] = deque(maxlen=max(window, 1))
        self._counts = np.zeros(backend.n_vocab, dtype=np.int32)
        if self._penalties:
            for t in prompt_tokens[-window:]:
                self._accept(int(t))
        self._rng = np.random.Generator(np.random.PCG64(params.seed))

    def _accept(self, token: int) -> None:
        if not self._penalties:
            return
        if len(self._history) == self._history.maxlen:
            self._counts[self._history[0]] -= 1
        self._history.append(token)
        self._counts[token] += 1

    def sample(self, batch_index: int) -> SampledToken:
        row = self._backend.logits_row(batch_index)
        p = self._p
        if p.greedy and self._bias is None and not self._penalties:
            token = int(row.argmax())
        else:
            token = self._sample_chain(row)
        self._accept(token)
        logprob = (token_logprob(row, token, self._n_logprobs, self._backend.token_text)
                   if self._n_logprobs is not None else None)
        return SampledToken(token=token, logprob=logprob)

    def _sample_chain(self, row: np.ndarray) -> int:
        p = self._p
        logits = row.astype(np.float32, copy=True)
        if self._bias is not None:
            np.add.at(logits, self._bias[0], self._bias[1])
        if self._penalties:
            seen = np.flatnonzero(self._counts)
            vals, counts = logits[seen], self._counts[seen]
            vals = np.where(vals <= 0, vals * p.repeat_penalty, vals / p.repeat_penalty)
            logits[seen] = vals - counts * p.frequency_penalty - p.presence_penalty
        ids = np.flatnonzero(np.isfinite(logits))
        if ids.size == 0:
            raise InvalidRequestError("no token can be sampled: logit_bias bans every token", param="logit_bias")
        if p.greedy:
            return int(logits.argmax())
        vals = logits[ids]
        order = np.argsort(-vals, kind="stable")  # candidates sorted by logit, as llama.cpp sorts them
        ids, vals = ids[order], vals[order]
        if 0 < p.top_k < ids.size:
            ids, vals = ids[:p.top_k], vals[:p.top_k]
        if p.top_p < 1.0:
            probs = _softmax(vals)
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1  # first prefix reaching top_p
            ids, vals = ids[:keep], vals[:keep]
        if p.min_p > 0.0:
            keep = max(1, int(np.count_nonzero(vals >= vals[0] + math.log(p.min_p))))
            ids, vals = ids[:keep], vals[:keep]
        probs = _softmax(vals / p.temperature)
        return int(ids[self._rng.choice(ids.size, p=probs)])


def _softmax(vals: np.ndarray) -> np.ndarray:
    e = np.exp((vals - vals.max()).astype(np.float64))
    return e / e.sum()
