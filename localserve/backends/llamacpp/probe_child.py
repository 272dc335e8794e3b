"""The probe's child process (probe.py runs `python -m` this module with a model's path): a real
load and a short decode, as an engine does it, so a build whose AMX path traps on this CPU kills
this process and not the daemon. Apart from probe.py, which the backend reads its verdict from, so
neither module imports the other.
"""

from __future__ import annotations

import logging
import sys

from ..base import BatchToken
from .backend import LlamaCppBackend
from .probe import PROBE_TOKENS


def run_probe(model_path: str) -> int:
    """The probe itself: a real load and decode, as an engine does it, then a clean exit."""
    # extra_buffers said outright: the default would follow a verdict this probe is here to make.
    with LlamaCppBackend.load(model_path, n_ctx=256, n_seq_max=1, n_batch=64, kv_unified=True,
                              extra_buffers=True) as backend:
        tokens = backend.tokenize("The quick brown fox jumps over the lazy dog. " * 8)[:PROBE_TOKENS]
        backend.decode([BatchToken(t, 0, i, i == len(tokens) - 1) for i, t in enumerate(tokens)])
        for step in range(4):  # single rows take the GEMV kernels, which the prompt did not
            backend.decode([BatchToken(tokens[step], 0, len(tokens) + step, True)])
    return 0


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)
    sys.exit(run_probe(sys.argv[1]))
