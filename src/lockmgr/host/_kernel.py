"""The kernel's part of a host lock: record locks on the shard files, and a doorbell per shard.

Each 64-bit identity (``lockmgr._keyhash``) owns two bytes of one shard file: the *hold*
byte, read-locked by every process holding the key shared and write-locked by the one
holding it exclusive, and the *queue* byte, read-locked by every process waiting for the
key. A third byte, the *writer* byte, is read-locked by every process waiting to write it.
The kernel releases all three when a process dies, however it dies: nothing is left to
clean up.

Linux uses open file description (OFD) locks: they belong to the manager's own descriptor
of the shard, so a forked child (which must open its own, ``LockDirectory.reopen_after_fork``)
never shares them. Elsewhere, or when asked (``mechanism="posix"``), POSIX record locks:
they belong to the process, so one process keeps one descriptor per shard file for every
manager of the directory (closing any descriptor of a file drops the process's POSIX locks
on it): ``_shared.process_directory``.

Waiting polls nothing faster than ``SLICE``: a waiter that finds the key taken sleeps on its
shard's doorbell (a futex word in the registry mapping, Linux) for at most ``SLICE``, and a
releaser rings it when a waiter armed it. The slice bounds what a ring that never comes (a
holder killed before it rang, a ring lost to a race) costs; elsewhere the waiter sleeps
``SLICE`` between tries.

Fairness the kernel does not give: a kernel record lock goes mostly back to the process that
released it, and read locks keep a writer out for as long as readers overlap. So:

- a process that arrives while others wait for the key (the queue byte is read-locked by
  another description) waits one doorbell ring or one ``SLICE`` before trying, so a
  releaser re-acquiring at once does not overtake the waiters it just woke;
- a reader that arrives while a writer of another process waits (the writer byte) waits
  until no writer does: a waiting writer gets the key once the readers present when it
  arrived leave. A stopped waiting writer keeps new readers out, as a queued writer does in
  PostgreSQL; a dead one does not (the kernel drops its writer byte).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import platform
import struct
import sys
import threading
import time
from collections.abc import Callable

from .._errors import LockError
from .._quiet import let_in
from ._directory import HEADER, SHARD_SLOT, SHARDS, LockDirectory

#: The longest a waiter sleeps before it tries the key again (the bound of issue 33: a
#: timed wait ends within it of its deadline; nothing polls faster).
SLICE = 0.005

_HOLD, _QUEUE, _WRITER = 0, 1, 2  # a key's bytes in its shard file: 3 per identity
_BYTES_PER_KEY = 3
_UNSIGNED = 1 << 64

# struct flock as Linux lays it out on every architecture it runs on (short, short, off_t,
# off_t, pid_t, padding): OFD locks exist on Linux only.
_FLOCK = struct.Struct("@hhqqi4x")
_UNLCK, _RDLCK, _WRLCK = fcntl.F_UNLCK, fcntl.F_RDLCK, fcntl.F_WRLCK

#: ``mechanism=`` values: which kernel record locks a manager uses.
MECHANISMS = ("ofd", "posix")


def default_mechanism() -> str:
    """OFD locks where the kernel has them (Linux), POSIX record locks elsewhere;
    ``LOCKMGR_HOST_LOCKS=posix`` asks for POSIX locks on Linux too (the tests of that path)."""
    asked = os.environ.get("LOCKMGR_HOST_LOCKS", "")
    if asked == "posix" or not hasattr(fcntl, "F_OFD_SETLK"):
        return "posix"
    return "ofd"


def place(ident: int) -> tuple[int, int]:
    """The shard and the first byte of ``ident``'s bytes in it."""
    unsigned = ident % _UNSIGNED
    return unsigned % SHARDS, (unsigned // SHARDS) * _BYTES_PER_KEY


class KernelLocks:
    """The record locks and doorbells of one directory, as one process uses them."""

    __slots__ = ("_directory", "_ofd", "_bells", "_futex")

    def __init__(self, directory: LockDirectory, mechanism: str) -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS}, not {mechanism!r}")
        if mechanism == "ofd" and not hasattr(fcntl, "F_OFD_SETLK"):
            raise ValueError("mechanism='ofd' needs Linux's open file description locks")
        self._directory = directory
        self._ofd = mechanism == "ofd"
        # The doorbell words: one u32 array over the registry's shard slots (an export of
        # the mapping, let go in ``close``: a mapping with exports cannot be closed).
        words = SHARDS * SHARD_SLOT // 4
        self._bells = (ctypes.c_uint32 * words).from_buffer(directory.registry, HEADER)
        self._futex = _Futex.for_this_machine()

    def close(self) -> None:
        """Let go of the mapping's export (the directory closes it)."""
        del self._bells

    # -- the record locks ------------------------------------------------------------------

    def lock_byte(self, shard: int, start: int, kind: int) -> bool:
        """Lock (or unlock) one byte; False if another holder's lock conflicts."""
        fd = self._directory.shard_fds[shard]
        try:
            if self._ofd:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, 1, 0))
            else:
                flags = {_UNLCK: fcntl.LOCK_UN, _RDLCK: fcntl.LOCK_SH | fcntl.LOCK_NB,
                         _WRLCK: fcntl.LOCK_EX | fcntl.LOCK_NB}[kind]
                fcntl.lockf(fd, flags, 1, start, os.SEEK_SET)
        except OSError as error:
            if error.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise LockError(f"the kernel refused a record lock on {self._directory.path}:"
                            f" {error}") from error
        return True

    def others_lock(self, shard: int, start: int, probe: int = _WRLCK) -> bool:
        """Whether another process (POSIX) or description (OFD) locks byte ``start`` in a
        way that conflicts with ``probe`` (a write conflicts with any lock, a read with a
        write)."""
        fd = self._directory.shard_fds[shard]
        if self._ofd:
            answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK,
                                 _FLOCK.pack(probe, os.SEEK_SET, start, 1, 0))
            return bool(_FLOCK.unpack(answer)[0] != _UNLCK)
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, _posix_flock(probe, start))
        return _posix_type(answer) != _UNLCK

    def held_elsewhere(self, ident: int, writes_only: bool) -> bool:
        """Whether another process (another description: OFD) holds the key (for write,
        if ``writes_only``)."""
        shard, start = place(ident)
        return self.others_lock(shard, start + _HOLD, _RDLCK if writes_only else _WRLCK)

    def try_take(self, ident: int, shared: bool, waits_after: bool = False) -> bool:
        """The key's hold byte at once, or False; waiting writers of other processes keep a
        new reader out. ``waits_after``: the first try of a call that waits if it fails,
        which also stands back while other processes wait for the key (``take`` then
        queues it behind them). A call that does not wait takes a free key whoever waits:
        a waiter stopped in its wait (SIGSTOP) must not make every try fail."""
        shard, start = place(ident)
        if waits_after and self.others_lock(shard, start + _QUEUE):
            return False
        if shared and self.others_lock(shard, start + _WRITER):
            return False
        return self.lock_byte(shard, start + _HOLD, _RDLCK if shared else _WRLCK)

    def take(self, ident: int, shared: bool, deadline: float | None,
             look: Callable[[], None] | None = None,
             stop: threading.Event | None = None) -> bool:
        """The key's hold byte by ``deadline`` (monotonic; None: no limit), waiting on the
        doorbell as the module says; False at the deadline, or within one ``SLICE`` of
        ``stop`` being set (a task's wait, cancelled), holding nothing of it.
        ``look`` is called before each sleep (``_waits.Look``: it may raise DeadlockError,
        and the wait then ends holding nothing of it)."""
        shard, start = place(ident)
        behind = self.others_lock(shard, start + _QUEUE)  # others already wait for it
        queued = writer_queued = armed = False
        try:
            while True:
                rung = self._bell(shard, armed)
                if not behind and not (shared and self.others_lock(shard, start + _WRITER)):
                    if self.lock_byte(shard, start + _HOLD, _RDLCK if shared else _WRLCK):
                        return True
                if not queued:
                    queued = self.lock_byte(shard, start + _QUEUE, _RDLCK)
                    if not shared:
                        writer_queued = self.lock_byte(shard, start + _WRITER, _RDLCK)
                if not armed:  # tried once: from now on a release rings; try again armed
                    armed = True
                    continue
                behind = False  # after one ring or one slice, it tries as every waiter does
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0 or stop is not None and stop.is_set():
                    return False
                if look is not None:
                    look()
                # (Ctrl-C ends the sleep: the finally gives the queue bytes back, the
                # caller what it took, with the handlers held off again)
                let_in(self._sleep, shard, rung, SLICE if left is None else min(SLICE, left))
        finally:
            if writer_queued:
                self.lock_byte(shard, start + _WRITER, _UNLCK)
            if queued:
                self.lock_byte(shard, start + _QUEUE, _UNLCK)
                self._ring(shard)  # newcomers behind this waiter look again

    def to_shared(self, ident: int) -> None:
        """Downgrade the hold byte from write to read: the kernel converts it in place."""
        shard, start = place(ident)
        self.lock_byte(shard, start + _HOLD, _RDLCK)
        self._ring(shard)

    def give(self, ident: int) -> None:
        """Unlock the hold byte (harmless if not held) and ring the shard's doorbell."""
        shard, start = place(ident)
        self.lock_byte(shard, start + _HOLD, _UNLCK)
        self._ring(shard)

    # -- the doorbell ----------------------------------------------------------------------

    def _bell(self, shard: int, arm: bool) -> int:
        """The doorbell's count now; ``arm``: the next release rings (armed before the try
        that precedes a sleep, so a release after that try cannot go unrung)."""
        index = shard * SHARD_SLOT // 4
        if arm:
            self._bells[index + 1] = 1
        return int(self._bells[index])

    def _ring(self, shard: int) -> None:
        index = shard * SHARD_SLOT // 4
        if self._bells[index + 1]:
            self._bells[index + 1] = 0
            self._bells[index] = (self._bells[index] + 1) & 0xFFFFFFFF
            self._futex.wake(ctypes.addressof(self._bells) + index * 4)

    def _sleep(self, shard: int, rung: int, seconds: float) -> None:
        index = shard * SHARD_SLOT // 4
        self._futex.wait(ctypes.addressof(self._bells) + index * 4, rung, seconds)


class _Futex:
    """FUTEX_WAIT/FUTEX_WAKE on a shared word (Linux, through libc's ``syscall``), or, where
    there is none, a sleep of the given time (the waiter then tries every ``SLICE``)."""

    # The futex system call's number on each Linux architecture lockmgr's wheels cover.
    _NUMBERS = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}
    _WAIT, _WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the word is in a file mapping
    _EVERYONE = 0x7FFFFFFF

    __slots__ = ("_syscall", "_number", "_timeouts")

    _instance: _Futex | None = None

    def __init__(self) -> None:
        self._number = self._NUMBERS.get(platform.machine()) if sys.platform == "linux" else None
        self._syscall = None
        # One timespec per thread, made once: CPython 3.13t's ctypes races on making
        # instances of one Structure type in several threads at once (ThreadSanitizer).
        self._timeouts = threading.local()
        if self._number is not None:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            self._syscall = libc.syscall
            self._syscall.restype = ctypes.c_long

    @classmethod
    def for_this_machine(cls) -> _Futex:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def wait(self, address: int, expected: int, seconds: float) -> None:
        """Sleep until woken, ``seconds`` at most, unless the word is no longer ``expected``
        (ctypes lets go of the GIL for the call; a signal ends it early: handlers run)."""
        if self._syscall is None:
            time.sleep(seconds)
            return
        timeout: _Timespec | None = getattr(self._timeouts, "timespec", None)
        if timeout is None:
            timeout = self._timeouts.timespec = _Timespec()
        whole = int(seconds)
        timeout.tv_sec, timeout.tv_nsec = whole, int((seconds - whole) * 1e9)
        self._syscall(self._number, ctypes.c_void_p(address), self._WAIT,
                      ctypes.c_uint32(expected), ctypes.byref(timeout), None, 0)

    def wake(self, address: int) -> None:
        if self._syscall is not None:
            self._syscall(self._number, ctypes.c_void_p(address), self._WAKE,
                          self._EVERYONE, None, None, 0)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _posix_flock(kind: int, start: int) -> bytes:
    """A struct flock for F_GETLK in this platform's layout (Linux's, or the BSDs' and
    macOS's: off_t, off_t, pid_t, short, short)."""
    if sys.platform == "linux":
        return _FLOCK.pack(kind, os.SEEK_SET, start, 1, 0)
    return struct.pack("@qqihh", start, 1, 0, kind, os.SEEK_SET)


def _posix_type(answer: bytes) -> int:
    if sys.platform == "linux":
        return int(_FLOCK.unpack(answer)[0])
    return int(struct.unpack("@qqihh", answer)[3])
