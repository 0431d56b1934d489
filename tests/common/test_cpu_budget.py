"""The CPU budget read from a fake /proc + /sys tree: affinity, cgroup v2 cpu.max and v1 CFS quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inferlab.common.cpu_budget import cpu_budget, parse_cpu_list


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def _proc(root: Path, cpus: str, cgroup: str, mountinfo: str | None = None) -> None:
    _write(root, "proc/self/status", f"Name:\tpython\nCpus_allowed:\tff\nCpus_allowed_list:\t{cpus}\nThreads:\t3\n")
    _write(root, "proc/self/cgroup", cgroup)
    if mountinfo is not None:
        _write(root, "proc/self/mountinfo", mountinfo)


def test_cpu_list_format():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}


def test_affinity_alone_sets_the_threads(tmp_path):
    _proc(tmp_path, "0-2,6", "0::/user.slice\n")
    b = cpu_budget(tmp_path)
    assert (b.affinity, b.quota, b.threads) == (4, None, 4)


def test_cgroup_v2_quota_of_an_ancestor_limits(tmp_path):
    _proc(tmp_path, "0-15", "0::/kubepods/pod1/ctr\n",
          "30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n")
    _write(tmp_path, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n")
    _write(tmp_path, "sys/fs/cgroup/kubepods/pod1/cpu.max", "250000 100000\n")  # 2.5 CPUs, on the parent
    _write(tmp_path, "sys/fs/cgroup/kubepods/cpu.max", "max 100000\n")
    b = cpu_budget(tmp_path)
    assert b.quota == 2.5 and b.threads == 2  # rounded down
    assert b.quota_source == "/sys/fs/cgroup/kubepods/pod1/cpu.max"


def test_cgroup_v2_unlimited(tmp_path):
    _proc(tmp_path, "0-7", "0::/a\n", "30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    _write(tmp_path, "sys/fs/cgroup/a/cpu.max", "max 100000\n")
    assert cpu_budget(tmp_path).threads == 8


def test_cgroup_v1_quota_below_affinity(tmp_path):
    # A hybrid host (this project's machines): v1 cpu controller beside a v2 mount without it.
    _proc(tmp_path, "0-3", "4:memory:/x\n2:cpuacct:/\n1:cpu:/bench\n0::/\n",
          "40 1 0:30 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
          "41 1 0:31 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    _write(tmp_path, "sys/fs/cgroup/cpu/bench/cpu.cfs_quota_us", "100000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu/bench/cpu.cfs_period_us", "100000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n")
    _write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n")
    b = cpu_budget(tmp_path)
    assert (b.affinity, b.quota, b.threads) == (4, 1.0, 1)
    assert b.quota_source == "/sys/fs/cgroup/cpu/bench/cpu.cfs_quota_us"


def test_cgroup_v1_in_a_container_sees_only_its_subtree(tmp_path):
    # /proc/self/cgroup names the host's path; the container's mount shows that cgroup as its root.
    _proc(tmp_path, "0-31", "3:cpu,cpuacct:/docker/abc\n",
          "50 1 0:40 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "150000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "50000\n")
    b = cpu_budget(tmp_path)
    assert b.quota == 3.0 and b.threads == 3


def test_quota_below_one_cpu_keeps_one_thread(tmp_path):
    _proc(tmp_path, "0-1", "0::/tiny\n")  # no mountinfo: the conventional mount points are tried
    _write(tmp_path, "sys/fs/cgroup/tiny/cpu.max", "20000 100000\n")
    b = cpu_budget(tmp_path)
    assert b.quota == pytest.approx(0.2) and b.threads == 1


def test_the_real_machine_matches_the_affinity_syscall():
    b = cpu_budget("/")
    assert b.affinity == len(os.sched_getaffinity(0))
    assert 1 <= b.threads <= b.affinity
