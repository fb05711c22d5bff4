"""The ``aio`` views of the backends across processes (``lockmgr.postgres``, ``lockmgr.host``),
written once: a task is an owner as a thread is, ordered in process by the manager's
in-process engine (its ``aio`` view) and across processes by the backend.

A backend gives its views a manager (whose ``_check_key`` refuses a key it cannot lock) and
its tasks' record (``TaskHolding``): ``take(items, seconds, local_acquire, local_release)``
takes ``items`` for the current task, in process through ``local_acquire`` and then its
own way, all or none, leaving nothing held if interrupted; ``give(items, local_release)``
gives one level of each back at the call and answers an awaitable of the backend's part;
``entered()`` and ``lease(items)`` serve the ``async with`` objects. The backend's own
module says what its parts raise and how its releases complete.

The rule for an ``async with`` object (``aio[key]``, ``hold()``, ``read()``, ``write()``,
``hold_many()``) is lockmgr._aio's: it records which task entered it, once that task holds
the keys, and its exit gives back exactly that task's hold (nothing if that task has ended:
its end released it); run by another task, NotOwnedError, and the keys stay held until
their task releases them or ends.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar

from ._args import READ, WRITE, hold_seconds, many_items, rw_items, wait_seconds
from ._errors import block_in_use, not_entered, not_owned_block, timed_out
from ._owners import current_task_or_none
from ._views import checked_key_func, function_to_wrap

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from ._aio import AsyncLockManager, AsyncRWLockManager
    from ._layered import Lease

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)
P = ParamSpec("P")  # a synchronized coroutine function's parameters
T = TypeVar("T")  # and its result

_Items = Sequence[tuple[Hashable, int]]


class TaskOwners(Protocol):
    """A backend's record of its tasks: ``entered()`` names the current task (which has just
    acquired) and its state, whose ``ended`` turns true once the task has ended and its
    holds went with it; ``lease(items)`` is its lease on what it has just acquired."""

    def entered(self) -> tuple[Any, Ending]: ...
    def lease(self, items: _Items) -> Lease: ...


class TaskHolding(TaskOwners, Protocol):
    """A backend's tasks, as its ``aio`` views use them (see the module)."""

    async def take(self, items: _Items, seconds: float,
                   local_acquire: Callable[[float], Awaitable[bool]],
                   local_release: Callable[[], object]) -> bool: ...
    def give(self, items: _Items,
             local_release: Callable[[], Awaitable[None]]) -> Awaitable[None]: ...


class KeyChecking(Protocol):
    def _check_key(self, key: Any) -> object: ...


class Ending(Protocol):
    @property
    def ended(self) -> bool: ...


class AsyncBlockRecord:
    """Which task is inside an ``async with`` object of a backend across processes, and
    how many times (the rule of lockmgr._aio): written once ``__aenter__`` holds the keys,
    read back by ``__aexit__``. The task is kept by a weak reference, its state strongly. A
    task that is done counts as ended at once (its state's end may still be queued behind
    the task awaiting it). Changed under a lock of its own (the collector may close a
    coroutine inside a block on another thread); reentrant, as a collection inside may run
    another exit."""

    __slots__ = ("_depth", "_lock", "_state", "_task")

    def __init__(self) -> None:
        self._task: weakref.ref[Any] | None = None
        self._state: Ending | None = None
        self._depth = 0
        self._lock = threading.RLock()

    def enter(self, owners: TaskOwners) -> None:
        """The current task holds the block's keys: it is inside (RuntimeError, and nothing
        changed, if another task is)."""
        task, state = owners.entered()
        with self._lock:
            inside_state, inside = self._state, None if self._task is None else self._task()
            if inside_state is None:
                self._task, self._state = weakref.ref(task), state
            if inside_state is None or inside is task:
                self._depth += 1
                return
        raise block_in_use(inside, _ended(inside_state, inside))

    def leave(self) -> Any:
        """One block exits: its task, or None if that task has ended (its end released, or
        releases, its keys). RuntimeError if no block is inside."""
        with self._lock:
            state, task = self._state, None if self._task is None else self._task()
            if state is None:
                raise not_entered()
            self._depth -= 1
            if not self._depth:
                self._task = self._state = None
        return None if _ended(state, task) else task


def _ended(state: Ending, task: Any) -> bool:
    return state.ended or task is None or bool(task.done())


async def enter_block(record: AsyncBlockRecord, owners: TaskOwners,
                      release: Callable[[], Awaitable[None]]) -> None:
    """The block enters ``record`` now that its task holds the keys; if another task
    entered meanwhile (two readers), they go back first (RuntimeError)."""
    try:
        record.enter(owners)
    except RuntimeError:
        await release()
        raise


async def exit_block(record: AsyncBlockRecord, key: Hashable,
                     release: Callable[[], Awaitable[None]]) -> None:
    """The exit of a block gives back the hold of the task that entered it, in that task;
    nothing if that task has ended. Run by another task (an async generator asyncio
    finalizes in a task of its own), it cannot release for it: NotOwnedError, and the key
    stays held until that task releases it or ends."""
    task = record.leave()
    if task is None:
        return
    if task is not current_task_or_none():
        raise not_owned_block(key, task)
    await release()


class AsyncHeld:
    """What the ``aio`` views' ``hold()``, ``read()``, ``write()`` and ``hold_many()`` return:
    ``async with`` gives the ``Lease``; entering raises LockTimeout if not acquired in
    time, what the acquisition raises, and RuntimeError if another task is inside."""

    __slots__ = ("_acquire", "_items", "_owners", "_record", "_release", "_seconds")

    def __init__(self, owners: TaskOwners, items: list[tuple[Hashable, int]],
                 acquire: Callable[[], Awaitable[bool]],
                 release: Callable[[], Awaitable[None]], seconds: float) -> None:
        self._owners = owners
        self._items = items
        self._acquire = acquire
        self._release = release
        self._seconds = seconds
        self._record = AsyncBlockRecord()

    async def __aenter__(self) -> Lease:
        if not await self._acquire():
            keys = [key for key, _ in self._items]
            raise timed_out(keys[0] if len(keys) == 1 else tuple(keys), self._seconds)
        await enter_block(self._record, self._owners, self._release)
        return self._owners.lease(self._items)

    async def __aexit__(self, kind: type[BaseException] | None, *exc_info: object) -> None:
        await exit_block(self._record, self._items[0][0], self._release)


_Manager = TypeVar("_Manager", bound=KeyChecking)
_Tasks = TypeVar("_Tasks", bound=TaskHolding)
_Local = TypeVar("_Local")


class LayeredAsyncView(Generic[K, _Manager, _Tasks, _Local]):
    """What both ``aio`` views share: the manager, its tasks' record, and the in-process
    engine's ``aio`` view (the same table as its threads')."""

    __slots__ = ("_local", "_manager", "_tasks")

    def __init__(self, manager: _Manager, tasks: _Tasks, local: _Local) -> None:
        self._manager = manager
        self._tasks = tasks
        self._local = local

    @property
    def manager(self) -> _Manager:
        """The manager this view acquires through."""
        return self._manager

    def __repr__(self) -> str:
        return f"<lockmgr.{type(self).__name__} of {self._manager!r}>"


def _same(key: Hashable) -> Hashable:
    """The multi-key argument rules' key mapping: the backends lock keys as given."""
    return key


class LayeredAsyncLockManager(
        LayeredAsyncView[K, _Manager, _Tasks, "AsyncLockManager[Hashable]"]):
    """An exclusive manager's ``aio`` view: acquiring is a coroutine, releasing is done at
    the call and answers an awaitable (see the backend's module). Every method raises
    RuntimeError outside a running asyncio task."""

    __slots__ = ()
    _local: AsyncLockManager[Hashable]

    async def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` for the current task across every process the backend reaches: True
        once held (reentrant), False if ``blocking`` is false or ``timeout`` ran out first.
        Raises, nothing taken: TypeError/ValueError for bad ``blocking``/``timeout``,
        TypeError for a key the backend cannot lock (keys are str, bytes, int and tuples of
        them), DeadlockError if waiting would close a cycle, and the backend's errors."""
        seconds = wait_seconds(blocking, timeout)
        self._manager._check_key(key)  # a key the backend cannot lock fails first
        local = self._local
        return await self._tasks.take([(key, WRITE)], seconds,
                                      lambda left: local.acquire(key, timeout=left),
                                      lambda: local.release(key))

    def release(self, key: K) -> Awaitable[None]:
        """Undo one ``acquire``, at the call (the last level releases it across processes);
        answers an awaitable of the backend's release. Raises NotOwnedError, nothing
        changed, if the current task does not hold ``key``."""
        local = self._local
        return self._tasks.give([(key, WRITE)], lambda: local.release(key))

    def hold(self, key: K, timeout: float | None = None) -> AsyncHeld:
        """``async with aio.hold(key, timeout=...)``: the key for the block (``as``: its
        ``Lease``). Entering raises LockTimeout if not acquired within ``timeout`` (None or
        -1: no limit), what ``acquire`` raises, and RuntimeError if another task is inside
        this object; leaving raises NotOwnedError if run by another task than the one
        inside, RuntimeError if none is."""
        seconds = hold_seconds(timeout)
        return AsyncHeld(self._tasks, [(key, WRITE)], lambda: self.acquire(key, timeout=seconds),
                         lambda: self.release(key), seconds)

    async def acquire_many(self, keys: Iterable[K], blocking: bool = True,
                           timeout: float = -1) -> bool:
        """Lock every key of ``keys`` at once, or none, within one deadline. Raises what
        ``acquire`` raises, nothing taken."""
        seconds = wait_seconds(blocking, timeout)
        return await self._acquire_items(many_items(keys, _same), seconds)

    def release_many(self, keys: Iterable[K]) -> Awaitable[None]:
        """Undo one ``acquire_many``, at the call (as ``release``). Raises NotOwnedError,
        nothing released, if the current task does not hold them all."""
        return self._release_items(many_items(keys, _same, True))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> AsyncHeld:
        """``async with aio.hold_many(keys, timeout=...)``: every key for the block; raises
        what ``hold`` raises."""
        seconds = hold_seconds(timeout)
        items = many_items(keys, _same)
        return AsyncHeld(self._tasks, items, lambda: self._acquire_items(items, seconds),
                         lambda: self._release_items(items), seconds)

    async def _acquire_items(self, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        keys = [key for key, _ in items]
        for key in keys:
            self._manager._check_key(key)
        local = self._local
        return await self._tasks.take(items, seconds,
                                      lambda left: local.acquire_many(keys, timeout=left),
                                      lambda: local.release_many(keys))

    def _release_items(self, items: list[tuple[Hashable, int]]) -> Awaitable[None]:
        keys = [key for key, _ in items]
        local = self._local
        return self._tasks.give(items, lambda: local.release_many(keys))

    def synchronized(self, key_func: Callable[..., K]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """Decorator for coroutine functions: each call holds ``key_func(*args, **kwargs)``
        for the current task while it runs (raising what ``hold`` raises). TypeError for a
        plain function, a ``key_func`` that is not callable, or written bare (saying how to
        write it)."""
        return async_synchronized(self.hold, key_func)


class LayeredAsyncRWLockManager(
        LayeredAsyncView[K, _Manager, _Tasks, "AsyncRWLockManager[Hashable]"]):
    """A shared/exclusive manager's ``aio`` view (as ``LayeredAsyncLockManager``)."""

    __slots__ = ()
    _local: AsyncRWLockManager[Hashable]

    async def acquire_read(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Read-lock ``key`` for the current task (shared with other readers of every
        process); raises what ``LayeredAsyncLockManager.acquire`` raises."""
        return await self._acquire_one(key, READ, wait_seconds(blocking, timeout))

    async def acquire_write(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Write-lock ``key`` for the current task (a reader of it upgrades); raises what
        ``LayeredAsyncLockManager.acquire`` raises."""
        return await self._acquire_one(key, WRITE, wait_seconds(blocking, timeout))

    async def _acquire_one(self, key: K, mode: int, seconds: float) -> bool:
        self._manager._check_key(key)
        local = self._local
        acquire = local.acquire_read if mode == READ else local.acquire_write
        release = local.release_read if mode == READ else local.release_write
        return await self._tasks.take([(key, mode)], seconds,
                                      lambda left: acquire(key, timeout=left),
                                      lambda: release(key))

    def release_read(self, key: K) -> Awaitable[None]:
        """Undo one ``acquire_read``, at the call (as ``LayeredAsyncLockManager.release``).
        Raises NotOwnedError if the current task does not read ``key``."""
        local = self._local
        return self._tasks.give([(key, READ)], lambda: local.release_read(key))

    def release_write(self, key: K) -> Awaitable[None]:
        """Undo one ``acquire_write``, at the call (a task that still reads ``key`` goes back
        to reading it). Raises NotOwnedError if the current task does not write ``key``."""
        local = self._local
        return self._tasks.give([(key, WRITE)], lambda: local.release_write(key))

    def read(self, key: K, timeout: float | None = None) -> AsyncHeld:
        """``async with aio.read(key, timeout=...)``: ``key`` shared for the block; raises
        what ``LayeredAsyncLockManager.hold`` raises."""
        seconds = hold_seconds(timeout)
        return AsyncHeld(self._tasks, [(key, READ)],
                         lambda: self.acquire_read(key, timeout=seconds),
                         lambda: self.release_read(key), seconds)

    def write(self, key: K, timeout: float | None = None) -> AsyncHeld:
        """``async with aio.write(key, timeout=...)``: ``key`` exclusive for the block;
        raises what ``LayeredAsyncLockManager.hold`` raises."""
        seconds = hold_seconds(timeout)
        return AsyncHeld(self._tasks, [(key, WRITE)],
                         lambda: self.acquire_write(key, timeout=seconds),
                         lambda: self.release_write(key), seconds)

    async def acquire_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                           blocking: bool = True, timeout: float = -1) -> bool:
        """Read ``reads`` and write ``writes`` at once, or none (a key in both is written);
        raises what ``LayeredAsyncLockManager.acquire`` raises."""
        seconds = wait_seconds(blocking, timeout)
        return await self._acquire_items(rw_items(reads, writes, _same), seconds)

    def release_many(self, reads: Iterable[K] = (), writes: Iterable[K] = ()) -> Awaitable[None]:
        """Undo one ``acquire_many``, at the call. Raises NotOwnedError, nothing released,
        if the current task does not hold them so."""
        return self._release_items(rw_items(reads, writes, _same, True))

    def hold_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                  timeout: float | None = None) -> AsyncHeld:
        """``async with aio.hold_many(reads, writes, timeout=...)``: all of them for the
        block; raises what ``LayeredAsyncLockManager.hold`` raises."""
        seconds = hold_seconds(timeout)
        items = rw_items(reads, writes, _same)
        return AsyncHeld(self._tasks, items, lambda: self._acquire_items(items, seconds),
                         lambda: self._release_items(items), seconds)

    async def _acquire_items(self, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        for key, _ in items:
            self._manager._check_key(key)
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        local = self._local
        return await self._tasks.take(
            items, seconds, lambda left: local.acquire_many(reading, writing, timeout=left),
            lambda: local.release_many(reading, writing))

    def _release_items(self, items: list[tuple[Hashable, int]]) -> Awaitable[None]:
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        local = self._local
        return self._tasks.give(items, lambda: local.release_many(reading, writing))

    def synchronized(self, key_func: Callable[..., K]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """As ``LayeredAsyncLockManager.synchronized``, holding the key for writing."""
        return async_synchronized(self.write, key_func)


class AsyncExclusiveView(Protocol[K_contra]):
    """What ``aio[key]`` uses of its backend's ``aio`` view."""

    @property
    def manager(self) -> Any: ...  # (its ``_check_key`` refuses a key it cannot lock)
    @property
    def _tasks(self) -> TaskOwners: ...
    async def acquire(self, key: K_contra, blocking: bool = True,
                      timeout: float = -1) -> bool: ...
    def release(self, key: K_contra) -> Awaitable[None]: ...
    async def locked(self, key: K_contra) -> bool: ...


class LayeredAsyncKeyLock(Generic[K]):
    """``locks.aio[key]`` of a backend across processes: one key as an asyncio lock of the
    current task (``async with``, or ``await acquire()`` / ``await release()``); its exit
    gives back the hold of the task that entered it.

    Making one raises TypeError for a key the manager cannot take (keys are str, bytes,
    int and tuples of them)."""

    __slots__ = ("_key", "_record", "_view")

    def __init__(self, view: AsyncExclusiveView[K], key: K) -> None:
        view.manager._check_key(key)  # a key the manager cannot take fails here
        self._view = view
        self._key = key
        self._record = AsyncBlockRecord()

    @property
    def key(self) -> K:
        return self._key

    async def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """``aio.acquire(key, ...)``: raises what it raises."""
        return await self._view.acquire(self._key, blocking, timeout)

    def release(self) -> Awaitable[None]:
        """``aio.release(key)``: answers and raises what it does."""
        return self._view.release(self._key)

    async def locked(self) -> bool:
        """``aio.locked(key)``: raises what it raises."""
        return await self._view.locked(self._key)

    async def __aenter__(self) -> bool:
        got = await self._view.acquire(self._key)
        await enter_block(self._record, self._view._tasks, self.release)
        return got

    async def __aexit__(self, kind: type[BaseException] | None, *exc_info: object) -> None:
        await exit_block(self._record, self._key, self.release)

    def __repr__(self) -> str:
        return f"<lockmgr.{type(self).__name__} key={self._key!r}>"


def async_synchronized(hold: Callable[[Any], AbstractAsyncContextManager[object]],
                       key_func: Callable[..., Hashable]
                       ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                     Callable[P, Coroutine[Any, Any, T]]]:
    """The ``aio.synchronized`` decorator of a backend: each call of the coroutine function
    holds ``hold(key_func(*args, **kwargs))`` while it runs. TypeError for a ``key_func``
    that is not callable, for a plain function, and written bare (saying how to write it)."""
    key_func = checked_key_func(key_func, "aio.synchronized")

    def decorate(*args: Any, **kwargs: Any) -> Callable[P, Coroutine[Any, Any, T]]:
        func: Callable[P, Coroutine[Any, Any, T]] = function_to_wrap(
            key_func, args, kwargs, "aio.synchronized")
        if not inspect.iscoroutinefunction(func):
            raise TypeError(f"aio.synchronized() wraps coroutine functions; "
                            f"{getattr(func, '__qualname__', func)!r} is not one")

        @functools.wraps(func)
        async def locked_call(*args: P.args, **kwargs: P.kwargs) -> T:
            async with hold(key_func(*args, **kwargs)):
                return await func(*args, **kwargs)

        return locked_call

    return decorate
