"""Naming the OS thread that runs the caller, so `top -H`, py-spy and /proc/PID/task/*/comm tell a server's threads
apart (and benchmarks/peers.py can split the server's CPU time between its HTTP side and its engine).

Python before 3.14 names only its own Thread objects; the kernel sees every thread as the process's name. Threads
started later from a named thread (asyncio's executor, a library's workers) inherit its name, so one call names a
whole side of the server.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15  # prctl(2): the calling thread's name, at most 15 bytes
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform.startswith("linux") else None


def set_os_thread_name(name: str) -> bool:
    """Name the calling thread (truncated to 15 bytes); False where the platform has no such call."""
    if _libc is None:
        return False
    return _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0
