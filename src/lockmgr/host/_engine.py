"""``_HostEngine``: what both host managers share, the two layers of a host lock.

A call takes its keys in process first (the manager's own in-process engine orders the
threads of this process: reentrancy, FIFO, deadlock detection), then, for each key the
calling thread did not hold yet, in the kernel (``ProcessDirectory.take``), in the order of
their identities: two ``acquire_many`` of overlapping sets from any processes never wait
for each other in a cycle. A call that cannot take every kernel lock by its deadline gives
back what it took, in the kernel and in process, and returns False.

Each thread's levels per (key, mode) are its own (``_Levels``, in thread-local storage):
the first level takes the kernel lock, the last gives it back. A thread that ends holding
keys has them given back in the kernel when its storage goes (the in-process engine
releases them in process, with ``AbandonedLockWarning``). In a forked child the keys the
forking thread held are its parent's: lost to the child (``LockLost`` at their release, as
``lockmgr.postgres`` does), and never given back in the kernel by the child.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload


from .._args import READ, WRITE
from .._errors import LockLost, not_owned
from .._keyhash import KeyIdents
from .._layered import Lease, _no_fencing, _read_has_no_fence
from .._observe import KeyState, LockMetrics
from .._quiet import block_handlers, quietly_for, run_blocked
from .._views import LockStats
from ._kernel import default_mechanism
from ._fences import FENCE_PATIENCE
from ._holders import abandoned
from ._inspect import HostKeyState, host_states
from ._shared import let_go, process_directory
from ._waits import Look

if TYPE_CHECKING:
    from .._contract import Engine

K = TypeVar("K", bound=Hashable)
_Manager = TypeVar("_Manager", bound="_HostEngine[Any]")
_Item = tuple[Hashable, int]

# The managers alive, for the fork handler (a weak set: a manager's life is its user's).
_MANAGERS: weakref.WeakSet[_HostEngine[Any]] = weakref.WeakSet()


def _managers_after_fork() -> None:
    for manager in list(_MANAGERS):
        manager._forget_parent_levels()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_managers_after_fork)


class _Levels:
    """One thread's levels with one manager, in its thread-local storage."""

    __slots__ = ("manager", "idents", "pid", "held", "lost", "fences", "__weakref__")

    def __init__(self, manager: _HostEngine[Any]) -> None:
        self.manager = weakref.ref(manager)
        self.idents = manager._idents  # (the thread's looks name what it holds)
        self.pid = os.getpid()
        self.held: dict[_Item, int] = {}  # (key, mode) -> levels held, the kernel's included
        self.lost: dict[_Item, int] = {}  # levels the forking thread held: the parent's
        self.fences: dict[Hashable, int] = {}  # written key -> the fence it was taken under

    def __del__(self) -> None:
        manager = self.manager()
        if manager is not None and self.held and self.pid == os.getpid():
            manager._thread_ended(self.held)


class _HostEngine(Generic[K]):
    """What ``HostLockManager`` and ``HostRWLockManager`` share."""

    _engine: Engine  # the in-process manager (lockmgr._contract)

    def __init__(self, directory: str | os.PathLike[str], engine: Engine, *,
                 namespace: str, mechanism: str | None, shared_with_group: bool,
                 fencing: bool) -> None:
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
        if not isinstance(shared_with_group, bool):
            raise TypeError("shared_with_group must be a bool")
        if not isinstance(fencing, bool):
            raise TypeError("fencing must be a bool")
        if mechanism is not None and not isinstance(mechanism, str):
            raise TypeError(f"mechanism must be a str or None, not {type(mechanism).__name__}")
        self._shared = process_directory(
            directory, default_mechanism() if mechanism is None else mechanism,
            shared_with_group)
        self._engine = engine
        # (the compiled core's managers hold the handlers off on C masks: ``lockmgr._quiet``)
        self._quietly = quietly_for(engine)
        self._namespace = namespace
        self._fencing = fencing
        self._idents = KeyIdents(namespace)
        self._local = threading.local()
        self._closed = False
        _MANAGERS.add(self)

    def __repr__(self) -> str:
        return (f"<lockmgr.host.{type(self).__name__} {self._shared.directory.path!r}"
                f" namespace={self._namespace!r} at {id(self):#x}>")

    @property
    def directory(self) -> str:
        """The lock directory, as opened (absolute)."""
        return self._shared.directory.path

    @property
    def mechanism(self) -> str:
        """The kernel's record locks in use: ``"ofd"`` or ``"posix"``."""
        return self._shared.mechanism

    def close(self) -> None:
        """Let go of the directory (the last manager of it in this process closes its
        files, once the process holds none of its keys). Keys still held stay held until
        released (through this manager) or until the process ends; a manager is closed
        once. Raises nothing."""
        if not self._closed:
            self._closed = True
            let_go(self._shared)

    def __enter__(self: _Manager) -> _Manager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_key(self, key: Hashable) -> int:
        """``key``'s identity; TypeError for a key other processes could not name alike
        (keys are str, bytes, int and tuples of them)."""
        return self._idents.of(key)

    def host_key(self, key: Hashable) -> int:
        """The signed 64-bit identity ``key`` locks in this manager's namespace (the same
        as ``lockmgr.postgres.advisory_key(key, namespace)``). Raises TypeError for a key
        that is not str, bytes, int or a tuple of them."""
        return self._idents.of(key)

    # -- what the in-process engine answers ---------------------------------------------------

    def stats(self) -> LockStats:
        """The in-process engine's counters (this process's threads). Raises nothing."""
        stats: LockStats = self._engine.stats()
        return stats

    def metrics(self) -> LockMetrics:
        """The in-process engine's metrics (waits between this process's threads). Raises
        nothing."""
        metrics: LockMetrics = self._engine.metrics()
        return metrics

    @property
    def log_waits_after(self) -> float | None:
        """Seconds after which a thread waiting for another thread of this process logs a
        WARNING (None: never)."""
        after: float | None = self._engine.log_waits_after
        return after

    @overload
    def snapshot(self, host: Literal[False] = False) -> list[KeyState]: ...

    @overload
    def snapshot(self, host: Literal[True],
                 keys: Iterable[Hashable] = ()) -> list[HostKeyState]: ...

    def snapshot(self, host: bool = False,
                 keys: Iterable[Hashable] = ()) -> list[KeyState] | list[HostKeyState]:
        """The keys held or waited on by this process's threads, as
        ``LockManager.snapshot``: the in-process engine's view. Raises nothing.

        ``host=True``: the host's instead, across its processes: every identity of the
        directory recorded written (its writer's pid) or waited for (the waiting pids), in
        identity order, named when this process knows the key (its threads' keys, recent
        str keys, and ``keys``). Raises TypeError for a key in ``keys`` that is not str,
        bytes, int or a tuple of them."""
        states: list[KeyState] = self._engine.snapshot()
        if not host:
            return states
        return host_states(self._shared, self._idents,
                           [*(state.key for state in states), *keys])

    def __len__(self) -> int:
        """Keys held by this process's threads through this manager."""
        return len(self._engine)

    def _lease(self, items: Sequence[_Item]) -> Lease:
        """The calling thread's lease on ``items``, which it has just acquired."""
        keys = tuple(key for key, _ in items)
        if not self._fencing:
            return Lease(keys, None)
        fences = self._levels().fences
        return Lease(keys, {key: fences[key] for key, mode in items if mode == WRITE})

    def fence(self, key: Hashable) -> int:
        """The fence under which the calling thread holds ``key`` for writing: the one its
        first acquisition took, kept by reentrant ones (``lease.fence`` of ``hold``).

        Raises LockError without ``fencing=True`` or for a key only read, NotOwnedError if
        the thread does not hold it, TypeError for a key that is not str, bytes, int or a
        tuple of them."""
        self._check_key(key)
        if not self._fencing:
            raise _no_fencing()
        levels = self._levels()
        if levels.held.get((key, WRITE)):
            return levels.fences[key]
        if levels.held.get((key, READ)):
            raise _read_has_no_fence(key)
        raise not_owned(key)

    # -- the two layers -----------------------------------------------------------------------

    def _levels(self) -> _Levels:
        levels: _Levels | None = getattr(self._local, "levels", None)
        if levels is None:
            levels = _Levels(self)
            # (references without callbacks: nothing but this thread touches its list)
            mine: list[weakref.ref[_Levels]] = self._shared.thread_levels.__dict__.setdefault(
                "all", [])
            mine[:] = [ref for ref in mine if ref() is not None] + [weakref.ref(levels)]
            # Kept only once listed: a signal handler raising between the two statements
            # leaves a listed reference to levels gone with this frame (skipped), never
            # levels the deadlock look cannot see (a cycle through them would be missed).
            self._local.levels = levels
        return levels

    def _take_fences(self, levels: _Levels, fresh: list[tuple[int, _Item]],
                     deadline: float | None) -> bool:
        """The fences of the written keys of ``fresh``, all or none; False if another
        process keeps a counter locked past the call's deadline (a try and a short timeout
        get ``FENCE_PATIENCE`` for it all the same)."""
        if deadline is not None:
            deadline = max(deadline, time.monotonic() + FENCE_PATIENCE)
        fences = {}
        for ident, (key, mode) in fresh:
            if mode == WRITE:
                fence = self._shared.fences.next(ident, deadline)
                if fence is None:
                    return False
                fences[key] = fence
        levels.fences.update(fences)  # (one statement: all or none of them)
        return True

    def _look(self, key: Hashable, ident: int, mode: int,
              taken: list[tuple[int, int]]) -> Look:
        """The ``Look`` of a wait in the kernel for ``key`` (made once it waits)."""
        return Look(self._shared.waits, key, ident, mode, lambda: self._held_idents(taken))

    def _held_idents(self, taking: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The identities the calling thread holds through every manager of the directory,
        with their modes, and ``taking`` (those this call took so far)."""
        held = list(taking)
        for ref in self._shared.thread_levels.__dict__.get("all", ()):
            levels = ref()
            if levels is not None:
                held += [(levels.idents.of(key), mode) for key, mode in levels.held]
        return held

    def _take(self, items: Sequence[_Item], seconds: float,
              local_acquire: Callable[[float], bool],
              local_release: Callable[[], None]) -> bool:
        """Take ``items`` ((key, mode) pairs) in process, then in the kernel, within
        ``seconds`` (-1: no limit; 0: at once or not): all of them, or none. With the
        signal handlers held off but in its waits (``lockmgr._quiet``): a handler that
        raises (Ctrl-C) leaves nothing taken, wherever it lands."""
        started = time.monotonic()
        # (a bad key changes nothing; one key: without a comprehension's call)
        idents = ([self._idents.of(items[0][0])] if len(items) == 1
                  else [self._idents.of(key) for key, _ in items])
        levels = self._levels()
        if levels.lost:
            for key, mode in items:
                if levels.lost.get((key, mode)):
                    raise LockLost(f"key {key!r} is held by the parent process this one was"
                                   " forked from: release it first")

        def untake(taken: bool) -> None:  # a handler raised as the call ended: undone
            if taken:
                self._give_now(items, local_release)

        try:
            if not local_acquire(seconds):
                return False
            return self._quietly(self._take_kernel, items, idents, levels, seconds, started,
                           local_release, undo=untake)
        except BaseException:
            # A handler raising as the in-process engine granted, or before the kernel part
            # began: that grant goes back, with the handlers blocked inline first (a C call:
            # a Python call's start is a check point where another would skip it).
            try:
                blocked: Iterable[int] | BaseException = block_handlers()
            except BaseException as stopped:  # (pending: blocked now too)
                blocked = stopped
            run_blocked(blocked, self._settle_in_process, items[0], levels, local_release)
            raise

    def _take_kernel(self, items: Sequence[_Item], idents: list[int], levels: _Levels,
                     seconds: float, started: float,
                     local_release: Callable[[], None]) -> bool:
        """``_take``'s kernel part, its handlers held off but in its waits; the in-process
        part is taken."""
        held = levels.held
        if len(items) == 1:  # (the common call, without the sort)
            fresh = [] if items[0] in held else [(idents[0], items[0])]
        else:
            fresh = sorted(((ident, item) for ident, item in zip(idents, items)
                            if item not in held), key=lambda pair: pair[0])
        deadline = None if seconds < 0 else started + seconds
        taken: list[tuple[int, int]] = []
        ended: list[tuple[int, int]] = []
        done = False
        try:
            for ident, (key, mode) in fresh:
                if not self._shared.take(ident, mode, deadline, id(self),
                                         partial(self._look, key, ident, mode, taken), ended):
                    break
                taken.append((ident, mode))
            fenced = True
            if self._fencing and len(taken) == len(fresh):
                fenced = self._take_fences(levels, fresh, deadline)
            done = fenced and len(taken) == len(fresh)
        finally:
            if not done:  # not in time, failed or interrupted: nothing stays
                try:
                    for ident, mode in reversed(taken):
                        self._shared.give(ident, mode, id(self))
                finally:
                    local_release()
        if not done:
            return False
        for item in items:
            held[item] = held.get(item, 0) + 1
        try:
            for ident, pid in ended:
                # (at the acquiring call's caller: past _take_kernel, quietly and _take)
                abandoned(next(key for key_ident, (key, _) in fresh if key_ident == ident), pid,
                          stacklevel=6)
        except BaseException:  # the warning made an error: the call fails, holding nothing
            self._give_now(items, local_release)
            raise
        return True

    def _settle_in_process(self, item: _Item, levels: _Levels,
                           local_release: Callable[[], None]) -> None:
        """After an interrupted take of ``item`` (its first): if the in-process engine
        granted it beyond the thread's levels, that grant goes back."""
        if self._levels_in_process(*item) > levels.held.get(item, 0):
            local_release()

    def _levels_in_process(self, key: Hashable, mode: int) -> int:
        """The calling thread's levels of ``key`` in ``mode`` in the in-process engine (read
        from its snapshot: after an interrupt only)."""
        me, name = threading.get_ident(), "write" if mode == WRITE else "read"
        return sum(holder.count for state in self._engine.snapshot() if state.key == key
                   for holder in state.holders
                   if holder.owner == me and holder.kind == "thread" and holder.mode == name)

    def _give(self, items: Sequence[_Item], local_release: Callable[[], None]) -> None:
        """Undo one ``_take`` of ``items``: the last level of each gives its kernel lock
        back. NotOwnedError, with nothing changed, if the thread holds one of them not.
        With the signal handlers held off (``lockmgr._quiet``): it is done, or not begun."""
        self._quietly(self._give_now, items, local_release)

    def _give_now(self, items: Sequence[_Item], local_release: Callable[[], None]) -> None:
        """``_give``'s work, its handlers held off."""
        levels = self._levels()
        if len(items) == 1 and not levels.lost:  # (the common call)
            self._give_one(levels, items[0], local_release)
            return
        for key, mode in items:
            if not levels.held.get((key, mode)) and not levels.lost.get((key, mode)):
                raise not_owned(key, None, mode if self._rw else None)
        lost = [key for key, mode in items if levels.lost.get((key, mode))]
        try:
            for key, mode in items:
                if levels.lost.get((key, mode)):
                    _count_down(levels.lost, (key, mode))
                elif _count_down(levels.held, (key, mode)) == 0:
                    if mode == WRITE:
                        levels.fences.pop(key, None)
                    self._shared.give(self._idents.of(key), mode, id(self))
        finally:
            local_release()
        if lost:
            raise LockLost(f"the lock on {', '.join(map(repr, lost))} was the parent"
                           " process's: released in this process only")

    def _give_one(self, levels: _Levels, item: _Item,
                  local_release: Callable[[], None]) -> None:
        """``_give`` of one item the thread holds (no level of it lost)."""
        count = levels.held.get(item)
        if not count:
            raise not_owned(item[0], None, item[1] if self._rw else None)
        try:
            if count > 1:
                levels.held[item] = count - 1
            else:
                del levels.held[item]
                if item[1] == WRITE:
                    levels.fences.pop(item[0], None)
                self._shared.give(self._idents.of(item[0]), item[1], id(self))
        finally:
            local_release()

    _rw = False  # whether NotOwnedError names the mode (the RW manager's)

    def release_all(self) -> int:
        """Release every key the calling thread holds through this manager, all levels;
        returns how many keys. Raises nothing (but what a signal handler raises after)."""
        return self._quietly(self._release_all_now)

    def _release_all_now(self) -> int:
        levels = self._levels()
        released = self._engine.release_all()
        held, levels.held, levels.lost, levels.fences = levels.held, {}, {}, {}
        for (key, mode), _count in held.items():
            self._shared.give(self._idents.of(key), mode, id(self))
        return released

    def _thread_ended(self, held: dict[_Item, int]) -> None:
        self._quietly(self._give_kernel, list(held))

    def _give_kernel(self, items: list[_Item]) -> None:
        for key, mode in items:
            self._shared.give(self._idents.of(key), mode, id(self))

    def _forget_parent_levels(self) -> None:
        """In a forked child: the forking thread's keys are the parent's (lost here), and
        no other thread of the parent's exists."""
        levels: _Levels | None = getattr(self._local, "levels", None)
        if levels is not None:
            for item, count in levels.held.items():
                levels.lost[item] = levels.lost.get(item, 0) + count
            levels.held, levels.fences = {}, {}
            levels.pid = os.getpid()


def _count_down(counts: dict[_Item, int], item: _Item) -> int:
    left = counts[item] - 1
    if left:
        counts[item] = left
    else:
        del counts[item]
    return left
