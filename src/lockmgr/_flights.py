"""What ``Singleflight`` and its ``aio`` view share: the record of one flight (one running
call and what it ended with) and the table of a flight group's running calls.

How waiting works. The caller that starts a flight (a thread, or for ``aio`` a task of its
own) takes the flight's record as a key for writing in a private ``RWLockManager`` of the
engine, before the record is published in the table, and gives it back once the outcome
is stored. A caller that joins waits to read that key, and gives it back at once. So every
wait for a flight is a wait in the engine: it has the engine's timeouts and cancellation,
a finished call wakes all its waiters in one grant (they are readers), and the engine's
deadlock detection sees who waits for whom: a call that waits, through other flights or
lock managers of the same engine, for a flight that waits for it is refused with
DeadlockError instead of hanging. Each flight is its own key (the record, hashed by
identity), so a new flight of the same key never queues behind the waiters of the last.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Hashable
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._errors import DeadlockError, FlightAbortedError, LockTimeout, NotOwnedError
from ._views import _short

if TYPE_CHECKING:
    import asyncio

    from ._aio import AsyncRWLockManager
    from ._pure import RWLockManager

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Flight(Generic[V]):
    """One call in flight: who runs it, and once it has ended, what it ended with.

    The outcome is written before the runner gives back its write hold, and read after a
    waiter's read is granted: the engine's hand-off orders the two."""

    __slots__ = ("key", "owner", "thread", "task", "value", "error", "traceback", "aborted",
                 "waiters", "cancel_when_abandoned", "abandoned", "guard")

    def __init__(self, key: Hashable, owner: object, thread: int) -> None:
        self.key = key
        #: the runner: a thread's ident, or the asyncio task running the coroutine
        self.owner = owner
        #: the thread the runner blocks while the call runs (the task's loop's thread)
        self.thread = thread
        self.task: asyncio.Task[Any] | None = None
        self.value: V | None = None
        self.error: Exception | None = None
        self.traceback: TracebackType | None = None
        self.aborted: BaseException | None = None
        # A task's flight counts its waiters, so that it can be cancelled once the last one
        # left, if every caller asked for that (see AsyncSingleflight.call).
        self.waiters = 0
        self.cancel_when_abandoned = True
        self.abandoned = False
        self.guard = threading.Lock()

    def join(self, cancel_when_abandoned: bool) -> bool:
        """Counts a waiter in (a task's flight): False if the flight was abandoned (its
        task is being cancelled: the caller starts a new one)."""
        with self.guard:
            if self.abandoned:
                return False
            self.waiters += 1
            if not cancel_when_abandoned:
                self.cancel_when_abandoned = False
            return True

    def leave(self) -> bool:
        """Counts a waiter out: True if it was the last, every caller asked for the call to
        be cancelled then, and it still runs (the caller cancels it)."""
        with self.guard:
            self.waiters -= 1
            task = self.task
            if (self.waiters or not self.cancel_when_abandoned or self.abandoned
                    or task is None or task.done()):
                return False
            self.abandoned = True
            return True

    def outcome(self) -> V:
        """The call's result, or its exception raised again: the same object for every
        caller (as ``concurrent.futures.Future.result()`` does), with the traceback it had
        when the call raised it; FlightAbortedError if it ended with a BaseException."""
        error = self.error
        if error is not None:
            raise error.with_traceback(self.traceback)
        if self.aborted is not None:
            raise aborted(self.key, self.aborted) from self.aborted
        return self.value  # type: ignore[return-value]  # set: the call returned

    def __repr__(self) -> str:
        return f"<flight of key {_short.repr(self.key)}>"


def aborted(key: object, cause: BaseException) -> FlightAbortedError:
    return FlightAbortedError(
        f"the call for key {_short.repr(key)} ended with {type(cause).__name__} in the caller "
        "that ran it (its __cause__); it has no result to share")


def flight_timed_out(key: object, seconds: float) -> LockTimeout:
    return LockTimeout(f"the call for key {_short.repr(key)} did not finish within {seconds:g} s")


def recursion(key: object, owner: object) -> DeadlockError:
    """Waiting for a flight that ``owner`` (the caller) runs, or that runs below it on its
    thread: it would wait for itself."""
    return DeadlockError(
        f"the call for key {_short.repr(key)} is run by this caller (or on this thread, "
        "below it): waiting for it would deadlock", [(owner, key)])


def give_back_read(locks: RWLockManager[Any] | AsyncRWLockManager[Any],
                   flight: Flight[Any]) -> None:
    """The read of ``flight`` the caller (thread, or task through ``aio``) holds, if it does:
    a flight's record is read by its waiters only, each once, so a read held here is the
    interrupted wait's. (A task's release is done at the call.)"""
    with contextlib.suppress(NotOwnedError):
        locks.release_read(flight)


def checked_callable(fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"the function of a flight must be callable, not {type(fn).__name__}")


def engine_locks(engine: ModuleType | None) -> RWLockManager[Any]:
    """A private reader/writer manager of ``engine`` (``lockmgr._core`` or ``lockmgr._pure``),
    or, for None, of the engine ``lockmgr`` chose (read when the flight group is made)."""
    if engine is None:
        # The package's own RWLockManager, the engine it chose (the package, which imports
        # this module, has done so by the time a group is made): looked up, not imported.
        package: Any = sys.modules[__name__.rpartition(".")[0]]
        chosen: RWLockManager[Any] = package.RWLockManager()
        return chosen
    manager: RWLockManager[Any] = engine.RWLockManager()
    return manager


class FlightTable(Generic[K, V]):
    """The running flights of one group by key, and the engine table their waits use.

    Starting is ``dict.setdefault`` (atomic, free-threaded builds included), so joining a
    running flight takes no lock of this module; a flight leaves the table under ``_retire``,
    which only ``retire`` and ``forget`` take."""

    __slots__ = ("flights", "locks", "starting", "_retire", "__weakref__")

    def __init__(self, engine: ModuleType | None) -> None:
        self.flights: dict[K, Flight[V]] = {}
        #: The keys whose runner task is made and has not yet published its flight: what
        #: it will answer (tasks of its loop asking meanwhile wait for that, rather than
        #: each making a runner of its own).
        self.starting: dict[K, asyncio.Future[Flight[V]]] = {}
        self.locks = engine_locks(engine)
        self._retire = threading.Lock()

    def publish(self, flight: Flight[V]) -> Flight[V]:
        """``flight`` if it is now the key's flight, else the flight that was first."""
        return self.flights.setdefault(flight.key, flight)  # type: ignore[arg-type]

    def current(self, key: K) -> Flight[V] | None:
        """The key's flight, if any that can still answer: one whose runner's loop was
        closed with the runner pending never will (it is retired, and a caller starts a
        new one)."""
        flight = self.flights.get(key)
        if flight is not None and flight.task is not None and flight.task.get_loop().is_closed():
            self.retire(flight)
            return None
        return flight

    def open(self, mine: Flight[V]) -> Flight[V]:
        """A thread's call: holds ``mine`` for writing (its own key: granted at once) and
        publishes it; the key's flight, ``mine`` or the one that was first. One step for
        ``quietly``: nothing stays held if it fails."""
        self.locks.acquire_write(mine)
        try:
            return self.publish(mine)
        except BaseException:
            self.locks.release_write(mine)
            raise

    def close(self, mine: Flight[V]) -> None:
        """A thread's call ended: ``mine`` retired (if published) and let go, even if the
        key's ``__eq__`` raises. One step for ``quietly``."""
        try:
            self.retire(mine)
        finally:
            self.locks.release_write(mine)

    def retire(self, flight: Flight[V]) -> None:
        """Takes ``flight`` out of the table, unless ``forget`` already did."""
        with self._retire:
            if self.flights.get(flight.key) is flight:  # type: ignore[arg-type]
                del self.flights[flight.key]  # type: ignore[arg-type]

    def started(self, key: K, published: asyncio.Future[Flight[V]]) -> None:
        """The runner answering ``published`` has published (or ended): only its owner
        takes an entry out, and nothing replaces one, so the check and the delete agree."""
        if self.starting.get(key) is published:
            del self.starting[key]

    def forget(self, key: K) -> bool:
        with self._retire:
            return self.flights.pop(key, None) is not None
