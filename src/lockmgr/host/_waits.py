"""Deadlock looks across processes: waits published in the registry, and cycles found in them.

The kernel finds no cycle through OFD locks, and POSIX locks report false ones (per process,
not per thread). So a thread that has waited in the kernel for ``LOOK_EVERY`` publishes its
wait in a slot of the registry's table (``_directory.WAITS``): its process and thread, the
identity and mode it waits for, and the identities it holds (with their modes). Every
``LOOK_EVERY`` after that it reads the table and follows the edges the kernel's grant rule
makes (``edges``): a cycle back to its own slot, found by two looks in a row and unchanged,
is a deadlock, and the youngest wait of the cycle (the last to start) gives up with
``DeadlockError``: one victim, chosen alike by every member.

A publication lives exactly as long as its wait: a slot is claimed by write-locking its own
byte of shard 0 (past every key's bytes) and read only while that byte is locked — by this
process (``_mine``) or another, which the kernel frees when that process dies. Each slot is
written under a sequence number (odd while it is written) and a read that saw it change is
taken as no edge. Only the directory's owner (or group, ``shared_with_group``) can write
the registry: nobody else can publish a wait.

A thread holding more identities than a slot lists (``HELD_MAX``) publishes the first ones:
a cycle through the others is not found (the waits then run to their timeouts); nothing is
found that is not there. A table with no free slot publishes nothing, with the same effect.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Hashable, Sequence

from .._args import READ, WRITE
from .._errors import DeadlockError
from ._directory import WAIT_SLOT, WAIT_SLOTS, WAITS, LockDirectory

#: Seconds a thread waits in the kernel before it publishes, and between its looks.
LOOK_EVERY = 0.25

# A slot: sequence, pid, thread ident, when the wait started (CLOCK_MONOTONIC, one clock for
# the whole host), the identity waited for, its mode, how many held identities follow, and a
# bit per held identity: set if held for write.
_HEAD = struct.Struct("=IIQdqIIQ")
HELD_MAX = (WAIT_SLOT - _HEAD.size) // 8
_HELD = struct.Struct(f"={HELD_MAX}q")
_LIVE_BASE = 1 << 61  # slot i's liveness byte in shard 0, past every key's bytes

_Wait = tuple[int, int, int, float, int, int, dict[int, int]]  # seq, pid, owner, started, ...


def _slot_offset(slot: int) -> int:
    return WAITS + slot * WAIT_SLOT


class WaitBoard:
    """The table of published waits of one directory, as one process uses it."""

    def __init__(self, directory: LockDirectory,
                 lock_byte: Callable[[int, int, int], bool],
                 others_lock: Callable[[int, int], bool]) -> None:
        self._registry = directory.registry
        self._lock_byte = lock_byte  # KernelLocks.lock_byte(shard, start, kind)
        self._others_lock = others_lock  # KernelLocks.others_lock(shard, start)
        self._guard = threading.Lock()
        self._mine: set[int] = set()  # slots this process's threads hold (guard)

    def forget_after_fork(self) -> None:
        """In a forked child: none of the parent's slots is the child's."""
        self._guard = threading.Lock()
        self._mine = set()

    def claim(self) -> int | None:
        """A free slot, made this process's and emptied (``publish`` writes a wait in it,
        ``withdraw`` frees it); None if every slot is taken."""
        with self._guard:
            for slot in range(WAIT_SLOTS):
                if slot in self._mine or not self._lock_byte(0, _LIVE_BASE + slot, fcntl.F_WRLCK):
                    continue
                self._mine.add(slot)
                struct.pack_into("=I", self._registry, _slot_offset(slot) + 4, 0)  # no pid yet
                return slot
        return None

    def publish(self, slot: int, owner: int, started: float, waits_for: int, mode: int,
                held: Sequence[tuple[int, int]]) -> None:
        """Write a wait in ``slot`` (``claim``'s)."""
        listed = list(held)[:HELD_MAX]
        modes = sum(1 << index for index, (_, held_mode) in enumerate(listed)
                    if held_mode == WRITE)
        offset = _slot_offset(slot)
        writing = _writing(self._registry, offset)
        idents = [ident for ident, _ in listed] + [0] * (HELD_MAX - len(listed))
        _HELD.pack_into(self._registry, offset + _HEAD.size, *idents)
        _HEAD.pack_into(self._registry, offset, writing, os.getpid(), owner, started,
                        waits_for, mode, len(listed), modes)
        struct.pack_into("=I", self._registry, offset, (writing + 1) & 0xFFFFFFFF)

    def withdraw(self, slot: int) -> None:
        """The wait in ``slot`` ended: the slot is free again."""
        offset = _slot_offset(slot)
        writing = _writing(self._registry, offset)
        struct.pack_into("=I", self._registry, offset + 4, 0)  # no pid: an empty slot
        struct.pack_into("=I", self._registry, offset, (writing + 1) & 0xFFFFFFFF)
        with self._guard:
            self._mine.discard(slot)
            self._lock_byte(0, _LIVE_BASE + slot, fcntl.F_UNLCK)

    def live(self) -> dict[int, _Wait]:
        """Every live wait of the table, by slot (a slot changing as it is read is left out)."""
        with self._guard:
            mine = set(self._mine)
        waits: dict[int, _Wait] = {}
        for slot in range(WAIT_SLOTS):
            offset = _slot_offset(slot)
            head = _HEAD.unpack_from(self._registry, offset)
            sequence, pid = head[0], head[1]
            if not pid or sequence & 1:
                continue
            if slot not in mine and not self._others_lock(0, _LIVE_BASE + slot):
                continue  # its process ended (or the wait is being withdrawn)
            held_idents = _HELD.unpack_from(self._registry, offset + _HEAD.size)
            if struct.unpack_from("=I", self._registry, offset)[0] != sequence:
                continue
            _, _, owner, started, waits_for, mode, count, modes = head
            held = {held_idents[index]: WRITE if modes >> index & 1 else READ
                    for index in range(min(count, HELD_MAX))}
            waits[slot] = (sequence, pid, owner, started, waits_for, mode, held)
        return waits

    def cycle(self, slot: int) -> list[tuple[int, _Wait]] | None:
        """The cycle of waits through ``slot``, in order from it, or None."""
        waits = self.live()
        if slot not in waits:
            return None
        path = [slot]
        seen = {slot}

        def follow(at: int) -> bool:
            for after in edges(waits, at):
                if after == slot:
                    return True
                if after not in seen:
                    seen.add(after)
                    path.append(after)
                    if follow(after):
                        return True
                    path.pop()
            return False

        return [(member, waits[member]) for member in path] if follow(slot) else None


def _writing(registry: mmap.mmap, offset: int) -> int:
    """Mark the slot at ``offset`` as being written (an odd sequence); returns it."""
    writing = ((struct.unpack_from("=I", registry, offset)[0] + 1) | 1) & 0xFFFFFFFF
    struct.pack_into("=I", registry, offset, writing)
    return int(writing)


def edges(waits: dict[int, _Wait], at: int) -> list[int]:
    """The waits the wait in slot ``at`` waits for, as the kernel grants: a write waits for
    every holder of its identity; a read for its writers, and (lockmgr lets a waiting writer
    in before new readers) for the waits to write it."""
    _, _, _, _, wanted, mode, _ = waits[at]
    found = []
    for slot, (_, _, _, _, other_wants, other_mode, held) in waits.items():
        if slot == at:
            continue
        held_mode = held.get(wanted)
        if held_mode is not None and (mode == WRITE or held_mode == WRITE):
            found.append(slot)
        elif mode == READ and other_wants == wanted and other_mode == WRITE:
            found.append(slot)
    return found


class Look:
    """One thread's wait in the kernel, looked at every ``LOOK_EVERY``: published at the
    first look, its cycle confirmed by the next; the victim raises DeadlockError."""

    __slots__ = ("_board", "_owner", "_key", "_ident", "_mode", "_held", "_started",
                 "_due", "_slot", "_last")

    def __init__(self, board: WaitBoard, key: Hashable, ident: int, mode: int,
                 held: Callable[[], list[tuple[int, int]]]) -> None:
        self._board = board
        self._owner = threading.get_ident()
        self._key = key
        self._ident = ident
        self._mode = mode
        self._held = held  # the identities the thread holds (called once, to publish)
        self._started = time.monotonic()
        self._due = self._started + LOOK_EVERY
        self._slot: int | None = None
        self._last: frozenset[tuple[int, int]] | None = None

    def __call__(self) -> None:
        if time.monotonic() < self._due:
            return
        try:
            if self._slot is None:
                # (the slot is the look's as soon as it is claimed: an interrupt while the
                # wait is written leaves it to ``stop``, which withdraws it)
                self._slot = self._board.claim()
                if self._slot is not None:
                    self._board.publish(self._slot, self._owner, self._started, self._ident,
                                        self._mode, self._held())
            else:
                self._confirm(self._board.cycle(self._slot))
        finally:
            self._due = time.monotonic() + LOOK_EVERY

    def _confirm(self, cycle: list[tuple[int, _Wait]] | None) -> None:
        found = None if cycle is None else frozenset((slot, wait[0]) for slot, wait in cycle)
        confirmed, self._last = found is not None and found == self._last, found
        if not confirmed or cycle is None:
            return
        victim = max(cycle, key=lambda member: (member[1][3], member[1][1], member[0]))
        if victim[0] == self._slot:
            raise DeadlockError(
                f"waiting for key {self._key!r} would deadlock across processes: it is held"
                " by a process whose thread waits, through others, for a key this thread holds",
                [(self._owner, self._key)]
                + [(f"process {wait[1]} thread {wait[2]}", wait[4]) for _, wait in cycle[1:]])

    def stop(self) -> None:
        """The wait ended: its publication goes."""
        if self._slot is not None:
            slot, self._slot = self._slot, None
            self._board.withdraw(slot)
