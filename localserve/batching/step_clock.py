"""A per-step time target for background prompt chunks, from measured step costs.

The batch lane's prompts are what makes steps long: a 256-token chunk holds the next step, and so
the first token of an interactive request that arrives meanwhile, for its whole prefill (0.6 s on
2 cores with SmolLM2). A fixed token count is the wrong unit for that (256 tokens are 30 ms on a
workstation and a second on a laptop with an 8B model), so the scheduler caps batch-lane chunks to
what fits a time target, converted to tokens with the cost per token measured on this machine.

The model is deliberately simple: a decode-only step's time per decoder (d), and a prompt token's
marginal cost (p) from steps that carry prompt tokens, after taking d per decoder off; both
smoothed over recent steps. Small prompt shares are mostly noise and fixed overhead, so they do not
count.
"""

from __future__ import annotations

# What a batch-lane chunk may add to the step an interactive request arrives during: small against
# an interactive first token (one prefill step of its prompt, 0.1-0.3 s on a small CPU).
DEFAULT_TARGET_S = 0.05
# The target for batch work alone on a backend that can interrupt a step: an interactive arrival
# stops the step, so the bound is only for what cannot (a batch-lane embedding, a cancellation, a
# model unload wait for the step's end). Prompt chunks this long cost a quarter less per token than
# the ~10-token chunks of a 50 ms target (measured on SmolLM2, 2 threads).
_ALONE_FACTOR = 10
_MIN_PROMPT = 16  # steps with fewer prompt tokens tell little about a prompt token's cost
_ALPHA = 0.2  # weight of the newest step in the smoothed costs


class StepClock:
    def __init__(self, target_s: float = DEFAULT_TARGET_S) -> None:
        self.target_s = target_s
        self.s_per_decode = 0.0  # 0 until measured
        self.s_per_prompt = 0.0  # 0 until measured: no cap before then

    def observe(self, decode_tokens: int, prompt_tokens: int, seconds: float) -> None:
        """One decoded step: so many decode rows and prompt tokens in `seconds`."""
        if seconds <= 0:
            return
        if prompt_tokens == 0 and decode_tokens:
            self.s_per_decode = _smooth(self.s_per_decode, seconds / decode_tokens)
        elif prompt_tokens >= _MIN_PROMPT:
            rest = seconds - self.s_per_decode * decode_tokens
            if rest > 0:
                self.s_per_prompt = _smooth(self.s_per_prompt, rest / prompt_tokens)

    def prompt_tokens_within(self, cap: int, decoders: int = 0, interruptible: bool = False) -> int:
        """Prompt tokens a background chunk may have so that it adds at most the target to its
        step, or as long as the step's `decoders` take, whichever is more: on a slow or busy
        machine the target alone shrank chunks to a few tokens, each paying a whole step of
        decodes, and a flood's prefill crawled. `interruptible`: the step holds only batch work
        that an arrival can stop, so a longer target applies. `cap` when nothing is measured or
        no target."""
        if not self.s_per_prompt or self.target_s <= 0:
            return cap
        target = self.target_s * (_ALONE_FACTOR if interruptible else 1)
        allowed = max(target, self.s_per_decode * decoders)
        return max(1, min(cap, int(allowed / self.s_per_prompt)))


def _smooth(old: float, new: float) -> float:
    return new if not old else (1 - _ALPHA) * old + _ALPHA * new
