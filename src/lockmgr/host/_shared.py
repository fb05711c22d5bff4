"""What the managers of one directory share in a process: the directory's descriptors, its
kernel locks, and which identities the process holds in the kernel, for which manager.

Two managers of one directory in one process hold the kernel's locks through the same
descriptors, so the kernel cannot tell them apart: this table does. An identity held for
write through one manager keeps every other manager of the process out until it is given
back; read holds of several managers share the kernel's read lock. Within one manager its
in-process engine has already ordered the owners; the table then only counts (two keys of
one manager meet here only if their identities collide, and then they share the kernel
lock, never let another process in).

Lock order: a manager's in-process engine first, then ``ProcessDirectory._guard``; nothing
blocks while holding the guard (kernel waits run outside it, the identity marked ``busy``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from .._args import READ, WRITE
from .._quiet import held_off, let_pending_in
from ._directory import LockDirectory, open_lock_directory
from ._fences import Fences
from ._holders import Holders
from ._kernel import SLICE, KernelLocks
from ._waits import Look, WaitBoard


class _Ident:
    """One identity the process holds or is taking in the kernel (under the guard)."""

    __slots__ = ("readers", "writers", "busy")

    def __init__(self) -> None:
        self.readers: dict[int, int] = {}  # manager id -> read levels it holds in the kernel
        self.writers: dict[int, int] = {}  # manager id -> write levels
        self.busy = False  # a thread is changing the kernel lock, outside the guard

    def others(self, manager: int, mode: int) -> bool:
        """Whether another manager's holds keep ``manager`` from ``mode``."""
        if any(who != manager for who in self.writers):
            return True
        return mode == WRITE and any(who != manager for who in self.readers)

    def covered(self, mode: int) -> bool:
        """Whether the kernel lock held already gives ``mode``."""
        return bool(self.writers) or (mode == READ and bool(self.readers))

    def empty(self) -> bool:
        return not self.readers and not self.writers and not self.busy


class ProcessDirectory:
    """One directory as this process uses it (``process_directory``)."""

    def __init__(self, directory: LockDirectory, mechanism: str,
                 shared_with_group: bool) -> None:
        self.directory = directory
        self.shared_with_group = shared_with_group
        self.kernel = KernelLocks(directory, mechanism)
        self.waits = WaitBoard(directory, self.kernel.lock_byte, self.kernel.others_lock)
        self.fences = Fences(directory, mechanism == "ofd")
        self.holders = Holders(directory)
        # Each thread's levels with each manager of the directory (``_engine._Levels``), for
        # the identities it holds when it publishes a wait; written by that thread only.
        self.thread_levels = threading.local()
        self.mechanism = mechanism
        self.users = 0  # managers using it (under _DIRECTORIES_GUARD)
        self._guard = threading.Lock()
        self._changed = threading.Condition(self._guard)  # an identity's holds or busy changed
        self._waiting = 0  # threads waiting on _changed (guard)
        self._idents: dict[int, _Ident] = {}  # identities held or being taken (guard)

    def take(self, ident: int, mode: int, deadline: float | None, manager: int,
             looking: Callable[[], Look] | None = None,
             ended: list[tuple[int, int]] | None = None,
             stop: threading.Event | None = None) -> bool:
        """Hold ``ident`` in ``mode`` in the kernel for ``manager`` by ``deadline``
        (monotonic; None: no limit; 0: at once or not); False if not in time. A wait in
        the kernel looks for cycles with the ``Look`` that ``looking`` makes. A write whose
        last writer ended holding it adds (ident, its pid) to ``ended`` (``_holders``).
        A wait ends, False, within one ``SLICE`` of ``stop`` being set (a task's wait in a
        thread, cancelled)."""
        with self._guard:
            if ident not in self._idents:
                # Nobody of this process holds or takes it: one try under the guard (a try
                # never blocks), the whole of an uncontended call.
                waits_after = deadline is None or deadline > time.monotonic()
                if self.kernel.try_take(ident, mode == READ, waits_after):
                    first = self._idents[ident] = _Ident()
                    (first.writers if mode == WRITE else first.readers)[manager] = 1
                    if mode == WRITE:
                        self._record(ident, ended)
                    return True
                if deadline is not None and deadline <= time.monotonic():
                    return False
            while True:
                state = self._idents.setdefault(ident, _Ident())
                if not state.busy and not state.others(manager, mode):
                    if state.covered(mode):
                        _count(state, mode, manager, 1)
                        return True
                    state.busy = True
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if stop is not None and stop.is_set():
                    left = 0
                if left is not None and left <= 0:
                    self._forget_if_empty(ident, state)
                    return False
                try:  # (a stopped wait is woken by no one: it looks every slice)
                    self._wait(SLICE if stop is not None and (left is None or left > SLICE)
                               else left)
                except BaseException:  # Ctrl-C (handlers are let in between slices)
                    self._forget_if_empty(ident, state)
                    raise
        taken: bool | None = None
        look = None
        try:
            if deadline is not None and deadline <= time.monotonic():
                taken = self.kernel.try_take(ident, mode == READ)
            else:
                look = None if looking is None else looking()
                taken = self.kernel.take(ident, mode == READ, deadline, look, stop)
        finally:
            try:
                with self._guard:
                    state.busy = False
                    if taken:
                        _count(state, mode, manager, 1)
                        if mode == WRITE:
                            self._record(ident, ended)
                    elif taken is None:  # interrupted: the byte may be held, or written
                        self._settle_kernel(ident, state)
                    self._forget_if_empty(ident, state)
                    self._notify()
            finally:
                if look is not None:
                    look.stop()
        return taken

    def give(self, ident: int, mode: int, manager: int) -> None:
        """Give back one ``take``: the kernel lock changes when the process's last hold of
        that mode goes (unlocked, or written down to read)."""
        with self._guard:
            state = self._idents[ident]
            while state.busy:  # (only a colliding identity's take can be under way)
                self._wait(None, interruptible=False)  # (the caller has counted it down)
            _count(state, mode, manager, -1)
            if mode == WRITE and not state.writers:
                self.holders.clear(ident)  # (first: a record outliving the lock warns)
            # (not busy: the loop above waited that out, and nobody sets it under the guard
            # held since; inline, as _forget_if_empty and _notify: the common path's calls)
            if not state.readers and not state.writers:
                self.kernel.give(ident)
                if self._idents.get(ident) is state:
                    del self._idents[ident]
            elif mode == WRITE and not state.writers:
                self.kernel.to_shared(ident)
            if self._waiting:
                self._changed.notify_all()

    def _wait(self, seconds: float | None, interruptible: bool = True) -> None:
        """Wait (the guard held) until an identity changes, ``seconds`` at most (None: no
        limit). In a quiet call (``lockmgr._quiet``) on the main thread, a ``SLICE`` at
        most, then the handlers of signals that arrived are let in, if ``interruptible``:
        what they raise propagates from here. They run with the guard let go (and taken
        again after): a handler may call a manager of this directory itself, which takes
        the guard; the caller reads the identities again."""
        interrupts = interruptible and held_off()
        if interrupts and (seconds is None or seconds > SLICE):
            seconds = SLICE
        self._waiting += 1
        try:
            self._changed.wait(seconds)
        finally:
            self._waiting -= 1
        if interrupts:
            self._guard.release()
            try:
                let_pending_in()
            finally:
                self._guard.acquire()  # (held off again: no handler can stop it)

    def _notify(self) -> None:
        if self._waiting:  # (the guard held)
            self._changed.notify_all()

    def _record(self, ident: int, ended: list[tuple[int, int]] | None) -> None:
        pid = self.holders.record(ident)
        if pid is not None and ended is not None:
            ended.append((ident, pid))

    def _settle_kernel(self, ident: int, state: _Ident) -> None:
        """Put the kernel lock back to what ``state`` records (under the guard)."""
        if not state.readers and not state.writers:
            self.kernel.give(ident)
        elif not state.writers:
            self.kernel.to_shared(ident)

    def holding(self) -> bool:
        """Whether the process holds, or is taking, any identity of the directory."""
        with self._guard:
            return bool(self._idents)

    def locked(self, ident: int) -> bool:
        """Whether any process holds ``ident`` (this one through any manager)."""
        with self._guard:
            state = self._idents.get(ident)
            if state is not None and (state.readers or state.writers):
                return True
        return self.kernel.held_elsewhere(ident, writes_only=False)

    def write_locked(self, ident: int) -> bool:
        """Whether any process holds ``ident`` for write."""
        with self._guard:
            state = self._idents.get(ident)
            if state is not None and state.writers:
                return True
        return self.kernel.held_elsewhere(ident, writes_only=True)

    def forget_all_after_fork(self) -> None:
        """In a forked child: it holds nothing (the kernel gave it none of its parent's
        locks); fresh descriptors of its own, and an empty table."""
        self.directory.reopen_after_fork()
        self._guard = threading.Lock()
        self._changed = threading.Condition(self._guard)
        self._waiting = 0
        self.waits.forget_after_fork()
        self.fences.after_fork()
        self.holders.after_fork()
        self._idents = {}

    def _forget_if_empty(self, ident: int, state: _Ident) -> None:
        if state.empty() and self._idents.get(ident) is state:
            del self._idents[ident]


def _count(state: _Ident, mode: int, manager: int, change: int) -> None:
    counts = state.writers if mode == WRITE else state.readers
    level = counts.get(manager, 0) + change
    if level:
        counts[manager] = level
    else:
        del counts[manager]


# The directories this process uses, by (device, inode): one set of descriptors per directory,
# whatever the number of managers (POSIX locks: closing any descriptor of a file would drop
# every lock of the process on it), and so one mechanism and one sharing rule.
_DIRECTORIES: dict[tuple[int, int], ProcessDirectory] = {}
_DIRECTORIES_GUARD = threading.Lock()


def process_directory(path: str | os.PathLike[str], mechanism: str,
                      shared_with_group: bool) -> ProcessDirectory:
    """The process's ``ProcessDirectory`` for ``path``, opened (and checked) if new. One
    already open is found before anything is opened: opening and closing the shard files
    again would drop the process's POSIX locks on them."""
    with _DIRECTORIES_GUARD:
        try:
            status = os.stat(path)
        except FileNotFoundError:
            existing = None  # (made by open_lock_directory below)
        else:
            existing = _DIRECTORIES.get((status.st_dev, status.st_ino))
        if existing is not None and (existing.mechanism, existing.shared_with_group) != (
                mechanism, shared_with_group):
            raise ValueError(
                f"{os.fspath(path)!r} is in use in this process with mechanism="
                f"{existing.mechanism!r}, shared_with_group={existing.shared_with_group}:"
                " every manager of a directory in one process uses the same")
        if existing is None:
            opened = open_lock_directory(path, shared_with_group=shared_with_group)
            try:
                status = os.stat(opened.path)
                existing = ProcessDirectory(opened, mechanism, shared_with_group)
            except BaseException:
                opened.close()
                raise
            _DIRECTORIES[status.st_dev, status.st_ino] = existing
        existing.users += 1
        return existing


def let_go(shared: ProcessDirectory) -> None:
    """A manager is done with ``shared``: the last closes the directory, unless the process
    still holds keys of it (closing a shard's descriptor would drop their kernel locks):
    then it stays open for the process's life, and a later manager of it uses it."""
    with _DIRECTORIES_GUARD:
        shared.users -= 1
        if shared.users or shared.holding():
            return
        for place, known in list(_DIRECTORIES.items()):
            if known is shared:
                del _DIRECTORIES[place]
    shared.kernel.close()
    shared.directory.close()


def _after_fork_in_child() -> None:
    global _DIRECTORIES_GUARD
    _DIRECTORIES_GUARD = threading.Lock()  # another thread of the parent may have held it
    for shared in _DIRECTORIES.values():
        shared.forget_all_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

