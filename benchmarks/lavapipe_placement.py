"""MoE experts in RAM and layers over two GPUs, on a real Vulkan device: Mesa's lavapipe (issue 46).

    python benchmarks/lavapipe_placement.py \\
        --vulkan-python ~/.cache/localserve-vulkan/venv/bin/python --cpu-python .venv/bin/python

tests/model/test_cpu_moe.py and tests/unit/test_gpu_split.py check the same settings on the CPU
build and on recorded two-GPU machines; only a GPU build shows that the tensors then land where the
settings say. No GPU is lent to this project's machines, so this runs llama.cpp's Vulkan backend on
lavapipe, a software Vulkan device: slow (a few tokens a second), so outside the CI run. Building
the Vulkan environment: /work/shared/notes/vulkan-on-lavapipe.md. ggml lists a CPU-type device only
when GGML_VK_VISIBLE_DEVICES names it; naming it twice ("0,0") gives two Vulkan devices on the one
lavapipe, which is how this machine gets a second "GPU" for the split.

What it checks, each a line PASS or FAIL (exit status 1 on any FAIL):
- MoE (tests/moe_model.py's tiny Qwen3-MoE, every layer offloaded): with cpu_moe off the expert
  stacks are on Vulkan0; with n_cpu_moe 1 the first layer's and with cpu_moe all of them are in a
  CPU buffer (llama.cpp's load log), Vulkan0's model buffer shrinks by their size, and the greedy
  tokens equal the CPU build's.
- Split (SmolLM2-135M, two devices): the hardware report lists both with their free memory;
  split_mode layer with tensor_split 1,1 and 3,1 puts the repeating layers on Vulkan0 and Vulkan1 in
  those shares (llama.cpp's load log, to a layer), each with buffers; split_mode none with main_gpu 1 puts the whole model on Vulkan1; greedy tokens equal
  the CPU build's (lavapipe's sums round differently from the CPU's: counted, and a FAIL only where
  the first tokens differ).
- The CLI and daemon on the Vulkan build with cpu_moe=on, and with tensor_split=1,1 on two devices:
  `localserve show` says before a load where the experts and each card's share will be, and `localserve
  ps` after an answer "experts of 3 layers in RAM", and each card's memory as llama.cpp allocated it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "Once upon a time, in a small village,"]
MIB = 1 << 20


# --- child: runs inside one environment, prints one JSON object --------------------------------

def _load_and_answer(gguf: str, load: dict, tokens: int, threads: int) -> dict:
    from localserve.backends.llamacpp.backend import LlamaCppBackend
    from localserve.backends.llamacpp.loading import GpuSplit
    from vulkan_lavapipe import greedy

    split = GpuSplit(load.get("mode", "layer"), load.get("main_gpu", 0), tuple(load.get("shares", ())))
    backend = LlamaCppBackend.load(gguf, n_ctx=256, n_seq_max=1, n_batch=64, n_gpu_layers=load.get("ngl", 0),
                                   cpu_moe_layers=load.get("cpu_moe", 0), split=split, n_threads=threads,
                                   kv_unified=False, flash_attention=False)
    try:
        facts = backend.offload
        return {"load": load, "gpu_layers": facts.gpu_layers, "offloadable_layers": facts.offloadable_layers,
                "overridden": facts.overridden, "bytes_by_device": facts.bytes_by_device,
                "layers_by_device": facts.layers_by_device,
                "model_bytes_on_devices": facts.device_bytes.get("model", 0),
                "moe_layers_in_ram": facts.moe_layers_in_ram,
                "tokens": [greedy(backend, p, tokens)[0] for p in PROMPTS]}
    finally:
        backend.close()


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    out: dict = {"runs": [_load_and_answer(args.model, load, args.tokens, args.threads)
                          for load in json.loads(args.loads)]}
    if args.report:
        from localserve.hardware import detect_hardware

        out["gpus"] = [{"name": g.name, "apis": g.apis, "vram_free_bytes": g.vram_free_bytes}
                       for g in detect_hardware().gpus]
    print("RESULT " + json.dumps(out))


def run_child(python: str, model: Path, loads: list[dict], args: argparse.Namespace, devices: str | None,
              report: bool = False) -> dict:
    cmd = [python, __file__, "--child", "--model", str(model), "--loads", json.dumps(loads),
           "--tokens", str(args.tokens), "--threads", str(args.threads)] + (["--report"] if report else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GGML_VK_VISIBLE_DEVICES", None)
    if devices is not None:
        env["GGML_VK_VISIBLE_DEVICES"] = devices
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{python} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


# --- the daemon ---------------------------------------------------------------------------------

def show_and_ps(python: str, gguf: Path, devices: str, **settings: str) -> tuple[str, str]:
    """`localserve show` before a load, and `localserve ps` after one greedy answer from a daemon,
    both run on `python`'s build."""
    from daemon_util import cli, cli_env, free_port, http_post, stop_quietly, wait_published

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        env = cli_env(home, free_port(), GGML_VK_VISIBLE_DEVICES=devices, LOCALSERVE_THREADS="1",
                      LOCALSERVE_CONTEXT_LENGTH="256", LOCALSERVE_MAX_SEQUENCES="1",
                      **{f"LOCALSERVE_{k.upper()}": v for k, v in settings.items()})
        added = cli(env, "add", str(gguf), "--name", "placed:vk")
        if added.returncode != 0:
            sys.exit(added.stderr)
        show = subprocess.run([python, "-m", "localserve", "show", "placed:vk"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600, check=True).stdout
        proc = subprocess.Popen([python, "-m", "localserve", "serve"], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = wait_published(home, timeout=120)["url"]
            status, body = http_post(url + "/api/generate", {"model": "placed:vk", "prompt": PROMPTS[0],
                                                             "stream": False, "options": {"temperature": 0,
                                                                                          "num_predict": 4}},
                                     timeout=600)
            if status != 200:
                sys.exit(f"the daemon answered {status}: {body}")
            return show, cli(env, "ps").stdout
        finally:
            stop_quietly(env, proc)


# --- parent -------------------------------------------------------------------------------------

class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def __call__(self, name: str, ok: bool, detail: str = "") -> None:
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)


def _agreement(run: dict, ref: dict) -> tuple[int, int]:
    """(prompts whose greedy tokens all agree, prompts whose first token agrees)."""
    pairs = list(zip(run["tokens"], ref["tokens"]))
    return sum(a == b for a, b in pairs), sum(a[0] == b[0] for a, b in pairs)


def check_moe(args: argparse.Namespace, check: Checks, moe: Path) -> None:
    from moe_model import N_LAYER, expert_tensor_names

    (ref,) = run_child(args.cpu_python, moe, [{}], args, None)["runs"]
    runs = run_child(args.vulkan_python, moe, [{"ngl": 99}, {"ngl": 99, "cpu_moe": 1}, {"ngl": 99, "cpu_moe": -1}],
                     args, "0")["runs"]
    plain = runs[0]
    check("MoE all offloaded", plain["gpu_layers"] == plain["offloadable_layers"] > 0 and not plain["overridden"],
          f"{plain['gpu_layers']}/{plain['offloadable_layers']} layers, model buffers {plain['bytes_by_device']}")
    for run, layers in ((runs[1], range(1)), (runs[2], range(N_LAYER))):
        names = sorted(run["overridden"])
        on_cpu = all(b.startswith("CPU") for b in run["overridden"].values())
        check(f"cpu_moe layers {len(layers)}: the expert stacks of exactly those layers in a CPU buffer",
              names == sorted(expert_tensor_names(layers)) and on_cpu and run["moe_layers_in_ram"] == len(layers),
              f"{len(names)} tensors, {set(run['overridden'].values())}")
        moved = plain["model_bytes_on_devices"] - run["model_bytes_on_devices"]
        check(f"cpu_moe layers {len(layers)}: Vulkan0's model buffer smaller", moved > 0,
              f"{plain['model_bytes_on_devices'] / MIB:.2f} -> {run['model_bytes_on_devices'] / MIB:.2f} MiB")
    for run in runs:
        same, first = _agreement(run, ref)
        check(f"MoE cpu_moe={run['load'].get('cpu_moe', 0)}: greedy tokens equal the CPU build's",
              same == len(PROMPTS), f"{same}/{len(PROMPTS)} prompts all {args.tokens} tokens, {first} first tokens")


def check_split(args: argparse.Namespace, check: Checks, model: Path) -> None:
    (ref,) = run_child(args.cpu_python, model, [{}], args, None)["runs"]
    loads = [{"ngl": 99, "mode": "layer", "shares": [1, 1]}, {"ngl": 99, "mode": "layer", "shares": [3, 1]},
             {"ngl": 99, "mode": "none", "main_gpu": 1}]
    out = run_child(args.vulkan_python, model, loads, args, "0,0", report=True)
    vulkan = [g for g in out["gpus"] if "Vulkan" in g["apis"]]
    check("the report lists two Vulkan devices with their free memory",
          len(vulkan) == 2 and all(g["vram_free_bytes"] for g in vulkan), json.dumps(vulkan))
    for run in out["runs"]:
        per = {d: n for d, n in run["bytes_by_device"].items()}
        load = run["load"]
        if load["mode"] == "layer":
            layers = run["layers_by_device"]
            a, b = layers.get("Vulkan0", 0), layers.get("Vulkan1", 0)
            want = load["shares"][0] / sum(load["shares"])
            got = a / (a + b) if a + b else 0
            check(f"split layer {load['shares']}: the layers over both devices in those shares",
                  a > 0 and b > 0 and abs(got - want) <= 1 / (a + b), f"layers {layers}, buffers {per}")
        else:
            check("split none, main_gpu 1: the whole model on Vulkan1", set(per) == {"Vulkan1"}, str(per))
        same, first = _agreement(run, ref)
        check(f"split {load['mode']} {load.get('shares', '')}: greedy tokens against the CPU build's",
              first == len(PROMPTS), f"{same}/{len(PROMPTS)} prompts all {args.tokens} tokens, {first} first tokens")


def _row(show: str, name: str) -> str:
    """A `show` row's text, its wrapped lines joined."""
    lines = show.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith(name)), None)
    if start is None:
        return ""
    text = [lines[start].strip()[len(name):].strip()]
    for line in lines[start + 1:]:
        if line[:19].strip():  # the next row's name
            break
        text.append(line.strip())
    return " ".join(text)


def check_daemon(args: argparse.Namespace, check: Checks, moe: Path, model: Path) -> None:
    show, ps = show_and_ps(args.vulkan_python, moe, "0", cpu_moe="on")
    print(ps, end="")
    in_ram = _row(show, "in RAM")
    check("show, before a load: the MoE model's experts in RAM", in_ram.startswith("MoE experts of every layer"), in_ram)
    check("ps: the MoE model's experts in RAM", "experts of 3 layers in RAM" in ps)
    show, ps = show_and_ps(args.vulkan_python, model, "0,0", tensor_split="1,1")
    print(ps, end="")
    per_gpu = _row(show, "per GPU")
    check("show, before a load: the split model's planned share on each card", "gpu:0" in per_gpu and "gpu:1" in per_gpu,
          per_gpu)
    check("ps: the split model's share on each card", "Vulkan0" in ps and "Vulkan1" in ps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--vulkan-python", default=str(Path.home() / ".cache/localserve-vulkan/venv/bin/python"))
    ap.add_argument("--cpu-python", default=str(ROOT / ".venv/bin/python"))
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp CPU threads (vulkan_lavapipe.py says why 1)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--skip", nargs="*", default=[], choices=["moe", "split", "daemon"])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--loads", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--report", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from moe_model import FILE_NAME, build_moe

    check = Checks()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        moe = build_moe(Path(args.model), Path(tmp) / FILE_NAME)
        if "moe" not in args.skip:
            check_moe(args, check, moe)
        if "split" not in args.skip:
            check_split(args, check, Path(args.model))
        if "daemon" not in args.skip:
            check_daemon(args, check, moe, Path(args.model))
    print(f"{check.failed} failed, in {time.monotonic() - started:.0f} s")
    sys.exit(1 if check.failed else 0)


if __name__ == "__main__":
    main()
