"""Who writes which key: the registry's table of writers, for the next writer and for snapshots.

A process that takes an identity for write records itself — identity, pid, and the process's
start time (so that a reused pid is not taken for it) — in the identity's slot
(``HOLDERS + (ident mod HOLDER_SLOTS) * HOLDER_SLOT``), and clears the record when it gives the
write back, before the kernel lock goes. So the next writer of that identity that finds
another process's record still there knows that writer ended without giving the key back
(killed, crashed; the kernel freed its lock): it gets ``AbandonedLockWarning`` naming that
pid — the data under the key may be half-written.

A slot is claimed (only when free, or left by a process that no longer runs) and cleared under
a record lock on the slot's own byte of shard 1, past every key's bytes, tried at once: a slot
busy at that instant, or holding another live writer's record (two identities, one slot), is
not recorded, and that writer's death then goes unreported. Nothing false is reported: a record
whose writer clears it at its release (it tries for ``_CLEAR_WITHIN``, while another process
holds the slot's byte for its few instructions) never warns. Readers are not recorded.
"""

from __future__ import annotations

import fcntl
import os
import struct
import sys
import time
import warnings
from collections.abc import Callable

from .._errors import AbandonedLockWarning
from ._directory import HOLDER_SLOT, HOLDER_SLOTS, HOLDERS, LockDirectory

_RECORD = struct.Struct("=qIIQ8x")  # identity, pid, 0, the process's start time (HOLDER_SLOT)
_SLOT_LOCK_BASE = 1 << 61  # slot i's byte in shard 1, past every key's bytes
# How long a release tries to clear its record while another process holds the slot's byte
# (for a few instructions): a record left would warn the next writer falsely.
_CLEAR_WITHIN = 0.01


def abandoned(key: object, pid: int) -> None:
    """Warn that process ``pid`` ended holding ``key`` (``Holders.record`` found it)."""
    warnings.warn(AbandonedLockWarning(
        f"process {pid} ended holding key {key!r} (it was killed or crashed before"
        " releasing it): what it wrote under it may be half-done"), stacklevel=4)


def start_time(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot, Linux); 0 where that is not
    known, or if it does not run (a zombie, killed but not yet reaped, runs no more)."""
    if sys.platform != "linux":
        return 0
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0
    if fields[0] in (b"Z", b"X"):  # (field 3, the state)
        return 0
    return int(fields[19])  # (field 22, counted after the command's closing parenthesis)


def runs(pid: int, started: int) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs."""
    if sys.platform == "linux":
        return started != 0 and start_time(pid) == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Holders:
    """The table of writers of one directory, as one process uses it (under the directory's
    guard, ``ProcessDirectory``: the slot locks do not exclude the threads of one process)."""

    def __init__(self, directory: LockDirectory,
                 lock_byte: Callable[[int, int, int], bool]) -> None:
        self._registry = directory.registry
        self._lock_byte = lock_byte
        self._me = (os.getpid(), start_time(os.getpid()))

    def after_fork(self) -> None:
        self._me = (os.getpid(), start_time(os.getpid()))

    def record(self, ident: int) -> int | None:
        """The calling process has just taken ``ident`` for write: record it. Returns the pid
        of the last writer if its record says it ended holding ``ident`` (``abandoned``)."""
        slot = ident % HOLDER_SLOTS
        if not self._lock_byte(1, _SLOT_LOCK_BASE + slot, fcntl.F_WRLCK):
            return None
        ended = None
        try:
            offset = HOLDERS + slot * HOLDER_SLOT
            found, pid, _, started = _RECORD.unpack_from(self._registry, offset)
            if pid and found == ident and (pid, started) != self._me:
                # A writer clears its record before its lock goes, and nobody else holds the
                # lock now: that one ended (or is ending: the kernel frees a dying process's
                # locks before it stops running) without giving the key back.
                ended = pid
            elif pid and ((pid, started) == self._me or runs(pid, started)):
                return None  # another live writer's record (or this process's): left alone
            _RECORD.pack_into(self._registry, offset, ident, self._me[0], 0, self._me[1])
        finally:
            self._lock_byte(1, _SLOT_LOCK_BASE + slot, fcntl.F_UNLCK)
        return ended

    def clear(self, ident: int) -> None:
        """The calling process gives ``ident``'s write back: its record goes."""
        slot = ident % HOLDER_SLOTS
        offset = HOLDERS + slot * HOLDER_SLOT
        found, pid, _, started = _RECORD.unpack_from(self._registry, offset)
        if found != ident or (pid, started) != self._me:
            return
        deadline = time.monotonic() + _CLEAR_WITHIN
        while not self._lock_byte(1, _SLOT_LOCK_BASE + slot, fcntl.F_WRLCK):
            if time.monotonic() > deadline:
                return  # (another process stopped in its few instructions there: left)
        try:
            _RECORD.pack_into(self._registry, offset, 0, 0, 0, 0)
        finally:
            self._lock_byte(1, _SLOT_LOCK_BASE + slot, fcntl.F_UNLCK)

    def writers(self) -> dict[int, int]:
        """Identity -> pid of every recorded writer that still runs."""
        found: dict[int, int] = {}
        for slot in range(HOLDER_SLOTS):
            ident, pid, _, started = _RECORD.unpack_from(self._registry,
                                                         HOLDERS + slot * HOLDER_SLOT)
            if pid and ((pid, started) == self._me or runs(pid, started)):
                found[ident] = pid
        return found
