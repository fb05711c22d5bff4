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

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, TypeVar

from .._args import READ, WRITE
from .._layered_aio import LayeredAsyncKeyLock, LayeredAsyncLockManager, LayeredAsyncRWLockManager
from ._sql import _MODE_NAMES

if TYPE_CHECKING:
    from ._engine import _PgEngine
    from ._managers import PgLockManager, PgRWLockManager
    from ._tasks import _Tasks

K = TypeVar("K", bound=Hashable)

__all__ = ["PgAsyncKeyLock", "PgAsyncLockManager", "PgAsyncRWLockManager"]


class _PgAsyncView:
    """What both PostgreSQL ``aio`` views add to the shared ones."""

    __slots__ = ()
    _manager: _PgEngine[Any]
    _tasks: _Tasks

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

    def fence(self, key: Hashable) -> int:
        """``PgLockManager.fence`` for the current task: the fence it holds ``key`` under."""
        return self._tasks.fence(key)


class PgAsyncLockManager(LayeredAsyncLockManager[K, "PgLockManager[K]", "_Tasks"], _PgAsyncView):
    """``PgLockManager.aio``: the manager with the current asyncio task as owner.

    Names, arguments and errors are those of ``PgLockManager``; acquiring is a coroutine,
    releasing is done at the call and answers an awaitable of the server's release (see
    the module). A cancelled acquire leaves nothing held, here or on the server. The
    releases raise LockLost, the key then no longer held, if its session was lost (at the
    call, or when awaited if the server's release finds it)."""

    __slots__ = ()
    _manager: PgLockManager[K]

    def __getitem__(self, key: K) -> PgAsyncKeyLock[K]:
        """One key as an asyncio lock of the current task, across processes. Raises
        TypeError for a key PostgreSQL cannot take."""
        return PgAsyncKeyLock(self, key)

    def owned(self, key: K) -> bool:
        """Whether the current task holds ``key`` (a lost key is not held)."""
        return bool(self._local.owned(key)) and not self._tasks.lost_here(key, WRITE)

    def recursion_count(self, key: K) -> int:
        count = int(self._local.recursion_count(key))
        return 0 if count and self._tasks.lost_here(key, WRITE) else count

    async def locked(self, key: K) -> bool:
        """Whether any session of any process holds ``key`` (asks the server)."""
        return await self._tasks.held_on_server(key, None)


class PgAsyncRWLockManager(LayeredAsyncRWLockManager[K, "PgRWLockManager[K]", "_Tasks"],
                           _PgAsyncView):
    """``PgRWLockManager.aio``: shared/exclusive keys with the current task as owner (see
    ``PgAsyncLockManager``)."""

    __slots__ = ()
    _manager: PgRWLockManager[K]

    def owned(self, key: K) -> bool:
        """Whether the current task reads or writes ``key`` (a lost key is not held)."""
        write, read = self._manager._engine._task_levels(key)
        return bool(write and not self._tasks.lost_here(key, WRITE)
                    or read and not self._tasks.lost_here(key, READ))

    def recursion_count(self, key: K) -> int:
        """How many times the current task writes ``key`` (0 if it does not)."""
        count = int(self._local.recursion_count(key))
        return 0 if count and self._tasks.lost_here(key, WRITE) else count

    async def write_locked(self, key: K) -> bool:
        """Whether any session of any process writes ``key`` (asks the server)."""
        return await self._tasks.held_on_server(key, _MODE_NAMES[WRITE])


class PgAsyncKeyLock(LayeredAsyncKeyLock[K]):
    """``locks.aio[key]``: one key as an asyncio lock of the current task, across processes
    (``async with``, or ``await acquire()`` / ``await release()``)."""

    __slots__ = ()
