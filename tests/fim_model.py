"""SmolLM2 as a fill-in-the-middle model, for tests/model/test_fim.py and benchmarks/fim.py.

No small GGUF with FIM tokens ships in a package these machines can reach, and SmolLM2 names none
(llama.cpp finds only its <reponame>). A copy with llama.cpp's FIM metadata keys pointing at
special tokens it has (its StarCoder-style <file_sep> and <reponame> are the real repo-level ones)
makes every server build real FIM prompts from it; what SmolLM2 makes of them is beside the point.
"""

from __future__ import annotations

from pathlib import Path

FIM_IDS = {"pre": 11, "suf": 12, "mid": 13, "rep": 4, "sep": 5}  # <jupyter_start> ... <reponame> <file_sep>


def with_fim_tokens(gguf_path: Path, out: Path) -> Path:
    """`out`: the GGUF with tokenizer.ggml.fim_*_token_id set to FIM_IDS (the file itself when it
    names FIM tokens already)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(gguf_path, "r")
    if reader.get_field("tokenizer.ggml.fim_pre_token_id") is not None:
        return gguf_path
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    new = {f"tokenizer.ggml.fim_{role}_token_id": MetadataDetails(gguf.GGUFValueType.UINT32, token)
           for role, token in FIM_IDS.items()}
    copy_with_new_metadata(reader, writer, new, [])
    return out
