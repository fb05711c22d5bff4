"""What the compiled core and the pure twin share: errors, the stats record, argument rules.

Both implementations call these helpers off their fast paths, so each rule is written once.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import reprlib
import sys
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

__all__ = [
    "HANDOFF_AFTER",
    "MAIN_THREAD_SLICE",
    "AWAIT_POST",
    "AbandonedLockWarning",
    "LOOP_THREAD",
    "Waker",
    "current_task_or_none",
    "current_task_or_raise",
    "not_in_task",
    "running_loop",
    "describe_owner",
    "DeadlockError",
    "LockError",
    "LockLost",
    "LockStats",
    "LockTimeout",
    "MAX_COUNT",
    "NestedWaitError",
    "NotOwnedError",
    "READ",
    "WRITE",
    "PICKLE_ERROR",
    "Stripe",
    "count_overflow",
    "deadlock",
    "hold_seconds",
    "key_lock_repr",
    "manager_repr",
    "many_items",
    "nested_wait",
    "not_owned",
    "pinned",
    "restored_count",
    "stripe_count",
    "stripe_index",
    "rw_items",
    "shards_per_table",
    "synchronized",
    "timed_out",
    "wait_seconds",
    "warn_abandoned",
]

#: Shards per manager of the compiled core when ``LOCKMGR_SHARDS`` is not set: on a
#: free-threaded build threads using keys of different shards never touch the same memory;
#: with a GIL only one thread runs at a time, so one shard saves memory.
FREE_THREADED_SHARDS = 64
MAX_SHARDS = 1024


def shards_per_table(setting: str | None, free_threaded: bool) -> int:
    """The shard count a ``LOCKMGR_SHARDS`` value asks for (a power of two, 1 to 1024)."""
    if setting is None or setting == "":
        return FREE_THREADED_SHARDS if free_threaded else 1
    try:
        count = int(setting)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_SHARDS or count & (count - 1):
        raise ValueError(
            f"LOCKMGR_SHARDS must be a power of two from 1 to {MAX_SHARDS}, not {setting!r}"
        )
    return count


#: In ``fair=False`` mode a waiter that has queued this long (seconds) is handed the key
#: directly instead of racing newcomers for it (CPython's and parking_lot's rule).
HANDOFF_AFTER = 0.001

#: The main thread waits in slices this long (seconds) so that Python signal handlers run
#: promptly even when the signal was delivered to another thread.
MAIN_THREAD_SLICE = 0.05

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60


class LockError(Exception):
    """Base class of every error lockmgr raises."""


class LockTimeout(LockError, TimeoutError):
    """A key could not be acquired within the timeout."""


class NotOwnedError(LockError, RuntimeError):
    """The calling thread released (or asked to give up) a key it does not hold."""


class DeadlockError(LockError, RuntimeError):
    """Waiting for a key would close a cycle of threads waiting for each other.

    ``cycle`` lists the cycle as ``(owner, key it waits for)`` pairs, starting with the
    refused request; each owner waits for the next one (the last for the first). An owner
    is a thread's ident or an asyncio task; a task whose event loop's thread is blocked in
    a synchronous acquire waits for that thread, shown as the key ``LOOP_THREAD``.
    """

    def __init__(self, message: str, cycle: list[tuple[Any, Hashable]]) -> None:
        super().__init__(message)
        self.cycle = cycle


class NestedWaitError(LockError, RuntimeError):
    """A thread that is already waiting for a key tried to wait for another.

    Only code that runs inside a wait can do that: a signal handler, or a finalizer (on
    3.12+ the garbage collector runs inside the waits of every thread). Such code may take
    free keys, re-enter held ones, try-lock and release; it may not queue.
    """


class LockLost(LockError):
    """A key's lock went away under its holder (a database session that was lost)."""


class AbandonedLockWarning(RuntimeWarning):
    """A thread ended while holding a key; the key was released."""


@dataclass(frozen=True)
class LockStats:
    """A snapshot of a manager's counters (each read at one instant, under the table guard)."""

    held: int
    """Keys currently held."""
    waiting: int
    """Requests currently waiting in a queue."""
    acquisitions: int
    """Successful acquisitions, reentrant ones included."""
    contended: int
    """Acquisitions that had to wait."""
    timeouts: int
    """Acquisitions that gave up: timed out, or a try-lock that found the key taken."""
    deadlocks: int
    """Acquisitions refused because waiting would have deadlocked."""


def wait_seconds(blocking: object, timeout: float) -> float:
    """Seconds to wait, under ``threading.Lock.acquire``'s argument rules.

    Returns -1.0 for "wait forever" and 0.0 for "try once". Raises the same exception
    types as ``threading.Lock.acquire`` for the same bad arguments.
    """
    if isinstance(timeout, float):
        if math.isnan(timeout):
            raise ValueError("timeout must not be NaN")
        seconds = timeout
    else:
        seconds = float(operator.index(timeout))
    if not blocking:
        if seconds != -1:
            raise ValueError("can't specify a timeout for a non-blocking call")
        return 0.0
    if seconds == -1:
        return -1.0
    if seconds < 0:
        raise ValueError("timeout value must be a non-negative number or -1")
    if seconds > threading.TIMEOUT_MAX:
        raise OverflowError("timeout value is too large")
    return seconds


def hold_seconds(timeout: float | None) -> float:
    """Seconds to wait for a ``hold()``: None or -1 wait forever, 0 tries once."""
    if timeout is None:
        return -1.0
    return wait_seconds(True, timeout)


def describe_owner(owner: object) -> str:
    """"thread 1234" for a thread's ident, "task 'name'" for an asyncio task."""
    if isinstance(owner, int):
        return f"thread {owner}"
    get_name = getattr(owner, "get_name", None)
    return f"task {get_name()!r}" if get_name is not None else f"task {owner!r}"


def _cycle_step(owner: object, key: Hashable) -> str:
    if key is LOOP_THREAD:
        return f"{describe_owner(owner)} waits for its event loop's thread"
    return f"{describe_owner(owner)} waits for key {_short.repr(key)}"


def deadlock(cycle: list[tuple[Any, Hashable]]) -> DeadlockError:
    """The error for a wait that would close ``cycle`` (see DeadlockError.cycle)."""
    steps = "; ".join(_cycle_step(owner, key) for owner, key in cycle)
    return DeadlockError(
        f"waiting for key {_short.repr(cycle[0][1])} would deadlock: {steps}, "
        f"held or queued ahead by the next owner in this list (the last by the first)",
        cycle,
    )


def warn_abandoned(owner: object, keys: list[Hashable]) -> None:
    """Report keys released because their owner (a thread's ident, or an asyncio task)
    ended while holding them."""
    for key in keys:
        warnings.warn(
            f"{describe_owner(owner)} ended holding key {_short.repr(key)}; released it",
            AbandonedLockWarning,
            stacklevel=1,
        )


class _LoopThread:
    """The "key" a task waits for in a deadlock cycle when what it needs is the thread that
    runs its event loop (blocked in a synchronous acquire)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<its event loop's thread>"


LOOP_THREAD: Any = _LoopThread()


# -- asyncio tasks as owners -------------------------------------------------------------------

#: What an engine's ``settle`` answers when a wake-up is already on its way to the task: it
#: must wait for that wake-up (its ``Waker`` post) before its request may change again.
AWAIT_POST = "await post"


def current_task_or_none() -> Any:
    """The running asyncio task, or None outside one."""
    try:
        return sys.modules["asyncio"].current_task()  # imported by whoever runs a loop
    except (KeyError, RuntimeError):  # no asyncio yet, or no running loop
        return None


def current_task_or_raise() -> Any:
    """The running asyncio task: the owner of every ``aio`` call (RuntimeError outside one)."""
    task = current_task_or_none()
    if task is None:
        not_in_task()
    return task


def not_in_task() -> NoReturn:
    raise RuntimeError(
        "lockmgr's aio methods must be called from an asyncio task (the task owns the "
        "keys it acquires); threads use the manager's own methods"
    )


def running_loop() -> Any:
    """The running event loop (the caller runs in a task: asyncio is imported)."""
    return sys.modules["asyncio"].get_running_loop()


class Waker:
    """How a lock table wakes one waiting task: the task sleeps on a future of its loop; a
    grant or wake-up *posts* (from any thread, never inside a section); the task takes the
    post before it looks at its request again. A binary semaphore, like a waiting thread's
    wakeup lock, whose count is touched on the loop's thread only."""

    __slots__ = ("future", "loop", "lost", "posts", "thread")

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.thread = threading.get_ident()  # the thread running the task (and its loop)
        self.posts = 0  # loop thread only
        self.future: Any = None  # loop thread only: what the task sleeps on
        # Set by the engine while the task waits: what to do if its loop is closed (the
        # task can never run again): leave the queues, release what the task holds.
        self.lost: Callable[[], object] | None = None

    def post(self) -> None:
        """Wake the task (any thread; it runs in a releasing call's finish)."""
        try:
            if self.loop.is_closed():
                raise RuntimeError("its event loop is closed")
            if threading.get_ident() == self.thread:
                self._post_here()
            else:
                self.loop.call_soon_threadsafe(self._post_here)
        except RuntimeError:  # closed (maybe just now): the task never runs again
            lost, self.lost = self.lost, None
            if lost is not None:
                lost()

    def _post_here(self) -> None:
        self.posts += 1
        future = self.future
        if future is not None and not future.done():
            future.set_result(None)

    def take_post(self) -> bool:
        if self.posts:
            self.posts -= 1
            return True
        return False

    async def sleep(self, deadline: float) -> None:
        """Until a post is there, or the monotonic ``deadline`` (< 0: none) passed. The
        future is published before ``posts`` is read: a post from code that runs in
        between (a signal handler's release, a collection's finalizer) is counted before
        the check, or finds the future to resolve after it."""
        future = self.future = self.loop.create_future()
        if self.posts:
            self.future = None
            return
        timer = None
        if deadline >= 0:
            timer = self.loop.call_later(max(deadline - time.monotonic(), 0.0), _settle_future,
                                         future)
        try:
            await future
        finally:
            self.future = None
            if timer is not None:
                timer.cancel()


def _settle_future(future: Any) -> None:
    if not future.done():
        future.set_result(None)


MAX_STRIPES = 1 << 24


def stripe_count(stripes: int | None) -> int | None:
    """``stripes=`` checked and rounded up to a power of two (None: one lock per key)."""
    if stripes is None:
        return None
    count = operator.index(stripes)
    if not 1 <= count <= MAX_STRIPES:
        raise ValueError(f"stripes must be between 1 and {MAX_STRIPES}, not {count}")
    return 1 << (count - 1).bit_length()


class Stripe(int):
    """The one lock a striped manager uses for every key that maps to it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<stripe {int(self)}>"


def stripe_index(key_hash: int, count: int) -> int:
    """Which of ``count`` (a power of two) stripes a key hashing to ``key_hash`` uses.

    The compiled core computes the same in C: multiply by 2**64/phi modulo 2**64, fold the
    high half onto the low half, keep the low bits.
    """
    mixed = (key_hash * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    return (mixed ^ (mixed >> 32)) & (count - 1)


READ = 1  # a shared (read) request
WRITE = 2  # an exclusive (write) request


def _distinct_locks(
    keys: Iterable[Hashable], argument: str, lock_key: Callable[[Hashable], Hashable]
) -> dict[Hashable, None]:
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"{argument} must be an iterable of keys, not a single {type(keys).__name__}")
    return dict.fromkeys(map(lock_key, keys))


def many_items(
    keys: Iterable[Hashable], lock_key: Callable[[Hashable], Hashable]
) -> list[tuple[Hashable, int]]:
    """``LockManager.*_many``: each distinct lock (key, or stripe) once, for write."""
    return [(key, WRITE) for key in _distinct_locks(keys, "keys", lock_key)]


def rw_items(
    reads: Iterable[Hashable], writes: Iterable[Hashable], lock_key: Callable[[Hashable], Hashable]
) -> list[tuple[Hashable, int]]:
    """``RWLockManager.*_many``: each distinct lock once; one named in both is written."""
    written = _distinct_locks(writes, "writes", lock_key)
    items = [(key, WRITE) for key in written]
    items += [(key, READ) for key in _distinct_locks(reads, "reads", lock_key) if key not in written]
    return items


#: The highest recursion level of one key for one thread (a C ``Py_ssize_t`` in the core).
MAX_COUNT = sys.maxsize


def not_owned(key: object) -> NotOwnedError:
    return NotOwnedError(f"key {_short.repr(key)} is not held by this thread")


def block_in_use(task: object, ended: bool) -> RuntimeError:
    """Entering an ``async with`` object that another task is inside (its record holds one
    task at a time: see lockmgr._aio)."""
    whose = "a task that ended inside it (its coroutine is not closed yet)" if ended else (
        f"another task ({task!r})")
    return RuntimeError(
        f"this async with object is already entered by {whose}; enter one object per "
        "block: async with aio[key] or aio.hold(key) makes a fresh one")


def not_owned_block(key: object, task: object) -> NotOwnedError:
    """A PostgreSQL block's exit run by another task than the live one inside it, whose
    connection it cannot use."""
    return NotOwnedError(
        f"the block holding key {_short.repr(key)} is {task!r}'s, which still runs; its "
        "exit ran in another task and cannot release for it (the key stays held until that "
        "task releases it or ends)")


def not_entered() -> RuntimeError:
    return RuntimeError("__aexit__ of an async with object that is not entered")


def pinned(key: object) -> NotOwnedError:
    """Releasing a level that a waiting ``acquire_many`` of the same thread took."""
    return NotOwnedError(f"key {_short.repr(key)} is held only by a waiting acquire_many of this thread")


def nested_wait(key: object) -> NestedWaitError:
    return NestedWaitError(
        f"cannot wait for key {_short.repr(key)}: this thread is already waiting for a key "
        "(a signal handler or finalizer runs inside that wait)"
    )


def count_overflow(key: object) -> OverflowError:
    return OverflowError(f"recursion count of key {_short.repr(key)} would exceed sys.maxsize")


def timed_out(key: object, seconds: float) -> LockTimeout:
    return LockTimeout(f"key {_short.repr(key)} not acquired within {seconds:g} s")


def restored_count(state: tuple[int, int]) -> int:
    """The recursion level in a ``_release_save()`` state, checked before anything changes."""
    count = operator.index(state[0])
    if count < 1:
        raise ValueError(f"invalid saved recursion count {count!r}")
    if count > MAX_COUNT:
        raise OverflowError(f"saved recursion count {count!r} exceeds sys.maxsize")
    return count


def manager_repr(manager: object, fair: bool, held: int, waiting: int) -> str:
    name = type(manager).__name__
    option = f" fair={fair}" if name == "LockManager" else ""
    return f"<lockmgr.{name}{option} held={held} waiting={waiting} at {id(manager):#x}>"


def key_lock_repr(view: object, key: object, owner: int | None, count: int) -> str:
    state = "unlocked" if owner is None else "locked"
    return (
        f"<{state} lockmgr.KeyLock object key={_short.repr(key)} "
        f"owner={owner or 0} count={count} at {id(view):#x}>"
    )


PICKLE_ERROR = "lock managers and their views cannot be pickled: locks belong to one process"


class _Holder(Protocol):
    def hold(self, key: Any, timeout: float | None = None) -> AbstractContextManager[object]: ...


P = ParamSpec("P")
T = TypeVar("T")


def synchronized(
    manager: _Holder, key_func: Callable[..., Hashable]
) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Decorator factory behind ``LockManager.synchronized``.

    The decorated function keeps its signature for type checkers (``ParamSpec``).
    ``key_func`` is called with the same arguments, so it must accept them; its own
    signature is not checked against the function's (a ``lambda natural_id, **_: ...``
    must stay usable), only its result's type, by the managers' annotations.
    """
    if not callable(key_func):
        raise TypeError(f"key_func must be callable, not {type(key_func).__name__}")

    def decorate(func: Callable[P, T]) -> Callable[P, T]:
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                "synchronized() holds a thread lock across the call; it cannot wrap "
                f"the coroutine function {func.__qualname__}"
            )

        @functools.wraps(func)
        def locked_call(*args: P.args, **kwargs: P.kwargs) -> T:
            with manager.hold(key_func(*args, **kwargs)):
                return func(*args, **kwargs)

        return locked_call

    return decorate
