"""asyncio tasks on the host managers: ``HostLockManager.aio`` and ``HostRWLockManager.aio``.

A task is an owner as a thread is: reentrant per task, ordered against the process's other
tasks and threads by the manager's in-process engine (its ``aio`` view: the threads' table),
and across processes by the kernel's record locks (``_tasks``). For the event loop:

- **The loop never blocks**: a task's first level of a key tries the kernel lock at once
  under the loop; if another process holds it, the wait runs in a thread of its own that
  the task awaits, so other tasks run meanwhile.
- **Cancellation** (``task.cancel()``, ``asyncio.timeout``, Ctrl-C under ``asyncio.run``)
  stops that wait within 5 ms (one slice), and a kernel lock taken as it landed is given
  back: a cancelled acquire leaves nothing held, in the kernel or in process.
- **Releasing** is done at the call, as in process: ``release`` (``release_read``,
  ``release_write``, ``release_many``, ``aio[key].release``) gives the kernel lock of the
  last level back and the key in process at once, and answers an awaitable done already,
  so ``await aio.release(key)`` runs here as on ``lockmgr.postgres`` and in process.
  ``release_all``, ``locked`` and ``write_locked`` are coroutines, as ``lockmgr.postgres``'s
  (they never wait here).
- **A task that ends holding keys** has their kernel locks given back when it ends (its
  done-callback); the in-process engine releases them in process with AbandonedLockWarning.
- **An ``async with`` object** (``aio[key]``, ``hold``, ``read``, ``write``, ``hold_many``)
  gives back, at its exit, the hold of the task that entered it: nothing if that task
  ended (its end gave it back); run by another task, NotOwnedError, and the key stays
  held until its task releases it or ends (as ``lockmgr.postgres``'s).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from .._args import READ, WRITE, hold_seconds, many_items, rw_items, wait_seconds
from .._layered import AsyncHeld, LayeredAsyncKeyLock, async_synchronized

if TYPE_CHECKING:
    from ._engine import _HostEngine
    from ._managers import HostLockManager, HostRWLockManager
    from ._tasks import _HostTasks

K = TypeVar("K", bound=Hashable)
P = ParamSpec("P")
T = TypeVar("T")
_Manager = TypeVar("_Manager", bound="_HostEngine[Any]")

_Item = tuple[Hashable, int]

__all__ = ["HostAsyncKeyLock", "HostAsyncLockManager", "HostAsyncRWLockManager"]


def _same(key: Hashable) -> Hashable:
    """The multi-key argument rules' key mapping: host managers lock keys as given."""
    return key


class _HostAsyncView(Generic[K, _Manager]):
    """What both ``aio`` views share."""

    __slots__ = ("_manager", "_tasks")

    def __init__(self, manager: _Manager, tasks: _HostTasks) -> None:
        self._manager = manager
        self._tasks = tasks

    @property
    def manager(self) -> _Manager:
        return self._manager

    async def release_all(self) -> int:
        """Release every key the current task holds through this manager, all levels; how
        many (a coroutine, as ``lockmgr.postgres``'s, that never waits)."""
        return self._tasks.release_all(self._manager._engine.aio.release_all)

    def __repr__(self) -> str:
        return f"<lockmgr.{type(self).__name__} of {self._manager!r}>"


class HostAsyncLockManager(_HostAsyncView[K, "HostLockManager[K]"]):
    """``HostLockManager.aio``: the manager with the current asyncio task as owner.

    Names, arguments and errors are those of ``HostLockManager``; acquiring is a coroutine,
    releasing is done at the call and answers an awaitable done already (see the module).
    Every method raises RuntimeError outside a running asyncio task."""

    __slots__ = ()
    _manager: HostLockManager[K]

    async def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` for the current task across every process using this directory and
        namespace: True once held (reentrant), False if ``blocking`` is false or ``timeout``
        ran out first. Raises, with nothing taken: TypeError/ValueError for bad
        ``blocking``/``timeout``, TypeError for a key that is not str, bytes, int or a
        tuple of them, DeadlockError if waiting would close a cycle of this process's
        tasks and threads, LockError if the kernel refused a record lock."""
        seconds = wait_seconds(blocking, timeout)
        local = self._manager._locks.aio
        return await self._tasks.take([(key, WRITE)], seconds,
                                      lambda left: local.acquire(key, timeout=left),
                                      lambda: local.release(key))

    def release(self, key: K) -> Awaitable[None]:
        """Undo one ``acquire``, at the call (the last level releases it across processes);
        answers an awaitable done already. Raises NotOwnedError, nothing changed, if the
        current task does not hold ``key``."""
        local = self._manager._locks.aio
        return self._tasks.give([(key, WRITE)], lambda: local.release(key), False)

    def hold(self, key: K, timeout: float | None = None) -> AsyncHeld:
        """``async with aio.hold(key, timeout=...)``: the key for the block (``as``: its
        ``Lease``). Entering raises LockTimeout if not acquired within ``timeout`` (None or
        -1: no limit), what ``acquire`` raises, and RuntimeError if another task is inside
        this object; leaving raises NotOwnedError if run by another task than the one
        inside, RuntimeError if none is."""
        seconds = hold_seconds(timeout)
        return AsyncHeld(self._tasks, [(key, WRITE)], lambda: self.acquire(key, timeout=seconds),
                         lambda: self.release(key), seconds)

    def __getitem__(self, key: K) -> HostAsyncKeyLock[K]:
        """One key as an asyncio lock of the current task, across processes. Raises
        TypeError for a key that is not str, bytes, int or a tuple of them."""
        return HostAsyncKeyLock(self, key)

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

    async def _acquire_items(self, items: list[_Item], seconds: float) -> bool:
        keys = [key for key, _ in items]
        local = self._manager._locks.aio
        return await self._tasks.take(items, seconds,
                                      lambda left: local.acquire_many(keys, timeout=left),
                                      lambda: local.release_many(keys))

    def _release_items(self, items: list[_Item]) -> Awaitable[None]:
        keys = [key for key, _ in items]
        local = self._manager._locks.aio
        return self._tasks.give(items, lambda: local.release_many(keys), False)

    def owned(self, key: K) -> bool:
        """Whether the current task holds ``key``."""
        return bool(self._tasks.owned((key, WRITE)))

    def recursion_count(self, key: K) -> int:
        """How many levels of ``key`` the current task holds (0 if none)."""
        return self._tasks.owned((key, WRITE))

    async def locked(self, key: K) -> bool:
        """Whether any process holds ``key`` (this one through any manager, or another): a
        coroutine, as ``lockmgr.postgres``'s, that never waits. Raises TypeError for a key
        that is not str, bytes, int or a tuple of them."""
        return self._manager.locked(key)

    def synchronized(self, key_func: Callable[..., K]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """Decorator for coroutine functions: each call holds ``key_func(*args, **kwargs)``
        for the current task while it runs (raising what ``hold`` raises). TypeError for a
        plain function, a ``key_func`` that is not callable, or written bare."""
        return async_synchronized(self.hold, key_func)

class HostAsyncRWLockManager(_HostAsyncView[K, "HostRWLockManager[K]"]):
    """``HostRWLockManager.aio``: shared (read) and exclusive (write) keys with the current
    task as owner (see ``HostAsyncLockManager``; names, arguments and errors of
    ``HostRWLockManager``). Every method raises RuntimeError outside a running task."""

    __slots__ = ()
    _manager: HostRWLockManager[K]

    async def acquire_read(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Read-lock ``key`` for the current task (shared with other readers of every
        process); raises what ``HostAsyncLockManager.acquire`` raises."""
        return await self._acquire_one(key, READ, wait_seconds(blocking, timeout))

    async def acquire_write(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Write-lock ``key`` for the current task (a reader of it upgrades); raises what
        ``HostAsyncLockManager.acquire`` raises."""
        return await self._acquire_one(key, WRITE, wait_seconds(blocking, timeout))

    async def _acquire_one(self, key: K, mode: int, seconds: float) -> bool:
        local = self._manager._rwlocks.aio
        acquire = local.acquire_read if mode == READ else local.acquire_write
        release = local.release_read if mode == READ else local.release_write
        return await self._tasks.take([(key, mode)], seconds,
                                      lambda left: acquire(key, timeout=left),
                                      lambda: release(key))

    def release_read(self, key: K) -> Awaitable[None]:
        """Undo one ``acquire_read``, at the call. Raises NotOwnedError if not held for
        reading by the current task."""
        local = self._manager._rwlocks.aio
        return self._tasks.give([(key, READ)], lambda: local.release_read(key), True)

    def release_write(self, key: K) -> Awaitable[None]:
        """Undo one ``acquire_write``, at the call. Raises NotOwnedError if not held for
        writing by the current task."""
        local = self._manager._rwlocks.aio
        return self._tasks.give([(key, WRITE)], lambda: local.release_write(key), True)

    def read(self, key: K, timeout: float | None = None) -> AsyncHeld:
        """``async with aio.read(key, timeout=...)``: ``key`` shared for the block; raises
        what ``HostAsyncLockManager.hold`` raises."""
        seconds = hold_seconds(timeout)
        return AsyncHeld(self._tasks, [(key, READ)],
                         lambda: self.acquire_read(key, timeout=seconds),
                         lambda: self.release_read(key), seconds)

    def write(self, key: K, timeout: float | None = None) -> AsyncHeld:
        """``async with aio.write(key, timeout=...)``: ``key`` exclusive for the block;
        raises what ``HostAsyncLockManager.hold`` raises."""
        seconds = hold_seconds(timeout)
        return AsyncHeld(self._tasks, [(key, WRITE)],
                         lambda: self.acquire_write(key, timeout=seconds),
                         lambda: self.release_write(key), seconds)

    async def acquire_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                           blocking: bool = True, timeout: float = -1) -> bool:
        """Read ``reads`` and write ``writes`` at once, or none (a key in both is written);
        raises what ``HostAsyncLockManager.acquire`` raises."""
        seconds = wait_seconds(blocking, timeout)
        return await self._acquire_items(rw_items(reads, writes, _same), seconds)

    def release_many(self, reads: Iterable[K] = (), writes: Iterable[K] = ()) -> Awaitable[None]:
        """Undo one ``acquire_many``, at the call. Raises NotOwnedError, nothing released,
        if the current task does not hold them so."""
        return self._release_items(rw_items(reads, writes, _same, True))

    def hold_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                  timeout: float | None = None) -> AsyncHeld:
        """``async with aio.hold_many(reads, writes, timeout=...)``: all of them for the
        block; raises what ``HostAsyncLockManager.hold`` raises."""
        seconds = hold_seconds(timeout)
        items = rw_items(reads, writes, _same)
        return AsyncHeld(self._tasks, items, lambda: self._acquire_items(items, seconds),
                         lambda: self._release_items(items), seconds)

    async def _acquire_items(self, items: list[_Item], seconds: float) -> bool:
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        local = self._manager._rwlocks.aio
        return await self._tasks.take(
            items, seconds, lambda left: local.acquire_many(reading, writing, timeout=left),
            lambda: local.release_many(reading, writing))

    def _release_items(self, items: list[_Item]) -> Awaitable[None]:
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        local = self._manager._rwlocks.aio
        return self._tasks.give(items, lambda: local.release_many(reading, writing), True)

    def owned(self, key: K) -> bool:
        """Whether the current task reads or writes ``key``."""
        return bool(self._tasks.owned((key, WRITE)) or self._tasks.owned((key, READ)))

    def recursion_count(self, key: K) -> int:
        """How many times the current task writes ``key`` (0 if it does not)."""
        return self._tasks.owned((key, WRITE))

    async def write_locked(self, key: K) -> bool:
        """Whether any process writes ``key`` (a coroutine that never waits). Raises
        TypeError for a key that is not str, bytes, int or a tuple of them."""
        return self._manager.write_locked(key)

    def synchronized(self, key_func: Callable[..., K]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """As ``HostAsyncLockManager.synchronized``, holding the key for writing."""
        return async_synchronized(self.write, key_func)

class HostAsyncKeyLock(LayeredAsyncKeyLock[K]):
    """``locks.aio[key]`` of a HostLockManager: one key as an asyncio lock of the current
    task, across processes (``async with``, or ``await acquire()`` / ``release()``); its
    exit gives back the hold of the task that entered it (see the module).

    Making one raises TypeError for a key that is not str, bytes, int or a tuple of them."""

    __slots__ = ()
