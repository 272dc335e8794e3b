"""One request's life inside the engine: its tokens, how many of them are in the KV cache, and the
output it has produced since the last step.

There are no prefill/decode phases (as in vLLM v1): `tokens` is prompt + generated, `num_computed`
says how many sit in the KV cache, and each step feeds some of `tokens[num_computed:]`. A decoding
sequence has exactly one pending token (the last sampled one); a preempted sequence simply drops
to num_computed = 0 and is re-fed, prompt and generated tokens alike, with its sampler untouched.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import Callable

from ..backends.base import SampledToken, Sampler
from ..errors import LocalserveError
from ..protocol.requests import LANE_RANK, LoraSet, FinishReason, GenerationEvent, GenerationRequest, TokenLogprob, Usage
from .speculation import DraftState
from .text import Detokenizer
from .thinking import ThinkCounter

_order = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = (
        "request", "sampler", "lane_rank", "order", "arrival_step", "due_step", "tokens", "num_prompt",
        "num_computed", "seq_id", "cells", "status", "cancelled", "queued", "num_generated",
        "cached_tokens", "num_preemptions", "finish_reason", "error", "n_ctx_seq", "t_submit",
        "t_scheduled", "t_first_token", "t_finish", "adapters", "_detok", "_is_eog", "_text", "_token_ids",
        "_logprobs", "_stop_hit", "stream", "draft", "spec", "think",
    )

    def __init__(
        self,
        request: GenerationRequest,
        sampler: Sampler | None,
        token_bytes: Callable[[int], bytes],
        is_eog: Callable[[int], bool],
        n_ctx_seq: int,
    ):
        self.request = request
        self.sampler = sampler
        self.lane_rank = LANE_RANK[request.lane]
        self.order = next(_order)  # arrival order: older wins ties, newer is preempted first
        self.arrival_step = 0  # set by the scheduler when it first sees the sequence
        self.due_step = 0  # when its prompt is due to be read (lanes.due_step), set with arrival_step
        self.tokens: list[int] = list(request.prompt_tokens)
        self.num_prompt = len(self.tokens)
        self.num_computed = 0
        # Its LoRA adapters (the engine checked them at submit: lora_set): one step runs one set.
        self.adapters: LoraSet = tuple(request.lora or ())
        self.seq_id = -1
        self.cells: list[int] = []  # KV cell ids this sequence holds (accounting; see kvpool.py)
        self.status = Status.WAITING
        self.cancelled = False  # set from any thread; the engine thread acts on it at the next step
        self.queued = True  # never scheduled yet (counts against its lane's queue bound)
        self.num_generated = 0
        self.cached_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.error: LocalserveError | None = None
        self.n_ctx_seq = n_ctx_seq
        self.t_submit = time.monotonic()
        self.t_scheduled = 0.0
        self.t_first_token = 0.0
        self.t_finish = 0.0
        self._detok = Detokenizer(token_bytes, request.stop)
        self._is_eog = is_eog
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._stop_hit = False
        self.stream = None  # the engine's RequestStream, for delivery
        self.draft: list[int] = []  # this step's draft tokens, fed after the pending one (speculation.py)
        self.spec: DraftState | None = None  # its prompt-lookup index and acceptance, once it drafts
        self.think = ThinkCounter(request.thinking) if request.thinking is not None else None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def pending(self) -> int:
        """Tokens not yet in the KV cache; 1 while decoding."""
        return len(self.tokens) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def is_eog(self, token: int) -> bool:
        """Whether `token` ends generation for this model (whatever ignore_eos says)."""
        return self._is_eog(token)

    @property
    def closing_thought(self) -> bool:
        """Its thinking budget is spent: the next sample gives way to the end-of-think tokens."""
        return self.think is not None and self.think.due

    def append(self, sampled: SampledToken) -> FinishReason | None:
        """Take one sampled token (or, once its thinking budget is spent, the model's end-of-think
        tokens in its place); returns why the sequence should finish, if it should."""
        if self.think is not None and self.think.due:
            for token in self.think.close():
                reason = self._take(token, None, forced=True)
                if reason:
                    return reason
            return None
        return self._take(sampled.token, sampled.logprob)

    def _take(self, token: int, logprob: TokenLogprob | None, forced: bool = False) -> FinishReason | None:
        self.tokens.append(token)
        self.num_generated += 1
        if not self.t_first_token:
            self.t_first_token = time.monotonic()
        if self.think is not None:
            self.think.see(token)
        # A forced end tag may hold an end-of-generation token (gpt-oss closes its analysis with
        # <|end|>): there it ends the thinking, not the answer.
        if self._is_eog(token) and not (self.request.ignore_eos or forced):
            return "stop"
        delta, stopped = self._detok.add(token)
        if delta:
            self._text.append(delta)
        self._token_ids.append(token)
        if logprob is not None:
            self._logprobs.append(logprob)
        if stopped:
            self._stop_hit = True
            return "stop"
        if self.num_generated >= self.request.max_tokens or len(self.tokens) >= self.n_ctx_seq:
            return "length"
        return None

    def mark_finished(self, reason: FinishReason, error: LocalserveError | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
        self.t_finish = time.monotonic()
        if not self._stop_hit:  # a stop string already cut the text; any other end releases the held tail
            tail = self._detok.finish()
            if tail:
                self._text.append(tail)
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None

    def take_event(self) -> GenerationEvent | None:
        """The output since the last call, or None when there is none."""
        if not (self._text or self._token_ids or self.finished):
            return None
        event = GenerationEvent(
            text="".join(self._text),
            token_ids=self._token_ids,
            logprobs=self._logprobs if self._logprobs else None,
        )
        self._text, self._token_ids, self._logprobs = [], [], []
        if self.finished:
            event.finish_reason = self.finish_reason
            event.error = self.error
            event.usage = self.usage()
        return event

    def usage(self) -> Usage:
        end = self.t_finish or time.monotonic()
        return Usage(
            prompt_tokens=self.num_prompt,
            completion_tokens=self.num_generated,
            cached_tokens=self.cached_tokens,
            reasoning_tokens=self.think.tokens if self.think is not None else 0,
            queue_s=(self.t_scheduled or end) - self.t_submit,
            ttft_s=(self.t_first_token - self.t_submit) if self.t_first_token else 0.0,
            total_s=end - self.t_submit,
        )
