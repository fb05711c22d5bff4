"""Who writes which key: the registry's table of writers, for the next writer and for snapshots.

A process that takes an identity for write records itself — identity, pid, and the process's
start time (so that a reused pid is not taken for it) — in the identity's slot
(``HOLDERS + (ident mod HOLDER_SLOTS) * HOLDER_SLOT``), and clears the record when it gives the
write back, before the kernel lock goes. So the next writer of that identity that finds
another process's record still there knows that writer ended without giving the key back
(killed, crashed; the kernel freed its lock): it gets ``AbandonedLockWarning`` naming that
pid — the data under the key may be half-written.

Only the writer of an identity writes its record, but two identities share a slot: a slot is
claimed only when empty, or left by a process that no longer runs, and a record carries a
check word of its fields, so that one written by two writers at once, torn between them, reads
as empty. A slot holding another live writer's record is not claimed, and a record may be
overwritten or torn by another identity's writer: that writer's death then goes unreported.
Nothing false is reported: a valid record of another process for the identity one has just
taken can only have been left by a writer that did not clear it. Readers are not recorded.
"""

from __future__ import annotations

import os
import struct
import sys
import warnings

from .._errors import AbandonedLockWarning
from ._directory import HOLDER_SLOT, HOLDER_SLOTS, HOLDERS, LockDirectory

# Identity, pid, 0, the process's start time, a check word of the three (HOLDER_SLOT bytes).
_RECORD = struct.Struct("=qIIQQ")
_EMPTY = bytes(HOLDER_SLOT)
_NO_PID = bytes(4)
_MASK = (1 << 64) - 1
_REMEMBERED = 4096  # own records remembered (the table is emptied when full)


def abandoned(key: object, pid: int, stacklevel: int = 4) -> None:
    """Warn that process ``pid`` ended holding ``key`` (``Holders.record`` found it), at
    the acquiring call's caller (``stacklevel`` frames up, as ``warnings.warn``'s)."""
    warnings.warn(AbandonedLockWarning(
        f"process {pid} ended holding key {key!r} (it was killed or crashed before"
        " releasing it): what it wrote under it may be half-done"), stacklevel=stacklevel)


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
    """The table of writers of one directory, as one process uses it."""

    def __init__(self, directory: LockDirectory) -> None:
        self._registry = directory.registry
        self._me = (os.getpid(), start_time(os.getpid()))
        self._mine: dict[int, bytes] = {}  # identity -> this process's record of it (cache)

    def after_fork(self) -> None:
        self._me = (os.getpid(), start_time(os.getpid()))
        self._mine = {}

    def _own(self, ident: int) -> bytes:
        """This process's record of ``ident``, as written (remembered: its check word costs
        a few big-integer products)."""
        record = self._mine.get(ident)
        if record is None:
            if len(self._mine) >= _REMEMBERED:
                self._mine.clear()
            pid, started = self._me
            record = self._mine[ident] = _RECORD.pack(ident, pid, 0, started,
                                                      _check(ident, pid, started))
        return record

    def _read(self, offset: int) -> tuple[int, int, int] | None:
        """The record at ``offset`` (identity, pid, start time), or None: empty, or torn."""
        ident, pid, _, started, check = _RECORD.unpack_from(self._registry, offset)
        if not pid or check != _check(ident, pid, started):
            return None
        return ident, pid, started

    def record(self, ident: int) -> int | None:
        """The calling process has just taken ``ident`` for write: record it. Returns the pid
        of the last writer if its record says it ended holding ``ident`` (``abandoned``)."""
        offset = HOLDERS + (ident % HOLDER_SLOTS) * HOLDER_SLOT
        mine = self._mine.get(ident) or self._own(ident)
        found = None if self._registry[offset + 8:offset + 12] == _NO_PID else self._read(offset)
        ended = None
        if found is not None:
            other, pid, started = found
            if other == ident and (pid, started) != self._me:
                # A writer clears its record before its lock goes, and nobody else holds the
                # lock now: that one ended (or is ending: the kernel frees a dying process's
                # locks before it stops running) without giving the key back.
                ended = pid
            elif (pid, started) == self._me or runs(pid, started):
                return None  # another live writer's record (or this process's): left alone
        self._registry[offset:offset + HOLDER_SLOT] = mine
        return ended

    def clear(self, ident: int) -> None:
        """The calling process gives ``ident``'s write back: its record goes."""
        offset = HOLDERS + (ident % HOLDER_SLOTS) * HOLDER_SLOT
        if self._registry[offset:offset + HOLDER_SLOT] == (self._mine.get(ident)
                                                             or self._own(ident)):
            self._registry[offset:offset + HOLDER_SLOT] = _EMPTY

    def writers(self) -> dict[int, int]:
        """Identity -> pid of every recorded writer that still runs."""
        found: dict[int, int] = {}
        for slot in range(HOLDER_SLOTS):
            record = self._read(HOLDERS + slot * HOLDER_SLOT)
            if record is not None and (record[1:] == self._me or runs(*record[1:])):
                found[record[0]] = record[1]
        return found


def _check(ident: int, pid: int, started: int) -> int:
    """A record's check word (a 64-bit mix of its fields, never 0): a record written by two
    writers at once, torn between them, fails it."""
    mixed = (ident * 0x9E3779B97F4A7C15 ^ pid * 0xC2B2AE3D27D4EB4F
             ^ started * 0x165667B19E3779F9) & _MASK
    mixed = ((mixed ^ mixed >> 31) * 0xBF58476D1CE4E5B9) & _MASK
    return (mixed ^ mixed >> 29) | 1
