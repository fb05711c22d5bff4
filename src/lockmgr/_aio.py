"""asyncio tasks on a manager's own lock table: ``locks.aio`` and ``rw.aio``.

An ``aio`` view owns keys by the current asyncio task, in the same table, queues and
wait-for graph as the manager's threads: a task and a thread exclude each other per key,
queue FIFO together, and a cycle among them is a DeadlockError. Both engines implement the
``_task_*`` methods these classes call, with the same semantics:

- ``_task_acquire(key, mode, try_only, count)`` and ``_task_acquire_many(items, try_only)``
  answer True (held), False (a try-lock found it taken) or a *wait*: the request is queued
  and ``wait.waker`` is how a grant reaches the task (posted after the granting section);
- ``wait.settle(consumed, deadline)`` (``consumed``: the task took a post) answers True
  (granted: the call's outcome), False (timed out: it left the queues), None (still
  waiting) or ``AWAIT_POST`` (a wake-up is on its way: wait for it, whatever the deadline);
- ``wait.abandon()`` takes the request out of the queues, or gives back a grant that raced
  the exception (a cancellation): the key goes to the next waiter; ``_task_abandon()`` does
  the same for the current task's request, if it has one (an exception between the queueing
  call and the wait);
- ``_task_release``, ``_task_release_many``, ``_task_release_all`` and ``_task_levels`` are the
  sync methods with the current task as owner.

Every method raises RuntimeError outside a running task.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Coroutine, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from ._common import (
    AWAIT_POST,
    READ,
    WRITE,
    LockStats,
    hold_seconds,
    many_items,
    rw_items,
    timed_out,
    wait_seconds,
)

if TYPE_CHECKING:
    from types import TracebackType

P = ParamSpec("P")
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

__all__ = ["AsyncKeyLock", "AsyncLockManager", "AsyncRWLockManager"]


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds if seconds > 0 else -1.0


async def _wait_for_grant(wait: Any, deadline: float) -> bool:
    """Sleep until the queued request of ``wait`` is granted (True) or times out (False).
    Any exception (a cancellation) takes it out of the queues, or passes a grant that raced
    the exception on to the next waiter, before it propagates."""
    waker = wait.waker
    outcome: object = None
    try:
        while True:
            await waker.sleep(-1.0 if outcome is AWAIT_POST else deadline)
            outcome = wait.settle(waker.take_post(), deadline)
            if outcome is True or outcome is False:
                return bool(outcome)
    except BaseException:
        wait.abandon()
        raise


async def _acquire(manager: Any, key: Hashable, mode: int, seconds: float) -> bool:
    return await _take(seconds, manager, manager._task_acquire, key, mode, seconds == 0, 1)


async def _acquire_many(manager: Any, items: list[tuple[Hashable, int]], seconds: float) -> bool:
    return await _take(seconds, manager, manager._task_acquire_many, items, seconds == 0)


async def _take(seconds: float, manager: Any, acquire: Callable[..., Any], *args: Any) -> bool:
    """``acquire(*args)`` for the current task, then its wait if it queued."""
    deadline = _deadline(seconds)
    try:
        got = acquire(*args)
        if got is True or got is False:
            return bool(got)
        return await _wait_for_grant(got, deadline)
    except BaseException:
        # A signal handler may raise between the queueing call's return and the wait (a
        # call is a check point): the task's own token still knows the request.
        manager._task_abandon()
        raise


class _AsyncHolding:
    """``async with aio.hold(key)`` (and ``read``/``write``): LockTimeout if not acquired."""

    __slots__ = ("_key", "_manager", "_mode", "_seconds")

    def __init__(self, manager: Any, key: Hashable, seconds: float, mode: int) -> None:
        self._manager = manager
        self._key = key
        self._seconds = seconds
        self._mode = mode

    async def __aenter__(self) -> bool:
        if not await _acquire(self._manager, self._key, self._mode, self._seconds):
            raise timed_out(self._key, self._seconds)
        return True

    async def __aexit__(self, *exc_info: object) -> None:
        self._manager._task_release(self._key, self._mode)


class _AsyncHoldingMany:
    """``async with aio.hold_many(...)``: every key for the block, or LockTimeout."""

    __slots__ = ("_items", "_manager", "_seconds")

    def __init__(self, manager: Any, items: list[tuple[Hashable, int]], seconds: float) -> None:
        self._manager = manager
        self._items = items
        self._seconds = seconds

    async def __aenter__(self) -> bool:
        if not await _acquire_many(self._manager, self._items, self._seconds):
            raise timed_out(tuple(key for key, _ in self._items), self._seconds)
        return True

    async def __aexit__(self, *exc_info: object) -> None:
        self._manager._task_release_many(self._items)


class AsyncKeyLock(Generic[K]):
    """``locks.aio[key]``: one key of the table as an asyncio lock owned by the current task
    (reentrant; ``async with`` acquires and releases it)."""

    __slots__ = ("_key", "_manager")

    def __init__(self, manager: Any, key: K) -> None:
        self._manager = manager
        self._key = key

    @property
    def key(self) -> K:
        return self._key

    async def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """As ``AsyncLockManager.acquire`` for this view's key."""
        return await _acquire(self._manager, self._key, WRITE, wait_seconds(blocking, timeout))

    def release(self) -> None:
        self._manager._task_release(self._key, WRITE)

    def locked(self) -> bool:
        """Whether any thread or task holds the key."""
        return bool(self._manager.locked(self._key))

    async def __aenter__(self) -> bool:
        return await _acquire(self._manager, self._key, WRITE, -1.0)

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, traceback: TracebackType | None) -> None:
        self._manager._task_release(self._key, WRITE)

    def __repr__(self) -> str:
        return f"<lockmgr.AsyncKeyLock key={self._key!r} locked={self.locked()}>"


class _AsyncEngineView:
    """What both asyncio views share: the table's state, and the current task's holds."""

    __slots__ = ("_manager",)

    def __init__(self, manager: Any) -> None:
        self._manager = manager

    @property
    def manager(self) -> Any:
        """The manager whose table this view uses."""
        return self._manager

    def release_all(self) -> int:
        """Release every key of this manager the current task holds, all levels; how many."""
        return int(self._manager._task_release_all())

    def stats(self) -> LockStats:
        return self._manager.stats()  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self._manager)

    def __contains__(self, key: object) -> bool:
        return key in self._manager

    def __reduce__(self) -> Any:
        return self._manager.__reduce__()


class AsyncLockManager(_AsyncEngineView, Generic[K]):
    """``LockManager.aio``: the manager's table, with the current asyncio task as owner.

    Acquiring methods are coroutines, releasing ones plain methods; names, arguments and
    errors are those of ``LockManager``. Never use ``asyncio.wait_for`` around an acquire on
    Python 3.11 and older: it acquires in an inner task, which then ends holding the key
    (released with an AbandonedLockWarning). Pass ``timeout=`` or use ``asyncio.timeout()``.
    """

    __slots__ = ()

    async def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` for the current task: True once held (reentrant), False if
        ``blocking`` is false or ``timeout`` (seconds, -1 = forever) ran out first. The
        event loop runs other tasks meanwhile; a cancellation leaves nothing acquired."""
        return await _acquire(self._manager, key, WRITE, wait_seconds(blocking, timeout))

    def release(self, key: K) -> None:
        """Undo one ``acquire`` of ``key`` (NotOwnedError if the current task does not hold it)."""
        self._manager._task_release(key, WRITE)

    def hold(self, key: K, timeout: float | None = None) -> _AsyncHolding:
        """``async with aio.hold(key, timeout=...)``: LockTimeout if not acquired in time."""
        return _AsyncHolding(self._manager, key, hold_seconds(timeout), WRITE)

    def __getitem__(self, key: K) -> AsyncKeyLock[K]:
        return AsyncKeyLock(self._manager, key)

    async def acquire_many(self, keys: Iterable[K], blocking: bool = True,
                           timeout: float = -1) -> bool:
        """Lock every key of ``keys`` at once, or none (as ``LockManager.acquire_many``)."""
        seconds = wait_seconds(blocking, timeout)
        return await _acquire_many(self._manager, many_items(keys, self._manager._table_key),
                                   seconds)

    def release_many(self, keys: Iterable[K]) -> None:
        self._manager._task_release_many(many_items(keys, self._manager._table_key))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> _AsyncHoldingMany:
        return _AsyncHoldingMany(self._manager, many_items(keys, self._manager._table_key),
                                 hold_seconds(timeout))

    def locked(self, key: K) -> bool:
        """Whether any thread or task holds ``key``."""
        return bool(self._manager.locked(key))

    def owned(self, key: K) -> bool:
        """Whether the current task holds ``key``."""
        return bool(self._manager._task_levels(key)[0])

    def recursion_count(self, key: K) -> int:
        """How many times the current task holds ``key`` (0 if it does not)."""
        return int(self._manager._task_levels(key)[0])

    def synchronized(self, key_func: Callable[..., Hashable]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """Decorator for coroutine functions: each call holds ``key_func(*args, **kwargs)``
        for the current task while it runs."""
        return _synchronized(self, key_func)

    def __repr__(self) -> str:
        return f"<lockmgr.AsyncLockManager of {self._manager!r}>"


class AsyncRWLockManager(_AsyncEngineView, Generic[K]):
    """``RWLockManager.aio``: shared/exclusive keys with the current asyncio task as owner
    (names, arguments and errors of ``RWLockManager``; see ``AsyncLockManager``)."""

    __slots__ = ()

    async def acquire_read(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        return await _acquire(self._manager, key, READ, wait_seconds(blocking, timeout))

    async def acquire_write(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        return await _acquire(self._manager, key, WRITE, wait_seconds(blocking, timeout))

    def release_read(self, key: K) -> None:
        self._manager._task_release(key, READ)

    def release_write(self, key: K) -> None:
        self._manager._task_release(key, WRITE)

    def read(self, key: K, timeout: float | None = None) -> _AsyncHolding:
        return _AsyncHolding(self._manager, key, hold_seconds(timeout), READ)

    def write(self, key: K, timeout: float | None = None) -> _AsyncHolding:
        return _AsyncHolding(self._manager, key, hold_seconds(timeout), WRITE)

    async def acquire_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                           blocking: bool = True, timeout: float = -1) -> bool:
        seconds = wait_seconds(blocking, timeout)
        return await _acquire_many(
            self._manager, rw_items(reads, writes, self._manager._table_key), seconds)

    def release_many(self, reads: Iterable[K] = (), writes: Iterable[K] = ()) -> None:
        self._manager._task_release_many(rw_items(reads, writes, self._manager._table_key))

    def hold_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                  timeout: float | None = None) -> _AsyncHoldingMany:
        return _AsyncHoldingMany(self._manager,
                                 rw_items(reads, writes, self._manager._table_key),
                                 hold_seconds(timeout))

    def readers(self, key: K) -> int:
        """How many threads and tasks hold ``key`` for reading."""
        return int(self._manager.readers(key))

    def write_locked(self, key: K) -> bool:
        return bool(self._manager.write_locked(key))

    def owned(self, key: K) -> bool:
        """Whether the current task holds ``key`` (for reading or writing)."""
        write, read = self._manager._task_levels(key)
        return bool(write or read)

    def recursion_count(self, key: K) -> int:
        """How many times the current task holds ``key`` for writing (0 if it does not)."""
        return int(self._manager._task_levels(key)[0])

    def synchronized(self, key_func: Callable[..., Hashable]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """As ``AsyncLockManager.synchronized``, holding the key for writing."""
        return _synchronized(self, key_func)

    def __repr__(self) -> str:
        return f"<lockmgr.AsyncRWLockManager of {self._manager!r}>"


def _synchronized(view: Any, key_func: Callable[..., Hashable]
                  ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                Callable[P, Coroutine[Any, Any, T]]]:
    if not callable(key_func):
        raise TypeError(f"key_func must be callable, not {type(key_func).__name__}")
    mode = WRITE
    manager = view._manager

    def decorate(func: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(
                "aio.synchronized() wraps coroutine functions (the task holds the key across "
                f"the call); {getattr(func, '__qualname__', func)!r} is not one: use the "
                "manager's own synchronized()"
            )

        @functools.wraps(func)
        async def locked_call(*args: P.args, **kwargs: P.kwargs) -> T:
            key = key_func(*args, **kwargs)
            async with _AsyncHolding(manager, key, -1.0, mode):
                return await func(*args, **kwargs)

        return locked_call

    return decorate

