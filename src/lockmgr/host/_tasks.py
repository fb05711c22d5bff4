"""asyncio tasks as owners of host locks (``_HostTasks``): each task's levels, and its waits
for kernel locks in threads of their own (``_KernelWait``), so that the event loop never
blocks.

A task takes its keys in process first (the in-process engine's task operations: tasks and
threads of the process on one table), then the kernel lock of each key it did not hold yet:
a try under the loop (a try never blocks), and if a key is taken, a wait in a thread the
task awaits. Its levels per (key, mode) are its own (``_TaskLevels``): the first takes the
kernel lock, the last gives it back; a task that ends holding keys has them given back in
the kernel by its done-callback (the in-process engine releases them in process, with
AbandonedLockWarning).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, cast

from .._args import READ, WRITE
from .._errors import not_owned
from .._layered import Lease, _no_fencing, _read_has_no_fence
from .._owners import current_task_or_raise
from ._engine import _count_down
from ._fences import FENCE_PATIENCE
from ._holders import abandoned
from ._waits import Look

if TYPE_CHECKING:
    import asyncio

    from .._contract import EngineModule
    from ._engine import _HostEngine
    from ._shared import ProcessDirectory

_Item = tuple[Hashable, int]
_Want = tuple[int, int]  # (identity, mode) of a kernel lock
# Makes the Look of a wait for (identity, mode), given the kernel locks the call took so far.
_Looking = Callable[[int, int, list[_Want]], Callable[[], "Look"]]

# The task records alive, for the fork handler: a forked child runs none of its parent's tasks.
_RECORDS: weakref.WeakSet[_HostTasks] = weakref.WeakSet()


def _tasks_after_fork() -> None:
    for record in list(_RECORDS):
        record.levels = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_tasks_after_fork)


class _TaskLevels:
    """One task's levels with one manager (the kernel's included), until it ends."""

    __slots__ = ("held", "fences", "ended")

    def __init__(self) -> None:
        self.held: dict[_Item, int] = {}
        self.fences: dict[Hashable, int] = {}  # written key -> the fence it was taken under
        self.ended = False  # its done-callback gave its kernel locks back


class _HostTasks:
    """The tasks of one host manager: their levels, taking and giving back."""

    def __init__(self, manager: _HostEngine[Any]) -> None:
        self.manager = manager
        self.levels: dict[asyncio.Task[Any], _TaskLevels] = {}  # running tasks holding keys
        _RECORDS.add(self)

    # -- the current task ------------------------------------------------------------------

    def current(self) -> _TaskLevels:
        """The current task's levels, made (with its done-callback) at its first call
        (RuntimeError outside a running task)."""
        task = current_task_or_raise()
        levels = self.levels.get(task)
        if levels is None:
            levels = self.levels[task] = _TaskLevels()
            task.add_done_callback(self.task_done)
        return levels

    def entered(self) -> tuple[asyncio.Task[Any], _TaskLevels]:
        """For an ``async with`` object's record (``_layered_aio.TaskOwners``)."""
        return current_task_or_raise(), self.current()

    def lease(self, items: Sequence[_Item]) -> Lease:
        """The current task's lease on ``items``, which it has just acquired."""
        keys = tuple(key for key, _ in items)
        if not self.manager._fencing:
            return Lease(keys, None)
        fences = self.current().fences
        return Lease(keys, {key: fences[key] for key, mode in items if mode == WRITE})

    def fence(self, key: Hashable) -> int:
        """``HostLockManager.fence`` for the current task (raises what it raises)."""
        self.manager._check_key(key)
        if not self.manager._fencing:
            raise _no_fencing()
        task = current_task_or_raise()
        levels = self.levels.get(task)
        if levels is not None and levels.held.get((key, WRITE)):
            return levels.fences[key]
        if levels is not None and levels.held.get((key, READ)):
            raise _read_has_no_fence(key)
        raise not_owned(key, task)

    def task_done(self, task: asyncio.Task[Any]) -> None:
        """A task ended: its kernel locks go back (the in-process engine releases its keys
        in process, with AbandonedLockWarning)."""
        levels = self.levels.pop(task, None)
        if levels is None:
            return
        levels.ended = True
        held, levels.held, levels.fences = levels.held, {}, {}
        self.give_kernel([(self.manager.host_key(key), mode) for key, mode in held])

    def looking(self, levels: _TaskLevels, fresh: Sequence[tuple[int, _Item]]) -> _Looking:
        """What makes the ``Look`` of the task's wait in the kernel for an identity of
        ``fresh`` (as ``_HostEngine._looking``): published by the waiting thread, with the
        identities the task holds and ``taken`` (what this call took so far)."""
        waits, idents = self.manager._shared.waits, self.manager._idents
        keys = {ident: key for ident, (key, _) in fresh}

        def held(taken: list[_Want]) -> list[_Want]:
            return taken + [(idents.of(key), mode) for key, mode in levels.held]

        return lambda ident, mode, taken: lambda: Look(waits, keys[ident], ident, mode,
                                                       lambda: held(taken))

    def end_stranded(self, task: asyncio.Task[Any]) -> None:
        """A task whose event loop closed while it waited in the kernel can never run
        again: what it holds goes, in process (AbandonedLockWarning) and in the kernel, as
        its done-callback would have it."""
        engine = cast("EngineModule", sys.modules[type(self.manager._engine).__module__])
        try:  # the kernel first: a thread the engine then lets in finds the key free
            self.task_done(task)
        finally:
            engine.end_stranded_task(task)

    def give_kernel(self, taken: Sequence[_Want]) -> None:
        shared, manager = self.manager._shared, id(self.manager)
        for ident, mode in reversed(taken):
            shared.give(ident, mode, manager)

    # -- taking and giving back ------------------------------------------------------------

    async def take(self, items: Sequence[_Item], seconds: float,
                   local_acquire: Callable[[float], Awaitable[bool]],
                   local_release: Callable[[], object]) -> bool:
        """``_HostEngine._take`` for the current task: ``items`` in process, then in the
        kernel, within ``seconds`` (-1: no limit; 0: at once or not), all or none. A
        cancellation leaves nothing held, in process or the kernel; a coroutine closed
        unrun (``GeneratorExit``, outside its task) gives back its kernel part only: its
        in-process part cannot be released outside the task, and stays until the task is
        ended (a wait in the kernel that finds its loop closed ends it: ``end_stranded``)."""
        started = time.monotonic()
        idents = [self.manager._check_key(key) for key, _ in items]  # a bad key: nothing
        if not await local_acquire(seconds):
            return False
        levels = self.current()
        fresh = sorted(((ident, item) for ident, item in zip(idents, items)
                        if item not in levels.held), key=lambda pair: pair[0])
        wanted = [(ident, mode) for ident, (_, mode) in fresh]
        ended: list[tuple[int, int]] = []  # (identity, pid) of holders that died holding it
        try:
            deadline = None if seconds < 0 else started + seconds
            taken = (await self.take_kernel(wanted, deadline, ended, self.looking(levels, fresh))
                     and await self.take_fences(levels, fresh, wanted, deadline))
        except GeneratorExit:  # closed unrun, outside its task: the kernel's part went back
            raise
        except BaseException:
            local_release()
            raise
        if not taken:
            local_release()
            return False
        for item in items:
            levels.held[item] = levels.held.get(item, 0) + 1
        try:
            for ident, pid in ended:
                abandoned(next(key for key_ident, (key, _) in fresh if key_ident == ident), pid)
        except BaseException:  # the warning made an error: the call fails, holding nothing
            self.give(items, cast("Callable[[], Awaitable[None]]", local_release))
            raise
        return True

    async def take_fences(self, levels: _TaskLevels, fresh: Sequence[tuple[int, _Item]],
                          wanted: list[_Want], deadline: float | None) -> bool:
        """A fencing manager's fences for the keys just written, all or none, taken in a
        thread (each is made durable on disk first: never on the loop); False if another
        process keeps a counter locked past the deadline (``FENCE_PATIENCE`` at least, as
        a thread's call). The kernel locks of ``wanted`` go back if it fails or raises."""
        if not self.manager._fencing:
            return True
        import asyncio

        if deadline is not None:
            deadline = max(deadline, time.monotonic() + FENCE_PATIENCE)
        counters = self.manager._shared.fences
        written = [(ident, key) for ident, (key, mode) in fresh if mode == WRITE]
        fences: dict[Hashable, int] = {}
        try:
            for ident, key in written:
                fence = await asyncio.to_thread(counters.next, ident, deadline)
                if fence is None:
                    break
                fences[key] = fence
        finally:
            if len(fences) < len(written):
                self.give_kernel(wanted)
        levels.fences.update(fences)  # (one statement: all or none of them)
        return len(fences) == len(written)

    async def take_kernel(self, wanted: list[_Want], deadline: float | None,
                          ended: list[tuple[int, int]], looking: _Looking) -> bool:
        """Every kernel lock of ``wanted``, in order, by ``deadline``, or none: tries under
        the loop, and from the first taken by another process on, waits in a thread
        (``ended``: as ``ProcessDirectory.take``'s; ``looking``: each wait's ``Look``)."""
        shared, manager = self.manager._shared, id(self.manager)
        task = current_task_or_raise()
        taken: list[_Want] = []
        try:
            for index, (ident, mode) in enumerate(wanted):
                if shared.take(ident, mode, 0.0, manager, None, ended):  # a try: never blocks
                    taken.append((ident, mode))
                    continue
                if deadline is not None and deadline <= time.monotonic():
                    return False
                rest = wanted[index:]
                waiting = _KernelWait(shared, rest, deadline, manager, ended,
                                      lambda: self.end_stranded(task),
                                      lambda ident, mode, more: looking(ident, mode,
                                                                        taken + more))
                if not await waiting.outcome():
                    return False
                taken.extend(rest)
                break
        finally:
            if len(taken) < len(wanted):
                self.give_kernel(taken)
        return True

    def give(self, items: Sequence[_Item],
             local_release: Callable[[], Awaitable[None]]) -> Awaitable[None]:
        """``_HostEngine._give`` for the current task, done at the call: the last level of
        each item gives its kernel lock back, then the keys go in process; answers the
        in-process release's awaitable (done already). NotOwnedError, nothing changed, if
        the task does not hold one of ``items`` (RuntimeError outside a running task)."""
        task = current_task_or_raise()
        levels = self.levels.get(task)
        for key, mode in items:
            if levels is None or not levels.held.get((key, mode)):
                raise not_owned(key, task, mode if self.manager._rw else None)
        assert levels is not None
        try:
            last = [item for item in items if _count_down(levels.held, item) == 0]
            for key, mode in last:
                if mode == WRITE:
                    levels.fences.pop(key, None)
            self.give_kernel([(self.manager.host_key(key), mode) for key, mode in last])
        finally:
            done = local_release()
        return done

    def release_all(self, local_release_all: Callable[[], int]) -> int:
        """Every level the current task holds, in the kernel then in process; how many
        keys (the in-process count)."""
        levels = self.levels.get(current_task_or_raise())
        try:
            if levels is not None:
                held, levels.held, levels.fences = levels.held, {}, {}
                self.give_kernel([(self.manager.host_key(key), mode) for key, mode in held])
        finally:
            released = local_release_all()
        return released

    def owned(self, item: _Item) -> int:
        """The current task's levels of ``item`` (RuntimeError outside a running task)."""
        levels = self.levels.get(current_task_or_raise())
        return 0 if levels is None else levels.held.get(item, 0)


_WAITING, _TAKEN, _CLAIMED, _DONE, _ABANDONED = range(5)


class _KernelWait:
    """A task's wait for kernel locks, in a thread of its own: all of ``wanted`` in order
    by ``deadline``, or none. The task awaits ``outcome()``; if it stops awaiting
    (cancelled, an ``asyncio.timeout``, its coroutine closed), ``abandon`` stops the thread
    within one ``SLICE``, and whichever of the two comes last gives back what the thread
    took: nothing stays held. A loop closed before the answer is delivered abandons it, and
ends the task (``stranded``): it can never run again."""

    __slots__ = ("_deadline", "_ended", "_future", "_looking", "_loop", "_manager", "_shared",
                 "_state", "_stop", "_stranded", "_wanted", "_guard")

    def __init__(self, shared: ProcessDirectory, wanted: list[_Want], deadline: float | None,
                 manager: int, ended: list[tuple[int, int]],
                 stranded: Callable[[], None], looking: _Looking) -> None:
        import asyncio

        self._looking = looking  # each wait's deadlock look (DeadlockError: told to the task)
        self._ended = ended  # (read by the task once it has them)
        self._stranded = stranded  # what ends the task if its loop closed meanwhile
        self._shared = shared
        self._wanted = wanted
        self._deadline = deadline
        self._manager = manager
        self._stop = threading.Event()
        self._guard = threading.Lock()
        self._state = _WAITING
        self._loop = asyncio.get_running_loop()
        self._future: asyncio.Future[bool] = self._loop.create_future()

    async def outcome(self) -> bool:
        """Start the thread and wait for it: True once every lock is the task's, False at
        the deadline; what the kernel raised (LockError), nothing held."""
        threading.Thread(target=self._run, name="lockmgr-host-wait", daemon=True).start()
        try:
            taken = await self._future
        except BaseException:
            self.abandon()
            raise
        with self._guard:
            self._state = _CLAIMED
        return taken

    def abandon(self) -> None:
        self._stop.set()
        with self._guard:
            state, self._state = self._state, _ABANDONED
        if state == _TAKEN:  # the thread finished holding them: nobody else gives back
            self._give(self._wanted)

    def _run(self) -> None:
        taken: list[_Want] = []
        error: BaseException | None = None
        try:
            for ident, mode in self._wanted:
                if not self._shared.take(ident, mode, self._deadline, self._manager,
                                         self._looking(ident, mode, list(taken)),
                                         self._ended, self._stop):
                    break
                taken.append((ident, mode))
        except BaseException as raised:  # told to the task
            error = raised
        if len(taken) < len(self._wanted):
            self._give(taken)
            taken = []
        with self._guard:
            abandoned = self._state == _ABANDONED
            if not abandoned:
                self._state = _TAKEN if taken else _DONE
        if abandoned:  # nobody awaits them: they go back
            self._give(taken)
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, bool(taken), error)
        except RuntimeError:  # the loop is closed: the task never resumes
            self.abandon()
            self._stranded()

    def _deliver(self, taken: bool, error: BaseException | None) -> None:
        if self._future.done():  # (cancelled: the task abandons, or has)
            return
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(taken)

    def _give(self, taken: Sequence[_Want]) -> None:
        for ident, mode in reversed(taken):
            self._shared.give(ident, mode, self._manager)
