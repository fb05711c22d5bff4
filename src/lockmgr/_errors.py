"""The errors (the public exception classes) and the messages both engines raise them with."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Hashable
from typing import Any

from ._args import READ, WRITE
from ._owners import AWAITED_THREAD, LOOP_THREAD
from ._views import _short


class LockError(Exception):
    """Base class of every error lockmgr raises."""


class LockTimeout(LockError, TimeoutError):
    """A key could not be acquired within the timeout (or, for a ``Singleflight`` caller,
    the shared call did not finish within it)."""


class NotOwnedError(LockError, RuntimeError):
    """The caller (a thread, or an asyncio task) released (or asked to give up) a key it does
    not hold, or not in the mode it named."""


class DeadlockError(LockError, RuntimeError):
    """Waiting for a key would close a cycle of threads waiting for each other.

    ``cycle`` lists the cycle as ``(owner, key it waits for)`` pairs, starting with the
    refused request; each owner waits for the next one (the last for the first). An owner
    is a thread's ident or an asyncio task; a task whose event loop's thread is blocked in
    a synchronous acquire waits for that thread, shown as the key ``LOOP_THREAD``; a task
    suspended in ``asyncio.to_thread`` waits for the thread running that call, shown as the
    key ``AWAITED_THREAD``.
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


class FlightAbortedError(LockError, RuntimeError):
    """The call a ``Singleflight`` caller waited for ended without a result to share: it
    raised a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``,
    ``SystemExit``, the cancellation of the task running it) where it ran, which raised
    it there. ``__cause__`` is that exception."""


class LockLost(LockError):
    """A key's lock went away under its holder (a database session that was lost)."""


class AbandonedLockWarning(RuntimeWarning):
    """A thread ended while holding a key; the key was released."""


def describe_owner(owner: object, thread_name: str | None = None) -> str:
    """An owner as its user knows it: "thread 'Worker-1' (ident 1234)" for a thread's
    ident, "task 'Task-3'" for an asyncio task. The thread's name is ``thread_name`` if
    given (an ended thread's, which the engines kept: see ``warn_abandoned``), else
    threading's for a running thread ("thread 1234" for one that has ended)."""
    if isinstance(owner, int):
        if thread_name is None:
            thread = next((each for each in threading.enumerate() if each.ident == owner), None)
            thread_name = None if thread is None else thread.name
        if thread_name is None:
            return f"thread {owner}"
        return f"thread {thread_name!r} (ident {owner})"
    get_name = getattr(owner, "get_name", None)
    return f"task {get_name()!r}" if get_name is not None else f"task {owner!r}"


def _cycle_step(owner: object, key: Hashable) -> str:
    if key is LOOP_THREAD:
        return f"{describe_owner(owner)} waits for its event loop's thread"
    if key is AWAITED_THREAD:
        return f"{describe_owner(owner)} awaits the thread (asyncio.to_thread)"
    return f"{describe_owner(owner)} waits for key {_short.repr(key)}"


def deadlock(cycle: list[tuple[Any, Hashable]]) -> DeadlockError:
    """The error for a wait that would close ``cycle`` (see DeadlockError.cycle)."""
    steps = "; ".join(_cycle_step(owner, key) for owner, key in cycle)
    return DeadlockError(
        f"waiting for key {_short.repr(cycle[0][1])} would deadlock: {steps}, "
        f"held or queued ahead by the next owner in this list (the last by the first)",
        cycle,
    )


def warn_abandoned(owner: object, keys: list[Hashable], thread_name: str | None = None) -> None:
    """Report keys released because their owner (a thread's ident, or an asyncio task)
    ended while holding them. ``thread_name``: an ended thread's name, as it was when the
    thread first used lockmgr (its token's creation): the thread is gone from threading by
    the time its exit releases its keys."""
    for key in keys:
        warnings.warn(
            f"{describe_owner(owner, thread_name)} ended holding key {_short.repr(key)}; "
            "released it",
            AbandonedLockWarning,
            stacklevel=1,
        )


def _caller(owner: object) -> str:
    return "this thread" if owner is None else f"the calling {describe_owner(owner)}"


def not_owned(key: object, owner: object = None, mode: int | None = None) -> NotOwnedError:
    """A release of what ``owner`` (the caller: a thread's ident or a task; None: "this
    thread") does not hold in ``mode`` (READ or WRITE, an RWLockManager's; None: a
    LockManager's, which has one mode)."""
    held = {None: "held", READ: "held for reading", WRITE: "held for writing"}[mode]
    return NotOwnedError(f"key {_short.repr(key)} is not {held} by {_caller(owner)}")


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


def pinned(key: object, owner: object = None) -> NotOwnedError:
    """Releasing a level that a waiting ``acquire_many`` of the same owner took."""
    return NotOwnedError(
        f"key {_short.repr(key)} is held only by a waiting acquire_many of {_caller(owner)}")


def nested_wait(key: object) -> NestedWaitError:
    return NestedWaitError(
        f"cannot wait for key {_short.repr(key)}: this thread is already waiting for a key "
        "(a signal handler or finalizer runs inside that wait)"
    )


def count_overflow(key: object) -> OverflowError:
    return OverflowError(f"recursion count of key {_short.repr(key)} would exceed sys.maxsize")


def timed_out(key: object, seconds: float) -> LockTimeout:
    return LockTimeout(f"key {_short.repr(key)} not acquired within {seconds:g} s")
