"""Several GPUs (config/gpu_split.py, runtime/placement.py): on a recorded two-GPU machine the
report lists each card with its free memory; a model one card cannot hold is split over both,
shares by free memory, each card charged its share; one that fits stays on one card (llama.cpp is
told so); asked shares and modes are kept; `ps` prints each card's memory as llama.cpp logged it."""

from __future__ import annotations

import re

import pytest

from fixtures.hw.loader import fixture_env
from localserve.config.gpu_split import SplitPrefs, check_split, split_prefs
from localserve.errors import ConfigError
from localserve.hardware import detect_hardware
from localserve.runtime.placement import GPU_RESERVE, Runtimes, choose_backend
from test_cpu_moe_placement import GPT_OSS_120B, QWEN3_30B_A3B
from test_placement import BIG, SMALL

MiB = 1 << 20
REPORT = detect_hardware(fixture_env("linux_2x4090"))


def _choose(estimate, split=SplitPrefs(), cpu_moe=None):
    return choose_backend(REPORT, ["gguf"], Runtimes.from_report(REPORT), estimate, cpu_moe=cpu_moe, split=split)


def test_the_report_lists_each_card_with_its_free_memory() -> None:
    cards = [(g.name, g.vram_free_bytes, g.bus_id) for g in REPORT.gpus if g.vendor == "NVIDIA"]
    assert cards == [("NVIDIA GeForce RTX 4090", 23662 * MiB, "0000:01:00.0"),
                     ("NVIDIA GeForce RTX 4090", 20371 * MiB, "0000:21:00.0")]


def test_a_model_one_card_cannot_hold_is_split_by_free_memory() -> None:
    # A dense model of 6.5 x Qwen2.5-7B's size at 8k (34 GiB): more than either card, less than both.
    choice = _choose(_scaled(SMALL, 6.5))
    free = [23662 * MiB - GPU_RESERVE, 20371 * MiB - GPU_RESERVE]
    assert (choice.backend, choice.device, choice.n_gpu_layers, choice.split_mode) == ("llamacpp", "gpu:0,1", -1, "layer")
    assert choice.tensor_split == pytest.approx((free[0] / sum(free), free[1] / sum(free)))
    assert all(n <= f for n, f in zip(choice.vram_per_device, free))
    assert choice.vram_per_device[0] > choice.vram_per_device[1]
    assert "all layers over 2 GPUs, layer split" in choice.reason
    # Each card: its share of the layers and their KV, a compute buffer; the last card the output
    # head too (llama.cpp puts it with the last layer).
    est = _scaled(SMALL, 6.5)
    layers = est.total_bytes - est.compute_bytes - est.non_layer_bytes
    share = free[0] / sum(free)
    assert choice.vram_per_device == pytest.approx(
        (layers * share + est.compute_bytes, layers * (1 - share) + est.compute_bytes + est.non_layer_bytes), abs=1)


def test_one_card_that_holds_it_keeps_it_and_llama_cpp_is_told() -> None:
    choice = _choose(SMALL)
    assert (choice.device, choice.split_mode, choice.main_gpu, choice.tensor_split) == ("gpu:0", "none", 0, ())


def test_split_mode_none_keeps_one_card_and_moe_experts_go_to_ram_instead() -> None:
    choice = _choose(GPT_OSS_120B, SplitPrefs("none"))
    assert (choice.device, choice.split_mode, choice.cpu_moe_layers) == ("gpu:0", "none", -1)
    # Over both cards gpt-oss-120b (59 GiB) still does not fit: its experts go to RAM on one card.
    assert _choose(GPT_OSS_120B).cpu_moe_layers == -1


def test_asked_shares_and_row_mode_are_kept_even_where_one_card_would_do() -> None:
    choice = _choose(QWEN3_30B_A3B, SplitPrefs("row", (3.0, 1.0)))
    assert (choice.device, choice.split_mode, choice.tensor_split) == ("gpu:0,1", "row", (0.75, 0.25))


def test_too_big_for_both_falls_back_to_layers_on_one_card() -> None:
    choice = _choose(BIG, cpu_moe=0)
    assert choice.device == "gpu:0" and 0 < choice.n_gpu_layers < 80 and choice.split_mode == "none"


def test_settings_resolve_per_model() -> None:
    prefs = split_prefs("layer", "", ("big=row",), ("big:70b=3/1",), "big:70b")
    assert prefs == SplitPrefs("row", (3.0, 1.0))
    assert split_prefs("layer", "[1, 1]", (), (), "other") == SplitPrefs("layer", (1.0, 1.0))
    assert split_prefs("none", "", ("big=row",), (), "other") == SplitPrefs("none", ())


@pytest.mark.parametrize(("mode", "shares", "items", "message"), [
    ("rows", "", (), "setting 'split_mode': 'rows' is not one of layer, row, none"),
    ("layer", "3,x", (), "setting 'tensor_split': '3,x' is not a list of numbers"),
    ("layer", "0,0", (), "setting 'tensor_split': '0,0' needs shares of 0 or more, at least one above 0"),
    ("layer", "", ("big=-1/2",), "setting 'model_tensor_split': 'big=-1/2': the value needs shares"),
])
def test_bad_values_stop_the_start_naming_the_entry(mode, shares, items, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_split(mode, shares, (), items)


def test_ps_prints_each_cards_memory() -> None:
    from localserve.backends.llamacpp.offload import parse_load_log
    from localserve.commands.daemon import _processor

    facts = parse_load_log(["load_tensors: offloaded 81/81 layers to GPU",
                            "load_tensors:        CUDA0 model buffer size = 20000.00 MiB",
                            "load_tensors:        CUDA1 model buffer size = 17000.00 MiB",
                            "llama_kv_cache:      CUDA0 KV buffer size =  1000.00 MiB",
                            "llama_kv_cache:      CUDA1 KV buffer size =   800.00 MiB",
                            "load_tensors: layer   0 assigned to device CUDA0, is_swa = 0",
                            "load_tensors: layer   1 assigned to device CUDA0, is_swa = 0",
                            "load_tensors: layer   2 assigned to device CUDA1, is_swa = 0"])
    assert facts.bytes_by_device == {"CUDA0": 21000 * MiB, "CUDA1": 17800 * MiB}
    assert facts.layers_by_device == {"CUDA0": 2, "CUDA1": 1}
    row = {"size": 38800 * MiB, "size_vram": 38800 * MiB, "gpu_layers": 81, "offloadable_layers": 81,
           "size_vram_by_device": facts.bytes_by_device}
    assert _processor(row) == "100% GPU (81/81 layers); CUDA0 20.5 GiB, CUDA1 17.4 GiB"


def _scaled(estimate, factor: float):
    import dataclasses

    return dataclasses.replace(estimate, weights_bytes=int(estimate.weights_bytes * factor),
                               total_bytes=int(estimate.total_bytes * factor))
