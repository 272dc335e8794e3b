"""Memory estimate: exact KV/weights figures for SmolLM2, compute margin checked against llama.cpp."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from localserve.errors import InvalidRequestError
from localserve.store.gguf_facts import read_gguf_facts
from localserve.runtime.memory import KV_BYTES, estimate_memory, format_bytes

MiB = 1 << 20


@pytest.fixture(scope="module")
def smollm2_facts(smollm2_gguf: Path):
    return read_gguf_facts(smollm2_gguf)


@pytest.mark.model
def test_smollm2_estimate(smollm2_facts) -> None:
    e = estimate_memory(smollm2_facts, 8192)
    # llama.cpp: "KV buffer size = 180.00 MiB (8192 cells, 30 layers) K (f16): 90.00 MiB, V (f16): 90.00 MiB"
    assert e.kv_bytes == 180 * MiB
    assert e.weights_bytes == 96_576_768  # "CPU_Mapped model buffer size = 92.10 MiB"
    assert e.total_bytes == e.weights_bytes + e.kv_bytes + e.compute_bytes
    assert e.n_layers == 30
    assert e.layer_bytes == smollm2_facts.largest_layer_bytes + 6 * MiB  # 180 MiB of KV over 30 layers
    assert e.non_layer_bytes == smollm2_facts.weights_bytes - smollm2_facts.layer_bytes
    assert estimate_memory(smollm2_facts, 4096).kv_bytes == 90 * MiB
    # Two sequences of 4096 need the same cells as one of 8192.
    assert estimate_memory(smollm2_facts, 4096, n_seq=2).kv_bytes == 180 * MiB
    assert estimate_memory(smollm2_facts, 8192, kv_bytes_per_elem=KV_BYTES["q8_0"]).kv_bytes == round(180 * MiB * 34 / 64)


@pytest.mark.model
def test_compute_margin_matches_llama_cpp(smollm2_gguf: Path, smollm2_facts) -> None:
    """Load the real model with llama.cpp and compare its logged buffers with our estimate."""
    code = (
        "import llama_cpp, sys\n"
        f"llama_cpp.Llama({str(smollm2_gguf)!r}, n_ctx=4096, n_threads=2, flash_attn=False, verbose=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    log = out.stdout + out.stderr
    compute = re.search(r"CPU compute buffer size =\s+([\d.]+) MiB", log)
    kv = re.search(r"KV buffer size =\s+([\d.]+) MiB", log)
    assert compute and kv, log[-2000:]
    e = estimate_memory(smollm2_facts, 4096)
    assert float(kv.group(1)) * MiB == e.kv_bytes
    measured = float(compute.group(1)) * MiB
    assert abs(e.compute_bytes - measured) / measured < 0.05, (e.compute_bytes / MiB, measured / MiB)


def test_bad_arguments(smollm2_facts) -> None:
    with pytest.raises(InvalidRequestError):
        estimate_memory(smollm2_facts, 0)
    with pytest.raises(InvalidRequestError):
        estimate_memory(smollm2_facts, 512, n_seq=0)
    with pytest.raises(InvalidRequestError):
        estimate_memory(smollm2_facts, 512, kv_bytes_per_elem=0)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(180 * MiB) == "180.0 MiB"
    assert format_bytes(24 * 1024 * MiB) == "24.0 GiB"
    assert format_bytes(2048 * 1024 * MiB) == "2048.0 GiB"
