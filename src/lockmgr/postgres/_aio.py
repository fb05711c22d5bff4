"""asyncio tasks on the PostgreSQL managers: ``PgLockManager.aio`` and ``PgRWLockManager.aio``.

A task is an owner as a thread is: reentrant per task, ordered against the process's other
tasks and threads by the manager's in-process engine (its ``aio`` view, the same table as
the threads'), and across processes by PostgreSQL. The rules of ``lockmgr.postgres`` hold
for tasks too, with these for the event loop:

- **Connections**: a task holding keys has a connection of its own (keys are session
  locks, and a waiting statement occupies its connection). It talks libpq directly, one
  message and one round trip per first acquire and per last release, and waits for the
  socket with the loop's readers, so other tasks run meanwhile. A task that ends still
  holding keys has its connection closed at once (its server locks go with it; the
  in-process engine releases its keys with an AbandonedLockWarning).
- **Cancellation** (``task.cancel()``, ``asyncio.timeout``, Ctrl-C under ``asyncio.run``):
  whatever the cancelled call may have taken on the server is given back by a *clean-up*
  task — cancel the statement, read it to its end, release what this call may hold
  (``_Session.unsure``) — that a second cancellation cannot interrupt (the caller waits for
  it under ``asyncio.shield``; if cancelled again, the task's next call on the manager
  waits for it first). Where it fails, the connection is closed: its keys are lost, never
  left held. A cancelled release still releases.
- **Releasing** is done at the call, as in process: ``release`` (``release_read``,
  ``release_write``, ``release_many``, ``aio[key].release``) counts the level down and
  releases the key in process at once, and starts the server's release in a task of the
  session's (which the task's next call on the manager waits for, as for a clean-up). It
  answers an awaitable: awaiting it waits for the server's answer and raises LockLost if
  the key was found gone; a release nobody awaits (code moved from the in-process
  ``aio``) still releases, on the server too, once the loop runs again; a thread that
  would wait for it meanwhile on a loop that cannot run (its own, or one stopped) gets
  DeadlockError at once (``_Tasks.refuse_unfinished_releases``). NotOwnedError, and
  LockLost for a key already known lost, are raised at the call. The in-process views'
  releases answer an awaitable done already, so ``await aio.release(key)`` runs on both.
  ``release_all`` (which answers a count) stays a coroutine here.
- **A coroutine closed unrun** (``GeneratorExit``: the garbage collector finishing a task
  whose loop was closed) can await nothing: what it may hold on the server goes with its
  connection, closed at once.
- **A loop closed with tasks pending** (asyncio.run's shutdown interrupted by another
  Ctrl-C) leaves sessions nobody can talk on: the manager's next acquisition (from a task
  or a thread), ``lost_keys()`` or ``close()`` closes their connections and ends their
  tasks in process (``_Tasks.sweep_closed_loops``); a wait still queued there ends within a
  second on PostgreSQL 14+ (``client_connection_check_interval``, set by every link).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from .._args import READ, WRITE, hold_seconds, many_items, rw_items, wait_seconds
from .._layered import AsyncHeld, LayeredAsyncKeyLock
from .._layered import async_synchronized as _synchronized
from ._session import _same
from ._sql import _MODE_NAMES

if TYPE_CHECKING:
    from ._engine import _PgEngine
    from ._managers import PgLockManager, PgRWLockManager
    from ._tasks import _Tasks

K = TypeVar("K", bound=Hashable)
P = ParamSpec("P")
T = TypeVar("T")

__all__ = ["PgAsyncKeyLock", "PgAsyncLockManager", "PgAsyncRWLockManager"]


class _PgAsyncView(Generic[K]):
    """What both ``aio`` views share."""

    __slots__ = ("_manager", "_tasks")

    def __init__(self, manager: _PgEngine[K], tasks: _Tasks) -> None:
        self._manager = manager
        self._tasks = tasks

    @property
    def manager(self) -> _PgEngine[K]:
        return self._manager

    async def release_all(self) -> int:
        """Release every key the current task holds, all levels; how many (LockLost, after
        releasing everything, if some had been lost)."""
        return await self._tasks.release_all(self._manager._engine.aio.release_all)

    async def lost_keys(self) -> set[Hashable]:
        """``PgLockManager.lost_keys()`` from a task: keys lost with their session that
        their holders (threads and tasks of this process) have not yet released; checks
        the current task's connection first, and the others' without waiting."""
        tasks = self._tasks
        session = tasks.session_or_none()
        if session is not None:
            await tasks.settle(session)
        tasks.check_others(session)
        return self._manager.lost_keys()

    def fence(self, key: K) -> int:
        """``PgLockManager.fence`` for the current task: the fence it holds ``key`` under."""
        return self._tasks.fence(key)

    def __repr__(self) -> str:
        return f"<lockmgr.{type(self).__name__} of {self._manager!r}>"


class PgAsyncLockManager(_PgAsyncView[K]):
    """``PgLockManager.aio``: the manager with the current asyncio task as owner.

    Names, arguments and errors are those of ``PgLockManager``; acquiring is a coroutine,
    releasing is done at the call and answers an awaitable of the server's release (see
    the module). A cancelled acquire leaves nothing held, here or on the server."""

    __slots__ = ()
    _manager: PgLockManager[K]

    async def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` for the current task across every process using this database and
        namespace: True once held, False if ``blocking`` is false or ``timeout`` ran out."""
        seconds = wait_seconds(blocking, timeout)
        self._manager.advisory_key(key)  # a key PostgreSQL cannot take fails first
        local = self._manager._engine.aio
        return await self._tasks.take([(key, WRITE)], seconds,
                                      lambda left: local.acquire(key, timeout=left),
                                      lambda: local.release(key))

    def release(self, key: K) -> Awaitable[None]:
        """Undo one ``acquire``, at the call (``await`` it for the server's answer: see the
        module). Raises NotOwnedError if the task does not hold ``key``; LockLost, the key
        then no longer held, if its session was lost (at the call, or when awaited if the
        server's release finds it)."""
        local = self._manager._engine.aio
        return self._tasks.give([(key, WRITE)], lambda: local.release(key))

    def hold(self, key: K, timeout: float | None = None) -> AsyncHeld:
        """``async with aio.hold(key, timeout=...)``: LockTimeout if not acquired in time."""
        seconds = hold_seconds(timeout)
        return AsyncHeld(self._tasks, [(key, WRITE)], lambda: self.acquire(key, timeout=seconds),
                          lambda: self.release(key), seconds)

    def __getitem__(self, key: K) -> PgAsyncKeyLock[K]:
        return PgAsyncKeyLock(self, key)

    async def acquire_many(self, keys: Iterable[K], blocking: bool = True,
                           timeout: float = -1) -> bool:
        """Lock every key of ``keys`` at once, or none."""
        seconds = wait_seconds(blocking, timeout)
        return await self._acquire_items(many_items(keys, _same), seconds)

    def release_many(self, keys: Iterable[K]) -> Awaitable[None]:
        """Undo one ``acquire_many``, at the call (as ``release``)."""
        return self._release_items(many_items(keys, _same, True))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> AsyncHeld:
        seconds = hold_seconds(timeout)
        items = many_items(keys, _same)
        return AsyncHeld(self._tasks, items, lambda: self._acquire_items(items, seconds),
                          lambda: self._release_items(items), seconds)

    async def _acquire_items(self, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        keys = [key for key, _ in items]
        for key in keys:
            self._manager.advisory_key(key)
        local = self._manager._engine.aio
        return await self._tasks.take(items, seconds,
                                      lambda left: local.acquire_many(keys, timeout=left),
                                      lambda: local.release_many(keys))

    def _release_items(self, items: list[tuple[Hashable, int]]) -> Awaitable[None]:
        keys = [key for key, _ in items]
        local = self._manager._engine.aio
        return self._tasks.give(items, lambda: local.release_many(keys))

    def owned(self, key: K) -> bool:
        """Whether the current task holds ``key`` (a lost key is not held)."""
        return bool(self._manager._engine.aio.owned(key)) and not self._tasks.lost_here(key, WRITE)

    def recursion_count(self, key: K) -> int:
        count = int(self._manager._engine.aio.recursion_count(key))
        return 0 if count and self._tasks.lost_here(key, WRITE) else count

    async def locked(self, key: K) -> bool:
        """Whether any session of any process holds ``key`` (asks the server)."""
        return await self._tasks.held_on_server(key, None)

    def synchronized(self, key_func: Callable[..., K]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """Decorator for coroutine functions: each call holds ``key_func(*args, **kwargs)``
        for the current task while it runs. Written bare (``@aio.synchronized``, no key
        function), it raises TypeError saying how to write it."""
        return _synchronized(self.hold, key_func)


class PgAsyncRWLockManager(_PgAsyncView[K]):
    """``PgRWLockManager.aio``: shared/exclusive keys with the current task as owner (see
    ``PgAsyncLockManager``)."""

    __slots__ = ()
    _manager: PgRWLockManager[K]

    async def acquire_read(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        return await self._acquire_one(key, READ, wait_seconds(blocking, timeout))

    async def acquire_write(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        return await self._acquire_one(key, WRITE, wait_seconds(blocking, timeout))

    async def _acquire_one(self, key: K, mode: int, seconds: float) -> bool:
        self._manager.advisory_key(key)
        local = self._manager._engine.aio
        acquire = local.acquire_read if mode == READ else local.acquire_write
        release = local.release_read if mode == READ else local.release_write
        return await self._tasks.take([(key, mode)], seconds,
                                      lambda left: acquire(key, timeout=left),
                                      lambda: release(key))

    def release_read(self, key: K) -> Awaitable[None]:
        """Undo one ``acquire_read``, at the call (as ``PgAsyncLockManager.release``)."""
        local = self._manager._engine.aio
        return self._tasks.give([(key, READ)], lambda: local.release_read(key))

    def release_write(self, key: K) -> Awaitable[None]:
        """Undo one ``acquire_write``, at the call (as ``PgAsyncLockManager.release``)."""
        local = self._manager._engine.aio
        return self._tasks.give([(key, WRITE)], lambda: local.release_write(key))

    def read(self, key: K, timeout: float | None = None) -> AsyncHeld:
        seconds = hold_seconds(timeout)
        return AsyncHeld(self._tasks, [(key, READ)],
                          lambda: self.acquire_read(key, timeout=seconds),
                          lambda: self.release_read(key), seconds)

    def write(self, key: K, timeout: float | None = None) -> AsyncHeld:
        seconds = hold_seconds(timeout)
        return AsyncHeld(self._tasks, [(key, WRITE)],
                          lambda: self.acquire_write(key, timeout=seconds),
                          lambda: self.release_write(key), seconds)

    async def acquire_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                           blocking: bool = True, timeout: float = -1) -> bool:
        """Read ``reads`` and write ``writes`` at once, or none (a key in both is written)."""
        seconds = wait_seconds(blocking, timeout)
        return await self._acquire_items(rw_items(reads, writes, _same), seconds)

    def release_many(self, reads: Iterable[K] = (), writes: Iterable[K] = ()) -> Awaitable[None]:
        """Undo one ``acquire_many``, at the call (as ``PgAsyncLockManager.release``)."""
        return self._release_items(rw_items(reads, writes, _same, True))

    def hold_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                  timeout: float | None = None) -> AsyncHeld:
        seconds = hold_seconds(timeout)
        items = rw_items(reads, writes, _same)
        return AsyncHeld(self._tasks, items, lambda: self._acquire_items(items, seconds),
                          lambda: self._release_items(items), seconds)

    async def _acquire_items(self, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        for key, _ in items:
            self._manager.advisory_key(key)
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        local = self._manager._engine.aio
        return await self._tasks.take(
            items, seconds, lambda left: local.acquire_many(reading, writing, timeout=left),
            lambda: local.release_many(reading, writing))

    def _release_items(self, items: list[tuple[Hashable, int]]) -> Awaitable[None]:
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        local = self._manager._engine.aio
        return self._tasks.give(items, lambda: local.release_many(reading, writing))

    def owned(self, key: K) -> bool:
        """Whether the current task reads or writes ``key`` (a lost key is not held)."""
        write, read = self._manager._engine._task_levels(key)
        return bool(write and not self._tasks.lost_here(key, WRITE)
                    or read and not self._tasks.lost_here(key, READ))

    def recursion_count(self, key: K) -> int:
        """How many times the current task writes ``key`` (0 if it does not)."""
        count = int(self._manager._engine.aio.recursion_count(key))
        return 0 if count and self._tasks.lost_here(key, WRITE) else count

    async def write_locked(self, key: K) -> bool:
        """Whether any session of any process writes ``key`` (asks the server)."""
        return await self._tasks.held_on_server(key, _MODE_NAMES[WRITE])

    def synchronized(self, key_func: Callable[..., K]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """As ``PgAsyncLockManager.synchronized``, holding the key for writing."""
        return _synchronized(self.write, key_func)


class PgAsyncKeyLock(LayeredAsyncKeyLock[K]):
    """``locks.aio[key]``: one key as an asyncio lock of the current task, across processes
    (``async with``, or ``await acquire()`` / ``await release()``)."""

    __slots__ = ()
