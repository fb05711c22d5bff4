"""asyncio tasks on a manager's own lock table: ``locks.aio`` and ``rw.aio``.

An ``aio`` view owns keys by the current asyncio task, in the same table, queues and
wait-for graph as the manager's threads: a task and a thread exclude each other per key,
queue FIFO together, and a cycle among them is a DeadlockError. Both engines implement the
``_task_*`` methods these classes call, with the same semantics (``lockmgr._contract``
types them: ``Engine``, ``LockEngine``, ``RWLockEngine``, ``TaskWait``, ``BlockRecord``):

- ``_task_enter(key, mode, seconds, raises_timeout)`` and
  ``_task_enter_many(items, seconds, raises_timeout)`` acquire for the current task at
  once and answer an awaitable of the outcome: a ready one (True, or False when a try-lock
  found the key taken; with ``raises_timeout`` that is LockTimeout, raised at once), or the
  *wait* of the queued request. Awaiting a wait runs ``_wait_for_grant``: True, or once
  ``seconds`` ran out False (LockTimeout with ``raises_timeout``); any exception takes the
  request out of the queues first. ``wait.waker`` is how a grant reaches the task (posted
  after the granting section);
- ``wait.settle(consumed, deadline)`` (``consumed``: the task took a post) answers True
  (granted: ``wait.complete()`` ends it; an exception before that gives the grant back),
  False (timed out: it left the queues), None (still waiting) or ``AWAIT_POST``
  (a wake-up is on its way: wait for it, whatever the deadline); ``wait.deadline`` and
  ``wait.timed_out()`` (False, or raises the LockTimeout) complete it; ``wait.log_at`` is
  when the slow-wait log wants ``wait.log_slow()`` (< 0: never), a logged wait ends with
  ``wait.log_end(granted)``, and a granted one with ``wait.observe()`` (the manager's wait
  observers);
- ``wait.abandon()`` takes the request out of the queues, or gives back a grant that raced
  the exception (a cancellation): the key goes to the next waiter; ``_task_abandon()`` does
  the same for the current task's request, if it has one (an exception between the
  acquiring call and the await); a task that is done abandons a wait it never awaited;
- ``_task_enter(key, mode, seconds, raises_timeout, record)`` and
  ``_task_enter_many(items, seconds, raises_timeout, record)``, for an ``async with``
  block, enter ``record`` (the object's, from ``_task_record()``) once the task holds what
  it asked for, at once or when its wait is granted; if another task is inside the
  object then, RuntimeError, after giving back what was taken;
- ``_task_key_lock(key)`` is ``aio[key]``: an ``AsyncKeyLock`` (the core has its own, which
  is its own record);
- ``_task_exit(record, key, mode)`` and ``_task_exit_many(record, items)`` are the exit of
  a block: they give back the hold of the task ``record`` names, whatever task runs them
  (or none), and nothing if lockmgr has ended that task; on another thread than that
  task's loop they send the release there. RuntimeError if no block is inside. Either
  way they answer a ready awaitable of None;
- ``_task_release``, ``_task_release_many``, ``_task_release_all`` and ``_task_levels``
  are the sync methods with the current task as owner.

Every method but the exits raises RuntimeError outside a running task.

The rule for an ``async with`` object (``aio[key]``, ``hold()``, ``read()``, ``write()``,
``hold_many()``): it records which task entered it, once that task holds the key, and its
exit gives back exactly that task's hold, whoever runs the exit (nothing if that task has
ended: its end released it). One task is inside an object at a time and may nest it;
another task's entry waits for the key as usual, and raises RuntimeError, taking nothing,
if the object is still another task's when it would enter (two readers; a task that
ended inside it). So a shared object never releases one task's hold on another's exit.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from ._args import READ, WRITE, hold_seconds, many_items, rw_items, wait_seconds
from ._owners import AWAIT_POST, TASK_WAIT_CHECK
from ._views import PICKLE_ERROR, LockStats, checked_key_func, function_to_wrap

if TYPE_CHECKING:
    from types import TracebackType

    # AsyncBlock: what hold(), read(), write() and hold_many() answer, an ``async with``
    # object (the compiled core's own C type, or _AsyncHolding/_AsyncHoldingMany).
    from ._contract import (
        AsyncBlock,
        BlockRecord,
        Engine,
        Items,
        LockEngine,
        RWLockEngine,
        SemaphoreEngine,
        TaskWait,
    )

P = ParamSpec("P")
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

__all__ = ["AsyncKeyLock", "AsyncLockManager", "AsyncRWLockManager", "AsyncSemaphoreManager"]


async def _wait_for_grant(wait: TaskWait) -> bool:
    """Sleep until the queued request of ``wait`` is granted (True) or times out
    (``wait.timed_out()``), running the task's wait check (``TASK_WAIT_CHECK``) on the way.
    Any exception (a cancellation, the check's) takes it out of the queues, or passes a
    grant that raced the exception on to the next waiter, before it propagates."""
    waker, deadline, log_at = wait.waker, wait.deadline, wait.log_at
    check = TASK_WAIT_CHECK.get()
    check_at = -1.0 if check is None else time.monotonic() + check[0]
    outcome: object = None
    logged = False
    try:
        while True:
            wake_at = deadline
            if log_at >= 0 and not logged and (deadline < 0 or log_at < deadline):
                wake_at = log_at
            if check_at >= 0 and (wake_at < 0 or check_at < wake_at):
                wake_at = check_at
            await waker.sleep(-1.0 if outcome is AWAIT_POST else wake_at)
            outcome = wait.settle(waker.take_post(), deadline)
            if outcome is True or outcome is False:
                if outcome is True:
                    wait.observe()
                if logged:
                    wait.log_end(outcome)
                if outcome is True:
                    wait.complete()
                    return True
                return bool(wait.timed_out())
            if log_at >= 0 and not logged and time.monotonic() >= log_at:
                logged = True
                wait.log_slow()
            if check is not None and outcome is None and time.monotonic() >= check_at:
                await check[1]()
                check_at = time.monotonic() + check[0]
    except BaseException:
        wait.abandon()
        raise


class _AsyncHolding:
    """``async with aio.hold(key)`` (and ``read``/``write``): LockTimeout if not acquired.
    Its exit gives back the hold of the task that entered it (see the module's rule)."""

    __slots__ = ("_key", "_manager", "_mode", "_record", "_seconds")

    _manager: Engine
    _record: BlockRecord

    def __init__(self, manager: Engine, key: Hashable, seconds: float, mode: int) -> None:
        self._manager = manager
        self._key = key
        self._seconds = seconds
        self._mode = mode
        self._record = manager._task_record()

    def _enter(self) -> Awaitable[bool]:
        manager = self._manager
        try:
            return manager._task_enter(self._key, self._mode, self._seconds, True, self._record)
        except BaseException:
            manager._task_abandon()
            raise

    def _exit(self, kind: type[BaseException] | None, *exc_info: object) -> Awaitable[None]:
        return self._manager._task_exit(self._record, self._key, self._mode)

    if TYPE_CHECKING:  # the engine's awaitables, typed as the AsyncBlock they act as
        async def __aenter__(self) -> bool: ...

        async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                            traceback: TracebackType | None, /) -> None: ...
    else:
        __aenter__, __aexit__ = _enter, _exit


class _AsyncHoldingMany:
    """``async with aio.hold_many(...)``: every key for the block, or LockTimeout. Its exit
    gives back the holds of the task that entered it (see the module's rule)."""

    __slots__ = ("_items", "_manager", "_record", "_seconds")

    _manager: Engine
    _record: BlockRecord

    def __init__(self, manager: Engine, items: Items, seconds: float) -> None:
        self._manager = manager
        self._items = items
        self._seconds = seconds
        self._record = manager._task_record()

    def _enter(self) -> Awaitable[bool]:
        manager = self._manager
        try:
            return manager._task_enter_many(self._items, self._seconds, True, self._record)
        except BaseException:
            manager._task_abandon()
            raise

    def _exit(self, kind: type[BaseException] | None, *exc_info: object) -> Awaitable[None]:
        return self._manager._task_exit_many(self._record, self._items)

    if TYPE_CHECKING:  # the engine's awaitables, typed as the AsyncBlock they act as
        async def __aenter__(self) -> bool: ...

        async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                            traceback: TracebackType | None, /) -> None: ...
    else:
        __aenter__, __aexit__ = _enter, _exit


class AsyncKeyLock(Generic[K]):
    """``locks.aio[key]``: one key of the table as an asyncio lock owned by the current task
    (reentrant; ``async with`` acquires and releases it). Its exit gives back the hold of
    the task that entered it (see the module's rule)."""

    __slots__ = ("_key", "_manager", "_record")

    _manager: LockEngine[K]
    _record: BlockRecord

    def __init__(self, manager: LockEngine[K], key: K) -> None:
        self._manager = manager
        self._key = key
        self._record = manager._task_record()

    @property
    def key(self) -> K:
        return self._key

    def acquire(self, blocking: bool = True, timeout: float = -1) -> Coroutine[Any, Any, bool]:
        """As ``AsyncLockManager.acquire`` for this view's key: raises what it raises."""
        return self._manager._task_acquire(self._key, blocking, timeout)

    def release(self) -> Awaitable[None]:
        """As ``AsyncLockManager.release`` for this view's key: answers and raises what it
        does."""
        return self._manager._task_release_write(self._key)

    def locked(self) -> bool:
        """Whether any thread or task holds the key. Raises nothing."""
        return bool(self._manager.locked(self._key))

    def __aenter__(self) -> Awaitable[bool]:
        manager = self._manager
        try:
            return manager._task_enter(self._key, WRITE, -1.0, False, self._record)
        except BaseException:
            manager._task_abandon()
            raise

    def __aexit__(self, kind: type[BaseException] | None,
                  exc: BaseException | None, traceback: TracebackType | None) -> Awaitable[None]:
        return self._manager._task_exit(self._record, self._key, WRITE)

    def __reduce__(self) -> Any:
        raise TypeError(PICKLE_ERROR)

    def __repr__(self) -> str:
        return f"<lockmgr.AsyncKeyLock key={self._key!r} locked={self.locked()}>"


class _AsyncEngineView:
    """What both asyncio views share: the table's state, and the current task's holds."""

    __slots__ = ("_manager",)
    _manager: Engine

    def __init__(self, manager: Engine) -> None:
        self._manager = manager

    @property
    def manager(self) -> Any:
        """The manager whose table this view uses."""
        return self._manager

    def release_all(self) -> int:
        """Release every key of this manager the current task holds, all levels; how many.
        Raises RuntimeError outside a running asyncio task."""
        return int(self._manager._task_release_all())

    def stats(self) -> LockStats:
        """The manager's counters (threads and tasks alike). Raises nothing."""
        return self._manager.stats()

    def __len__(self) -> int:
        return len(self._manager)

    def __contains__(self, key: object) -> bool:
        return key in self._manager

    def __reduce__(self) -> Any:
        return self._manager.__reduce__()


class AsyncLockManager(_AsyncEngineView, Generic[K]):
    """``LockManager.aio``: the manager's table, with the current asyncio task as owner.

    Names, arguments and errors are those of ``LockManager``; ``acquire`` is a coroutine
    function, ``release`` a plain one:

    - ``await aio.acquire(key, blocking=True, timeout=-1)``: lock ``key`` for the task
      that awaits it: True once held (reentrant), False if ``blocking`` is false or
      ``timeout`` (seconds, -1 = forever) ran out first. The event loop runs other tasks
      meanwhile; a cancellation leaves nothing acquired.
    - ``aio.release(key)``: undo one ``acquire`` (NotOwnedError if the current task does
      not hold ``key``), at the call. It answers an awaitable that is done already, so
      ``await aio.release(key)`` works too: code written for the PostgreSQL views (whose
      release also releases at the call, and whose awaitable tells when the server has)
      runs here unchanged, and the other way round. ``release_many`` and ``aio[key].release``
      likewise.

    What they raise: ``acquire`` TypeError/ValueError for bad ``blocking``/``timeout`` and
    TypeError for an unhashable key, DeadlockError if waiting would close a cycle of
    tasks and threads, nothing acquired in each case; both raise RuntimeError outside a running asyncio task.

    Both are the engine's own methods, bound here: the compiled core's ``acquire`` answers
    a coroutine of its own, so the uncontended pair runs no Python frame. Never use
    ``asyncio.wait_for`` around an acquire on Python 3.11: it acquires in an inner task,
    which then ends holding the key (released with an AbandonedLockWarning). Pass
    ``timeout=`` or use ``asyncio.timeout()``.
    """

    _manager: LockEngine[K]

    if TYPE_CHECKING:  # what they are; at run time, the engine's methods (below)
        __slots__ = ()

        async def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
            ...

        def release(self, key: K) -> Awaitable[None]:
            ...
    else:
        __slots__ = ("acquire", "release")

        def __init__(self, manager: LockEngine[K]) -> None:
            super().__init__(manager)
            self.acquire = manager._task_acquire
            self.release = manager._task_release_write

    def hold(self, key: K, timeout: float | None = None) -> AsyncBlock:
        """``async with aio.hold(key, timeout=...)``: the key for the block.

        Entering raises LockTimeout if not acquired in time, what ``acquire`` raises, and
        RuntimeError if another task is inside this object when it would enter; leaving
        raises RuntimeError if no task is inside it."""
        return self._manager._task_hold(key, hold_seconds(timeout), WRITE)

    def __getitem__(self, key: K) -> AsyncKeyLock[K]:
        return self._manager._task_key_lock(key)

    def acquire_many(self, keys: Iterable[K], blocking: bool = True,
                     timeout: float = -1) -> Coroutine[Any, Any, bool]:
        """Lock every key of ``keys`` at once, or none (as ``LockManager.acquire_many``): a
        coroutine, as from an ``async def``. Raises what ``acquire`` raises, nothing
        acquired."""
        manager = self._manager
        return manager._task_acquire_many(lambda: many_items(keys, manager._table_key),
                                          blocking, timeout)

    def release_many(self, keys: Iterable[K]) -> Awaitable[None]:
        """Undo one ``acquire_many`` of ``keys``, at the call (an awaitable done already, as
        ``release``'s). Raises NotOwnedError, nothing released, if the current task does not
        hold them all; RuntimeError outside a running asyncio task."""
        return self._manager._task_release_many(many_items(keys, self._manager._table_key, True))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> AsyncBlock:
        """``async with aio.hold_many(keys, timeout=...)``: every key for the block; raises
        what ``hold`` raises."""
        return self._manager._task_hold_many(
            many_items(keys, self._manager._table_key), hold_seconds(timeout))

    def locked(self, key: K) -> bool:
        """Whether any thread or task holds ``key``. Raises TypeError for an unhashable key."""
        return bool(self._manager.locked(key))

    def owned(self, key: K) -> bool:
        """Whether the current task holds ``key``. Raises RuntimeError outside a running asyncio task."""
        return bool(self._manager._task_levels(key)[0])

    def recursion_count(self, key: K) -> int:
        """How many times the current task holds ``key`` (0 if it does not). Raises
        RuntimeError outside a running asyncio task."""
        return int(self._manager._task_levels(key)[0])

    def synchronized(self, key_func: Callable[..., Hashable]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """Decorator for coroutine functions: each call holds ``key_func(*args, **kwargs)``
        for the current task while it runs. A call raises what ``hold`` raises around the
        function's own errors; a ``key_func`` that is not callable, and decorating a
        plain function, raise TypeError. Written bare (``@aio.synchronized``, no key
        function), it raises TypeError saying how to write it."""
        return _synchronized(self, key_func)

    def __repr__(self) -> str:
        return f"<lockmgr.AsyncLockManager of {self._manager!r}>"


class AsyncRWLockManager(_AsyncEngineView, Generic[K]):
    """``RWLockManager.aio``: shared/exclusive keys with the current asyncio task as owner
    (names, arguments and errors of ``RWLockManager``; the acquiring and releasing methods
    are the engine's own, bound here, as for ``AsyncLockManager``: a release is done at the
    call and answers an awaitable done already)."""

    _manager: RWLockEngine[K]

    if TYPE_CHECKING:  # what they are; at run time, the engine's methods (below)
        __slots__ = ()

        async def acquire_read(self, key: K, blocking: bool = True,
                               timeout: float = -1) -> bool: ...

        async def acquire_write(self, key: K, blocking: bool = True,
                                timeout: float = -1) -> bool: ...

        def release_read(self, key: K) -> Awaitable[None]: ...

        def release_write(self, key: K) -> Awaitable[None]: ...
    else:
        __slots__ = ("acquire_read", "acquire_write", "release_read", "release_write")

        def __init__(self, manager: RWLockEngine[K]) -> None:
            super().__init__(manager)
            self.acquire_read = manager._task_acquire_read
            self.acquire_write = manager._task_acquire
            self.release_read = manager._task_release_read
            self.release_write = manager._task_release_write

    def read(self, key: K, timeout: float | None = None) -> AsyncBlock:
        """``async with aio.read(key, timeout=...)``: ``key`` shared for the block; raises
        what ``AsyncLockManager.hold`` raises."""
        return self._manager._task_hold(key, hold_seconds(timeout), READ)

    def write(self, key: K, timeout: float | None = None) -> AsyncBlock:
        """``async with aio.write(key, timeout=...)``: ``key`` exclusive for the block;
        raises what ``AsyncLockManager.hold`` raises."""
        return self._manager._task_hold(key, hold_seconds(timeout), WRITE)

    def acquire_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                     blocking: bool = True, timeout: float = -1) -> Coroutine[Any, Any, bool]:
        """Read ``reads`` and write ``writes`` at once, or none (a key in both is written):
        a coroutine, as from an ``async def``. Raises what ``AsyncLockManager.acquire``
        raises, nothing acquired."""
        manager = self._manager
        return manager._task_acquire_many(
            lambda: rw_items(reads, writes, manager._table_key), blocking, timeout)

    def release_many(self, reads: Iterable[K] = (), writes: Iterable[K] = ()) -> Awaitable[None]:
        """Undo one ``acquire_many``, at the call (an awaitable done already, as
        ``AsyncLockManager.release``'s). Raises NotOwnedError, nothing released, if the
        current task does not hold them so; RuntimeError outside a running asyncio task."""
        return self._manager._task_release_many(
            rw_items(reads, writes, self._manager._table_key, True))

    def hold_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                  timeout: float | None = None) -> AsyncBlock:
        """``async with aio.hold_many(reads, writes, timeout=...)``: all of them for the
        block; raises what ``AsyncLockManager.hold`` raises."""
        return self._manager._task_hold_many(
            rw_items(reads, writes, self._manager._table_key), hold_seconds(timeout))

    def readers(self, key: K) -> int:
        """How many threads and tasks hold ``key`` for reading. Raises TypeError for an
        unhashable key."""
        return int(self._manager.readers(key))

    def write_locked(self, key: K) -> bool:
        """Whether a thread or task holds ``key`` for writing. Raises TypeError for an
        unhashable key."""
        return bool(self._manager.write_locked(key))

    def owned(self, key: K) -> bool:
        """Whether the current task holds ``key`` (for reading or writing). Raises
        RuntimeError outside a running asyncio task."""
        write, read = self._manager._task_levels(key)
        return bool(write or read)

    def recursion_count(self, key: K) -> int:
        """How many times the current task holds ``key`` for writing (0 if it does not).
        Raises RuntimeError outside a running asyncio task."""
        return int(self._manager._task_levels(key)[0])

    def synchronized(self, key_func: Callable[..., Hashable]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """As ``AsyncLockManager.synchronized``, holding the key for writing; raises what
        it raises."""
        return _synchronized(self, key_func)

    def __repr__(self) -> str:
        return f"<lockmgr.AsyncRWLockManager of {self._manager!r}>"


class AsyncSemaphoreManager(_AsyncEngineView, Generic[K]):
    """``SemaphoreManager.aio``: slots of the manager's keys with the current asyncio task as
    owner, in the same queues as its threads (names, arguments and errors of
    ``SemaphoreManager``; ``acquire`` is a coroutine function, ``release`` a plain one
    answering an awaitable done already, as ``AsyncLockManager``'s)."""

    _manager: SemaphoreEngine[K]

    if TYPE_CHECKING:  # what they are; at run time, the engine's methods (below)
        __slots__ = ()

        async def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
            ...

        def release(self, key: K) -> Awaitable[None]:
            ...
    else:
        __slots__ = ("acquire", "release")

        def __init__(self, manager: SemaphoreEngine[K]) -> None:
            super().__init__(manager)
            if manager._slot_mode == WRITE:
                self.acquire = manager._task_acquire
                self.release = manager._task_release_write
            else:
                self.acquire = manager._task_acquire_read
                self.release = manager._task_release_read

    def hold(self, key: K, timeout: float | None = None) -> AsyncBlock:
        """``async with aio.hold(key, timeout=...)``: a slot of ``key`` for the block; raises
        what ``AsyncLockManager.hold`` raises."""
        manager = self._manager
        return manager._task_hold(key, hold_seconds(timeout), manager._slot_mode)

    def __getitem__(self, key: K) -> AsyncBlock:
        """``async with aio[key]``: a slot of ``key`` for the block, waiting as long as it
        takes (``hold(key, timeout)`` bounds the wait)."""
        manager = self._manager
        hash(key)
        return manager._task_hold(key, -1.0, manager._slot_mode)

    def _items(self, keys: Iterable[K], releasing: bool = False) -> Items:
        manager = self._manager
        if manager._slot_mode == WRITE:
            return many_items(keys, manager._table_key, releasing)
        return rw_items(keys, (), manager._table_key, releasing)

    def acquire_many(self, keys: Iterable[K], blocking: bool = True,
                     timeout: float = -1) -> Coroutine[Any, Any, bool]:
        """A slot of every key of ``keys`` at once, or none: a coroutine; raises what
        ``AsyncLockManager.acquire_many`` raises."""
        return self._manager._task_acquire_many(lambda: self._items(keys), blocking, timeout)

    def release_many(self, keys: Iterable[K]) -> Awaitable[None]:
        """Undo one ``acquire_many``, at the call; raises what
        ``AsyncLockManager.release_many`` raises."""
        return self._manager._task_release_many(self._items(keys, True))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> AsyncBlock:
        """``async with aio.hold_many(keys, timeout=...)``: a slot of each for the block;
        raises what ``AsyncLockManager.hold`` raises."""
        return self._manager._task_hold_many(self._items(keys), hold_seconds(timeout))

    def holders(self, key: K) -> int:
        """How many slots of ``key`` are held (an owner holding two counts twice). Raises
        TypeError for an unhashable key."""
        return int(self._manager.holders(key))

    def available(self, key: K) -> int:
        """How many slots of ``key`` are free now. Raises TypeError for an unhashable
        key."""
        return int(self._manager.available(key))

    def owned(self, key: K) -> bool:
        """Whether the current task holds a slot of ``key``. Raises RuntimeError outside a
        running asyncio task."""
        write, read = self._manager._task_levels(key)
        return bool(write or read)

    def synchronized(self, key_func: Callable[..., Hashable]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """As ``AsyncLockManager.synchronized``, holding a slot of the key; raises what it
        raises."""
        return _synchronized(self, key_func, self._manager._slot_mode)

    def __repr__(self) -> str:
        return f"<lockmgr.AsyncSemaphoreManager of {self._manager!r}>"


def _synchronized(view: _AsyncEngineView, key_func: Callable[..., Hashable], mode: int = WRITE
                  ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                Callable[P, Coroutine[Any, Any, T]]]:
    key_func = checked_key_func(key_func, "aio.synchronized")
    manager = view._manager

    def decorate(*args: Any, **kwargs: Any) -> Callable[P, Coroutine[Any, Any, T]]:
        func: Callable[P, Coroutine[Any, Any, T]] = function_to_wrap(
            key_func, args, kwargs, "aio.synchronized")
        if not inspect.iscoroutinefunction(func):
            raise TypeError(
                "aio.synchronized() wraps coroutine functions (the task holds the key across "
                f"the call); {getattr(func, '__qualname__', func)!r} is not one: use the "
                "manager's own synchronized()"
            )

        @functools.wraps(func)
        async def locked_call(*args: P.args, **kwargs: P.kwargs) -> T:
            key = key_func(*args, **kwargs)
            async with manager._task_hold(key, -1.0, mode):
                return await func(*args, **kwargs)

        return locked_call

    return decorate

