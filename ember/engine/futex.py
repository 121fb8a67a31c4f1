"""Linux futexes on a word of shared memory, through the raw system call (Python has no binding): a process
sleeps until another changes the word and wakes it, instead of polling it. Works across processes on a
MAP_SHARED mapping (the non-private futex operations)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform

# The futex system call's number per architecture (asm/unistd.h).
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}
FUTEX_WAIT = 0
FUTEX_WAKE = 1
WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """FUTEX_WAIT / FUTEX_WAKE on the 32-bit word at an address in a shared mapping."""

    def __init__(self) -> None:
        machine = platform.machine()
        if os.uname().sysname != "Linux" or machine not in SYS_FUTEX:
            raise OSError(
                f"futexes need Linux on {' or '.join(SYS_FUTEX)} (this is {os.uname().sysname} on {machine})"
            )
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._number = ctypes.c_long(SYS_FUTEX[machine])

    def wait(self, address: int, expected: int, timeout_s: float) -> None:
        """Sleep while the word at `address` holds `expected` (its low 32 bits), until woken or `timeout_s`
        passes; returns at once if it already holds something else. Spurious returns are possible: the caller
        re-checks the word."""
        timeout = _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
        result = self._syscall(
            self._number,
            ctypes.c_void_p(address),
            FUTEX_WAIT,
            ctypes.c_uint32(expected & 0xFFFFFFFF),
            ctypes.byref(timeout),
            None,
            0,
        )
        if result == -1 and ctypes.get_errno() not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(ctypes.get_errno(), "futex wait failed")

    def wake(self, address: int) -> None:
        """Wake every process sleeping on the word at `address`."""
        self._syscall(self._number, ctypes.c_void_p(address), FUTEX_WAKE, WAKE_ALL, None, None, 0)
