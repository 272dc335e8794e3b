"""KV memory that follows what the cache holds: pages of the KV buffer are committed as cells are
written and handed back to the OS when a sequence's stream is emptied (Linux).

Why: with a stream per sequence id the product's context reserves every id a full-length stream
(SmolLM2 at 8 running + 8 parked ids x 8,192 cells: 3 GiB of f16 K/V), and llama.cpp clears the
whole buffer when it creates the context (ggml_backend_buffer_clear, a memset), so every page was
committed at load: a 98 MB model held 3.1 GiB at rest and the clear was most of its load time
(issue 42). Private anonymous pages that were never written, or were given back with
madvise(MADV_DONTNEED), read as zeros, which is exactly what the clear writes: so

- while llama.cpp creates the context, its zero memsets of large private anonymous ranges drop the
  pages instead of writing them (`zeroing_by_release`: the memset slot of libggml-base's GOT points
  here for that call only), which records where the KV buffer is;
- a stream whose sequence has held no cells for a few seconds gets its slice of every layer's K and
  V back the same way (`KVPages.release_stream`, timed by `StreamKeeper`), and a cleared cache all
  of it at once (`release_all`).

Reading a page that was never written maps the kernel's shared zero page, so attention over empty
(masked) cells costs no memory, and answers do not change: llama.cpp reads those cells only behind
a -inf mask, as zeros either way.

The layout is llama.cpp's (llama-kv-cache.cpp): per layer a K then a V tensor of
[row, kv_size, n_stream] in one buffer, one after another; stream s of a tensor is its s-th
contiguous block. It is trusted only where the recorded buffer's size is exactly what that layout
gives for this model; anything else (sliding-window caches in two buffers, recurrent state, other
OSes) keeps llama.cpp's own behaviour: pages stay committed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import llama_cpp

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_LARGE = 1 << 20  # smaller memsets are left to libc: the saving is nothing, the risk not
_MADV_DONTNEED = 4
_ELT_BYTES = {llama_cpp.GGML_TYPE_F32: (4, 1), llama_cpp.GGML_TYPE_F16: (2, 1), llama_cpp.GGML_TYPE_Q8_0: (34, 32)}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MEMSET = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
_real_memset = _MEMSET(ctypes.cast(_libc.memset, ctypes.c_void_p).value)
_hook_lock = threading.Lock()
_recorded: list[tuple[int, int]] = []  # (address, size) of the zero memsets dropped during a hook


def available() -> bool:
    return sys.platform.startswith("linux") and _got_slot() is not None


def release(address: int, size: int) -> int:
    """Zero [address, address + size) of private anonymous memory by giving back the whole pages
    inside it (the partial pages at either end are written). Returns the bytes given back."""
    first = -(-address // PAGE) * PAGE
    last = (address + size) // PAGE * PAGE
    if last <= first:
        _zero(address, size)
        return 0
    _zero(address, first - address)
    _zero(last, address + size - last)
    if _libc.madvise(first, last - first, _MADV_DONTNEED) != 0:
        _real_memset(first, 0, last - first)  # could not give them back: write the zeros
        return 0
    return last - first


def _zero(address: int, size: int) -> None:
    """Zero a partial page at a range's edge, unless it reads as zeros already: writing would
    commit a page a neighbouring stream never used (480 KiB a stream for SmolLM2's 60 slices)."""
    if size and ctypes.string_at(address, size).count(0) != size:
        _real_memset(address, 0, size)


def _private_anonymous(address: int, size: int) -> bool:
    """Whether the range lies in one private anonymous mapping, where MADV_DONTNEED reads back as
    zeros (a file or shared mapping would read the file or keep the data)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                named = len(fields) > 5 and not fields[5].startswith(("[heap]", "[anon:"))
                return address + size <= end and fields[1][3] == "p" and fields[4] == "0" and not named
    return False


@_MEMSET
def _memset_hook(address: int, value: int, size: int) -> int:
    # Runs in place of libc's memset for libggml-base while a context is created; never raise.
    try:
        if value == 0 and size >= _LARGE and address and _private_anonymous(address, size):
            release(address, size)
            _recorded.append((address, size))
            return address
    except Exception:  # noqa: BLE001 - anything odd: the plain memset below is always correct
        pass
    return _real_memset(address, value, size)


def _got_slot() -> int | None:
    """Address of libggml-base's GOT entry for memset (its calls go through it), or None."""
    global _slot_cache
    if _slot_cache is not False:
        return _slot_cache
    _slot_cache = None
    try:
        path = next(line.split()[-1] for line in open("/proc/self/maps") if "libggml-base.so" in line)
        offset, base_symbol_value = _elf_memset_reloc(path)
        base = ctypes.cast(ctypes.CDLL(path).ggml_backend_buffer_clear, ctypes.c_void_p).value
        if offset and base_symbol_value:
            _slot_cache = base - base_symbol_value + offset
    except Exception as e:  # noqa: BLE001 - no hook: llama.cpp clears as it always did
        log.debug("KV pages: no memset slot in libggml-base (%s)", e)
    return _slot_cache


_slot_cache: int | None | bool = False


def _elf_memset_reloc(path: str) -> tuple[int, int]:
    """(r_offset of memset's PLT relocation, st_value of ggml_backend_buffer_clear) in an ELF64
    little-endian shared object; 0 for what is not there."""
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return 0, 0
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    dynsym = next(s for s in sections if s[1] == 11)  # SHT_DYNSYM
    strtab = sections[dynsym[6]]

    def symbol(index: int) -> tuple[str, int]:
        name, _info, _other, _shndx, value, _size = struct.unpack_from("<IBBHQQ", data, dynsym[4] + index * 24)
        start = strtab[4] + name
        return data[start:data.index(b"\0", start)].decode(), value

    clear_value = next((v for v in (symbol(i) for i in range(dynsym[5] // 24)) if v[0] == "ggml_backend_buffer_clear"),
                       ("", 0))[1]
    for s in sections:
        if s[1] != 4 or sections[s[6]] is not dynsym:  # SHT_RELA against .dynsym
            continue
        for k in range(s[5] // 24):
            r_offset, r_info, _addend = struct.unpack_from("<QQq", data, s[4] + k * 24)
            if symbol(r_info >> 32)[0] == "memset":
                return r_offset, clear_value
    return 0, clear_value


@contextlib.contextmanager
def zeroing_by_release() -> Iterator[list[tuple[int, int]]]:
    """While in the block, libggml-base's large zero memsets of private anonymous memory give the
    pages back instead of writing them; yields the (address, size) of each such range."""
    slot = _got_slot() if sys.platform.startswith("linux") else None
    found: list[tuple[int, int]] = []
    if slot is None:
        yield found
        return
    with _hook_lock:
        word = ctypes.c_void_p.from_address(slot)
        page = slot // PAGE * PAGE
        _libc.mprotect(page, PAGE, 3)  # PROT_READ | PROT_WRITE: a RELRO'd GOT is read-only
        before = word.value
        _recorded.clear()
        word.value = ctypes.cast(_memset_hook, ctypes.c_void_p).value
        try:
            yield found
        finally:
            word.value = before
            found.extend(_recorded)
            _recorded.clear()


@dataclass(frozen=True)
class KVPages:
    """Where each stream of each layer's K and V lies in the KV buffer (see the module docstring)."""

    address: int
    size: int
    n_layer: int
    n_stream: int
    k_stream_bytes: int  # one stream's block of one layer's K tensor
    v_stream_bytes: int

    @classmethod
    def locate(cls, model: llama_cpp.llama_model_p, cparams, found: list[tuple[int, int]]) -> "KVPages | None":
        """The layout of the KV buffer among the ranges `zeroing_by_release` recorded, where one of
        them is exactly this model's K/V size for these context parameters; else None."""
        if cparams.kv_unified or llama_cpp.llama_model_n_swa(model) or llama_cpp.llama_model_is_recurrent(model) \
                or llama_cpp.llama_model_is_hybrid(model):
            return None
        n_layer = llama_cpp.llama_model_n_layer(model)
        n_stream = cparams.n_seq_max
        kv_size = cparams.n_ctx // n_stream
        k_row, v_row = _row_bytes(model, cparams.type_k, "key_length"), _row_bytes(model, cparams.type_v, "value_length")
        if not (k_row and v_row):
            return None
        k_stream, v_stream = kv_size * k_row, kv_size * v_row
        want = n_layer * n_stream * (k_stream + v_stream)
        match = [r for r in found if r[1] == want]
        if len(match) != 1:
            log.debug("KV pages: no recorded buffer of %d bytes among %s", want, found)
            return None
        return cls(match[0][0], want, n_layer, n_stream, k_stream, v_stream)

    def stream_ranges(self, stream: int) -> Iterator[tuple[int, int]]:
        """(address, size) of stream `stream`'s block in every layer's K and V tensor."""
        layer_bytes = self.n_stream * (self.k_stream_bytes + self.v_stream_bytes)
        for layer in range(self.n_layer):
            k = self.address + layer * layer_bytes
            v = k + self.n_stream * self.k_stream_bytes
            yield k + stream * self.k_stream_bytes, self.k_stream_bytes
            yield v + stream * self.v_stream_bytes, self.v_stream_bytes

    def release_stream(self, stream: int) -> int:
        """Give back the pages of an empty stream; the bytes given back."""
        return sum(release(a, n) for a, n in self.stream_ranges(stream))

    def release_all(self) -> int:
        return release(self.address, self.size)


def _row_bytes(model, ggml_type: int, length_key: str) -> int:
    """Bytes of one cell of one layer's K (or V): heads x head size, in the cache's element type."""
    per = _ELT_BYTES.get(ggml_type)
    n_head_kv = llama_cpp.llama_model_n_head_kv(model)
    if per is None or n_head_kv <= 0:
        return 0
    head = _meta_int(model, length_key) or llama_cpp.llama_model_n_embd(model) // max(1, llama_cpp.llama_model_n_head(model))
    elements = n_head_kv * head
    return elements * per[0] // per[1] if elements % per[1] == 0 else 0


def _meta_int(model, key_suffix: str) -> int:
    arch = _meta_str(model, "general.architecture")
    value = _meta_str(model, f"{arch}.attention.{key_suffix}") if arch else ""
    return int(value) if value.isdigit() else 0


def _meta_str(model, key: str) -> str:
    buffer = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buffer, len(buffer))
    return buffer.value.decode(errors="replace") if n >= 0 else ""


def resident_bytes(address: int, size: int) -> int:
    """Bytes of [address, address + size) whose pages are mapped now (mincore; the shared zero page
    of a read but never written page counts too). For tests and figures."""
    first = address // PAGE * PAGE
    pages = -(-(address + size - first) // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * PAGE), vec) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return sum(b & 1 for b in vec) * PAGE


class StreamKeeper:
    """Gives a stream's pages back once its sequence has stayed empty for HOLD_S seconds, and no
    copy still reads them.

    Why not at once: writing a stream's pages again after they were given back costs page faults,
    and on this 2-core VM a 1,000-token prefix copied into a given-back stream took 14 ms against
    2.5 ms into pages still held (llama_state_seq_set_data, SmolLM2): load C, whose 32 requests
    start in waves of 8 from one cached 1,000-token system prompt, ran 12% slower than when every
    page stayed committed (benchmarks/serve.py, 2026-12-07). A busy engine reuses its streams within
    milliseconds; one left empty for seconds is memory no request is using, and goes back.

    llama.cpp copies a whole stream (llama_memory_seq_cp across streams) lazily, at the start of
    the next llama_decode; a move (copy, then remove the source) empties the source before its
    data was read, so a source is never given back before the decode that reads it."""

    HOLD_S = 5.0

    def __init__(self, pages: KVPages, memory) -> None:
        self.pages = pages
        self._memory = memory
        self._copying_from: set[int] = set()
        self._emptied: dict[int, float] = {}  # seq id -> when it was emptied

    def _empty(self, seq_id: int) -> bool:
        return llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id) < 0

    def removed(self, seq_id: int) -> None:
        """Cells of `seq_id` were removed (it held some before)."""
        if self._empty(seq_id):
            self._emptied.setdefault(seq_id, time.monotonic())

    def stream_copy(self, src: int) -> None:
        """A lazy whole-stream copy from `src` was asked for."""
        self._copying_from.add(src)

    def decoded(self) -> None:
        """A llama_decode succeeded: pending stream copies have run."""
        self._copying_from.clear()

    def release_due(self, now: float) -> float | None:
        """Give back the streams empty for HOLD_S (still empty, no copy pending); the seconds until
        the next one is due, None when no stream waits."""
        for seq_id, since in list(self._emptied.items()):
            if not self._empty(seq_id):  # written again: its pages are in use
                del self._emptied[seq_id]
            elif since + self.HOLD_S <= now and seq_id not in self._copying_from:
                self.pages.release_stream(seq_id)
                del self._emptied[seq_id]
        # A source a copy still reads waits for the next decode, which the step that asked for the
        # copy runs: not counted, or an idle engine would wake for it at once, again and again.
        return min((since + self.HOLD_S - now for seq_id, since in self._emptied.items()
                    if seq_id not in self._copying_from), default=None)

    def cleared(self) -> None:
        """Every sequence was removed (llama_memory_clear without its data clear)."""
        self._copying_from.clear()
        self._emptied.clear()
        self.pages.release_all()
