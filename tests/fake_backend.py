"""A deterministic stand-in for the llama.cpp backend, for scheduler and engine unit tests.

It declares its Capabilities explicitly (constructor arguments), and behaves as declared: with
prefix_sharing "share" it keeps a real model of a unified KV cache: n_ctx cells, each holding one
(sequence set, position) entry, shared between sequences by kv_copy and freed when no sequence
holds them; with "copy" each id has a stream of n_ctx // n_seq_max cells and kv_copy copies.
decode() enforces llama.cpp's rules (at most n_batch tokens, seq ids in range, positions that
continue each sequence exactly) and fails with KVFullError when cells run out, keeping nothing.

The "logits" of a row are a hash of the tokens the backend holds for that sequence at positions
0..pos -- its own KV content, nothing else. So a greedy run's output depends only on the sequence's
own history, as with a real model: if the scheduler fed a wrong position, a stale cell, another
sequence's prefix or a dropped token, the output changes, and comparing a batched run with each
request alone catches it.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import threading
import time
from typing import Sequence

from localserve.backends.base import (
    Backend, BatchToken, Capabilities, DecodeInterrupted, KVFullError, ModelInfo, PrefixSharing, SampledToken, Sampler,
)
from localserve.protocol.requests import SamplingParams, TokenLogprob
from localserve.errors import BackendError

EOG = 0
# Vocabulary: 0 = end of generation; 1..26 letters; 27 space; 28-31 pieces of multi-byte
# characters ("é" = 28 29, "€" = 30 31) so text deltas must hold incomplete UTF-8 back; the
# rest are two-letter pieces.
_PIECES = [b""] + [bytes([c]) for c in range(ord("a"), ord("z") + 1)] + [b" ", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac"]


def _piece(token: int) -> bytes:
    if token < len(_PIECES):
        return _PIECES[token]
    i = token - len(_PIECES)
    return bytes([ord("a") + i % 26, ord("a") + (i // 26) % 26])


def _mix(prev: int, token: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{prev}:{token}".encode(), digest_size=8).digest(), "little")


class FakeBackend(Backend):
    def __init__(
        self,
        n_ctx: int = 1024,
        n_batch: int = 64,
        n_seq_max: int = 16,
        n_vocab: int = 64,
        eog_every: int = 0,
        step_time: float = 0.0,
        token_time: float = 0.0,
        prefix_sharing: PrefixSharing = "share",
        consecutive_ids: bool = True,
        micro_batch: int | None = None,
        min_chunk: int = 2,
        min_recompute: int = 2,
        interruptible: bool = False,
        copying: bool = False,
    ):
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.n_vocab = n_vocab
        self.eog_every = eog_every  # 0 = greedy output never ends by itself
        self.step_time = step_time  # simulated compute per decode call, plus per token
        self.token_time = token_time
        # A model whose answers copy their input (an editor's edit): a row's greedy token is the one
        # that followed the most recent earlier occurrence of its own token, four times in five, so
        # prompt lookup drafts are mostly accepted. Still a pure function of the sequence's KV.
        self.copying = copying
        # The defaults are the rules the scheduler applied before backends declared them (two-token
        # chunks and recompute, consecutive ids, one pass per decode), so the tests written
        # against those rules keep testing them; tests of other rules pass their own.
        self._capabilities = Capabilities(
            max_batch_tokens=n_batch,
            kv_cells=n_ctx,
            kv_cells_per_seq=n_ctx if prefix_sharing == "share" else n_ctx // n_seq_max,
            max_seqs=n_seq_max,
            prefix_sharing=prefix_sharing,
            consecutive_ids=consecutive_ids,
            micro_batch=micro_batch or n_batch,
            min_chunk=min_chunk,
            min_recompute=min_recompute,
            # Its sampler ignores grammars (it only refuses the text "invalid", so engine tests can
            # see a sampler that fails at creation): it constrains nothing.
            constraints=frozenset(),
            embeddings=True,
            interruptible=interruptible,
            speculation=True,  # several sampled rows per sequence, and tails removed: as llama.cpp
        )
        self.interrupted = False  # interrupt() was called and no clear_interrupt() since
        self.interruptible_decodes: list[bool] = []  # per decode call: was it interruptible
        self.shares_cells = prefix_sharing == "share"
        self.n_ctx_seq = self._capabilities.kv_cells_per_seq
        self.info = ModelInfo(
            name="fake", architecture="fake", n_ctx_train=n_ctx, n_vocab=n_vocab, n_embd=8,
            n_params=0, chat_template=None, bos_token=None, eos_token=None,
        )
        self._seqs: dict[int, list[int]] = {}  # seq id -> cell ids by position
        self._hash: dict[int, int] = {}  # cell id -> hash of the tokens at positions 0..pos
        self._refs: dict[int, int] = {}
        self._cells = itertools.count()
        self._rows: dict[int, int] = {}  # batch index -> "logits" of the last decode
        self._copies: dict[int, int] = {}  # batch index -> the token a copying model would copy there
        self._token: dict[int, int] = {}  # cell id -> its token (the copying model reads them)
        self.batches: list[list[BatchToken]] = []  # every decode call, for budget checks
        self.fail_when = None  # callable(batch) -> True to fail that decode with BackendError
        self.kv_full_when = None  # callable(batch) -> True to fail it with KVFullError
        self.thread: threading.Thread | None = None  # decode must stay on one thread

    # --- bookkeeping visible to tests ------------------------------------------------------
    @property
    def used_cells(self) -> int:
        return len(self._refs)

    def seq_tokens_hash(self, seq_id: int) -> list[int]:
        return [self._hash[c] for c in self._seqs.get(seq_id, [])]

    def live_seq_ids(self) -> set[int]:
        return {s for s, cells in self._seqs.items() if cells}

    # --- Backend ---------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def decode(self, batch: Sequence[BatchToken], interruptible: bool = False) -> None:
        if self.thread is None:
            self.thread = threading.current_thread()
        assert self.thread is threading.current_thread(), "decode called from two threads"
        # llama.cpp aborts the whole process on these: a test must never see them.
        assert 0 < len(batch) <= self.n_batch, f"batch of {len(batch)} tokens, n_batch {self.n_batch}"
        next_pos: dict[int, int] = {}
        for t in batch:
            assert 0 <= t.seq_id < self.n_seq_max, f"seq id {t.seq_id}"
            assert 0 <= t.token < self.n_vocab, f"token {t.token}"
            expected = next_pos.get(t.seq_id, len(self._seqs.get(t.seq_id, ())))
            assert t.pos == expected, f"seq {t.seq_id}: position {t.pos}, expected {expected}"
            next_pos[t.seq_id] = t.pos + 1
        self.batches.append(list(batch))
        self.interruptible_decodes.append(interruptible)
        if interruptible and self._capabilities.interruptible and self.interrupted:
            raise DecodeInterrupted("interrupted")  # like llama.cpp's: nothing of the batch kept
        if self.step_time or self.token_time:
            time.sleep(self.step_time + self.token_time * len(batch))
        if self.kv_full_when and self.kv_full_when(batch):
            raise KVFullError("injected")
        if len(self._refs) + len(batch) > self.n_ctx:
            raise KVFullError(f"no room for {len(batch)} tokens")
        if not self.shares_cells and any(p > self.n_ctx_seq for p in next_pos.values()):
            raise KVFullError("a sequence outgrew its stream")
        if self.fail_when and self.fail_when(batch):
            raise BackendError("injected failure")  # like llama.cpp's backend: positions rolled back
        self._rows = {}
        self._copies = {}
        for i, t in enumerate(batch):
            cells = self._seqs.setdefault(t.seq_id, [])
            prev = self._hash[cells[-1]] if cells else 0
            cell = next(self._cells)
            self._hash[cell] = _mix(prev, t.token)
            self._refs[cell] = 1
            self._token[cell] = t.token
            cells.append(cell)
            if t.logits:
                self._rows[i] = self._hash[cell]
                if self.copying:
                    self._copy_row(i, [self._token[c] for c in cells])

    def _copy_row(self, row: int, tokens: list[int]) -> None:
        last = tokens[-1]
        for j in range(len(tokens) - 2, -1, -1):
            if tokens[j] == last:
                self._copies[row] = tokens[j + 1]
                return

    def copy_at(self, row: int) -> int | None:
        return self._copies.get(row)

    def interrupt(self) -> None:
        self.interrupted = True

    def clear_interrupt(self) -> None:
        self.interrupted = False

    def new_sampler(self, params: SamplingParams, prompt_tokens: Sequence[int]) -> Sampler:
        if params.grammar == "invalid":
            from localserve.errors import InvalidRequestError

            raise InvalidRequestError("invalid grammar")
        return FakeSampler(self, params)

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        out = []
        for tokens in inputs:
            h = 0
            for t in tokens:
                h = _mix(h, t)
            v = [((h >> (8 * i)) & 0xFF) + 1.0 for i in range(8)]
            norm = sum(x * x for x in v) ** 0.5
            out.append([x / norm for x in v])
        return out

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        assert 0 <= seq_id < self.n_seq_max
        assert p1 < 0, "the fake supports removing a tail only"
        cells = self._seqs.get(seq_id, [])
        for cell in cells[p0:]:
            self._unref(cell)
        del cells[p0:]

    def kv_copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        assert 0 <= src < self.n_seq_max and 0 <= dst < self.n_seq_max
        assert p0 == 0 and not self._seqs.get(dst), "copy a prefix into an empty sequence"
        cells = self._seqs.get(src, [])
        assert p1 <= len(cells), f"copy of {p1} positions from a sequence holding {len(cells)}"
        cells = cells if p1 < 0 else cells[:p1]  # p1 < 0: to the end, as in llama.cpp
        if not self.shares_cells:
            copies = []
            for cell in cells:
                new = next(self._cells)
                self._hash[new] = self._hash[cell]
                self._token[new] = self._token[cell]
                self._refs[new] = 1
                copies.append(new)
            self._seqs[dst] = copies
            return
        for cell in cells:
            self._refs[cell] += 1
        self._seqs[dst] = list(cells)

    def kv_pos_max(self, seq_id: int) -> int:
        return len(self._seqs.get(seq_id, [])) - 1

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        out = []
        for ch in text:
            if "a" <= ch <= "z":
                out.append(1 + ord(ch) - ord("a"))
            elif ch == " ":
                out.append(27)
        return out

    def token_to_bytes(self, token: int, special: bool = False) -> bytes:
        return _piece(token)

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def logits_row(self, index: int) -> int:
        if index not in self._rows:
            raise ValueError(f"row {index} has no logits")
        return self._rows[index]

    def _unref(self, cell: int) -> None:
        if self._refs[cell] == 1:
            del self._refs[cell]
            del self._hash[cell]
            self._token.pop(cell, None)
        else:
            self._refs[cell] -= 1


class FakeSampler(Sampler):
    """Greedy = a pure function of the row's hash; seeded = that plus the request's own RNG, so a
    seed reproduces a request wherever it sits in a batch."""

    def __init__(self, backend: FakeBackend, params: SamplingParams):
        self.backend = backend
        self.params = params
        self.rng = None if params.greedy else random.Random(params.seed)
        self.closed = False

    def sample(self, batch_index: int) -> SampledToken:
        assert not self.closed, "sampling with a closed sampler"
        h = self.backend.logits_row(batch_index)
        if self.rng is not None:
            h ^= self.rng.getrandbits(64)
        b = self.backend
        token = EOG if b.eog_every and h % b.eog_every == 0 else 1 + (h >> 8) % (b.n_vocab - 1)
        copy = b.copy_at(batch_index)
        if copy is not None and h % 5 and token != EOG:
            token = copy
        lp = None
        if self.params.logprobs is not None:
            lp = TokenLogprob(token, _piece(token).decode("utf-8", "replace"), -((h >> 20) % 100) / 10.0)
        return SampledToken(token, lp)

    def close(self) -> None:
        self.closed = True
