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
  A task whose loop closed while it waited in the kernel is ended so when its wait ends.
- **As threads do**, a task takes fences (``fencing=True``: ``Lease.fence``,
  ``aio.fence(key)``; taken in a thread, as they are made durable on disk), is warned
  (AbandonedLockWarning) when the last writer of a key it takes died holding it, and its
  wait in the kernel publishes itself for the deadlock looks across processes
  (DeadlockError, nothing held, if it closes a cycle and is the one chosen).
- **An ``async with`` object** (``aio[key]``, ``hold``, ``read``, ``write``, ``hold_many``)
  gives back, at its exit, the hold of the task that entered it: nothing if that task
  ended (its end gave it back); run by another task, NotOwnedError, and the key stays
  held until its task releases it or ends (as ``lockmgr.postgres``'s).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, TypeVar

from .._args import READ, WRITE
from .._layered_aio import LayeredAsyncKeyLock, LayeredAsyncLockManager, LayeredAsyncRWLockManager

if TYPE_CHECKING:
    from ._managers import HostLockManager, HostRWLockManager
    from ._tasks import _HostTasks

K = TypeVar("K", bound=Hashable)

__all__ = ["HostAsyncKeyLock", "HostAsyncLockManager", "HostAsyncRWLockManager"]


class _HostAsyncView:
    """What both host ``aio`` views add to the shared ones."""

    __slots__ = ()
    _tasks: _HostTasks

    async def release_all(self) -> int:
        """Release every key the current task holds through this manager, all levels; how
        many (a coroutine, as ``lockmgr.postgres``'s, that never waits). Raises
        RuntimeError outside a running asyncio task."""
        return self._tasks.release_all(self._tasks.manager._engine.aio.release_all)

    def fence(self, key: Hashable) -> int:
        """The fence under which the current task holds ``key`` for writing (``lease.fence``
        of its ``hold``), as ``HostLockManager.fence``: LockError without ``fencing=True``
        or for a key only read, NotOwnedError if the task does not hold it, TypeError for
        a key that is not str, bytes, int or a tuple of them."""
        return self._tasks.fence(key)


class HostAsyncLockManager(LayeredAsyncLockManager[K, "HostLockManager[K]", "_HostTasks"],
                           _HostAsyncView):
    """``HostLockManager.aio``: the manager with the current asyncio task as owner.

    Names, arguments and errors are those of ``HostLockManager``; acquiring is a coroutine
    (LockError if the kernel refused a record lock), releasing is done at the call and
    answers an awaitable done already (see the module). Every method raises RuntimeError
    outside a running asyncio task."""

    __slots__ = ()
    _manager: HostLockManager[K]
    _tasks: _HostTasks

    def __getitem__(self, key: K) -> HostAsyncKeyLock[K]:
        """One key as an asyncio lock of the current task, across processes. Raises
        TypeError for a key that is not str, bytes, int or a tuple of them."""
        return HostAsyncKeyLock(self, key)

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


class HostAsyncRWLockManager(LayeredAsyncRWLockManager[K, "HostRWLockManager[K]",
                                                       "_HostTasks"], _HostAsyncView):
    """``HostRWLockManager.aio``: shared (read) and exclusive (write) keys with the current
    task as owner (see ``HostAsyncLockManager``; names, arguments and errors of
    ``HostRWLockManager``). Every method raises RuntimeError outside a running task."""

    __slots__ = ()
    _manager: HostRWLockManager[K]
    _tasks: _HostTasks

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


class HostAsyncKeyLock(LayeredAsyncKeyLock[K]):
    """``locks.aio[key]`` of a HostLockManager: one key as an asyncio lock of the current
    task, across processes (``async with``, or ``await acquire()`` / ``release()``); its
    exit gives back the hold of the task that entered it (see the module).

    Making one raises TypeError for a key that is not str, bytes, int or a tuple of them."""

    __slots__ = ()
