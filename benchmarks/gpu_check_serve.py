"""The device check's serving stages: localserve, then llama-server, on the same GGUF.

Every figure comes from serve.py's own client (streaming chat requests, end-of-generation banned so
each answer runs to its length) and launchers, so the GPU figures read like every other benchmark's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from serve import (LOADS, batched_ceiling, eog_bias, make_chats, report_errors, run_load, start_llama_server,
                   start_localserve, stop, summarize, wait_ready)

SEQUENCES = 8  # llama-server -np 8 as issue 8 anchors it; localserve's LOCALSERVE_MAX_SEQUENCES the same


def _decode_tps(results: list[Any], sequences: int) -> float:
    """Decode tokens/s of `sequences` streams decoding together: 1 / median time per output token
    after the first, times the streams (prefill stays out of it: that is TTFT's figure)."""
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in results if r.ok and r.output_tokens > 1]
    return sequences / statistics.median(tpot) if tpot else math.nan


async def _measure(url: str, model: str, args: argparse.Namespace, bias: dict[str, float],
                   requests_per_load: int) -> dict[str, float]:
    extra = {"logit_bias": bias}
    figures: dict[str, float] = {"requests_per_load": requests_per_load}
    await run_load(url, model, ["Hello"], concurrency=1, request_rate=math.inf, max_tokens=4, seed=0,
                   api_key=None, extra={})  # localserve loads on first use: keep the load out of the figures
    decode_tokens = 32 if args.tiny else 128
    for sequences in (1, SEQUENCES):
        chats = make_chats(sequences * (2 if sequences == 1 else 1), seed=7, lo=5, hi=20)
        results, _ = await run_load(url, model, chats, concurrency=sequences, request_rate=math.inf,
                                    max_tokens=decode_tokens, seed=7, api_key=None, extra=extra)
        report_errors(f"decode at {sequences}", results)
        figures[f"decode_tps_{sequences}"] = _decode_tps(results, sequences)
        figures[f"decode_{sequences}_errors"] = sum(not r.ok for r in results)
    for load in ("A", "B") if requests_per_load else ():
        lo, hi, max_tokens, system_words = LOADS[load]
        chats = make_chats(requests_per_load, 0, lo, hi, system_words)
        results, duration = await run_load(url, model, chats, concurrency=SEQUENCES, request_rate=math.inf,
                                           max_tokens=max_tokens, seed=0, api_key=None, extra=extra)
        report_errors(f"load {load}", results)
        summary = summarize(results, duration)
        figures |= {f"{load}_tps": summary["output_tokens_per_s"], f"{load}_ttft_p50_ms": summary["ttft_ms_p50"],
                    f"{load}_ttft_p95_ms": summary["ttft_ms_p95"], f"{load}_errors": summary["errors"]}
    return figures


def _offload(url: str) -> dict[str, float]:
    """localserve's own account of the load (/api/ps): layers on the GPU and its device buffers."""
    with urllib.request.urlopen(f"{url}/api/ps", timeout=10) as response:
        row = json.load(response)["models"][0]
    return {"gpu_layers": row["gpu_layers"], "offloadable_layers": row["offloadable_layers"],
            "size_vram_mib": row["size_vram"] / 2**20, "moe_layers_in_ram": row.get("moe_layers_in_ram", 0)}


def _gpu_memory_mib() -> float:
    from gpu_check import gpu_memory_used_mib

    return gpu_memory_used_mib()


def _requests_per_load(args: argparse.Namespace, left_s: float) -> int:
    """Requests of each of loads A and B, the same for both servers: 32 as serve.py's default,
    fewer when the build left little of the budget (a cut run still gives decode figures), 8 for
    the CPU twin."""
    if args.tiny:
        return 8
    return 32 if left_s > 300 else 16 if left_s > 150 else 0


def serve_one(name: str, model: Path, args: argparse.Namespace, work: Path, requests: int,
              n_cpu_moe: int = 0) -> dict[str, Any]:
    """One server's figures; `n_cpu_moe`: the first N layers' MoE experts in RAM (localserve's
    setting n_cpu_moe, llama-server's --n-cpu-moe)."""
    gpu = not args.cpu
    before = _gpu_memory_mib() if gpu else 0.0
    if name == "localserve":
        moe_env = {"LOCALSERVE_N_CPU_MOE": str(n_cpu_moe)} if n_cpu_moe else {}
        proc, url, served = start_localserve(model, args.threads, SEQUENCES, work, extra_env=moe_env)
    else:
        # -fa off: localserve runs without flash attention, and the build has no FA kernels.
        moe_args = ["--n-cpu-moe", str(n_cpu_moe)] if n_cpu_moe else []
        proc, url, served = start_llama_server(model, args.threads, SEQUENCES, work,
                                               extra_args=["-fa", "off", *(["-ngl", "999"] if gpu else []), *moe_args])
    try:
        asyncio.run(wait_ready(url, "/health", proc))
        figures: dict[str, Any] = asyncio.run(_measure(url, served, args, eog_bias(model), requests))
        if not requests and not n_cpu_moe:  # the MoE stage runs no loads A and B by design
            figures["note"] = "loads A and B skipped: too little of the time budget left"
        if name == "localserve":
            figures |= _offload(url)
        if gpu:
            figures["gpu_memory_mib"] = _gpu_memory_mib() - before
        return figures
    finally:
        stop(proc)


def _serve_both(model: Path, args: argparse.Namespace, work: Path, deadline: float, stage: Callable[[str], None],
                requests: int, n_cpu_moe: int = 0) -> dict[str, Any]:
    """localserve, then llama-server, each skipped (and said so) where it cannot run."""
    from gpu_check import built_tool

    servers: dict[str, Any] = {}
    for name in ("localserve", "llama-server"):
        stage(f"serve with {name}" + (f" (--n-cpu-moe {n_cpu_moe})" if n_cpu_moe else ""))
        if name == "llama-server" and built_tool("llama-server") is None:
            print("llama-server: skipped (no llama-server built in benchmarks/llama_server_build.py's cache; "
                  "the CPU twin never compiles one)")
            servers[name] = {"skipped": "no llama-server build"}
            continue
        if deadline - time.monotonic() < 45:  # a start, a model load and the decode runs: keep the budget
            print(f"{name}: skipped (no time left in the budget)")
            servers[name] = {"skipped": "no time left in the budget"}
            continue
        folder = work / (f"{name}-moe" if n_cpu_moe else name)
        folder.mkdir(exist_ok=True)
        t = time.monotonic()
        servers[name] = serve_one(name, model, args, folder, requests, n_cpu_moe)
        servers[name]["stage_s"] = time.monotonic() - t
        print(f"{name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in servers[name].items()))
    return servers


def serve_moe(model: Path, args: argparse.Namespace, deadline: float, stage: Callable[[str], None],
              n_cpu_moe: int) -> dict[str, Any]:
    """The MoE stage: decode at 1 and 8 sequences (no loads A and B: the time is the dense model's)
    with the first `n_cpu_moe` layers' experts in RAM, localserve beside llama-server --n-cpu-moe."""
    return _serve_both(model, args, Path(args.work).resolve(), deadline, stage, 0, n_cpu_moe)


def serve_all(model: Path, args: argparse.Namespace, deadline: float, stage: Callable[[str], None]) -> dict[str, Any]:
    from gpu_check import built_tool

    work = Path(args.work).resolve()
    requests = _requests_per_load(args, deadline - time.monotonic())
    servers = _serve_both(model, args, work, deadline, stage, requests)
    served = servers["localserve"]
    if not args.cpu and served.get("gpu_layers", 0) < served.get("offloadable_layers", 0):
        print(f"WARNING: localserve offloaded only {served['gpu_layers']}/{served['offloadable_layers']} layers "
              f"(see {work / 'localserve' / 'localserve.out'})")
    stage("llama-batched-bench (the build's ceiling)")
    if built_tool("llama-batched-bench") and deadline - time.monotonic() > 30:
        gpu_args = () if args.cpu else ("-ngl", "999")
        servers["llama-batched-bench"] = batched_ceiling(model, args.threads, npl=f"1,{SEQUENCES}", extra=gpu_args)
        print(servers["llama-batched-bench"])
    else:
        print("llama-batched-bench: skipped (not built, or no time left)")
    return servers
