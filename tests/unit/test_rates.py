"""The engine's recent rates (engine/rates.py): tokens per busy second over a sliding window."""

from __future__ import annotations

import pytest

from localserve.engine.rates import RATE_WINDOW_S, Rates


def test_rates_count_the_window_before_the_reading_not_before_the_last_step() -> None:
    rates = Rates()
    rates.step(100.0, 0.5, decode_tokens=40, prompt_tokens=200)
    rates.step(101.0, 0.5, decode_tokens=60, prompt_tokens=0)
    assert rates.tokens_per_s(now=101.0) == (pytest.approx(100.0), pytest.approx(200.0))
    # Idle since: the first step leaves the window, then the second; no step arrived to cut it.
    assert rates.tokens_per_s(now=100.0 + RATE_WINDOW_S + 0.5) == (pytest.approx(120.0), 0.0)
    assert rates.tokens_per_s(now=101.0 + RATE_WINDOW_S + 0.5) == (0.0, 0.0)
