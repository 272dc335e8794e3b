"""What a model folder may hold, whoever made it: data, never code, and no path that leaves it.

A folder comes from `localserve add` or from a pull of someone else's repo, and the runtimes that
read it (onnxruntime, onnxruntime-genai) resolve the names inside it against the folder and load
what they find. So every name a graph or a config holds must stay inside the folder, and nothing
in the folder may be native code a runtime could be talked into loading (`dlopen` runs a library's
constructors before any symbol is looked up: loading it at all is running it).

- `inside`: a relative name, resolved, as a file in the folder; refused when absolute, with `..`,
  a Windows separator or drive, or a link out.
- `native_code_name` / `check_no_native_code`: shared libraries and executables, by name (before a
  pull downloads anything) and by content (an ELF, PE or Mach-O image, or a `#!` script, whatever
  its name).
- `check_graph`: a graph's structure (`onnx.load(load_external_data=False)` does not read external
  weights) and every file it names: external data of every tensor (initializers, sparse ones,
  node attributes, subgraphs, functions) and EPContext caches kept beside the graph. No size
  cutoff: a graph that embeds its weights costs one parse of its own bytes.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator

from ..errors import ModelDirError, redact_paths

# Names a loader takes for a library or program: .so and its versioned forms (libx.so.1.2).
_NATIVE_NAME = re.compile(r"\.(so(\.\d+)*|dll|dylib|exe|pyd)$", re.IGNORECASE)
# Mach-O thin (32/64-bit, either byte order) and fat images.
_MACHO = {b"\xfe\xed\xfa\xce", b"\xfe\xed\xfa\xcf", b"\xce\xfa\xed\xfe", b"\xcf\xfa\xed\xfe",
          b"\xca\xfe\xba\xbe", b"\xca\xfe\xba\xbf"}
_HEAD = 0x40  # an MZ header's e_lfanew sits at 0x3c


def inside(directory: Path, rel: Any, what: str) -> Path:
    """`rel` as an existing file inside `directory`; ModelDirError (naming `what`, never a host path)
    when it is not a plain relative name or resolves outside, e.g. through a linked folder."""
    if (not isinstance(rel, str) or not rel or "\\" in rel or ":" in rel or "\0" in rel
            or PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts):
        # An absolute name is shown by its last part: the message may reach a client.
        raise ModelDirError(f"{what} must name a file inside the folder (got {redact_paths(str(rel))[:60]!r})")
    path = directory / rel
    try:
        escapes = not path.resolve().is_relative_to(directory.resolve())
    except (OSError, RuntimeError):  # a link loop
        escapes = True
    if escapes:
        raise ModelDirError(f"{what} must name a file inside the folder ({rel[:60]!r} leads out of it)")
    if not path.is_file():
        raise ModelDirError(f"the folder has no {rel} ({what})")
    return path


def native_code_name(rel: str) -> bool:
    """Whether a file's name says it is a library or a program (checked before a pull fetches it)."""
    return bool(_NATIVE_NAME.search(rel.rsplit("/", 1)[-1]))


def _native_content(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(_HEAD)
        if head[:4] == b"\x7fELF" or head[:4] in _MACHO or head[:2] == b"#!":
            return True
        if head[:2] != b"MZ" or len(head) < _HEAD:
            return False
        # A PE image is MZ plus "PE\0\0" where e_lfanew points: two bytes alone would also match
        # one weights file in 65,536.
        f.seek(struct.unpack_from("<I", head, 0x3C)[0])
        return f.read(4) == b"PE\0\0"


def check_no_native_code(files: Iterable[tuple[str, Path | None]]) -> None:
    """Refuse the folder when any of its (relative name, path) files is a library or a program; by
    name alone where the path is None (a pull's listing, before any byte is fetched)."""
    for rel, path in files:
        if native_code_name(rel) or (path is not None and _native_content(path)):
            raise ModelDirError(f"{rel[:80]} is a shared library or an executable; a model folder holds "
                                "data only (libraries and programs are never taken from one)")


def _graph_tensors(graph: Any) -> Iterator[Any]:
    """Every TensorProto of a GraphProto and its subgraphs, the sparse ones' parts included (ORT
    before 1.27 read a sparse tensor's external data unchecked)."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    yield from _node_tensors(graph.node)


def _node_tensors(nodes: Iterable[Any]) -> Iterator[Any]:
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sparse in ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []) + list(attr.sparse_tensors):
                yield from (sparse.values, sparse.indices)
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _graph_tensors(sub)


def _all_nodes(graph: Any) -> Iterator[Any]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _all_nodes(sub)


def _load_structure(graph: Path) -> Any:
    try:
        import onnx
    except ImportError:
        raise ModelDirError("checking a model folder's graphs needs the onnx package "
                            "(pip install 'localserve[onnx]')") from None
    try:
        return onnx.load(str(graph), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - onnx raises DecodeError and others for a bad file
        raise ModelDirError(f"{graph.name} is not a readable ONNX model ({type(e).__name__})") from None


def _check_external(directory: Path, name: str, tensor: Any, sizes: dict[str, int]) -> None:
    import onnx

    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return
    entries = {}
    for entry in tensor.external_data:
        if entry.key in entries:  # which one a runtime takes is its own choice: refuse the ambiguity
            raise ModelDirError(f"{name} names {entry.key!r} twice for tensor {tensor.name[:60]!r}")
        entries[entry.key] = entry.value
    location = inside(directory, entries.get("location"), f"{name}'s external data")
    try:
        end = int(entries.get("offset") or 0) + int(entries.get("length") or 0)
    except ValueError:
        raise ModelDirError(f"{name}: tensor {tensor.name[:60]!r} has a non-numeric offset or length") from None
    if end > sizes.setdefault(entries["location"], location.stat().st_size):
        raise ModelDirError(f"{entries['location']} is shorter than {name} says (truncated?)")


def _check_ep_context(directory: Path, name: str, node: Any) -> None:
    # An EPContext node with embed_mode 0 names a compiled-context file beside the graph, which the
    # EP (QNN, OpenVINO, ...) reads: the same rule as external data.
    if node.op_type != "EPContext":
        return
    attrs = {a.name: a for a in node.attribute}
    if attrs["embed_mode"].i if "embed_mode" in attrs else 1:
        return
    cache = attrs.get("ep_cache_context")
    inside(directory, cache.s.decode("utf-8", "replace") if cache is not None else None, f"{name}'s EPContext cache")


def check_graph(directory: Path, rel: str, what: str) -> None:
    """`rel` is an ONNX graph inside `directory` whose every named file is inside it too and, for
    external data, holds the bytes the graph points at (a folder copied without its multi-GB weights
    is refused at add, not at first load)."""
    path = inside(directory, rel, what)
    with open(path, "rb") as f:
        head = f.read(2)
    # A serialized ModelProto starts with field 1 (ir_version, a varint), tag byte 0x08: this names
    # a truncated-to-empty file or a web page saved as model.onnx before onnx parses anything.
    if len(head) < 2 or head[0] != 0x08:
        raise ModelDirError(f"{path.name} is not an ONNX model (empty or not a serialized ModelProto)")
    model = _load_structure(path)
    sizes: dict[str, int] = {}
    nodes = list(_all_nodes(model.graph))
    tensors = list(_graph_tensors(model.graph))
    for function in model.functions:
        nodes += function.node
        tensors += _node_tensors(function.node)
    for tensor in tensors:
        _check_external(path.parent, rel, tensor, sizes)
    for node in nodes:
        _check_ep_context(path.parent, rel, node)
