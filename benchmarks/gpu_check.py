"""The GPU device check (issue 46): localserve beside llama-server on one NVIDIA card, one command.

Here, once, with network (writes .gpu-check/, ignored by git, 7-8 MB):

    python benchmarks/gpu_check.py prepare

A session lent a GPU machine then makes this one call of the device tool's `run` (carry: the
prepared folder; nothing else is needed there: the machine has nvcc, CMake, ninja, scikit-build-core,
numpy, aiohttp, jinja2, rich and psutil, and .gpu-check/ brings the trimmed llama.cpp sources, the
tokenizer and the wheels of gguf, platformdirs and diskcache):

    run(command="set -o pipefail; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py run --out $OUT 2>&1 | tee $OUT/log.txt",
        carry=[".gpu-check"], timeout_s=600)

then `give_back` (a second call would start from nothing: the build is not kept). The run keeps
to --budget-s (570 s of the 600): when the build is slow, the serving stages are cut (loads A and B
with fewer requests, then none) or skipped, and the table says so; it is always written. The files
come back under the reply's files_at: gpu_check.txt (the table, also the end of output_tail),
gpu_check.json (every figure), log.txt, build.log, localserve.out and llama_server.out.

Before reporting, check in the table: localserve's "layers on the GPU" equals "layers offloadable"
(the model's 16 layers + the output: 17 for 1b; else its placement kept layers on the CPU and
localserve.out says why), and loads A and B had no errors. Then put the table in the issue's note
with the card's name, saying that both servers ran the same build, card and GGUF, one after the
other, in one run (no alternating passes: one run is what the device time allows).

What one run does, on the card found:
1. builds llama.cpp once with CUDA for that card only (CMAKE_CUDA_ARCHITECTURES from nvidia-smi's
   compute capability, "9.0" -> 90), only the targets used: libllama (what localserve's backend
   loads, through llama-cpp-python installed from the same sources with pip, no compile),
   llama-server, llama-batched-bench and llama-quantize (gpu_check_build.py);
2. writes a Llama-3.2-1B-shaped GGUF (--shape 3b / 8b for larger) of seeded random weights with
   SmolLM2's tokenizer and quantizes it to Q4_K_M with that build's llama-quantize (gpu_check_model.py);
3. serves it with localserve (its own placement puts every layer on the GPU: checked in /api/ps)
   and with llama-server -ngl 999, one after the other, and measures for each: decode tok/s at 1
   and 8 sequences (from TPOT), loads A and B of serve.py (tok/s, TTFT p50/p95) and the GPU memory
   the server holds (nvidia-smi); then llama-batched-bench's generation at 1 and 8 sequences and
   the bandwidth bound (weight bytes read per token against the card's memory bandwidth).

Time: the CUDA build is the long pole. `ninja -n` on the trimmed sources (configured here with
nvcc 13.0, the device's version) lists 340 objects for the four targets, 144 of them CUDA units:
69 kernel files, 22 mmq and 16 mmf instances, and 37 flash-attention instances that compile to
empty kernels with GGML_CUDA_FA=OFF. Timed here for sm_90 (CPU seconds, with a stub cuBLAS header:
this machine's toolkit has none): an mmq instance 59, an mmf instance 32, mmvq.cu (the heaviest
kernel file) 96, norm.cu (a light one) 9. So about 3,100 CPU-s of nvcc plus ~600 of C++, which is
4-5 minutes on the device's 16 cores at this machine's per-core speed (no unit is longer than
~100 s, so the cores stay busy to the end). Then ~1 minute for the 1B model (2.1 GB of F16
written, quantized on 16 threads; here it took under a minute of CPU to write) and ~2-3 for the
serving stages. Each stage prints its start time; the table gives the build's.

If the toolkit lacks cuBLAS or the driver stub (this dev machine's lacks both), the configure is
retried with the cuBLAS of the NVIDIA wheels in python3's site-packages (the device's PyTorch
brings them) and without CUDA VMM; the table's JSON says which (cmake_fallbacks).

The CPU twin, `run --cpu --tiny` (tests/system/test_gpu_check.py), runs the same stages here with
no CUDA and no compile: a 2-layer model, the installed llama-cpp-python (its llama_model_quantize
binding instead of the tool), and llama-server only when benchmarks/llama_server_build.py's cache
already holds one (else it says it skipped it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
PREPARED = REPO / ".gpu-check"
TOKENIZER_SOURCE = REPO / ".test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf"
# The wheels the device lacks: what localserve and llama-cpp-python import at serve time beyond
# the machine's own packages (numpy, aiohttp, jinja2, rich, psutil, prometheus-client, Pillow).
WHEELS = {"gguf": "0.19.0", "platformdirs": "4.14.9", "diskcache": "5.6.3"}


def stage(name: str) -> None:
    print(f"\n== {name} ({time.strftime('%H:%M:%S')})", flush=True)


# --- prepare (here) ----------------------------------------------------------------------------


def prepare(dest: Path) -> None:
    from gpu_check_build import prepare_sources
    from gpu_check_model import extract_tokenizer

    prepare_sources(dest / "llama-src.tar.gz")
    extract_tokenizer(TOKENIZER_SOURCE, dest / "tokenizer.json")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d",
                    str(dest / "wheels"), *(f"{n}=={v}" for n, v in WHEELS.items())], check=True)
    total = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"{dest}: {total / 2**20:.1f} MiB to carry")


# --- the environment of a run ------------------------------------------------------------------


def gpu_facts() -> dict[str, object]:
    """The card: name, memory, compute capability and its memory bandwidth by name (datasheet
    figures: the bandwidth bound is what a decode step reading every weight once can reach)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,compute_cap,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"no NVIDIA GPU here ({e}): this is the device check; `run --cpu --tiny` is its CPU twin")
    name, total, cap, driver = [c.strip() for c in out.splitlines()[0].split(",")]
    return {"gpu": name, "memory_total_mib": float(total), "compute_cap": cap, "driver": driver,
            "bandwidth_bytes_per_s": card_bandwidth(name)}


def card_bandwidth(name: str) -> float | None:
    """Datasheet memory bandwidth (bytes/s) of the cards this check is written for, by nvidia-smi's
    name ("NVIDIA H100 80GB HBM3" is the SXM card, "NVIDIA H100 PCIe" the PCIe one)."""
    if "H200" in name:
        return 4.8e12
    if "H100" in name:
        return 2.0e12 if "PCIe" in name else 3.35e12
    return None


def gpu_memory_used_mib() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.splitlines()[0])


def install_wheels(site: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), *map(str, (PREPARED / "wheels").glob("*.whl"))], check=True)


def cuda_environment(work: Path, figures: dict) -> None:
    """Build llama.cpp with CUDA and install llama-cpp-python on it; point this process and the
    servers it starts at them (PYTHONPATH for localserve's workers, the bench cache for
    llama_server_build.tool_binary)."""
    from gpu_check_build import build_cuda, install_python_package, unpack

    site, cache = work / "site", work / "cache"
    install_wheels(site)
    sdist = unpack(PREPARED / "llama-src.tar.gz", work / "src")
    figures.update(build_cuda(sdist, cache / "build", work / "build.log"))
    install_python_package(sdist, site, cache / "build" / "bin", work / "build.log")
    os.environ["LOCALSERVE_BENCH_CACHE"] = str(cache)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = [str(site), str(REPO)]


def built_tool(name: str) -> Path | None:
    """A tool of llama_server_build's cache if it is already built (never builds one)."""
    from llama_server_build import cache_dir

    path = cache_dir() / "build" / "bin" / name
    return path if path.is_file() else None


# --- the model ---------------------------------------------------------------------------------


def tokenizer_json(args: argparse.Namespace, work: Path) -> Path:
    """The prepared tokenizer, or one read now from --tokenizer-gguf (the twin: CI has no .gpu-check/)."""
    from gpu_check_model import extract_tokenizer

    if args.tokenizer_gguf:
        return extract_tokenizer(Path(args.tokenizer_gguf), work / "tokenizer.json")
    return PREPARED / "tokenizer.json"


def make_model(work: Path, shape: str, tokenizer: Path, threads: int, figures: dict) -> Path:
    from gpu_check_model import LLAMA_FTYPE_MOSTLY_Q4_K_M, MOE_SHAPES, file_type, quantize_with_binding, \
        weight_bytes, write_f16_model, write_moe_f16_model

    f16, q4 = work / f"{shape}-f16.gguf", work / f"{shape}-Q4_K_M.gguf"
    (write_moe_f16_model if shape in MOE_SHAPES else write_f16_model)(f16, shape, tokenizer)
    if tool := built_tool("llama-quantize"):
        subprocess.run([str(tool), str(f16), str(q4), "Q4_K_M", str(threads)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        figures["quantized_by"] = "llama-quantize"
    else:
        quantize_with_binding(f16, q4, threads)
        figures["quantized_by"] = "llama_model_quantize (llama-cpp-python)"
    f16.unlink()
    if file_type(q4) != LLAMA_FTYPE_MOSTLY_Q4_K_M:
        raise SystemExit(f"{q4} is not Q4_K_M")
    figures |= {"model": q4.name, "shape": shape, "weight_bytes": float(weight_bytes(q4))}
    return q4


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "prepare":
        prepare(PREPARED)
        return 0
    from gpu_check_serve import serve_all
    from gpu_check_report import write_report

    started = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    figures: dict = {"device": "cpu" if args.cpu else "cuda", "threads": args.threads}
    try:
        if not args.cpu:
            stage("GPU")
            figures |= gpu_facts()
            print(figures)
            stage("build llama.cpp with CUDA (the long pole)")
            cuda_environment(work, figures)
            print(f"configured in {figures['configure_s']:.0f} s, built in {figures['build_s']:.0f} s")
        stage(f"model: {args.shape}, Q4_K_M")
        t = time.monotonic()
        tokenizer = tokenizer_json(args, work)
        model = make_model(work, args.shape, tokenizer, args.threads, figures)
        figures["model_s"] = time.monotonic() - t
        print(f"{model.name}: {figures['weight_bytes'] / 2**20:.1f} MiB of weights, "
              f"quantized by {figures['quantized_by']} in {figures['model_s']:.0f} s")
        deadline = started + args.budget_s
        figures["servers"] = serve_all(model, args, deadline, stage)
        figures["moe"] = moe_stage(work, args, tokenizer, deadline)
    except BaseException as e:
        figures["failed"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        figures["total_s"] = time.monotonic() - started
        write_report(figures, out)
        keep_logs(work, out)
    return 0


def moe_stage(work: Path, args: argparse.Namespace, tokenizer: Path, deadline: float) -> dict:
    """A Qwen3-MoE made here, served by both with the first half of its layers' experts in RAM
    (localserve's n_cpu_moe, llama-server's --n-cpu-moe): decode tok/s side by side; skipped, and
    said so, when the dense stages left too little of the budget."""
    from gpu_check_model import MOE_SHAPES
    from gpu_check_serve import serve_moe

    shape = "moe-tiny" if args.tiny else "moe"
    n_cpu_moe = MOE_SHAPES[shape].n_layer // 2
    stage(f"MoE: {shape}, Q4_K_M, the first {n_cpu_moe} layers' experts in RAM")
    if deadline - time.monotonic() < 150:  # write + quantize (~1 min there) and two servers' decode runs
        print("MoE: skipped (no time left in the budget)")
        return {"skipped": "no time left in the budget"}
    figures: dict = {"n_cpu_moe": n_cpu_moe}
    model = make_model(work, shape, tokenizer, args.threads, figures)
    figures["servers"] = serve_moe(model, args, deadline, stage, n_cpu_moe)
    return figures


def keep_logs(work: Path, out: Path) -> None:
    """The build's and the servers' logs beside the figures: on the device only $OUT comes back
    (at most 8 files; these make 6 with the JSON, the table and the tee'd output)."""
    for log in (work / "build.log", work / "localserve" / "localserve.out", work / "llama-server" / "llama_server.out"):
        if log.is_file():
            shutil.copy(log, out / log.name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("prepare", "run"))
    p.add_argument("--cpu", action="store_true", help="the CPU twin: no CUDA build, the installed llama-cpp-python")
    p.add_argument("--tiny", action="store_true", help="the twin's small shape and loads")
    p.add_argument("--shape", default="1b", choices=("1b", "3b", "8b"), help="the model's shape (default 1b)")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out", help="where the JSON and table go")
    p.add_argument("--work", default="/tmp/gpu-check", help="build, site and model folder")
    p.add_argument("--tokenizer-gguf", help="read the tokenizer from this GGUF (default: the prepared JSON)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--budget-s", type=float, default=570, help="the whole run's time (the device allows 600)")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape = "tiny"
    return args


if __name__ == "__main__":
    sys.exit(main())
