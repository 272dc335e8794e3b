"""The smallest file the store takes as a vision projector: a GGUF whose architecture is `clip`,
with one tiny tensor and the flag saying it sees (the store checks what a projector is and reads
what it takes, not that it runs: the engine's tests build a working one, tests/vision_model.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import gguf
import numpy as np


def projector_bytes(arch: str = "clip") -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mmproj.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_string("clip.projector_type", "idefics3")
        writer.add_bool("clip.has_vision_encoder", True)  # what it takes, as every real projector says
        writer.add_tensor("mm.model.fc.weight", np.zeros((4, 4), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes()
