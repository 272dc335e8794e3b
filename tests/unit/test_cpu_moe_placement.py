"""MoE experts in RAM (config/moe.py, runtime/placement.py): the settings resolve per model, and
`auto` keeps the experts in RAM exactly when the whole model does not fit the GPU but the rest
does, on recorded machines (tests/fixtures/hw); the plan charges the GPU only the rest."""

from __future__ import annotations

import re

import pytest

from fixtures.hw.loader import fixture_env
from localserve.config.moe import ALL_LAYERS, check_cpu_moe, cpu_moe_layers
from localserve.config.settings import load_settings
from localserve.errors import ConfigError
from localserve.hardware import detect_hardware
from localserve.runtime.memory import estimate_memory, experts_in_ram
from localserve.runtime.placement import Runtimes, choose_backend
from localserve.runtime.planning import planned_vram
from test_placement import QWEN_7B, _facts, _gpu, _report, CUDA

# Shapes of the MoE GGUFs desk users run, sizes approximate (expert stacks from their shapes at the
# file's bits per weight): gpt-oss-120b (MXFP4, 63 GB, 36 layers of 128 experts) and
# Qwen3-30B-A3B Q4_K_M (18.6 GB, 48 layers of 128 experts).
GPT_OSS_120B = estimate_memory(_facts(
    architecture="gpt-oss", n_layers=36, n_heads=64, n_kv_heads=8, n_embd=2880, head_dim=64, head_dim_v=64,
    context_length=131072, vocab_size=201088, file_size=63_400_000_000, weights_bytes=63_390_000_000,
    layer_bytes=62_200_000_000, largest_layer_bytes=1_730_000_000, kv_heads_all_layers=288,
    expert_bytes=60_900_000_000), 8192)
QWEN3_30B_A3B = estimate_memory(_facts(
    architecture="qwen3moe", n_layers=48, n_heads=32, n_kv_heads=4, n_embd=2048, head_dim=128, head_dim_v=128,
    context_length=40960, vocab_size=151936, file_size=18_560_000_000, weights_bytes=18_550_000_000,
    layer_bytes=17_930_000_000, largest_layer_bytes=374_000_000, kv_heads_all_layers=192,
    expert_bytes=17_300_000_000), 8192)


def _choose(case: str, estimate, cpu_moe):
    report = detect_hardware(fixture_env(case))
    return choose_backend(report, ["gguf"], Runtimes.from_report(report), estimate, cpu_moe=cpu_moe)


@pytest.mark.parametrize(("case", "estimate", "cpu_moe", "layers", "moe_layers", "reason"), [
    # auto: the 63 GB model does not fit the 4090's 23 GiB, its 2.5 GB without the experts does.
    ("linux_nvidia", GPT_OSS_120B, None, -1, ALL_LAYERS, "every layer's MoE experts (56.7 GiB) in RAM"),
    # auto: the H200 holds all of it; the 4090 holds all of Qwen3-30B-A3B: nothing moves.
    ("linux_h200", GPT_OSS_120B, None, -1, 0, "all layers on NVIDIA H200"),
    ("linux_nvidia", QWEN3_30B_A3B, None, -1, 0, "all layers on NVIDIA GeForce RTX 4090"),
    # asked for: on the H200 too; and the first 40 of 48 layers' experts on the RTX 3060 (11 GiB).
    ("linux_h200", GPT_OSS_120B, ALL_LAYERS, -1, ALL_LAYERS, "every layer's MoE experts"),
    ("windows_nvidia", QWEN3_30B_A3B, 40, -1, 40, "the first 40 layers' MoE experts (13.4 GiB) in RAM"),
    # off: the model does not fit whole, so only the layers that fit go, experts and all.
    ("linux_nvidia", GPT_OSS_120B, 0, 13, 0, "13/36 layers on NVIDIA GeForce RTX 4090"),
    # a dense model has no experts: auto changes nothing.
    ("windows_nvidia", estimate_memory(QWEN_7B, 8192), None, -1, 0, "all layers on NVIDIA GeForce RTX 3060"),
])
def test_experts_go_to_ram_when_only_the_rest_fits(case, estimate, cpu_moe, layers, moe_layers, reason) -> None:
    choice = _choose(case, estimate, cpu_moe)
    assert (choice.backend, choice.device, choice.n_gpu_layers, choice.cpu_moe_layers) == (
        "llamacpp", "gpu:0", layers, moe_layers)
    assert reason in choice.reason
    assert choice.experts_ram_bytes == experts_in_ram(estimate, moe_layers)


def test_the_plan_charges_the_gpu_only_the_rest() -> None:
    choice = _choose("linux_nvidia", GPT_OSS_120B, None)
    vram = planned_vram(choice.n_gpu_layers, GPT_OSS_120B, GPT_OSS_120B.total_bytes, choice.experts_ram_bytes)
    assert vram == GPT_OSS_120B.total_bytes - GPT_OSS_120B.expert_bytes
    assert vram < 23_662 << 20  # the 4090's free memory, recorded


def test_when_even_the_rest_does_not_fit_the_experts_stay_with_their_layers() -> None:
    choice = choose_backend(_report(_gpu(2 << 30)), ["gguf"], CUDA, GPT_OSS_120B, cpu_moe=None)
    assert (choice.device, choice.n_gpu_layers, choice.cpu_moe_layers) == ("cpu", 0, 0)


def test_settings_resolve_per_model(tmp_path) -> None:
    items = ("gpt-oss=on", "qwen3:30b=12", "qwen3=off")
    assert cpu_moe_layers("auto", 0, items, "gpt-oss:120b") == ALL_LAYERS
    assert cpu_moe_layers("auto", 0, items, "qwen3:30b") == 12  # the tag's item wins over the name's
    assert cpu_moe_layers("auto", 0, items, "qwen3:4b") == 0
    assert cpu_moe_layers("auto", 0, items, "other") is None
    assert cpu_moe_layers("auto", 8, items, "other") == 8  # n_cpu_moe over cpu_moe
    assert cpu_moe_layers("on", 0, (), "other") == ALL_LAYERS
    assert cpu_moe_layers("false", 0, (), "other") == 0
    config = tmp_path / "config.toml"
    config.write_text('cpu_moe = true\nn_cpu_moe = 3\nmodel_cpu_moe = ["a=auto"]\n')
    settings = load_settings(environ={}, config_path=config)
    assert (settings.cpu_moe, settings.n_cpu_moe, settings.model_cpu_moe) == ("True", 3, ("a=auto",))
    assert cpu_moe_layers(settings.cpu_moe, settings.n_cpu_moe, settings.model_cpu_moe, "b") == 3


@pytest.mark.parametrize(("cpu_moe", "items", "message"), [
    ("some", (), "setting 'cpu_moe': 'some' is not auto, on, off"),
    ("3", (), "setting 'cpu_moe': '3' is not auto, on, off"),  # a count is n_cpu_moe's
    ("auto", ("gpt-oss=many",), "setting 'model_cpu_moe': 'gpt-oss=many': the value is not auto, on, off or a number"),
    ("auto", ("gpt-oss",), "setting 'model_cpu_moe': 'gpt-oss' is not NAME[:TAG]=VALUE"),
])
def test_bad_values_stop_the_start_naming_the_entry(cpu_moe, items, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_cpu_moe(cpu_moe, items)


def test_ps_says_whose_experts_stay_in_ram() -> None:
    from localserve.commands.daemon import _processor

    row = {"size": 63 << 30, "size_vram": 3 << 30, "gpu_layers": 37, "offloadable_layers": 37, "moe_layers_in_ram": 36}
    assert _processor(row) == "95%/5% CPU/GPU (37/37 layers), experts of 36 layers in RAM"
    assert _processor({**row, "moe_layers_in_ram": 0}) == "95%/5% CPU/GPU (37/37 layers)"


def test_offload_facts_count_the_layers_llama_cpp_kept_in_ram() -> None:
    from localserve.backends.llamacpp.offload import parse_load_log

    lines = ["tensor blk.0.ffn_up_exps.weight (1536 MiB q4_K) buffer type overridden to CPU_REPACK",
             "tensor blk.0.ffn_down_exps.weight (1536 MiB q6_K) buffer type overridden to CPU",
             "tensor blk.1.ffn_up_exps.weight (1536 MiB q4_K) buffer type overridden to CPU",
             "load_tensors: offloaded 49/49 layers to GPU",
             "load_tensors:        CUDA0 model buffer size =  1200.00 MiB"]
    facts = parse_load_log(lines)
    assert facts.moe_layers_in_ram == 2 and facts.gpu_layers == 49
    assert facts.overridden["blk.0.ffn_up_exps.weight"] == "CPU_REPACK"
