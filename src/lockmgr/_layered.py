"""What the backends across processes (``lockmgr.postgres``, ``lockmgr.host``) give their
users alike: the ``Lease`` of a block, the context manager that takes it, and the ``[key]``
view; for asyncio tasks, the ``async with`` objects, the record of which task is inside
one, and ``aio.synchronized``. Each backend's manager has the lock manager's methods
(``acquire``, ``release``, ``owned``, ``recursion_count``, ``locked``), a ``_check_key``
that refuses a key it cannot lock, and a ``_lease`` of what a call holds."""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar

from ._args import restored_count
from ._errors import (
    LockError,
    block_in_use,
    not_entered,
    not_owned,
    not_owned_block,
    timed_out,
)
from ._owners import current_task_or_none
from ._views import checked_key_func, function_to_wrap

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)
P = ParamSpec("P")  # a synchronized coroutine function's parameters
T = TypeVar("T")  # and its result


def _no_fencing() -> LockError:
    return LockError("this manager takes no fences: create it with fencing=True")


def _read_has_no_fence(key: Hashable) -> LockError:
    return LockError(f"key {key!r} is held for reading: only a write takes a fence")


class Lease:
    """What ``with locks.hold(key) as lease:`` (``write``, ``read``, ``hold_many``) gives:
    truthy, like the ``True`` it stands for, with the ``keys`` held and, from a manager
    made with ``fencing=True``, the fence each written key was taken under.

    A fence strictly increases for its key across every process, connection and server
    restart: pass it with each write to storage that refuses a fence lower than one it
    has seen, and a holder whose lock was lost under it (a long pause, a dead session) can
    no longer overwrite the work of the one that took the key next."""

    __slots__ = ("_fences", "_keys")

    def __init__(self, keys: tuple[Hashable, ...], fences: dict[Hashable, int] | None) -> None:
        self._keys = keys
        self._fences = fences  # written key -> fence; None: the manager takes no fences

    @property
    def keys(self) -> tuple[Hashable, ...]:
        return self._keys

    @property
    def fence(self) -> int:
        """The fence of a single-key lease (LockError for a read, or several keys)."""
        fences = self.fences
        if len(self._keys) != 1:
            raise LockError(f"a lease on {len(self._keys)} keys has a fence for each: "
                            "use lease.fences")
        key = self._keys[0]
        if key not in fences:
            raise _read_has_no_fence(key)
        return fences[key]

    @property
    def fences(self) -> dict[Hashable, int]:
        """Each written key's fence (read keys have none): a copy."""
        if self._fences is None:
            raise _no_fencing()
        return dict(self._fences)

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<Lease {', '.join(map(self._describe, self._keys))}>"

    def _describe(self, key: Hashable) -> str:
        if self._fences is None:
            return repr(key)
        return f"{key!r} fence={self._fences[key]}" if key in self._fences else f"{key!r} (read)"


class Leasing(Protocol):
    def _lease(self, items: Sequence[tuple[Hashable, int]]) -> Lease: ...


class Held:
    """What ``hold()``, ``read()``, ``write()`` and ``hold_many()`` return."""

    __slots__ = ("_acquire", "_items", "_manager", "_release", "_seconds")

    def __init__(self, manager: Leasing, items: list[tuple[Hashable, int]],
                 acquire: Callable[[], bool], release: Callable[[], None],
                 seconds: float) -> None:
        self._manager = manager
        self._items = items
        self._acquire = acquire
        self._release = release
        self._seconds = seconds

    def __enter__(self) -> Lease:
        if not self._acquire():
            keys = [key for key, _ in self._items]
            raise timed_out(keys[0] if len(keys) == 1 else tuple(keys), self._seconds)
        return self._manager._lease(self._items)

    def __exit__(self, *exc_info: object) -> None:
        self._release()


class ExclusiveManager(Protocol[K_contra]):
    def _check_key(self, key: K_contra) -> object: ...
    def acquire(self, key: K_contra, blocking: bool = True, timeout: float = -1) -> bool: ...
    def release(self, key: K_contra) -> None: ...
    def locked(self, key: K_contra) -> bool: ...
    def owned(self, key: K_contra) -> bool: ...
    def recursion_count(self, key: K_contra) -> int: ...


class LayeredKeyLock(Generic[K]):
    """``locks[key]`` of an exclusive manager across processes: ``acquire``, ``release``,
    ``locked``, ``with``, and ``threading.Condition(locks[key])``.

    Making one raises TypeError for a key the manager cannot take (keys are str, bytes,
    int and tuples of them)."""

    __slots__ = ("key", "manager")

    def __init__(self, manager: ExclusiveManager[K], key: K) -> None:
        manager._check_key(key)  # a key the manager cannot take fails here
        self.manager = manager
        self.key = key

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """``manager.acquire(key, ...)``: raises what it raises."""
        return self.manager.acquire(self.key, blocking, timeout)

    def release(self) -> None:
        """``manager.release(key)``: raises what it raises."""
        self.manager.release(self.key)

    def locked(self) -> bool:
        """``manager.locked(key)``: raises what it raises."""
        return self.manager.locked(self.key)

    def _is_owned(self) -> bool:
        return self.manager.owned(self.key)

    def _recursion_count(self) -> int:
        return self.manager.recursion_count(self.key)

    def _release_save(self) -> tuple[int, int]:
        """For ``threading.Condition``: give the key up entirely, remembering the level."""
        count = self.manager.recursion_count(self.key)
        if not count:
            raise not_owned(self.key, threading.get_ident())
        for _ in range(count):
            self.manager.release(self.key)
        return count, threading.get_ident()

    def _acquire_restore(self, state: tuple[int, int]) -> None:
        self.manager.acquire(self.key)
        for _ in range(restored_count(state) - 1):
            self.manager.acquire(self.key)

    def __enter__(self) -> bool:
        return self.manager.acquire(self.key)

    def __exit__(self, *exc_info: object) -> None:
        self.manager.release(self.key)


# -- asyncio tasks as owners: what the backends' ``aio`` views share ---------------------------


class TaskOwners(Protocol):
    """A backend's record of its tasks: ``entered()`` names the current task (which has just
    acquired) and its state, whose ``ended`` turns true once the task has ended and its
    holds went with it; ``lease(items)`` is its lease on what it has just acquired."""

    def entered(self) -> tuple[Any, Ending]: ...
    def lease(self, items: Sequence[tuple[Hashable, int]]) -> Lease: ...


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
