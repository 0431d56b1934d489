"""How many prefill tokens a step may carry beside running decodes, from the engine's own measured step times.

Every decoding stream waits for the whole step, so a prompt's prefill chunk in a step is a stall in every stream
that decodes beside it: on the 2-core CPU, 16 streams decode in ~24 ms a step, and a step that also prefilled four
new 128-token prompts took ~270 ms (inter-token p99 264 ms, measured served). A fixed cap
(--max-prefill-tokens-with-decodes) is right for one model, machine and load only: the 48 tokens that double a
16-sequence step on this CPU add a third to a 64-sequence one, and are nothing on a GPU; and a cap below the load's
prefill demand (16 streams of 128-token prompts need ~16 prompt tokens a step on average) starves admission, so the
streams that wait for their prompt leave the decode batch and throughput falls (cap 16: 503 -> 319 tok/s, measured).

So the bound is a ratio of times (--decode-stall-ratio, default 1.5): a step that prefills beside decodes may take at
most `ratio` times what those decodes alone take. Both times come from a linear cost model the engine fits to its own
steps as it runs,

    step seconds ~ a + b * decodes + c * (keys the decodes read) / 1024 + e * prefill tokens,

by least squares with every term at least 0 (nonnegative_solve) and exponential forgetting (a memory of ~FORGET_STEPS
steps: hosts drift in speed by up to 1.5x within a minute, contexts grow, a CPU engine may change its thread count),
and the prefill budget is the tokens whose predicted cost fits the slack: (ratio - 1) * predicted decode-only step / e.
Until both kinds of step have been seen there is no bound (the first steps of a server prefill with nothing decoding,
which is where `e` is learnt).

The slack alone starves prompts when they come faster than it prefills them: 8 streams of 1,000-token prompts at
ratio 2 waited 7.9 s for their first token instead of 1.2 s, at 23% less throughput, and their decodes stalled no
less (ITL p99 475 against 472 ms: once the queue holds every stream, nothing decodes and nothing bounds; measured
served). So the budget is also at least a drain rate, the queue's prompt tokens over DRAIN_STEPS: a queue that the
slack would take longer than that to clear is prefilled in bigger chunks, trading decode stalls for time to first
token as an unbounded engine does. Too few steps and the bursts of a closed loop (16 streams finishing together and
sending 16 new prompts) pass the bound: 8 steps let 256-token chunks beside decodes through, the steps of its ITL
p99. At 32 (default ratio 1.5, served): 16 streams ITL p99 44 ms at 572 tok/s, 64 streams 108 ms at 785 tok/s, and
the 8 streams of 1,000-token prompts 2.5 s to first token at 128 tok/s (unbounded: 1.2 s, 120-126 tok/s, ITL p99
~460).

The rate is set when the queue grows and held until it empties. Recomputed each step on what was left, it fell by
1/DRAIN_STEPS a step, so a burst took ~3.7x DRAIN_STEPS steps to clear (eight 1,000-token prompts: 118 steps), its
last streams out of the decode batch all the while (a served 64-stream round prefilled its prompts over 90 steps).
Held, 64 streams served 1.07-1.08x the tokens a second (bf16, and W8A8 with the 8-bit pool; time to first token p50
-15 to -20%) and 16 streams as many, ITL p99 49.8 against 55 ms (docs/benchmarks.md, round 14).

Multi-token queries of decoding sequences (speculative verification) count as prefill tokens: they cost the same.
"""

from __future__ import annotations

import numpy as np

FORGET_STEPS = 200  # the fit's memory: each step's weight decays by 1 - 1/FORGET_STEPS per later step
MIN_SEEN = 4  # steps of each kind, decode-only and with prefill, before the fit bounds anything
DRAIN_STEPS = 32  # steps in which the budget prefills at least the whole queue of prompt tokens
OUTLIER = 3.0  # a step this many times slower than predicted counts as this many (a preempted thread, a GC pause)
RIDGE = 1e-9  # keeps the normal equations solvable while one feature has not varied yet


class PrefillBudget:
    """The online cost model and the budget it implies. One per scheduler; the engine reports each step."""

    def __init__(self, ratio: float, min_tokens: int = 16):
        if ratio <= 1.0:
            raise ValueError(f"decode_stall_ratio must be above 1 (a step's time over its decodes' alone), got {ratio}")
        self.ratio = ratio
        self.min_tokens = min_tokens  # below this a chunk costs mostly the step's fixed overhead
        self._keep = 1.0 - 1.0 / FORGET_STEPS
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        # Steps seen of each kind, decode-only and with prefill, not forgotten: they gate the first fit only. A
        # saturated server runs almost nothing but steps with prefill; counted with decay, its decode-only steps fell
        # below MIN_SEEN and took the bound away just when the queue was longest (simulating examples/card-cpu-long.yaml
        # at saturation: 500-token chunks beside seven decodes).
        self._seen = np.zeros(2)
        self._coef: np.ndarray | None = None
        self._stale = True  # steps observed since _coef was solved: the next coefficients() solves again
        self._drain = 0  # prompt tokens a step may prefill to clear the queue in DRAIN_STEPS steps (see tokens)

    @staticmethod
    def _features(decodes: int, attended: int, prefill: int) -> np.ndarray:
        return np.array([1.0, decodes, attended / 1024.0, prefill])

    def observe(self, decodes: int, attended: int, prefill: int, seconds: float) -> None:
        """One step's measured time: `decodes` one-token queries reading `attended` keys in all, `prefill` other
        new tokens."""
        x = self._features(decodes, attended, prefill)
        if self._coef is not None:  # the fit as last solved: observing never solves (see queue_empty)
            predicted = float(self._coef @ x)
            if predicted > 0:
                seconds = min(seconds, OUTLIER * predicted)
        self._xtx *= self._keep
        self._xty *= self._keep
        self._xtx += np.outer(x, x)
        self._xty += x * seconds
        self._seen[1 if prefill else 0] += 1.0
        self._stale = True

    def coefficients(self) -> np.ndarray | None:
        """(a, b, c, e) in seconds, each at least 0, or None before both kinds of step have been seen."""
        if self._stale and self._seen.min() >= MIN_SEEN:
            reg = RIDGE * max(1.0, np.trace(self._xtx)) * np.eye(4)
            self._coef = nonnegative_solve(self._xtx + reg, self._xty)
            self._stale = False
        return self._coef

    def queue_empty(self) -> None:
        """Nothing waits to be prefilled, so the scheduler asks for no bound and the drain rate held ends.

        With prompts waiting, each step solves the fit once (in tokens()); with none, no step does, and the
        outlier test in observe() uses the fit as last solved. Solved every step, the fit cost a one-sequence
        int4 decode step ~0.19 ms of its ~5.4 (`benchmarks/step_profile.py --batches 1 1 1 1 1 --engine-arg
        decode_stall_ratio=1.5`, docs/benchmarks.md round 20): a dozen small numpy calls whose code and data each
        step's weight stream had pushed out of the caches."""
        self._drain = 0

    @property
    def drain(self) -> int:
        """The drain rate held (prompt tokens a step; 0: none), as the last tokens() call left it."""
        return self._drain

    def predict(self, decodes: int, attended: int, prefill: int) -> float | None:
        coef = self.coefficients()
        return None if coef is None else float(coef @ self._features(decodes, attended, prefill))

    def tokens(self, decodes: int, attended: int, backlog: int = 0) -> int | None:
        """Prefill tokens a step beside these decodes may carry, with `backlog` prompt tokens waiting to be
        computed; None: no bound (no decodes, or not fitted yet)."""
        # held, not recomputed on what is left (see the module's docstring)
        self._drain = max(self._drain, -(-backlog // DRAIN_STEPS)) if backlog > 0 else 0
        coef = self.coefficients()
        if decodes == 0 or coef is None:
            return None
        per_token = coef[3]
        decode_only = float(coef[:3] @ self._features(decodes, attended, 0)[:3])
        if per_token <= 0 or decode_only <= 0:  # a fit that does not see prefill cost anything: no basis to bound
            return None
        slack = int((self.ratio - 1.0) * decode_only / per_token)
        return max(self.min_tokens, slack, self._drain)


def nonnegative_solve(gram: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """The least-squares coefficients from normal equations (gram x = rhs), constrained to x >= 0 (Lawson and
    Hanson's active set, on the normal equations).

    Every term of a step's time costs time, but the decoding batch and the keys it reads grow together (each decode
    brings its context), and a step with prefill pays the general path's fixed cost, which no term here carries.
    So a plain fit may trade one term for another: the budget fed the steps served before the 1 req/s point of
    examples/card-cpu-long.yaml fitted -7.5 ms a decode against +3.3 ms per 1,024 keys. Within the steps seen that
    predicts well; for four decodes of short contexts it predicts a decode-only step of no time, which leaves the
    step without a bound (in the simulation of that point: 500-token chunks beside three to seven decodes, ~600 ms
    steps). When the plain solve is nonnegative, it is all this costs."""
    x = np.linalg.solve(gram, rhs)
    if (x >= 0).all():
        return x
    n = len(rhs)
    tol = 1e-12 * max(1.0, float(np.abs(rhs).max()))
    free = np.zeros(n, dtype=bool)  # coefficients off their bound of 0
    x = np.zeros(n)
    for _ in range(3 * n):
        gradient = rhs - gram @ x
        gradient[free] = -np.inf
        j = int(np.argmax(gradient))
        if gradient[j] <= tol:
            break
        free[j] = True
        for _ in range(n):  # at most n coefficients can leave the free set
            z = np.zeros(n)
            z[free] = np.linalg.solve(gram[np.ix_(free, free)], rhs[free])
            if (z[free] > 0).all():
                x = z
                break
            # step from x toward z as far as feasibility allows; the coefficient that hits 0 leaves the free set
            hit = free & (z <= 0)
            alpha = float(np.min(x[hit] / (x[hit] - z[hit])))
            x = x + alpha * (z - x)
            free &= x > tol
            x[~free] = 0.0
    return x
