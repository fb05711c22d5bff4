"""What the managers show: the stats record, the reprs, pickling's refusal, and the
``synchronized`` decorator."""

from __future__ import annotations

import functools
import inspect
import reprlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar

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


def semaphore_repr(manager: object, limit: object, fair: bool, held: int, waiting: int) -> str:
    if callable(limit):
        limit = getattr(limit, "__qualname__", limit)
    return (f"<lockmgr.SemaphoreManager limit={limit} fair={fair} held={held} "
            f"waiting={waiting} at {id(manager):#x}>")


def key_lock_repr(view: object, key: object, owner: int | None, count: int) -> str:
    state = "unlocked" if owner is None else "locked"
    return (
        f"<{state} lockmgr.KeyLock object key={_short.repr(key)} "
        f"owner={owner or 0} count={count} at {id(view):#x}>"
    )


PICKLE_ERROR = "lock managers and their views cannot be pickled: locks belong to one process"


K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)


class _Semaphores(Protocol[K_contra]):
    def acquire(self, key: K_contra, blocking: bool = True, timeout: float = -1) -> bool: ...
    def release(self, key: K_contra) -> None: ...
    def holders(self, key: K_contra) -> int: ...
    def available(self, key: K_contra) -> int: ...


class KeySemaphore(Generic[K]):
    """One key of a ``SemaphoreManager`` (``manager[key]``): its ``acquire``, ``release``,
    ``holders``, ``available``, and ``with`` for a slot held over a block (waiting as long
    as it takes; ``manager.hold(key, timeout)`` bounds the wait).

    Views are cheap and not cached: two views of one key of one manager are the same
    semaphore (and compare equal). A view keeps its manager alive."""

    __slots__ = ("_key", "_manager")

    def __init__(self, manager: _Semaphores[K], key: K) -> None:
        self._manager = manager
        self._key = key

    @property
    def key(self) -> K:
        return self._key

    @property
    def manager(self) -> _Semaphores[K]:
        return self._manager

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """``manager.acquire(key, ...)``: raises what it raises."""
        return self._manager.acquire(self._key, blocking, timeout)

    def release(self) -> None:
        """``manager.release(key)``: raises what it raises."""
        self._manager.release(self._key)

    def holders(self) -> int:
        """``manager.holders(key)``. Raises nothing."""
        return self._manager.holders(self._key)

    def available(self) -> int:
        """``manager.available(key)``. Raises nothing."""
        return self._manager.available(self._key)

    def __enter__(self) -> bool:
        self._manager.acquire(self._key)
        return True

    def __exit__(self, *exc_info: object) -> None:
        self._manager.release(self._key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeySemaphore):
            return NotImplemented
        return self._manager is other._manager and bool(self._key == other._key)

    def __hash__(self) -> int:
        return hash((id(self._manager), self._key))

    def __reduce__(self) -> Any:
        raise TypeError(PICKLE_ERROR)

    def __repr__(self) -> str:
        return (f"<lockmgr.KeySemaphore key={_short.repr(self._key)} "
                f"holders={self.holders()} at {id(self):#x}>")


class _Holder(Protocol):
    def hold(self, key: Any, timeout: float | None = None) -> AbstractContextManager[object]: ...


P = ParamSpec("P")
T = TypeVar("T")


def checked_key_func(key_func: object, decorator: str) -> Callable[..., Hashable]:
    """``key_func`` as a ``synchronized(key_func)`` takes it: a plain callable that computes
    the key from the call's arguments. A coroutine function is refused (its result is no
    key): ``@synchronized`` written bare over one is caught here, at decoration."""
    if not callable(key_func):
        raise TypeError(
            f"{decorator}(key_func): key_func must be a callable that returns the key from the "
            f"call's arguments, not {type(key_func).__name__}; for one fixed key, write "
            f"@{decorator}(lambda *args, **kwargs: KEY)")
    if inspect.iscoroutinefunction(key_func) or inspect.isasyncgenfunction(key_func):
        raise TypeError(
            f"{decorator}(key_func) was given {_name(key_func)}, a coroutine function, as its "
            f"key function: a bare @{decorator} over it? Write @{decorator}(lambda <its "
            "arguments>: key) above the function: the key function gets the call's "
            "arguments and returns the key to hold")
    return key_func


def function_to_wrap(
    key_func: Callable[..., Hashable], args: tuple[object, ...], kwargs: dict[str, object],
    decorator: str,
) -> Callable[..., Any]:
    """What the decorator ``synchronized(key_func)`` answers was applied to: one callable.

    Anything else is a bare ``@synchronized`` over ``key_func`` (the function, which the
    decorator replaced), now called with that function's arguments: refused, saying how to
    write it, rather than answering a wrapper and never running the body. (Such a function
    called with one callable argument cannot be told from a decoration.)"""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    if kwargs or len(args) != 1:
        given = f"{len(args)} positional and {len(kwargs)} keyword arguments"
    else:
        given = f"a value of type {type(args[0]).__name__}"
    raise TypeError(
        f"{decorator}(key_func) returns a decorator, which takes the one function to wrap, "
        f"not {given}: is {_name(key_func)} decorated with a bare @{decorator}? Write "
        f"@{decorator}(lambda <its arguments>: key) above it: the key function gets the "
        "call's arguments and returns the key to hold")


def _name(function: object) -> str:
    return repr(getattr(function, "__qualname__", function))


def synchronized(
    manager: _Holder, key_func: Callable[..., Hashable]
) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Decorator factory behind ``LockManager.synchronized``.

    The decorated function keeps its signature for type checkers (``ParamSpec``).
    ``key_func`` is called with the same arguments, so it must accept them; its own
    signature is not checked against the function's (a ``lambda natural_id, **_: ...``
    must stay usable), only its result's type, by the managers' annotations.
    """
    key_func = checked_key_func(key_func, "synchronized")

    def decorate(*args: Any, **kwargs: Any) -> Callable[P, T]:
        func: Callable[P, T] = function_to_wrap(key_func, args, kwargs, "synchronized")
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
