"""The GPU device check's CPU twin (benchmarks/gpu_check.py run --cpu --tiny): the script a GPU
session runs as it is, run here for real with no CUDA and no compile. A Llama GGUF is written from
seeded weights with SmolLM2's tokenizer, quantized to Q4_K_M through llama-cpp-python's binding,
served by a real localserve daemon under serve.py's loads, and its figures printed and written as
the device run writes them. llama-server runs only where benchmarks/llama_server_build.py's cache
already holds one (CI compiles none); the twin says so when it skips it. No timing is asserted:
only that every stage ran and produced well-formed, finite figures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localserve.store.gguf_facts import read_gguf_facts

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.mark.timeout(420)
def test_cpu_twin_runs_every_stage(tmp_path: Path, smollm2_gguf: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    run = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check.py"), "run", "--cpu", "--tiny",
                          "--threads", "2", "--out", str(out), "--work", str(work), "--tokenizer-gguf", str(smollm2_gguf)],
                         env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for header in ("== model: tiny, Q4_K_M", "== serve with localserve", "== serve with llama-server",
                   "== llama-batched-bench", "== MoE: moe-tiny, Q4_K_M, the first 1 layers' experts in RAM",
                   "== serve with localserve (--n-cpu-moe 1)"):
        assert header in run.stdout

    # The model: a Llama GGUF of the tiny shape, quantized to Q4_K_M, with SmolLM2's tokenizer.
    model, source = read_gguf_facts(work / "tiny-Q4_K_M.gguf"), read_gguf_facts(smollm2_gguf)
    assert (model.architecture, model.quant, model.n_layers, model.n_embd) == ("llama", "Q4_K_M", 2, 256)
    assert (model.tokenizer_model, model.vocab_size, model.chat_template) == \
        (source.tokenizer_model, source.vocab_size, source.chat_template)

    figures = json.loads((out / "gpu_check.json").read_text())
    assert figures["device"] == "cpu" and figures["shape"] == "tiny"
    assert figures["weight_bytes"] == model.weights_bytes > 0
    served = figures["servers"]["localserve"]
    for key in ("decode_tps_1", "decode_tps_8", "A_tps", "B_tps", "A_ttft_p50_ms", "B_ttft_p95_ms"):
        assert math.isfinite(served[key]) and served[key] > 0, (key, served)
    assert served["A_errors"] == served["B_errors"] == served["decode_1_errors"] == served["decode_8_errors"] == 0
    assert served["A_ttft_p50_ms"] <= served["A_ttft_p95_ms"]
    assert served["gpu_layers"] == 0  # the CPU twin: nothing offloaded
    anchor = figures["servers"]["llama-server"]
    if "skipped" in anchor:
        assert "llama-server: skipped" in run.stdout
    else:
        assert anchor["A_errors"] == 0 and anchor["decode_tps_1"] > 0

    # The MoE stage: a Qwen3-MoE made the same way, both servers decoding with n_cpu_moe 1 (on the
    # CPU the setting moves nothing: every weight is in RAM already).
    moe = figures["moe"]
    assert (read_gguf_facts(work / "moe-tiny-Q4_K_M.gguf").architecture, moe["n_cpu_moe"]) == ("qwen3moe", 1)
    moe_served = moe["servers"]["localserve"]
    assert moe_served["decode_tps_1"] > 0 and moe_served["decode_tps_8"] > 0
    assert moe_served["decode_1_errors"] == moe_served["decode_8_errors"] == 0
    assert moe_served["moe_layers_in_ram"] == 0 and moe_served["gpu_layers"] == 0

    # The table is the end of the output (what the device reply's output_tail shows) and its file.
    table = (out / "gpu_check.txt").read_text()
    assert run.stdout.rstrip().endswith(table.rstrip())
    for row in ("decode tok/s, 1 sequence", "decode tok/s, 8 sequences", "load A output tok/s",
                "load B TTFT p95 (ms)", "MoE moe-tiny", "  localserve: decode tok/s"):
        assert row in table


def test_bandwidth_bound_by_card_name() -> None:
    from gpu_check import card_bandwidth
    from gpu_check_report import table

    assert card_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert card_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert card_bandwidth("NVIDIA H200") == 4.8e12
    assert card_bandwidth("NVIDIA GeForce RTX 4090") is None
    text = table({"gpu": "NVIDIA H200", "bandwidth_bytes_per_s": 4.8e12, "weight_bytes": 800e6,
                  "servers": {"localserve": {"decode_tps_1": 300.0}}})
    assert "= 6000 tok/s; localserve reaches 5%" in text


def test_trimmed_sources_keep_what_the_build_reads() -> None:
    from gpu_check_build import SDIST_DIR, _keep

    vendor = f"{SDIST_DIR}/vendor/llama.cpp"
    for kept in ("CMakeLists.txt", "llama_cpp/llama_cpp.py", "vendor/llama.cpp/ggml/src/ggml-cuda/mmq.cu",
                 "vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c", "vendor/llama.cpp/ggml/src/ggml.c",
                 "vendor/llama.cpp/tools/server/server.cpp", "vendor/llama.cpp/tools/ui/CMakeLists.txt"):
        assert _keep(f"{SDIST_DIR}/{kept}"), kept
    for dropped in ("models/ggml-vocab-llama-bpe.gguf", "docs/build.md", "tests/test-backend-ops.cpp",
                    "ggml/src/ggml-vulkan/ggml-vulkan.cpp", "tools/ui/src/app.html"):
        assert not _keep(f"{vendor}/{dropped}"), dropped
    assert not _keep(f"{SDIST_DIR}/docs/index.md") and not _keep(f"{SDIST_DIR}/tests/test_llama.py")
