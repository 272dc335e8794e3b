"""Speculative decoding, replayed offline: our drafting (speculation.py's real PromptLookup and
DraftPolicy) over recorded greedy answers to benchmarks/speculative.py's edit prompts, each draft
checked against the recorded answer and each step timed from a step-cost curve measured here.

    python benchmarks/speculative_replay.py --model-path .test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf

Why: on a noisy 2-core machine a change to the drafts moves the live benchmark by less than its
pass-to-pass spread. The replay is deterministic, takes a second once the answers are recorded, and
says what a drafting change could give with no serving overhead at all: an upper bound to hold the
live figure against. It assumes the answer with speculation is the plain greedy one, which holds
except at near-ties (docs/architecture.md).

What it does not predict: a change to the step-cost model. A per-call cost curve (and a cheaper
prior) in place of StepCosts' line replayed at 108.0 against 102.6 and ran live at 90 against 102
(2026-12-05, two alternating passes each). Why is not known: replayed steps cost exactly the
recorded curve, live ones whatever the machine gives them. Hold such a change to the live benchmark.

Records once into --record (the answers in process, as the engine loads the model: a KV stream
per sequence, flash attention off, end-of-generation banned; then one sequence's step at the first
answer's context for 1 to 65 rows, best of 5), then prints per --k-max the replayed decode tokens/s
over all answers, per answer, the steps that found no draft, drafts accepted / verified, and what a
policy that knew the answer would give with the same drafts (the bound of the lookup itself).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import EDIT_COMMIT, EDIT_FILES, edit_messages, read_source  # noqa: E402
from serve import REPO  # noqa: E402

sys.path.insert(0, str(REPO))
import localserve.batching.speculation as speculation  # noqa: E402

CURVE_ROWS = (1, 2, 4, 8, 16, 24, 33, 48, 65)
OUTSIDE_DECODE_S = 0.002  # a step's time outside llama_decode in the engine (stop 37's per-call log)


def record(model_path: Path, answers: int, max_tokens: int) -> dict:
    from localserve.api.templates import ChatTemplate
    from localserve.backends.base import BatchToken
    from localserve.backends.llamacpp.backend import LlamaCppBackend

    b = LlamaCppBackend.load(model_path, n_ctx=8192, n_seq_max=2, n_batch=512, kv_unified=False,
                             flash_attention=False)
    template = ChatTemplate.for_model(b.info.chat_template, b.info.bos_token, b.info.eos_token)
    banned = [t for t in range(b.n_vocab) if b.is_eog(t)]
    out, curve = [], {}
    for i in range(answers):
        text = template.render(edit_messages(read_source(f"{EDIT_COMMIT}:{EDIT_FILES[i % len(EDIT_FILES)]}"), i))
        prompt = b.tokenize(text, add_special=False, parse_special=True)
        b.kv_remove(0)
        for s in range(0, len(prompt), 512):
            b.decode([BatchToken(t, 0, s + j, s + j == len(prompt) - 1) for j, t in enumerate(prompt[s:s + 512])])
        row, pos, answer = (len(prompt) - 1) % 512, len(prompt), []
        for _ in range(max_tokens):
            logits = np.array(b.logits(row), dtype=np.float32)
            logits[banned] = -np.inf
            answer.append(int(np.argmax(logits)))
            b.decode([BatchToken(answer[-1], 0, pos, True)])
            row, pos = 0, pos + 1
        out.append({"prompt": prompt, "answer": answer})
        print(f"answer {i}: {len(prompt)} prompt tokens", file=sys.stderr)
        if not curve:
            for rows in CURVE_ROWS:
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    b.decode([BatchToken(answer[j % len(answer)], 0, pos + j, True) for j in range(rows)])
                    best = min(best, time.perf_counter() - t0)
                    b.kv_remove(0, pos)
                curve[rows] = best
    return {"answers": out, "curve_s": curve}


def step_seconds(curve: list[tuple[int, float]], rows: int) -> float:
    """The measured curve, linear between its points and past its last two."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if rows <= x1 or (x1, y1) == curve[-1]:
            return y0 + (y1 - y0) * (rows - x0) / (x1 - x0) + OUTSIDE_DECODE_S
    return curve[0][1] + OUTSIDE_DECODE_S


def replay(prompt: list[int], answer: list[int], k_max: int, curve: list[tuple[int, float]]) -> dict:
    """One answer decoded as the engine would alone, each step drafting what the policy picks."""
    state, policy = speculation.DraftState(), speculation.DraftPolicy("auto", separate_calls=True)
    tokens, emitted, seconds = prompt + answer[:1], 1, 0.0
    steps = novel = 0
    while emitted < len(answer):
        room = min(k_max, len(answer) - emitted - 1)
        draft, match = state.lookup.draft(tokens, room) if room >= 1 else ([], 0)
        novel += not draft
        chosen = policy.choose([speculation.Candidate(0, state, draft, match)], 1, 1, 1) if draft else []
        k = chosen[0][1] if chosen else 0
        accepted = accepted_length(draft[:k], answer[emitted:])
        tokens += answer[emitted:emitted + accepted + 1]
        emitted += accepted + 1
        if k:
            policy.record("replay", state, k, accepted)
        step = step_seconds(curve, 1 + k)
        policy.costs.observe(1, 1 + k, step)
        seconds, steps = seconds + step, steps + 1
    return {"tokens": len(answer) - 1, "seconds": seconds, "steps": steps, "novel": novel,
            "drafted": state.drafted, "accepted": state.accepted}


def accepted_length(draft: list[int], answer: list[int]) -> int:
    """Draft tokens accepted before the first that differs from the answer."""
    return next((i for i, (d, a) in enumerate(zip(draft, answer)) if d != a), min(len(draft), len(answer)))


def oracle(prompt: list[int], answer: list[int], k_max: int, curve: list[tuple[int, float]]) -> dict:
    """The bound of the lookup itself: the fastest schedule of steps a policy that knew the answer
    could pick from the same drafts (a shortest path: at each answer position, any k up to the
    draft's accepted length)."""
    lookup, n = speculation.PromptLookup(), len(answer)
    accepted = [0] * n  # at position e (answer[:e] emitted), how many of the lookup's drafts hold
    for e in range(1, n - 1):
        draft, _ = lookup.draft(prompt + answer[:e], min(k_max, n - e - 1))
        accepted[e] = accepted_length(draft, answer[e:])
    best = [0.0] * (n + 1)
    for e in range(n - 1, 0, -1):
        best[e] = min(step_seconds(curve, 1 + k) + best[min(n, e + k + 1)] for k in range(accepted[e] + 1))
    return {"tokens": n - 1, "seconds": best[1]}


def tokens_per_s(runs: list[dict]) -> float:
    """Replayed answers' decode tokens over their replayed seconds."""
    return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", type=Path, required=True)
    p.add_argument("--record", type=Path, default=REPO / ".test-cache" / "speculative-replay.json",
                   help="recorded answers and step curve (made if missing)")
    p.add_argument("--answers", type=int, default=len(EDIT_FILES))
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--k-max", default="16,32,64", help="draft caps to replay")
    args = p.parse_args()
    if not args.record.exists():
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(record(args.model_path, args.answers, args.max_tokens)))
    data = json.loads(args.record.read_text())
    curve = sorted((int(rows), s) for rows, s in data["curve_s"].items())
    print("step ms by rows:", {rows: round(s * 1000, 1) for rows, s in curve})
    print(f"plain decode: {1 / step_seconds(curve, 1):.1f} tok/s")
    for k_max in (int(k) for k in args.k_max.split(",")):
        runs = [replay(a["prompt"], a["answer"], k_max, curve) for a in data["answers"]]
        known = [oracle(a["prompt"], a["answer"], k_max, curve) for a in data["answers"]]
        per_answer = [round(tokens_per_s([r]), 1) for r in runs]
        print(f"K_MAX {k_max:3d}: {tokens_per_s(runs):6.1f} tok/s (per answer {per_answer}), "
              f"steps without a draft {[r['novel'] for r in runs]}, accepted {sum(r['accepted'] for r in runs)}"
              f"/{sum(r['drafted'] for r in runs)}; knowing the answer: {tokens_per_s(known):.1f}")


if __name__ == "__main__":
    main()
