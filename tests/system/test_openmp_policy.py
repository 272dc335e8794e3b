"""The OpenMP wait policy reaches libgomp: set before llama.cpp loads, and never over the user's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, sys
import localserve.backends.llamacpp.backend  # loads llama_cpp, hence libgomp
print(json.dumps({"spin": os.environ.get("GOMP_SPINCOUNT"), "policy": os.environ.get("OMP_WAIT_POLICY"),
                  "llama_cpp_loaded": "llama_cpp" in sys.modules}))
"""


def probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", PROBE], env=clean | env, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_default_spin_is_set_before_llama_cpp_loads():
    from localserve.backends.llamacpp.openmp import SPIN_COUNT

    assert probe() == {"spin": SPIN_COUNT, "policy": None, "llama_cpp_loaded": True}


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "5"}])
def test_the_users_choice_wins(env):
    got = probe(**env)
    assert got["spin"] == env.get("GOMP_SPINCOUNT") and got["policy"] == env.get("OMP_WAIT_POLICY")
