"""``Singleflight.aio``: asyncio tasks sharing one call per key, with the group's threads.

A task that starts a flight does not run the coroutine itself: a task of its own does (the
*runner*, created on the starter's loop, in a copy of its context), so that cancelling the
caller that happened to come first abandons only that caller's wait. The runner takes the
flight for writing in the engine before it publishes it (see ``lockmgr._flights``); the
starter waits for that, shielded, then waits for the outcome like any other caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar, TypeVarTuple, Unpack

from ._args import hold_seconds
from ._flights import (Flight, FlightTable, checked_callable, flight_timed_out, give_back_read,
                       recursion)
from ._quiet import block_handlers, run_blocked

if TYPE_CHECKING:
    from ._aio import AsyncRWLockManager

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
Ts = TypeVarTuple("Ts")


def checked_coroutine_function(fn: object) -> None:
    checked_callable(fn)
    # a coroutine function, a partial of one, or an object whose __call__ is one
    if not (inspect.iscoroutinefunction(fn)
            or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise TypeError(
            f"flight.aio.call runs a coroutine function (async def), not {fn!r}; for a "
            "plain function, call flight.call (in a thread: asyncio.to_thread)")


def _never_ran(published: asyncio.Future[Any]) -> bool:
    """Whether a wait for ``published`` ended because its runner was cancelled before its
    first step (not the waiting task: its own cancellation goes on)."""
    task = asyncio.current_task()
    return published.cancelled() and task is not None and not task.cancelling()


class AsyncSingleflight(Generic[K, V]):
    """A ``Singleflight``'s flights for asyncio tasks: ``await flight.aio.call(key, coro_fn,
    *args)``. Tasks and threads share one flight per key: a task may wait for a call a
    thread runs, and the reverse."""

    __slots__ = ("_table",)

    def __init__(self, table: FlightTable[K, V]) -> None:
        self._table = table

    async def call(self, key: K, coro_fn: Callable[[Unpack[Ts]], Awaitable[V]], /,
                   *args: Unpack[Ts],
                   timeout: float | None = None, cancel_when_abandoned: bool = False) -> V:
        """``await coro_fn(*args)`` once for every caller that asks for ``key`` while it runs.

        The first caller starts the call in a task of its own; the others wait for it; all
        get its result, or its exception (the same object). Keyword arguments are this
        method's own options, never ``coro_fn``'s: pass those with ``functools.partial``
        (as ``loop.run_in_executor`` asks).

        ``timeout`` (seconds; None waits for ever) bounds this caller's wait: LockTimeout
        after it. A timeout or a cancellation abandons this caller's wait only; the call
        goes on for the others, and to its end even if nobody waits any more, unless every
        caller that joined it passed ``cancel_when_abandoned=True``: then the last one to
        leave cancels it.

        Raises TypeError (nothing started) for an unhashable key, a ``coro_fn`` that is not
        a coroutine function, a bad ``timeout``; DeadlockError if the calling task runs the
        call itself, or the call was started by a thread blocked below this event loop (it
        would wait for itself), or waiting would close a cycle the engine sees;
        FlightAbortedError if the call ended with a BaseException that is not an
        Exception (its task was cancelled), chaining it; RuntimeError outside a running
        task.
        """
        checked_coroutine_function(coro_fn)
        return await self._call(key, coro_fn, args, hold_seconds(timeout),
                                bool(cancel_when_abandoned))

    async def _call(self, key: K, coro_fn: Callable[..., Awaitable[V]], args: tuple[Any, ...],
                    seconds: float, cancel_when_abandoned: bool) -> V:
        table = self._table
        while True:
            flight = table.current(key)
            if flight is None:
                flight = await self._start(key, coro_fn, args, cancel_when_abandoned)
            elif flight.task is not None and not flight.join(cancel_when_abandoned):
                # Abandoned, its task being cancelled: out of the table (its last waiter
                # takes it out, unless a handler's exception stopped that), and a new one
                # starts (else this loop would find it again, never awaiting anything).
                table.retire(flight)
                flight = None
            if flight is not None:
                return await self._wait(flight, seconds)

    async def _start(self, key: K, coro_fn: Callable[..., Awaitable[V]], args: tuple[Any, ...],
                     cancel_when_abandoned: bool) -> Flight[V] | None:
        """Starts a runner for ``key``: the flight the caller now waits for (counted in),
        its own or one that was published first; None if that one was abandoned."""
        loop = asyncio.get_running_loop()
        table = self._table
        published: asyncio.Future[Flight[V]] = loop.create_future()
        pending = table.starting.setdefault(key, published)
        if pending is not published and pending.get_loop() is loop:
            return await self._await_start(pending, cancel_when_abandoned)
        mine: Flight[V] = Flight(key, None, threading.get_ident())
        mine.waiters = 1  # the starter
        mine.cancel_when_abandoned = cancel_when_abandoned
        mine.task = loop.create_task(self._run(mine, coro_fn, args, published))
        # A runner cancelled before its first step (its loop shutting down) publishes nothing.
        mine.task.add_done_callback(lambda task: self._runner_done(key, published, task))
        try:
            flight = await asyncio.shield(published)
        except BaseException:
            if _never_ran(published):
                return None
            # Abandoned before the runner published: it leaves once it has (see _run).
            published.add_done_callback(lambda done: self._leave_started(mine, done))
            raise
        if flight is mine or flight.task is None or flight.join(cancel_when_abandoned):
            return flight
        return None

    async def _await_start(self, pending: asyncio.Future[Flight[V]],
                           cancel_when_abandoned: bool) -> Flight[V] | None:
        """Waits for the flight another task's runner is about to publish, and joins it;
        None if that runner never ran, or its flight was abandoned: the caller starts anew."""
        try:
            flight = await asyncio.shield(pending)
        except asyncio.CancelledError:
            if _never_ran(pending):
                return None
            raise
        if flight.task is None or flight.join(cancel_when_abandoned):
            return flight
        return None

    def _runner_done(self, key: K, published: asyncio.Future[Flight[V]],
                     runner: asyncio.Task[None]) -> None:
        self._table.started(key, published)
        published.cancel()  # (a no-op once answered)
        if not runner.cancelled():
            # Its KeyboardInterrupt or SystemExit went out of the loop already, and to the
            # waiters as FlightAbortedError: retrieved, so that the task's finalizer does
            # not log it again (at a garbage collection, inside whatever code runs then).
            runner.exception()

    def _leave_started(self, mine: Flight[V], published: asyncio.Future[Flight[V]]) -> None:
        if not published.cancelled() and published.exception() is None and (
                published.result() is mine):
            self._leave(mine)

    async def _run(self, mine: Flight[V], coro_fn: Callable[..., Awaitable[V]],
                   args: tuple[Any, ...], published: asyncio.Future[Flight[V]]) -> None:
        """The runner task: publishes ``mine`` holding it for writing, runs the call, stores
        its outcome, retires the flight. An Exception of the call is the outcome (the task
        itself ends without one: nobody awaits it); a BaseException is raised on."""
        table = self._table
        locks = table.locks.aio
        mine.owner = asyncio.current_task()
        await locks.acquire_write(mine)  # its own key: granted at once
        try:
            flight = table.publish(mine)
            # callers now find the flight published (mine.key is the K this group was given)
            table.started(mine.key, published)  # type: ignore[arg-type]
            published.set_result(flight)
            if flight is mine:
                mine.value = await coro_fn(*args)
        except Exception as error:
            # (no call before the outcome is set: a handler's exception there would leave
            # the waiters a result of None)
            mine.error, mine.traceback = error, error.__traceback__
            if not published.done():
                published.set_exception(error)
        except BaseException as error:
            mine.aborted = error
            if not published.done():
                published.set_exception(error)
            raise
        finally:
            # Retired and let go in one step with the handlers blocked, begun inline by a C
            # call: a handler's exception at a check point before (a Python call's start)
            # would leave the ended flight published (its outcome answered to every later
            # caller) or its hold kept (its waiters waiting for ever).
            try:
                blocked: Iterable[int] | BaseException = block_handlers()
            except BaseException as stopped:  # (pending: blocked now too)
                blocked = stopped
            run_blocked(blocked, _close_task_flight, table, locks, mine)

    async def _wait(self, flight: Flight[V], seconds: float) -> V:
        """Waits (counted in, for a task's flight) for ``flight``'s outcome."""
        try:
            if flight.owner is asyncio.current_task() or (
                    flight.task is None and flight.thread == threading.get_ident()):
                raise recursion(flight.key, flight.owner)
            locks = self._table.locks.aio
            try:
                granted = await locks.acquire_read(flight, True, seconds)
                if granted:
                    locks.release_read(flight)  # (at the call: nothing to await)
            except BaseException:
                # A handler's exception between the grant and the release leaves the read
                # held: given back, the handlers blocked inline first (as in _run).
                try:
                    blocked: Iterable[int] | BaseException = block_handlers()
                except BaseException as stopped:
                    blocked = stopped
                run_blocked(blocked, give_back_read, locks, flight)
                raise
            if not granted:
                raise flight_timed_out(flight.key, seconds)
        finally:
            if flight.task is not None:
                self._leave(flight)
        return flight.outcome()

    def _leave(self, flight: Flight[V]) -> None:
        task = flight.task
        if flight.leave() and task is not None:
            self._table.retire(flight)  # the next caller starts a new call
            with contextlib.suppress(RuntimeError):  # its loop has closed: it is done
                task.get_loop().call_soon_threadsafe(task.cancel)

    def _shared_call(self, key: K, fn: Callable[..., Awaitable[V]], args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Awaitable[V]:
        """A decorated coroutine function's call (``Singleflight.shared``)."""
        return self._call(key, lambda: fn(*args, **kwargs), (), -1.0, False)

    def __repr__(self) -> str:
        return f"<lockmgr.Singleflight.aio flights={len(self._table.flights)}>"


def _close_task_flight(table: FlightTable[Any, Any], locks: AsyncRWLockManager[Any],
                       mine: Flight[Any]) -> None:
    """A runner task's flight ended: retired, and its hold let go (at the call: a task's
    release needs no await). A loop closed with the runner pending closes its coroutine
    outside any loop: then the engine gives the hold back as the task goes (with an
    AbandonedLockWarning)."""
    try:
        table.retire(mine)
    finally:
        if asyncio._get_running_loop() is not None:
            locks.release_write(mine)
