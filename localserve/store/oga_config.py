"""What a genai_config.json may ask of onnxruntime-genai: settings, never code or host paths.

OGA acts on its config: `session_options.custom_ops_library` is `dlopen`ed (resolved against the
folder first), `enable_profiling` writes files at the prefix it holds, every session option it does
not know becomes an ORT session config entry, and provider options reach EP libraries (QNN's
`backend_path` loads a library). A folder is someone else's data, so the options a config may hold
are an allow-list: the few ORT settings that are numbers, flags or names (threads, log level,
arenas, optimization level), execution providers by the names OGA knows, and per provider the
flags that are not paths, not pointers and write no files. Anything else refuses the folder with
the field named, at add, at pull, and again at load (`localserve/model_dirs.py`); what OGA then
reads is exactly the allowed subset.

Every other field that names a file (`filename`, `*_filename`, `*_file`, `*_path`, `*_dir`, ...
in any section: decoder, embedding, vision, speech, pipeline stages) must name a file inside the
folder; those ending in `.onnx` are graphs whose own references are checked too.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from ..errors import ModelDirError

# name -> the JSON type OGA parses it as (config.cpp SessionOptions_Element).
SESSION_OPTIONS: dict[str, type | tuple[type, ...]] = {
    "log_id": str,
    "intra_op_num_threads": (int, float),
    "inter_op_num_threads": (int, float),
    "log_severity_level": (int, float),
    "log_verbosity_level": (int, float),
    "enable_cpu_mem_arena": bool,
    "enable_mem_pattern": bool,
    "graph_optimization_level": str,
    "provider_options": list,
}
# Per execution provider (OGA's names, compared lowercase without "ExecutionProvider"), the options
# that are plain values. Left out on purpose: paths (backend_path, profiling_file_path, cache_dir,
# config_file, op_packages, skel_library_dir, *_cache_path, load_config, ...), raw pointers passed
# as strings (user_compute_stream, context, webgpuDevice, ...) and dump/profiling switches that write.
PROVIDERS: dict[str, frozenset[str]] = {
    "cpu": frozenset(),
    "cuda": frozenset({
        "device_id", "gpu_mem_limit", "arena_extend_strategy", "cudnn_conv_algo_search",
        "do_copy_in_default_stream", "cudnn_conv_use_max_workspace", "cudnn_conv1d_pad_to_nc1d",
        "enable_cuda_graph", "enable_skip_layer_norm_strict_mode", "use_tf32", "prefer_nhwc",
        "use_ep_level_unified_stream", "tunable_op_enable", "tunable_op_tuning_enable",
        "tunable_op_max_tuning_duration_ms", "sdpa_kernel", "fuse_conv_bias"}),
    "dml": frozenset({"device_id", "performance_preference", "device_filter", "disable_metacommands",
                      "enable_graph_capture"}),
    "qnn": frozenset({
        "backend_type", "htp_performance_mode", "htp_graph_finalization_optimization_mode", "soc_model",
        "htp_arch", "device_id", "vtcm_mb", "enable_htp_fp16_precision", "qnn_context_priority",
        "rpc_control_latency", "offload_graph_io_quantization", "enable_htp_spill_fill_buffer",
        "enable_htp_shared_memory_allocator", "htp_bf16_enable"}),
    "openvino": frozenset({"device_type", "precision", "num_of_threads", "num_streams", "model_priority",
                           "enable_opencl_throttling", "enable_qdq_optimizer", "disable_dynamic_shapes",
                           "reshape_input", "layout"}),
    "vitisai": frozenset({"target", "cache_key", "log_level"}),
    "ryzenai": frozenset(),
    "amdgpu": frozenset({"device_id"}),
    "webgpu": frozenset({"deviceId", "enableGraphCapture", "validationMode", "preferredLayout",
                         "storageBufferCacheMode", "uniformBufferCacheMode", "queryResolveBufferCacheMode",
                         "defaultBufferCacheMode", "powerPreference", "dawnBackendType"}),
    "nvtensorrtrtx": frozenset({"device_id", "nv_max_workspace_size", "nv_max_shared_mem_size",
                                "enable_cuda_graph"}),
}
DEVICE_FILTER = frozenset({"hardware_device_type", "hardware_device_id", "hardware_vendor_id"})
# ORT run config entries that only tune speed (run_options: any other key could be a LoRA path etc.).
RUN_OPTIONS = frozenset({"memory.enable_memory_arena_shrinkage", "gpu_graph_id", "disable_synchronize_execution_providers",
                         "qnn.htp_perf_mode", "qnn.htp_perf_mode_post_run", "qnn.rpc_control_latency"})
_PATH_KEY = re.compile(r"(^|_)(filename|file|path|dir|folder|library)$")
_PATHLIKE = re.compile(r"[/\\:]|\.(so|dll|dylib|exe)\b", re.IGNORECASE)


def provider_key(name: str) -> str:
    """OGA's provider name as PROVIDERS spells it: `QNN`, `qnn`, `QNNExecutionProvider` are one."""
    lower = name.lower()
    return lower[: -len("executionprovider")] if lower.endswith("executionprovider") and lower != "executionprovider" else lower


def _refuse(field: str, why: str) -> ModelDirError:
    return ModelDirError(f"genai_config.json: {field[:120]} {why}; a model folder may set threads, "
                         "the execution provider and its plain flags, never libraries, files or paths")


def _check_provider(field: str, entry: Any) -> None:
    if not isinstance(entry, dict):
        raise _refuse(field, "must be an object of providers")
    for name, options in entry.items():
        allowed = PROVIDERS.get(provider_key(str(name)))
        where = f"{field}.{name}"
        if allowed is None:
            raise _refuse(where, "is not an execution provider localserve knows")
        if not isinstance(options, dict):
            raise _refuse(where, "must be an object")
        for key, value in options.items():
            if key == "device_filtering_options" and isinstance(value, dict):
                if bad := sorted(set(value) - DEVICE_FILTER):
                    raise _refuse(f"{where}.{key}.{bad[0]}", "is not allowed")
                continue
            if key not in allowed:
                raise _refuse(f"{where}.{key}", "is not allowed")
            if not isinstance(value, (str, int, float, bool)) or _PATHLIKE.search(str(value)):
                raise _refuse(f"{where}.{key}", "must be a plain value, not a path")


def check_session_options(field: str, options: Any) -> None:
    """Raise ModelDirError naming the first option of `options` (at `field`) outside the allow-list."""
    if not isinstance(options, dict):
        raise _refuse(field, "must be an object")
    for key, value in options.items():
        kind = SESSION_OPTIONS.get(key)
        if kind is None:
            raise _refuse(f"{field}.{key}", "is not allowed")
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise _refuse(f"{field}.{key}", "has the wrong type")
        if key == "provider_options":
            for i, entry in enumerate(value):
                _check_provider(f"{field}.provider_options[{i}]", entry)
        elif isinstance(value, str) and _PATHLIKE.search(value):
            raise _refuse(f"{field}.{key}", "must be a plain value, not a path")


def _check_run_options(field: str, options: Any) -> None:
    if not isinstance(options, dict):
        raise _refuse(field, "must be an object")
    for key, value in options.items():
        if key not in RUN_OPTIONS or not isinstance(value, str) or _PATHLIKE.search(value):
            raise _refuse(f"{field}.{key}", "is not allowed")


def checked_files(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, relative name) of every file `config` names, after refusing any session or run option
    outside the allow-list. The caller resolves each name inside the folder."""
    def walk(node: Any, field: str) -> Iterator[tuple[str, str]]:
        if isinstance(node, list):
            for i, item in enumerate(node):
                yield from walk(item, f"{field}[{i}]")
            return
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            here = f"{field}.{key}" if field else str(key)
            if key == "session_options":
                check_session_options(here, value)
            elif key == "run_options":
                _check_run_options(here, value)
            elif _PATH_KEY.search(str(key)) and isinstance(value, str):
                yield here, value
            else:
                yield from walk(value, here)

    return list(walk(config, ""))
