"""The OS sees the name a thread gives itself, and threads it starts inherit it (so one call names a server's whole
HTTP side for /proc, top -H and benchmarks/peers.py)."""

import sys
import threading
from pathlib import Path

import pytest

from inferlab.common.thread_name import set_os_thread_name

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")


def _comm(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def test_a_named_thread_and_the_threads_it_starts_carry_the_name():
    seen: dict[str, str] = {}

    def child() -> None:
        seen["child"] = _comm(threading.get_native_id())

    def named() -> None:
        assert set_os_thread_name("inferlab-http-and-more")  # over 15 bytes: the kernel keeps 15
        seen["named"] = _comm(threading.get_native_id())
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=named)
    t.start()
    t.join()
    assert seen == {"named": "inferlab-http-a", "child": "inferlab-http-a"}
    assert _comm(threading.get_native_id()) != "inferlab-http-a"  # the caller's thread alone was renamed
