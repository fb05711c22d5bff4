"""``Singleflight``: concurrent callers asking for one key share one call (Go's singleflight).

Built on the engine (see ``lockmgr._flights``): every wait for a flight is a read of the
flight in a private ``RWLockManager`` whose writer is the caller running it, so the
engine's timeouts, wake-ups and deadlock detection serve flights as they serve keys.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Hashable, Iterable
from types import ModuleType
from typing import Any, ClassVar, cast, Generic, ParamSpec, TypeVar, TypeVarTuple, Unpack

from ._args import hold_seconds
from ._flight_aio import AsyncSingleflight
from ._flights import (Flight, FlightTable, checked_callable, flight_timed_out, give_back_read,
                       recursion)
from ._quiet import block_handlers, handlers_run_here, quietly, run_blocked
from ._views import checked_key_func, function_to_wrap

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
T = TypeVar("T")
P = ParamSpec("P")
Ts = TypeVarTuple("Ts")


class Singleflight(Generic[K, V]):
    """Concurrent callers with an equal key share one execution of a function.

    ``flight.call(key, fn, *args)``: the first caller for ``key`` runs ``fn(*args)`` in its
    own thread; every caller that asks for ``key`` while it runs waits for it, and all get
    its result or its exception. A finished call leaves nothing behind: results are not
    cached, the next caller for ``key`` starts a new call (``forget(key)`` starts one even
    while the current call runs). ``flight.aio`` is the same for asyncio tasks, sharing the
    flights of the threads; ``@flight.shared(key=...)`` decorates a function.
    """

    __slots__ = ("_aio", "_table", "__weakref__")

    #: The engine whose lock table the flights wait in (None: the one lockmgr chose).
    _engine: ClassVar[ModuleType | None] = None

    def __init__(self) -> None:
        self._table: FlightTable[K, V] = FlightTable(self._engine)
        self._aio: AsyncSingleflight[K, V] = AsyncSingleflight(self._table)

    @property
    def aio(self) -> AsyncSingleflight[K, V]:
        """The flights for asyncio tasks: ``await flight.aio.call(key, coro_fn, *args)``."""
        return self._aio

    def call(self, key: K, fn: Callable[[Unpack[Ts]], V], /, *args: Unpack[Ts],
             timeout: float | None = None) -> V:
        """``fn(*args)`` once for every caller that asks for ``key`` while it runs.

        The first caller runs it, in its own thread; the others wait for it; all get its
        result, or its exception: the same object for every caller (as
        ``concurrent.futures.Future.result()`` raises it), raised with the traceback the
        call gave it. Keyword arguments are this method's own options, never ``fn``'s:
        pass those with ``functools.partial`` (as ``loop.run_in_executor`` asks), so that
        no name of ``fn``'s can collide with an option.

        ``timeout`` (seconds; None waits for ever) bounds the wait for a call another
        caller runs: LockTimeout after it, and the call goes on for the others. The caller
        that runs the call waits for it whatever its timeout.

        Raises TypeError (nothing started) for an unhashable key, an ``fn`` that is not
        callable, a bad ``timeout``; DeadlockError if this thread runs the call already
        (``fn`` asking for its own key), or waiting would close a cycle of waits the engine
        sees (two calls waiting for each other's keys, through flights or lock managers of
        the same engine); FlightAbortedError, chaining the original, if the call ended with
        a BaseException that is not an Exception (KeyboardInterrupt, SystemExit: raised
        in the caller that ran it, which had it raised there).
        """
        if not callable(fn):
            checked_callable(fn)
        return self._call(key, fn, args, {}, -1.0 if timeout is None else hold_seconds(timeout))

    def _call(self, key: K, fn: Callable[..., V], args: tuple[Any, ...], kwargs: dict[str, Any],
              seconds: float) -> V:
        table = self._table
        while True:
            flight = table.current(key)
            if flight is None:
                mine: Flight[V] = Flight(key, threading.get_ident(), threading.get_ident())
                interruptible = handlers_run_here()
                opened = None
                try:
                    # Taking and publishing, then retiring and letting go, each one step no
                    # signal handler splits (a hold left would keep the waiters for ever).
                    opened = flight = quietly(table.open, mine,
                                              undo=lambda _: table.close(mine))
                    if flight is mine:
                        value = fn(*args, **kwargs)
                        mine.value = value
                        return value
                except Exception as error:
                    # (no call before the outcome is set: a handler's exception there would
                    # leave the waiters a result of None)
                    mine.error, mine.traceback = error, error.__traceback__
                    raise
                except BaseException as error:
                    mine.aborted = error
                    raise
                finally:
                    if opened is not None:
                        if interruptible:
                            # Blocked inline, by a C call: a handler's exception at a check
                            # point before the close (a Python call's start) would skip it.
                            try:
                                blocked: Iterable[int] | BaseException = block_handlers()
                            except BaseException as stopped:  # (pending: blocked now too)
                                blocked = stopped
                            run_blocked(blocked, table.close, mine)
                        else:
                            table.close(mine)
            if flight.task is None:  # a thread's call: no waiter count to keep
                return self._wait(flight, seconds)
            if flight.join(False):
                try:
                    return self._wait(flight, seconds)
                finally:
                    self._aio._leave(flight)
            # Abandoned, its task being cancelled: out of the table (its last waiter takes it
            # out, unless a handler's exception stopped that), and a new call starts.
            table.retire(flight)

    def _wait(self, flight: Flight[V], seconds: float) -> V:
        """Waits for ``flight``'s outcome (the hot path of a hit: positional arguments,
        which the compiled core takes faster than keywords)."""
        if flight.thread == threading.get_ident():
            raise recursion(flight.key, flight.owner)
        locks = self._table.locks
        try:
            granted = locks.acquire_read(flight, True, seconds)
            if granted:
                locks.release_read(flight)
        except BaseException:
            # A handler's exception between the grant and the release (at a call's check
            # point) leaves the read held: given back, the handlers blocked inline first
            # (see _call).
            try:
                blocked: Iterable[int] | BaseException = block_handlers()
            except BaseException as stopped:
                blocked = stopped
            run_blocked(blocked, give_back_read, locks, flight)
            raise
        if not granted:
            raise flight_timed_out(flight.key, seconds)
        return flight.outcome()

    def shared(self, key: Callable[..., K]) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """Decorator: calls with an equal ``key(*args, **kwargs)`` share one call, as
        ``call`` shares them (without a timeout). Over a coroutine function it makes one
        whose calls share through ``aio``.

        Write it with its key function: ``@flight.shared(key=lambda url: url)``. Raises
        TypeError at once for a ``key`` that is not callable or is a coroutine function,
        and (when called) for a bare ``@flight.shared`` over a function; each call raises
        what ``call`` (or ``aio.call``) raises.
        """
        key_func = cast("Callable[..., K]", checked_key_func(key, "shared"))

        def decorate(*args: Any, **kwargs: Any) -> Callable[P, T]:
            func: Callable[P, Any] = function_to_wrap(key_func, args, kwargs, "shared")
            if inspect.iscoroutinefunction(func):
                aio = self._aio

                @functools.wraps(func)
                async def shared_coroutine(*args: P.args, **kwargs: P.kwargs) -> Any:
                    return await aio._shared_call(key_func(*args, **kwargs), func, args,
                                                      kwargs)

                return shared_coroutine  # type: ignore[return-value]  # T: a coroutine of

            @functools.wraps(func)
            def shared_call(*args: P.args, **kwargs: P.kwargs) -> T:
                # T is V here: the result of a call of this group
                return cast(T, self._call(key_func(*args, **kwargs), func, args, kwargs, -1.0))

            return shared_call

        return decorate

    def forget(self, key: K) -> bool:
        """Lets the next caller for ``key`` start a new call while the current one runs
        (its callers still get its outcome). True if a call for ``key`` was running.
        Raises TypeError for an unhashable key."""
        return self._table.forget(key)

    def __len__(self) -> int:
        """How many keys have a call running."""
        return len(self._table.flights)

    def __contains__(self, key: object) -> bool:
        """Whether a call for ``key`` is running. Raises TypeError for an unhashable key."""
        return key in self._table.flights

    def __repr__(self) -> str:
        return f"<lockmgr.Singleflight flights={len(self._table.flights)} at {id(self):#x}>"


@functools.cache
def singleflight_on(engine: ModuleType) -> type[Singleflight[Any, Any]]:
    """``Singleflight`` with its flights in ``engine``'s lock table (``lockmgr._core`` or
    ``lockmgr._pure``): how the tests run one body on both engines."""
    return type("Singleflight", (Singleflight,), {"__slots__": (), "_engine": engine,
                                                   "__module__": Singleflight.__module__})
