"""The engine's CPU thread count, adapted to the CPU the process actually gets.

At start: the thread count fits the affinity mask and the cgroup quota (common/cpu_budget.py). While running:
OpenMP threads spin at every barrier, so when a neighbour takes a core (another login session under Linux's
autogroup, a noisy VM neighbour, a CFS quota) each parallel region waits for a descheduled teammate, and a step
that took 13 ms takes a scheduler period or more (measured: batch-1 decode at 1% of its quiet speed). One
thread fewer per region degrades in proportion to the CPU lost instead.

The signal is the step time itself, relative to what a step of the same size (tokens, bucketed by powers of two)
took at the full thread count: it measures exactly what users feel, and compares thread counts on the machine as it
is now. Two steps in a row four times slower ("stall") step down at once, and a median 1.8x slower ("slow") after a
window of steps, but either only where another process competed for our cores or a CPU quota throttled us
meanwhile (engine/cpu_contention.py): on a quiet machine the host's own noise made steps that slow for a moment,
and 3 of 8 quiet peers.py servers fell back to one thread for seconds or for good (measured), where fewer threads
could not help. A stall is judged on the second stalled step alone (the meter is read at the end of the first), and
every window's evidence starts after an idle spell, not before it: a server that had idled while its neighbours
loaded, then served on a quiet machine, had two steps in a row take x11 and x62 their quiet time, fell back to one
thread with no other process busy, and served one stream at 11 ms a token instead of 7 until a probe won, two
minutes and two measured runs later (issue 19, round 29). A server started beside a busy neighbour never sees a
quiet step, so before the model loads it reads what other processes use and starts with fewer threads when they
hold a core ("contended"). The way back is measured: after a hold time the engine probes one level up; a probe
that stalls ends at once and doubles the hold (2 s to 64 s), so probing a busy machine costs a step or so per
minute, and a probe that runs faster than the fallback stays.

Our threads' wait for a CPU (schedstat run_delay) was tried as a running signal and dropped: on a quiet machine the
server's own event loop and the bench client made two threads wait 27-43% of the time, as a neighbour would, and
the engine flip-flopped (c16 342 against 594 tok/s, measured).

The lever is `torch.set_num_threads` on the engine thread: libgomp sizes each parallel region from it. Passive
waiting (OMP_WAIT_POLICY, GOMP_SPINCOUNT) cannot be the lever: libgomp reads them once, at start-up.
`--num-threads`, OMP_NUM_THREADS or OMP_WAIT_POLICY set by the user are choices the engine keeps: no adaptation.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from inferlab.common.cpu_budget import CpuBudget, cpu_budget
from inferlab.engine.cpu_contention import Contention, ContentionMeter

log = logging.getLogger("inferlab.engine")

CHECK_EVERY = 8  # steps per window: a decision reads the median of this many step-time ratios
DEGRADED = 1.8  # median step time over the quiet reference that means the team stalls (1 thread of 2 is ~1.6x)
STALL = 4.0  # two steps in a row this slow: step down at once (a stalled step may take a second)
IDLE = 1.0  # seconds between steps beyond their own time that make an idle spell (no steps: nothing to judge)
RECOVER = 1.3  # a winning probe this close to the quiet reference is logged as "quiet", else as "faster"
BETTER = 0.85  # a setting must be this much faster than the other to count as faster
HOLD_MIN, HOLD_MAX = 2.0, 64.0  # seconds before probing more threads; doubled after each failed probe
REF_DRIFT = 1.002  # the quiet reference may rise 0.2% per full-thread step (longer contexts cost more)
# Start with fewer threads when other processes leave fewer free CPUs than the team less this much: a busy loop in
# another session uses 1.0 CPU of 2, a quiet machine ~0.
SPARE_CPU = 0.6
# While serving, other processes compete for our cores when they use this much: a busy loop in our own session
# gets 0.7 CPU beside two spinning threads (measured; at 0.9 the gate kept two threads there and 1-stream speed
# fell to 24% of quiet), one in another session 1.0; the bench client uses 0.1-0.2 at one stream, up to 0.8 at 64.
# A quota held us back when it throttled this share of the window.
HELD_CORE = 0.5
THROTTLED = 0.05
FALLBACK_REASONS = ("stall", "slow", "contended")  # the label values of inferlab:cpu_fallbacks_total


@dataclass(slots=True)
class ThreadDecision:
    time: float  # the adapter's clock
    threads: int
    reason: str  # budget | explicit | stall | slow | contended | quiet | faster | probe_failed
    detail: str


@dataclass(slots=True)
class ThreadAdapter:
    """Feed it every step's (tokens, seconds); it changes the thread count through `set_threads`."""

    levels: list[int]  # thread counts, most first: the budget, halved down to 1
    set_threads: Callable[[int], None]
    clock: Callable[[], float] = time.monotonic
    contention: Callable[[], Contention | None] = field(default_factory=lambda: ContentionMeter().read)
    adaptive: bool = True
    level: int = 0
    mode: str = "steady"  # steady | probe (one level up, on trial)
    decisions: list[ThreadDecision] = field(default_factory=list)
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> count of steps down
    recoveries: int = 0
    kept_stalls: int = 0  # stalls with no other process holding a core: the team kept
    _ref: dict[int, float] = field(default_factory=dict)  # size bucket -> quiet step time at levels[0]
    _window: list[float] = field(default_factory=list)  # step time / quiet reference, since the last change
    _compare: float = 0.0  # median ratio of the setting a probe is measured against
    _hold: float = HOLD_MIN
    _probe_at: float = 0.0
    _last_step_end: float | None = None

    @property
    def threads(self) -> int:
        return self.levels[self.level]

    def observe(self, num_tokens: int, seconds: float) -> None:
        if not self.adaptive or len(self.levels) < 2:
            return
        now = self.clock()
        if self._last_step_end is None or now - self._last_step_end > seconds + IDLE:
            self.contention()  # what others did while we idled says nothing about the steps to come
        self._last_step_end = now
        bucket = num_tokens.bit_length()
        ref = self._ref.get(bucket)
        if ref is None:
            # First seen below the full team (busy from the start): a provisional reference, replaced as soon as
            # the full team runs that size faster. Not during a probe, which is measured against it.
            self._ref[bucket] = seconds
        elif self.level == 0 and self.mode == "steady":
            self._ref[bucket] = min(ref * REF_DRIFT, seconds)
        if ref is None:
            return
        w = self._window
        w.append(seconds / ref)
        if self.mode == "probe":
            self._on_probe()
        elif len(w) >= 2 and w[-1] > STALL and w[-2] > STALL and self.level + 1 < len(self.levels):
            # Over the second stalled step, read at the end of the first (below). /proc counts 10 ms ticks, so a
            # stall of ~30 ms reads other processes' CPU to ~0.35 either way; a misread steps down, as every stall
            # used to.
            held = self.contention()
            stalled = f"two steps in a row took x{w[-2]:.1f} and x{w[-1]:.1f} the quiet time of their size"
            if self._held(held):
                self._down("stall", stalled + self._evidence(held))
            else:
                self._window.clear()
                self.kept_stalls += 1
                # A host that stalls again and again would log every other step: the 1st, 2nd, 4th, 8th... time.
                level = logging.INFO if self.kept_stalls & (self.kept_stalls - 1) == 0 else logging.DEBUG
                log.log(level, "cpu threads kept at %d (stall %d with no core held): %s%s", self.threads,
                        self.kept_stalls, stalled, self._evidence(held))
        elif w[-1] > STALL:
            self.contention()  # the next step's evidence starts here
        elif len(w) >= CHECK_EVERY:
            self._check(statistics.median(w))

    def settle_in(self, seconds: float = 0.2, sleep: Callable[[float], None] = time.sleep) -> None:
        """Before the first step (and before the model loads, whose packing runs on the team too): if other
        processes already hold the cores, start with fewer threads. Our threads are idle here, so what the others
        use tells; the first probe undoes it if they leave."""
        if not self.adaptive or len(self.levels) < 2:
            return
        self.contention()
        sleep(seconds)
        c = self.contention()
        if c is None:
            return
        level = self.level
        while level + 1 < len(self.levels) and c.cpus - c.foreign_cpus < self.levels[level] - SPARE_CPU:
            level += 1
        if level != self.level:
            self._hold = HOLD_MIN
            self._change(level, "steady", "contended", f"at start, other processes used {c.foreign_cpus:.1f} of "
                                                        f"{c.cpus} CPUs")

    def _check(self, m: float) -> None:
        now = self.clock()
        if self.level == 0:
            held = self.contention()  # since the previous check or change (or idle spell): this window
            if m > DEGRADED and self._held(held):
                self._down("slow", f"steps took x{m:.2f} the quiet time of their size (median of {CHECK_EVERY})"
                                   + self._evidence(held))
            self._window.clear()
        elif m > STALL and self.level + 1 < len(self.levels):
            self._down("stall", f"still x{m:.1f} the quiet time at {self.threads} threads")
        elif now >= self._probe_at:
            self._compare = m
            self._change(self.level - 1, "probe", "probe", f"trying {self.levels[self.level - 1]} threads "
                                                           f"(now x{m:.2f} the quiet time)")
        else:
            self._window.clear()

    @staticmethod
    def _held(c: Contention | None) -> bool:
        """Whether another process held one of our cores or a quota throttled us (no meter: assume so)."""
        return c is None or c.foreign_cpus >= HELD_CORE or c.throttled >= THROTTLED

    @staticmethod
    def _evidence(c: Contention | None) -> str:
        return "" if c is None else (f"; other processes used {c.foreign_cpus:.1f} of {c.cpus} CPUs, a quota "
                                     f"throttled us {c.throttled:.0%} of the time")

    def _on_probe(self) -> None:
        w, fallback = self._window, self.level + 1
        if w[-1] > STALL * max(1.0, self._compare):  # one stalled step ends a probe: it may have cost a second
            self._failed_probe(f"a step took x{w[-1]:.1f} the quiet time")
        elif len(w) >= CHECK_EVERY:
            m = statistics.median(w)
            # Faster than the fallback, measured, not merely close to the reference: a reference taken on a busy
            # machine would call any probe quiet.
            if m < BETTER * self._compare:
                self.recoveries += 1
                self._hold = HOLD_MIN
                self._change(self.level, "steady", "quiet" if m <= RECOVER else "faster",
                             f"x{m:.2f} the quiet time at {self.threads} threads, against x{self._compare:.2f} "
                             f"at {self.levels[fallback]}")
            else:
                self._failed_probe(f"x{m:.2f} the quiet time against x{self._compare:.2f} with fewer threads")

    def _failed_probe(self, why: str) -> None:
        self._hold = min(HOLD_MAX, self._hold * 2)
        self._change(self.level + 1, "steady", "probe_failed", f"{why}; next probe in {self._hold:g} s")

    def _down(self, reason: str, detail: str) -> None:
        self._hold = HOLD_MIN
        self._change(self.level + 1, "steady", reason, detail)

    def _change(self, level: int, mode: str, reason: str, detail: str) -> None:
        now = self.clock()
        if level > self.level and reason in FALLBACK_REASONS:
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        self.level, self.mode = level, mode
        self._window.clear()
        self.contention()  # the next window's evidence starts here
        self._probe_at = now + self._hold
        self.set_threads(self.threads)
        self._record(reason, detail, now)

    def _record(self, reason: str, detail: str, now: float | None = None) -> None:
        d = ThreadDecision(self.clock() if now is None else now, self.threads, reason, detail)
        self.decisions = self.decisions[-63:] + [d]
        level = logging.DEBUG if reason in ("probe", "probe_failed") else logging.INFO
        log.log(level, "cpu threads -> %d (%s): %s", d.threads, reason, detail)


def thread_levels(threads: int) -> list[int]:
    """8 -> [8, 4, 2, 1]: each fallback halves the team."""
    levels = [max(1, threads)]
    while levels[-1] > 1:
        levels.append(levels[-1] // 2)
    return levels


def explicit_setting(num_threads: int | None, env: dict[str, str] | None = None) -> str | None:
    """What the user chose, if anything: then the engine keeps it and does not adapt."""
    env = os.environ if env is None else env
    if num_threads:
        return f"--num-threads {num_threads}"
    for name in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS"):
        if env.get(name):
            return f"{name}={env[name]}"
    return None


def make_adapter(num_threads: int | None, root: Path | str = "/", env: dict[str, str] | None = None,
                 budget: CpuBudget | None = None) -> ThreadAdapter:
    """The engine's thread count at start (applied here) and the adapter that keeps it fitting."""
    import torch

    explicit = explicit_setting(num_threads, env)
    if num_threads:
        torch.set_num_threads(num_threads)
    current = torch.get_num_threads()
    if explicit:
        adapter = ThreadAdapter([current], torch.set_num_threads, adaptive=False)
        adapter._record("explicit", f"{current} thread(s), as set by {explicit}: no adaptation")
        return adapter
    budget = budget or cpu_budget(root)
    start = min(current, budget.threads)
    if start != current:
        torch.set_num_threads(start)
    adapter = ThreadAdapter(thread_levels(start), torch.set_num_threads)
    adapter._record("budget", f"{budget.describe()}; torch's default was {current}")
    adapter.settle_in()
    return adapter
