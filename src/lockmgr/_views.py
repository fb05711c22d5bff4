"""What the managers show: the stats record, the reprs, pickling's refusal, and the
``synchronized`` decorator."""

from __future__ import annotations

import functools
import inspect
import reprlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60


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
