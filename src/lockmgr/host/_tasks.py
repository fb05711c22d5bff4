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
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

from .._args import READ, WRITE
from .._errors import not_owned
from .._layered import Lease, _no_fencing, _read_has_no_fence
from .._owners import current_task_or_raise
from .._quiet import block_handlers, quietly, run_blocked
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

_SWEEP_AT_FIRST = 64

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


class _Taking:
    """What one ``take`` of a task holds so far, for giving it back."""

    __slots__ = ("kernel", "counted", "in_process")

    def __init__(self) -> None:
        self.kernel: list[_Want] = []  # kernel locks taken, not yet the task's levels'
        self.counted = False  # its levels counted (the kernel locks theirs)
        self.in_process = True  # its in-process part held


class _HostTasks:
    """The tasks of one host manager: their levels, taking and giving back."""

    def __init__(self, manager: _HostEngine[Any]) -> None:
        self.manager = manager
        self.levels: dict[asyncio.Task[Any], _TaskLevels] = {}  # running tasks holding keys
        self.sweep_at = _SWEEP_AT_FIRST  # records of tasks at which ``sweep`` runs next
        _RECORDS.add(self)

    # -- the current task ------------------------------------------------------------------

    def current(self) -> _TaskLevels:
        """The current task's levels, made (with its done-callback) at its first call
        (RuntimeError outside a running task)."""
        task = current_task_or_raise()
        levels = self.levels.get(task)
        if levels is None:
            if len(self.levels) >= self.sweep_at:
                self.sweep()
            levels = self.levels[task] = _TaskLevels()
            task.add_done_callback(self.task_done)
        return levels

    def sweep(self) -> None:
        """Give back the kernel locks of tasks that ended without their done-callback
        running: a signal handler raised (Ctrl-C) as the loop was to run it, and the loop
        stopped. Run as records pile up (each time their number has doubled)."""
        for task in [task for task in self.levels if task.done()]:
            self.task_done(task)
        self.sweep_at = max(_SWEEP_AT_FIRST, 2 * len(self.levels))

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
        in process, with AbandonedLockWarning). Held off, as ``give``."""
        self.manager._quietly(self._task_done_now, task)

    def _task_done_now(self, task: asyncio.Task[Any]) -> None:
        levels = self.levels.pop(task, None)
        if levels is None:
            return
        levels.ended = True
        held, levels.held, levels.fences = levels.held, {}, {}
        self.give_kernel([(self.manager.host_key(key), mode) for key, mode in held])

    def looking(self, levels: _TaskLevels, fresh: Sequence[tuple[int, _Item]]) -> _Looking:
        """What makes the ``Look`` of the task's wait in the kernel for an identity of
        ``fresh`` (as ``_HostEngine._look``): published by the waiting thread, with the
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
        cancellation, or a signal handler raising (Ctrl-C) wherever it lands, leaves
        nothing held, in process or the kernel (each step between two awaits runs with the
        handlers held off, ``lockmgr._quiet``); a coroutine closed unrun (``GeneratorExit``,
        outside its task) gives back its kernel part only: its in-process part cannot be
        released outside the task, and stays until the task is ended (a wait in the kernel
        that finds its loop closed ends it: ``end_stranded``)."""
        started = time.monotonic()
        idents = [self.manager._check_key(key) for key, _ in items]  # a bad key: nothing
        levels = self.current()
        try:
            if not await local_acquire(seconds):
                return False
        except BaseException:  # (a handler raising as the engine granted it: given back)
            # (the handlers blocked inline first, as in _HostEngine._take)
            try:
                blocked: Iterable[int] | BaseException = block_handlers()
            except BaseException as stopped:
                blocked = stopped
            run_blocked(blocked, self._settle_in_process, items[0], levels, local_release)
            raise
        fresh = sorted(((ident, item) for ident, item in zip(idents, items)
                        if item not in levels.held), key=lambda pair: pair[0])
        wanted = [(ident, mode) for ident, (_, mode) in fresh]
        ended: list[tuple[int, int]] = []  # (identity, pid) of holders that died holding it
        taking = _Taking()
        try:
            deadline = None if seconds < 0 else started + seconds
            if (await self.take_kernel(wanted, deadline, ended, self.looking(levels, fresh),
                                       taking.kernel)
                    and await self.take_fences(levels, fresh, deadline)):
                self.manager._quietly(self._count_in, levels, items, taking)
            if not taking.counted:
                self.manager._quietly(self._untake, taking, levels, items, local_release)
                return False
            for ident, pid in ended:  # (a warning made an error fails the call, as below)
                abandoned(next(key for key_ident, (key, _) in fresh if key_ident == ident), pid)
        except GeneratorExit:  # closed unrun, outside its task: the kernel's part goes back
            self.manager._quietly(self._untake, taking, levels, items, None)
            raise
        except BaseException:  # interrupted, failed: nothing stays
            try:  # (as above)
                blocked = block_handlers()
            except BaseException as stopped:
                blocked = stopped
            run_blocked(blocked, self._untake, taking, levels, items, local_release)
            raise
        return True

    def _settle_in_process(self, item: _Item, levels: _TaskLevels,
                           local_release: Callable[[], object]) -> None:
        """The in-process engine granted ``item`` to the current task beyond its levels
        (an interrupt landed as it did): given back."""
        write, read = self.manager._engine._task_levels(item[0])
        if (write if item[1] == WRITE else read) > levels.held.get(item, 0):
            local_release()

    @staticmethod
    def _count_in(levels: _TaskLevels, items: Sequence[_Item], taking: _Taking) -> None:
        """The call took everything: its levels counted, its kernel locks now theirs."""
        for item in items:
            levels.held[item] = levels.held.get(item, 0) + 1
        taking.kernel, taking.counted = [], True

    def _untake(self, taking: _Taking, levels: _TaskLevels, items: Sequence[_Item],
                local_release: Callable[[], object] | None) -> None:
        """Give back what a ``take`` of the current task got: its levels if counted, its
        kernel locks, then in process (unless ``local_release`` is None); once."""
        if taking.counted:
            taking.counted = False
            for key, mode in [item for item in items if _count_down(levels.held, item) == 0]:
                if mode == WRITE:
                    levels.fences.pop(key, None)
                taking.kernel.append((self.manager.host_key(key), mode))
        kernel, taking.kernel = taking.kernel, []
        self.give_kernel(kernel)
        if local_release is not None and taking.in_process:
            taking.in_process = False
            local_release()

    async def take_fences(self, levels: _TaskLevels, fresh: Sequence[tuple[int, _Item]],
                          deadline: float | None) -> bool:
        """A fencing manager's fences for the keys just written, all or none, taken in a
        thread (each is made durable on disk first: never on the loop); False if another
        process keeps a counter locked past the deadline (``FENCE_PATIENCE`` at least, as
        a thread's call)."""
        if not self.manager._fencing:
            return True
        import asyncio

        if deadline is not None:
            deadline = max(deadline, time.monotonic() + FENCE_PATIENCE)
        counters = self.manager._shared.fences
        written = [(ident, key) for ident, (key, mode) in fresh if mode == WRITE]
        fences: dict[Hashable, int] = {}
        for ident, key in written:
            fence = await asyncio.to_thread(counters.next, ident, deadline)
            if fence is None:
                return False
            fences[key] = fence
        levels.fences.update(fences)  # (one statement: all or none of them)
        return True

    async def take_kernel(self, wanted: list[_Want], deadline: float | None,
                          ended: list[tuple[int, int]], looking: _Looking,
                          taken: list[_Want]) -> bool:
        """Every kernel lock of ``wanted``, in order, by ``deadline``: tries under the
        loop, and from the first taken by another process on, waits in a thread
        (``ended``: as ``ProcessDirectory.take``'s; ``looking``: each wait's ``Look``).
        Each lock goes into ``taken`` as it is taken, in one step with it (held off): the
        caller gives them back if this returns False or raises."""
        shared, manager = self.manager._shared, id(self.manager)
        task = current_task_or_raise()
        for index, (ident, mode) in enumerate(wanted):
            if self.manager._quietly(self._try_kernel, ident, mode, ended, taken):
                continue
            if deadline is not None and deadline <= time.monotonic():
                return False
            rest = wanted[index:]
            waiting = _KernelWait(shared, rest, deadline, manager, ended,
                                  lambda: self.end_stranded(task),
                                  lambda ident, mode, more: looking(ident, mode,
                                                                    taken + more))
            return await waiting.outcome(taken)
        return True

    def _try_kernel(self, ident: int, mode: int, ended: list[tuple[int, int]],
                    taken: list[_Want]) -> bool:
        """A try for the kernel lock of (``ident``, ``mode``), into ``taken`` if taken."""
        if not self.manager._shared.take(ident, mode, 0.0, id(self.manager), None, ended):
            return False  # (a try never blocks)
        taken.append((ident, mode))
        return True

    def give(self, items: Sequence[_Item],
             local_release: Callable[[], Awaitable[None]]) -> Awaitable[None]:
        """``_HostEngine._give`` for the current task, done at the call: the last level of
        each item gives its kernel lock back, then the keys go in process; answers the
        in-process release's awaitable (done already). NotOwnedError, nothing changed, if
        the task does not hold one of ``items`` (RuntimeError outside a running task).
        With the signal handlers held off (``lockmgr._quiet``): done, or not begun."""
        return self.manager._quietly(self._give_now, items, local_release)

    def _give_now(self, items: Sequence[_Item],
                  local_release: Callable[[], Awaitable[None]]) -> Awaitable[None]:
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
        keys (the in-process count). Held off, as ``give``."""
        return self.manager._quietly(self._release_all_now, local_release_all)

    def _release_all_now(self, local_release_all: Callable[[], int]) -> int:
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

    async def outcome(self, into: list[_Want]) -> bool:
        """Start the thread and wait for it: True once every lock is the task's (put in
        ``into`` in one step with claiming them), False at the deadline; what the kernel
        raised (LockError), nothing held."""
        threading.Thread(target=self._run, name="lockmgr-host-wait", daemon=True).start()
        try:
            if not await self._future:
                return False
            quietly(self._claim, into)
            return True
        except BaseException:
            try:  # (as _HostTasks.take's)
                blocked: Iterable[int] | BaseException = block_handlers()
            except BaseException as stopped:
                blocked = stopped
            run_blocked(blocked, self.abandon)
            raise

    def _claim(self, into: list[_Want]) -> None:
        with self._guard:
            self._state = _CLAIMED
        into.extend(self._wanted)

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
