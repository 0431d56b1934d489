"""Bench's machine sampling: the contamination and client-bound fields from a synthetic /proc sequence, the
warnings they raise in the table and the HTML report, and a real run beside a busy loop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from inferlab.bench.machine import FOREIGN_MAX, MachineSampler, local_server_pid, machine_warnings

TCK = 100


class FakeProc:
    """A /proc tree whose counters the test advances between the sampler's start and stop."""

    def __init__(self, root: Path, server_pid: int = 4242, child_pid: int = 4243):
        self.root, self.server_pid, self.child_pid = root, server_pid, child_pid
        self.now = 0.0
        self.write(cpu=(0, 0, 0, 0), bench=0, server=0, child=0, pressure=0)

    def write(self, cpu: tuple[int, int, int, int], bench: int, server: int, child: int, pressure: int) -> None:
        user, system, idle, iowait = cpu
        (self.root / "proc/pressure").mkdir(parents=True, exist_ok=True)
        (self.root / "proc/stat").write_text(
            f"cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0 0 0\n"
            "intr 1 2 3\n")

        def stat(pid: int, name: str, ppid: int, ticks: int, reaped: int = 0) -> str:
            # utime and stime split the ticks; cutime+cstime hold reaped children (bench's worker processes)
            return (f"{pid} ({name}) S {ppid} 1 1 0 -1 0 0 0 0 0 {ticks // 2} {ticks - ticks // 2} "
                    f"{reaped} 0 20 0 3 0 100 0 0\n")

        for pid, name, ppid, ticks in ((self.server_pid, "inferlab serve", 1, server),
                                       (self.child_pid, "worker) x", self.server_pid, child), (1, "init", 0, 0)):
            (self.root / f"proc/{pid}").mkdir(parents=True, exist_ok=True)
            (self.root / f"proc/{pid}/stat").write_text(stat(pid, name, ppid, ticks))
        (self.root / "proc/self").mkdir(parents=True, exist_ok=True)
        (self.root / "proc/self/stat").write_text(stat(999, "inferlab", 1, bench - 10 if bench >= 10 else bench,
                                                       10 if bench >= 10 else 0))
        (self.root / "proc/pressure/cpu").write_text(
            f"some avg10=0.00 avg60=0.00 avg300=0.00 total={pressure}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")

    def sampler(self, server: bool = True) -> MachineSampler:
        return MachineSampler(self.server_pid if server else None, self.root, clock=lambda: self.now, clk_tck=TCK)


def test_a_neighbour_is_measured_and_flagged(tmp_path):
    fake = FakeProc(tmp_path)
    s = fake.sampler()
    s.start()
    # 10 s on 2 CPUs = 2000 ticks: bench 150, the server 700 (+100 in its worker child), 800 by a neighbour.
    fake.now = 10.0
    fake.write(cpu=(1500, 250, 150, 100), bench=150, server=700, child=100, pressure=4_000_000)
    m = s.stop()
    assert m["interval_s"] == 10.0 and m["cpu_count"] == 2
    assert m["busy_share"] == pytest.approx(1750 / 2000)
    assert m["server_cpu_share"] == pytest.approx(800 / 2000)
    assert m["bench_cpu_share"] == pytest.approx(150 / 2000)
    assert m["bench_cpu_cores"] == pytest.approx(0.15)
    assert m["foreign_cpu_share"] == pytest.approx(800 / 2000)
    assert m["cpu_pressure_some_avg"] == pytest.approx(40.0)
    assert m["contaminated"] is True and m["client_bound"] is False
    (w,) = machine_warnings(m)
    assert w.startswith("contaminated") and "40%" in w


def test_a_quiet_machine_is_not_flagged_and_the_threshold_is_the_boundary(tmp_path):
    fake = FakeProc(tmp_path)
    s = fake.sampler()
    s.start()
    fake.now = 10.0
    foreign = int(FOREIGN_MAX * 2000) - 10  # just under the threshold
    fake.write(cpu=(900 + foreign, 100, 1000 - foreign, 0), bench=200, server=800, child=0, pressure=0)
    m = s.stop()
    assert m["foreign_cpu_share"] == pytest.approx(foreign / 2000)
    assert m["contaminated"] is False and machine_warnings(m) == []


def test_a_saturated_client_is_flagged(tmp_path):
    fake = FakeProc(tmp_path)
    s = fake.sampler(server=False)  # a remote server: everything but bench is foreign
    s.start()
    fake.now = 5.0
    fake.write(cpu=(500, 0, 500, 0), bench=480, server=0, child=0, pressure=0)
    m = s.stop(workers=1)
    assert m["server_cpu_share"] is None
    assert m["bench_cpu_cores"] == pytest.approx(0.96)
    assert m["client_bound"] is True and m["contaminated"] is False
    (w,) = machine_warnings(m)
    assert w.startswith("client-bound") and "--workers" in w
    assert s.stop(workers=2)["client_bound"] is False  # two event loops have two cores to fill


def test_without_proc_nothing_is_claimed(tmp_path):
    s = MachineSampler(None, tmp_path / "nothing")
    s.start()
    m = s.stop()
    assert m["contaminated"] is None and m["foreign_cpu_share"] is None and machine_warnings(m) == []


def test_the_local_server_is_found_by_its_port():
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        import os

        assert local_server_pid(f"http://127.0.0.1:{port}") == os.getpid()
    assert local_server_pid("http://example.invalid:80") is None


def test_the_warning_reaches_the_table_and_the_html(fake, bench, capsys):
    """A real run beside a busy loop on this machine: the neighbour's CPU shows as foreign, and the warning is in
    results.json, the terminal table and the HTML report."""
    url, _ = fake(ttft=0.01, itl=0.005)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        rc, res, out = bench("--base-url", url, "--concurrency", "2", "--num-requests", "40", "--output-len", "20")
    finally:
        busy.kill()
        busy.wait()
    assert rc == 0
    m = res["runs"][0]["machine"]
    assert m["server_pid"] is None  # the fake server runs inside bench's own process
    assert m["foreign_cpu_share"] >= FOREIGN_MAX and m["contaminated"] is True
    assert any(w.startswith("contaminated") for w in res["runs"][0]["warnings"])
    assert "1 of 1 load point(s) measured on a busy machine" in capsys.readouterr().err  # even with --quiet
    from rich.console import Console

    from inferlab.bench.report import print_results

    con = Console(record=True, width=200)
    print_results(res, con)
    assert "warning: contaminated: other processes used" in con.export_text()
    assert "contaminated" in (out / "report.html").read_text()
