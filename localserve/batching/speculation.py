"""Speculative decoding by prompt lookup: drafts from a sequence's own tokens, verified inside the
packed batch, and a policy that drafts only where the measured step costs say it pays.

An editor's or an agent's answer mostly copies its input (a rewritten function, a patch, a file
with one line changed). `PromptLookup` finds the longest recent n-gram of the sequence's tokens
(prompt + answer) that ends like the sequence does now and proposes the tokens that followed it.
The scheduler feeds a drafting sequence's pending token and its k drafts as k + 1 rows of the same
step, each with logits; engine/step.py samples them in row order with the request's own sampler
chain and stops at the first sample that differs from the draft ("sample and match", as
llama-server does): greedy requests get argmax equality, seeded ones one RNG draw per emitted
token, so the tokens are the ones plain decoding gives whenever the logits are. Rejected rows'
cells are removed (kvpool.KVPool.truncate) before the next step.

Why a policy at all: a draft costs rows, and with a KV stream per sequence (the default) a
drafting sequence is computed in a llama_decode call of its own, which is one more pass over the
weights. Alone, k drafts cost k rows of the one call; beside seven other decoders they cost a whole
call. llama.cpp measured lookup decoding at 1.10x with 1 slot and 0.77x with 8 (its server drafts
for every slot regardless). So `DraftPolicy` keeps a step-cost model, seconds = calls * c + rows *
r, fitted to every step this engine runs (`StepCosts`), and per sequence the chance that a draft
token is accepted given the one before it was (`DraftState.rate`); each step it adds a sequence's
drafts only while they raise the step's expected tokens per second, with the k that raises it most.
Under load the answer is no drafts, by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal

SpeculativeMode = Literal["auto", "ngram", "off"]
MODES: tuple[str, ...] = ("auto", "ngram", "off")

# n-gram sizes tried longest first: a long match is a copy of the input (an edited file), a short
# one is a guess. 3 is the shortest that still finds code's repeated lines without matching every
# other "the".
NGRAM_SIZES = (8, 3)
K_MAX = 32  # drafts per sequence per step; the cost model usually asks for fewer (16 gave 78.2 decode
# tok/s on benchmarks/speculative.py's edit, 32 gave 82.4, one pass each, 2026-12-05)
K_FORCED = 8  # "ngram" mode: drafts whenever a match exists, at most this many
# Acceptance assumed for a sequence's first drafts, by the size of the match that proposed them: an
# 8-token match held for 461 of 475 drafted tokens in benchmarks/speculative.py's edit. At 0.8, a
# first draft paid by 8% on 2 cores, and step-time noise often declined it, so acceptance was never
# measured and auto never drafted.
_PRIOR = {8: 0.9, 3: 0.4}
# A sequence's acceptance is counted in tokens: accepted drafts and first misses, each verification's
# counts added to the earlier ones weighed down by _DECAY, with the prior worth _PRIOR_WEIGHT tokens.
# An answer alternates between copying (every draft accepted) and new text (drafts missed or none),
# so the estimate must follow the latest stretch. Counted per verification instead (an average of
# accepted / (accepted + miss), weight 0.3), one 32-token copy weighed as much as one missed draft,
# three misses in new text sank it near 0, and it took dozens of steps to climb back, declining good
# drafts meanwhile.
_DECAY = 0.6
_PRIOR_WEIGHT = 4.0


class PromptLookup:
    """An incremental index of one sequence's n-grams: for each size n, the hash of every n tokens
    -> where the tokens after its most recent occurrence start. Built lazily (only sequences the
    policy considers pay for it), extended by the tokens appended since the last call."""

    __slots__ = ("_index", "_indexed")

    def __init__(self) -> None:
        self._index: dict[int, dict[int, int]] = {n: {} for n in NGRAM_SIZES}
        self._indexed = 0  # n-grams ending before this position are in the index

    def draft(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest indexed
        n-gram ending at the end of `tokens`, and that n (0: no match).

        When what followed runs into the end of `tokens` (the answer repeats itself with a period
        shorter than k), the draft goes round again: once those tokens are emitted, the sequence
        ends with the same n-gram and the lookup would propose them again. llama-server's
        ngram-mod reaches the same drafts by looking up one token at a time."""
        end = len(tokens)
        self._extend(tokens, end - 1)  # everything before the current suffix: it must not find itself
        found, size = [], 0
        for n in NGRAM_SIZES:
            if end < n + 1:
                continue
            start = self._index[n].get(hash(tuple(tokens[end - n:])))
            if start is not None and start < end:
                period = end - start
                if period >= k:
                    found = tokens[start:start + k]
                else:
                    found = [tokens[start + i % period] for i in range(k)]
                size = n
                break
        self._extend(tokens, end)
        return found, size

    def _extend(self, tokens: list[int], last: int) -> None:
        """Index the n-grams ending at positions up to `last`."""
        for n, index in self._index.items():
            for stop in range(max(self._indexed, n), last + 1):
                index[hash(tuple(tokens[stop - n:stop]))] = stop
        self._indexed = max(self._indexed, last + 1)


@dataclass(slots=True)
class DraftState:
    """One sequence's speculation: its lookup index, its recent acceptance counts (decayed, see
    _DECAY), and its totals."""

    lookup: PromptLookup = field(default_factory=PromptLookup)
    hits: float = 0.0  # draft tokens accepted, recent ones weighing most
    misses: float = 0.0  # draft tokens rejected (one per verification that missed), likewise
    drafted: int = 0
    accepted: int = 0

    def rate(self, match: int) -> float:
        """The chance that a draft token is accepted given the one before it was: the recent
        counts, with the prior of the match that proposed the draft worth _PRIOR_WEIGHT tokens."""
        return (self.hits + _PRIOR_WEIGHT * _PRIOR[match]) / (self.hits + self.misses + _PRIOR_WEIGHT)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification: `accepted` of `drafted` tokens matched (then one mismatch, unless all did)."""
        self.drafted += drafted
        self.accepted += accepted
        self.hits = _DECAY * self.hits + accepted
        self.misses = _DECAY * self.misses + (accepted < drafted)


def expected_tokens(accept: float, k: int) -> float:
    """Tokens a verification of k drafts emits on average: the correction or bonus token, plus the
    drafts accepted before the first miss (1 + a + a^2 + ... + a^k)."""
    if accept >= 1.0:
        return k + 1.0
    return (1.0 - accept ** (k + 1)) / (1.0 - accept)


class StepCosts:
    """seconds ~ calls * c + rows * r, fitted over recent steps by exponentially weighted least
    squares. `calls` is the number of llama_decode calls a step took (with per-sequence streams:
    one per multi-row sequence, plus one for the single-row decodes), `rows` its batch rows. The
    prior (5 ms a call, 5.5 ms a row with logits: SmolLM2 on 2 cores, 1 to 33 rows) only holds
    until real steps outweigh it."""

    _DECAY = 0.98

    def __init__(self, call_s: float = 0.005, row_s: float = 0.0055) -> None:
        self._sxx = [[0.0, 0.0], [0.0, 0.0]]
        self._sxy = [0.0, 0.0]
        self.call_s, self.row_s = call_s, row_s
        for calls, rows in ((1, 1), (1, 9)):
            self._add(calls, rows, calls * call_s + rows * row_s, 4.0)

    def observe(self, calls: int, rows: int, seconds: float) -> None:
        if calls <= 0 or rows <= 0 or seconds <= 0:
            return
        self._add(calls, rows, seconds, 1.0)
        (a, b), (_, d) = self._sxx
        det = a * d - b * b
        if det <= 1e-12:
            return
        c = (d * self._sxy[0] - b * self._sxy[1]) / det
        r = (a * self._sxy[1] - b * self._sxy[0]) / det
        if c > 0 and r > 0:  # a fit that says a call or a row is free is noise: keep the last one
            self.call_s, self.row_s = c, r

    def _add(self, calls: int, rows: int, seconds: float, weight: float) -> None:
        d = self._DECAY
        x = (calls, rows)
        for i in range(2):
            self._sxy[i] = d * self._sxy[i] + weight * x[i] * seconds
            for j in range(2):
                self._sxx[i][j] = d * self._sxx[i][j] + weight * x[i] * x[j]

    def seconds(self, calls: int, rows: int) -> float:
        return calls * self.call_s + rows * self.row_s


@dataclass(slots=True)
class Candidate:
    """A decoding sequence this step could draft for: its state, the draft found, the match size."""

    key: object  # the sequence (kept opaque: this module knows nothing of Sequence)
    state: DraftState
    draft: list[int]
    match: int


class DraftPolicy:
    """Which decoders draft this step, and how many tokens each (see the module docstring)."""

    def __init__(self, mode: SpeculativeMode, separate_calls: bool) -> None:
        if mode not in MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(MODES)} (got {mode!r})")
        self.mode = mode
        # Per-sequence KV streams: a multi-row sequence is computed in a call of its own.
        self.separate_calls = separate_calls
        self.costs = StepCosts()
        self.drafted: dict[str, int] = {}  # lane -> draft tokens verified
        self.accepted: dict[str, int] = {}  # lane -> draft tokens accepted
        self.verifications = 0

    def choose(self, candidates: list[Candidate], decoders: int, calls: int, rows: int) -> list[tuple[object, int]]:
        """(sequence, k) for the candidates that draft, of a step that already holds `decoders`
        one-token decodes in `calls` calls and `rows` rows (no prompt chunk: drafts never delay one)."""
        if self.mode == "ngram":
            return [(c.key, min(len(c.draft), K_FORCED)) for c in candidates]
        chosen: list[tuple[object, int]] = []
        tokens = float(decoders)
        seconds = self.costs.seconds(calls, rows)
        shared = decoders  # decoders still in the shared one-row call
        for cand in sorted(candidates, key=lambda c: -c.state.rate(c.match)):
            rate = cand.state.rate(cand.match)
            # A separate call, unless this sequence was the last one in the shared call.
            extra_call = self.separate_calls and shared > 1
            best_k, best = 0, tokens / seconds
            for k in range(1, len(cand.draft) + 1):
                t = seconds + self.costs.seconds(int(extra_call), k)
                gain = (tokens + expected_tokens(rate, k) - 1.0) / t
                if gain > best:
                    best_k, best = k, gain
            if best_k:
                chosen.append((cand.key, best_k))
                tokens += expected_tokens(rate, best_k) - 1.0
                seconds += self.costs.seconds(int(extra_call), best_k)
                shared -= 1
        return chosen

    def record(self, lane: str, state: DraftState, drafted: int, accepted: int) -> None:
        state.observe(drafted, accepted)
        self.drafted[lane] = self.drafted.get(lane, 0) + drafted
        self.accepted[lane] = self.accepted.get(lane, 0) + accepted
        self.verifications += 1


def step_calls(rows_per_sequence: Iterable[int], separate_calls: bool) -> int:
    """llama_decode calls a step of these per-sequence row counts takes (backends/llamacpp/batch.py
    stream_groups: a call per multi-row sequence, one for all one-row ones; unified: one)."""
    counts = list(rows_per_sequence)
    if not counts:
        return 0
    if not separate_calls:
        return 1
    multi = sum(1 for n in counts if n > 1)
    return multi + (1 if multi < len(counts) else 0)
