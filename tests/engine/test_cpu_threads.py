"""The thread adapter on synthetic step-time traces: it steps down when the team stalls, starts with fewer threads
beside a busy neighbour, probes its way back, and keeps a user's explicit choice. Time is a fake clock advanced by
each synthetic step, so nothing here depends on the machine's speed."""

from __future__ import annotations

from collections.abc import Callable

from inferlab.engine.cpu_contention import Contention
from inferlab.engine.cpu_threads import ThreadAdapter, explicit_setting, thread_levels


class Sim:
    """A fake machine: step time is a function of the thread count; the adapter's clock advances by it. `foreign`:
    the CPUs other processes use (of 2)."""

    def __init__(self, levels: list[int], foreign: float = 0.0, throttled: float = 0.0):
        self.now = 0.0
        self.calls: list[int] = []
        self.foreign, self.throttled = foreign, throttled
        self._last = 0.0
        self.adapter = ThreadAdapter(levels, self.calls.append, clock=lambda: self.now, contention=self._read)

    def _read(self) -> Contention | None:
        last, self._last = self._last, self.now
        return None if self.now <= last else Contention(self.now - last, self.foreign, 2, self.throttled)

    def settle_in(self) -> None:
        self.adapter.settle_in(0.2, sleep=lambda s: setattr(self, "now", self.now + s))

    def run(self, seconds: float, step_time: Callable[[int], float], tokens: int = 16) -> None:
        end = self.now + seconds
        while self.now < end:
            dt = step_time(self.adapter.threads)
            self.now += dt
            self.adapter.observe(tokens, dt)

    def reasons(self) -> list[str]:
        return [d.reason for d in self.adapter.decisions]


QUIET = {2: 0.010, 1: 0.016}  # 2 threads on a quiet 2-core machine; 1 thread is ~1.6x slower
AUTOGROUP = {2: 1.0, 1: 0.016}  # a neighbour in another session: every parallel region waits a period


def test_levels_halve_to_one():
    assert thread_levels(8) == [8, 4, 2, 1]
    assert thread_levels(3) == [3, 1]
    assert thread_levels(1) == [1]


def test_a_stalling_team_falls_back_and_returns_when_quiet():
    sim = Sim([2, 1])
    sim.run(1.0, QUIET.get)
    assert sim.calls == [] and sim.adapter.threads == 2
    sim.foreign = 1.0
    sim.run(10.0, AUTOGROUP.get)  # the neighbour arrives: a busy loop in another session, 1.0 CPU of 2
    assert sim.adapter.threads == 1
    assert sim.reasons()[0] == "stall"
    assert sim.adapter.fallbacks == {"stall": 1}
    assert "other processes used 1.0 of 2 CPUs" in sim.adapter.decisions[0].detail
    # While the neighbour stays, probes of 2 threads stall at their first step and are abandoned, backing off.
    probes = sim.reasons().count("probe")
    assert probes >= 1 and sim.reasons().count("probe_failed") == probes
    assert all(t == 1 for t in sim.calls[-1:])
    sim.foreign = 0.0
    sim.run(70.0, QUIET.get)  # the neighbour has gone: the next probe succeeds
    assert sim.adapter.threads == 2
    assert sim.reasons()[-1] == "quiet"
    assert sim.adapter.recoveries == 1
    assert sim.calls[-1] == 2


def test_probes_back_off_while_the_machine_stays_busy():
    sim = Sim([2, 1], foreign=1.0)
    sim.run(1.0, QUIET.get)
    sim.run(200.0, AUTOGROUP.get)
    failed = [d.time for d in sim.adapter.decisions if d.reason == "probe_failed"]
    gaps = [b - a for a, b in zip(failed, failed[1:])]
    assert len(failed) >= 4
    assert all(later >= earlier for earlier, later in zip(gaps, gaps[1:]))  # the hold doubles, up to its cap
    # Stalled steps cost little: far fewer 2-thread steps than 1-thread steps ran.
    assert sim.calls.count(2) == len(failed)


def test_a_quota_below_the_team_falls_back_when_fewer_threads_are_faster():
    # Two threads under a one-CPU quota get throttled (x2.2); one thread runs at x1.6 of quiet.
    quota = {2: 0.022, 1: 0.016}
    sim = Sim([2, 1])
    sim.run(1.0, QUIET.get)
    sim.throttled = 0.4  # the quota arrives: the cgroup's cpu.stat counts throttled time
    sim.run(30.0, quota.get)
    assert sim.adapter.threads == 1
    assert sim.adapter.fallbacks == {"slow": 1}
    assert "probe_failed" in sim.reasons()  # probes keep measuring 2 threads slower, so 1 stays
    assert sim.adapter.recoveries == 0


def test_slow_steps_step_down_only_where_another_process_or_a_quota_holds_a_core():
    # Steps 2x slower than quiet: a busy loop in our session (0.7 CPU of 2 beside two spinning threads) makes one
    # thread faster; with no other process busy and no throttling the slowdown is the host's or our own, and fewer
    # threads cannot help.
    slow = {2: 0.020, 1: 0.016}
    quiet_host = Sim([2, 1], foreign=0.2)  # the bench client at one stream
    quiet_host.run(1.0, QUIET.get)
    quiet_host.run(30.0, slow.get)
    assert quiet_host.calls == [] and quiet_host.adapter.fallbacks == {}
    neighbour = Sim([2, 1])
    neighbour.run(1.0, QUIET.get)
    neighbour.foreign = 0.7
    neighbour.run(30.0, slow.get)
    assert neighbour.adapter.threads == 1 and neighbour.adapter.fallbacks == {"slow": 1}
    slow_down = next(d for d in neighbour.adapter.decisions if d.reason == "slow")
    assert "other processes used 0.7 of 2 CPUs" in slow_down.detail


def test_a_probe_that_is_faster_though_not_quiet_wins():
    sim = Sim([4, 2, 1], foreign=1.0)
    sim.run(1.0, {4: 0.010, 2: 0.014, 1: 0.02}.get)
    sim.run(5.0, {4: 0.5, 2: 0.5, 1: 0.03}.get)  # even 2 threads stall: down two levels
    assert sim.adapter.threads == 1
    sim.run(20.0, {4: 0.5, 2: 0.018, 1: 0.03}.get)  # 2 threads now beat 1, 4 still stall
    assert sim.adapter.threads == 2
    assert "faster" in sim.reasons()


def test_stalls_with_no_core_held_keep_the_team():
    # A quiet host's hiccup: steps 10-60x their quiet time for a moment, no other process busy. Fewer threads cannot
    # help, and the probes back to two would have to win on a noisy host.
    sim = Sim([2, 1], foreign=0.1)
    sim.run(1.0, QUIET.get)
    for dt in (0.11, 0.62):
        sim.now += dt
        sim.adapter.observe(16, dt)
    sim.run(5.0, QUIET.get)
    assert sim.calls == [] and sim.adapter.fallbacks == {} and sim.adapter.kept_stalls == 1


def test_what_others_did_while_we_idled_is_not_evidence():
    # Other servers load (1.5 CPUs of 2) while this one idles for a minute; then, alone, its first steps stall.
    busy_until = [0.0]
    last = [0.0]

    def read() -> Contention | None:  # other processes' CPUs, averaged over the window since the last read
        lo, hi = last[0], sim.now
        last[0] = hi
        if hi <= lo:
            return None
        return Contention(hi - lo, 1.5 * max(0.0, min(hi, busy_until[0]) - lo) / (hi - lo), 2)

    sim = Sim([2, 1])
    sim.adapter.contention = read
    sim.run(1.0, QUIET.get)
    sim.now += 60.0
    busy_until[0] = sim.now
    for dt in (0.11, 0.62, 0.3):  # the stall's window is its second step: nobody else ran then
        sim.now += dt
        sim.adapter.observe(16, dt)
    assert sim.adapter.threads == 2 and sim.adapter.kept_stalls == 1
    sim.run(1.0, {2: 0.02, 1: 0.016}.get)  # slow (x2), after the idle spell: no evidence either
    assert sim.calls == [] and sim.adapter.fallbacks == {}


def test_a_server_started_beside_a_busy_neighbour_starts_with_fewer_threads():
    sim = Sim([2, 1], foreign=1.0)  # a busy loop in another session: 1.0 CPU of 2
    sim.settle_in()
    assert sim.adapter.threads == 1 and sim.adapter.fallbacks == {"contended": 1}
    assert "at start, other processes used 1.0 of 2 CPUs" in sim.adapter.decisions[-1].detail
    # Every size is first seen at one thread; probes of two stall at their first step and back off.
    sim.run(60.0, AUTOGROUP.get)
    assert sim.adapter.threads == 1
    failed = sim.reasons().count("probe_failed")
    assert failed >= 3 and sim.calls.count(2) == failed
    # The neighbour leaves: the next probe runs faster than one thread and stays.
    sim.run(140.0, QUIET.get)
    assert sim.adapter.threads == 2 and sim.reasons()[-1] == "quiet"
    for foreign in (0.0, 0.4):  # a quiet machine, or a light process beside the server: the full team
        sim = Sim([2, 1], foreign=foreign)
        sim.settle_in()
        assert sim.adapter.threads == 2 and sim.calls == []


def test_a_quiet_noisy_trace_never_changes_threads():
    import random

    rng = random.Random(0)
    sim = Sim([2, 1])
    sim.run(60.0, lambda t: QUIET[t] * (1 + 0.3 * rng.random()) * (5 if rng.random() < 0.01 else 1))
    assert sim.calls == []


def test_sizes_are_compared_with_their_own_reference():
    # Prefill steps of 256 tokens take 20x a decode step: that is not a stall.
    sim = Sim([2, 1])
    for _ in range(50):
        for tokens, dt in ((1, 0.010), (256, 0.2)):
            sim.now += dt
            sim.adapter.observe(tokens, dt)
    assert sim.calls == []


def test_explicit_choices_win():
    assert explicit_setting(3, {}) == "--num-threads 3"
    assert explicit_setting(None, {"OMP_WAIT_POLICY": "PASSIVE"}) == "OMP_WAIT_POLICY=PASSIVE"
    assert explicit_setting(None, {"OMP_NUM_THREADS": "2"}) == "OMP_NUM_THREADS=2"
    assert explicit_setting(None, {}) is None
    off = ThreadAdapter([2], lambda n: None, adaptive=False)
    for _ in range(100):
        off.observe(16, 5.0)
    assert off.decisions == [] and off.threads == 2


def test_the_engine_starts_within_the_budget_and_keeps_explicit_settings(tmp_path):
    import torch

    from inferlab.common.cpu_budget import cpu_budget
    from inferlab.engine.cpu_threads import make_adapter

    before = torch.get_num_threads()
    try:
        # A one-CPU cgroup v1 quota through a fake /proc + /sys tree: the team shrinks to one thread at start.
        (tmp_path / "proc/self").mkdir(parents=True)
        (tmp_path / "proc/self/status").write_text("Cpus_allowed_list:\t0-7\n")
        (tmp_path / "proc/self/cgroup").write_text("1:cpu:/job\n")
        q = tmp_path / "sys/fs/cgroup/cpu/job"
        q.mkdir(parents=True)
        (q / "cpu.cfs_quota_us").write_text("100000\n")
        (q / "cpu.cfs_period_us").write_text("100000\n")
        assert cpu_budget(tmp_path).threads == 1
        a = make_adapter(None, root=tmp_path, env={})
        assert torch.get_num_threads() == 1 and a.levels == [1] and a.decisions[0].reason == "budget"
        torch.set_num_threads(2)
        a = make_adapter(None, root="/nonexistent", env={"OMP_WAIT_POLICY": "PASSIVE"})
        assert not a.adaptive and a.threads == 2 and "OMP_WAIT_POLICY=PASSIVE" in a.decisions[0].detail
        a = make_adapter(1, env={})
        assert torch.get_num_threads() == 1 and not a.adaptive and a.levels == [1]
    finally:
        torch.set_num_threads(before)


def test_the_engine_reports_its_threads(llm_fp32):
    import torch

    from inferlab import SamplingParams

    engine = llm_fp32.engine
    llm_fp32.generate(["hello"], SamplingParams(max_tokens=3))
    s = engine.stats()
    assert s.cpu_threads == engine.cpu_threads.threads == torch.get_num_threads()
    assert s.cpu_threads_max == engine.cpu_threads.levels[0]


def test_the_meter_reads_other_processes_and_quota_throttling_from_a_fake_root(tmp_path):
    from pathlib import Path

    from inferlab.engine.cpu_contention import ContentionMeter

    def write(rel: str, text: str) -> None:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def sample(busy_user: int, own: int, throttled_usec: int) -> None:
        # /proc/stat: user nice system idle iowait irq softirq steal; /proc/self/stat: utime, stime are fields 14-15
        write("proc/stat", f"cpu  {busy_user} 0 0 5000 0 0 0 0 0 0\ncpu0 0 0 0 0\ncpu1 0 0 0 0\n")
        write("proc/self/stat", "42 (python (x)) S " + " ".join(["0"] * 10) + f" {own} 0 0 0\n")
        write("sys/fs/cgroup/svc/cpu.stat", f"usage_usec 1\nnr_throttled 3\nthrottled_usec {throttled_usec}\n")

    write("proc/self/cgroup", "0::/svc\n")
    write("proc/self/mountinfo", "30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    now = [0.0]
    meter = ContentionMeter(root=Path(tmp_path), clock=lambda: now[0])
    meter._tck = 100
    sample(1000, 300, 0)
    assert meter.read() is None  # the first read only sets the base
    now[0] = 2.0
    sample(1000 + 300, 300 + 100, 500_000)  # 3 s busy in 2 s, 1 s of it ours; throttled 0.5 s
    c = meter.read()
    assert (c.cpus, round(c.foreign_cpus, 3), round(c.throttled, 3)) == (2, 1.0, 0.25)
