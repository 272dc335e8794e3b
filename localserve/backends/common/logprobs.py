"""The logprobs listing both backends report: one implementation, so llama.cpp and ONNX Runtime give
the same numbers for the same logits."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ...protocol.requests import TokenLogprob


def token_logprob(row: np.ndarray, token: int, n_top: int, token_text: Callable[[int], str]) -> TokenLogprob:
    """`token`'s log-softmax over the raw logits `row` (before bias, penalties and temperature, as
    OpenAI reports it) and the `n_top` most likely alternatives, highest first."""
    top_max = float(row.max())
    log_z = top_max + math.log(float(np.exp(row - top_max).sum(dtype=np.float64)))
    top: list[tuple[int, str, float]] = []
    k = min(n_top, row.size)
    if k > 0:
        idx = np.argpartition(row, row.size - k)[row.size - k:]
        idx = idx[np.argsort(-row[idx], kind="stable")]
        top = [(int(i), token_text(int(i)), float(row[i]) - log_z) for i in idx]
    return TokenLogprob(token=token, text=token_text(token), logprob=float(row[token]) - log_z, top=top)
