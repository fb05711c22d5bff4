"""Fencing tokens across the processes of one host: a counter per identity in the directory's
``fences`` file, persisted before a fence is handed out.

Each identity has an 8-byte counter at ``(ident mod FENCE_SLOTS) * 8`` (two identities that
share one share the counter: each key's fences still strictly increase). Taking a fence locks
that counter's bytes (a record lock, released by the kernel if the process dies), reads it,
writes the next value and makes it durable (``fdatasync``) before the fence is handed out: a
restart of every process, or of the host, never hands one out again. The next value is also
at least the wall clock in microseconds, so a counter lost with its file (a directory on
tmpfs, wiped by a reboot) starts again above every fence handed out before — as long as the
clock was never set back and no key took more than a million fences a second.

The file is opened for each fence and closed after (fences cost a durable write anyway): a
forked child never uses its parent's description, and with POSIX locks closing it drops
nothing else, the counter's lock being the only one ever taken on that file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time

from .._errors import LockError
from .._quiet import let_in
from ._directory import LockDirectory

FENCES = "fences"
FENCE_SLOTS = 1 << 16
#: How long a try, or a call whose deadline is near, waits for another process's fence on
#: the same counter (microseconds, unless that process was stopped there).
FENCE_PATIENCE = 0.05
_FLOCK = struct.Struct("@hhqqi4x")  # Linux's struct flock (as _kernel's)


class FenceError(LockError):
    """A fence could not be taken and made durable (the file system refused): the
    acquisition that needed it failed and holds nothing."""


class Fences:
    """The fence counters of one directory, as one process takes them."""

    def __init__(self, directory: LockDirectory, ofd: bool) -> None:
        self._directory = directory
        self._ofd = ofd
        # POSIX record locks do not exclude the threads of one process: this does.
        self._in_process = threading.Lock()
        self._taker = 0  # the thread taking a fence (under _in_process): 0, none

    def after_fork(self) -> None:
        self._in_process = threading.Lock()
        self._taker = 0

    def next(self, ident: int, deadline: float | None) -> int | None:
        """The next fence of ``ident``, durable before it is returned; None if another
        process keeps its counter locked past ``deadline`` (monotonic; None: no limit: a
        process stopped in its few instructions there); FenceError if the file system
        refused (nothing is handed out then)."""
        offset = (ident % FENCE_SLOTS) * 8
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self._taker == threading.get_ident():
            # A signal handler, let in while this thread waits for another process's
            # counter: it would wait for its own thread for ever.
            raise RuntimeError(
                "lockmgr.host: a signal handler asked for a fence while its thread was "
                "taking one in the same directory; the call was refused (it cannot wait "
                "for itself)")
        if not self._in_process.acquire(timeout=-1 if left is None else left):
            return None
        self._taker = threading.get_ident()
        try:
            try:
                fd = self._directory.open_file(FENCES)
            except OSError as error:
                raise FenceError(f"cannot open {FENCES} in {self._directory.path}: {error}") from error
            try:
                if not self._lock_by(fd, offset, deadline):
                    return None
                try:
                    stored = os.pread(fd, 8, offset)
                    current = int.from_bytes(stored, "little") if len(stored) == 8 else 0
                    fence = max(current + 1, time.time_ns() // 1000)
                    if os.pwrite(fd, fence.to_bytes(8, "little"), offset) != 8:
                        raise OSError("short write")
                    os.fdatasync(fd)
                finally:
                    self._lock(fd, offset, fcntl.F_UNLCK)
            except OSError as error:
                raise FenceError(f"cannot take a fence in {self._directory.path}: {error}") from error
            finally:
                os.close(fd)
        finally:
            self._taker = 0
            self._in_process.release()
        return fence

    def _lock_by(self, fd: int, offset: int, deadline: float | None) -> bool:
        """Lock the counter's 8 bytes by ``deadline``, trying every millisecond (another
        process holds it for a few instructions, unless it was stopped there)."""
        while True:
            try:
                self._lock(fd, offset, fcntl.F_WRLCK)
                return True
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if deadline is not None and time.monotonic() >= deadline:
                return False
            let_in(time.sleep, 0.001)

    def _lock(self, fd: int, offset: int, kind: int) -> None:
        """Lock (at once, or OSError) or unlock the counter's 8 bytes."""
        if self._ofd:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, offset, 8, 0))
        else:
            flags = fcntl.LOCK_UN if kind == fcntl.F_UNLCK else fcntl.LOCK_EX | fcntl.LOCK_NB
            fcntl.lockf(fd, flags, 8, offset)
