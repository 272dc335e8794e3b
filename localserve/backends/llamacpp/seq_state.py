"""One sequence's KV state as bytes and back: what the prompt cache on disk keeps (store/prompt_cache.py).

`llama_state_seq_get_data` writes the cells a sequence holds (their positions and K/V rows, bit
for bit) and `set_data` puts them into free cells of another sequence's stream: the same data at
the same positions, so a prompt continued after a restore is computed as it was before (seq_copy.py
uses the same calls in memory). Two limits follow from what the state leaves out:

- a model with a sliding window writes only the cells its window still sees (Gemma 3: 5 KB a token
  instead of 18 KB), so a restored sequence may be continued from its end only, never cut back;
- a recurrent or hybrid model's state is not cells at all: the same, from its end only.

`trim_margin` says how far before its end a restored state may be cut (None: anywhere).

The key names what must match for the bytes to mean the same thing in the reading engine: the
llama.cpp build (llama-cpp-python's version and its library file, whose size and time change
with every rebuild), the CPU features it was compiled for, the KV layout (streams or one pool),
the K/V element type and whether V is stored transposed (flash attention off).
"""

from __future__ import annotations

import ctypes
import hashlib
import os

import llama_cpp

from ...errors import BackendError


def build_id() -> str:
    """This process's llama.cpp build, as precisely as it can be told without hashing the library."""
    lib = getattr(llama_cpp.llama_cpp, "_lib", None)
    stamp = ""
    path = getattr(lib, "_name", None)
    if path and os.path.isfile(path):
        st = os.stat(path)
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
    system = llama_cpp.llama_print_system_info().decode(errors="replace")
    digest = hashlib.sha256(f"{stamp}|{system}".encode()).hexdigest()[:16]
    return f"llama-cpp-python {llama_cpp.__version__} build {digest}"


def state_key(*, kv_unified: bool, kv_type: str, flash_attention: bool, exact_attention: bool) -> str:
    layout = "unified" if kv_unified else "streams"
    element = "f32" if exact_attention else kv_type
    v_trans = exact_attention or not flash_attention  # llama.cpp transposes V where flash attention is off
    return f"{build_id()}; kv {layout} {element}{' v-transposed' if v_trans else ''}"


def trim_margin(model: llama_cpp.llama_model_p) -> int | None:
    if (llama_cpp.llama_model_n_swa(model) or llama_cpp.llama_model_is_recurrent(model)
            or llama_cpp.llama_model_is_hybrid(model)):
        return 0
    return None


class SeqState:
    """A loaded backend's sequences, saved and restored (the engine thread only: it reads the
    context the decodes write)."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.trim_margin = trim_margin(backend.model)

    def save(self, seq_id: int) -> bytes:
        ctx = self._backend.ctx
        self._backend._check_seq(seq_id)
        size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
        buffer = (ctypes.c_uint8 * size)()
        if not size or llama_cpp.llama_state_seq_get_data(ctx, buffer, size, seq_id) != size:
            raise BackendError(f"could not read sequence {seq_id}'s KV state")
        return bytes(buffer)

    def restore(self, seq_id: int, state: bytes, keep: int) -> None:
        """Put `state` into the empty sequence `seq_id` and drop its positions from `keep` on."""
        backend = self._backend
        backend._check_seq(seq_id)
        source = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        # On failure llama.cpp clears what it had placed ("failed to restore kv cache").
        if llama_cpp.llama_state_seq_set_data(backend.ctx, source, len(state), seq_id) != len(state):
            raise BackendError(f"could not place a saved KV state in sequence {seq_id}")
        if backend.kv_pos_max(seq_id) >= keep:
            backend.kv_remove(seq_id, keep, -1)
