"""A task's connection: ``_AsyncLink`` talks libpq with the loop's readers; ``_TaskSession``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_attempts_async, conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus

from ._link import (
    _ABORT_SECONDS,
    _CANCEL_GRACE,
    _NOT_CONNECTED_IN_TIME,
    _Attach,
    _Link,
    _Lose,
    _NotConnectedInTime,
    _Overdue,
    _RoundTrip,
    _Steps,
    _T,
    _checked,
    _connect_by,
    _not_connected,
    _poll,
    _run_all_steps,
    _set_up_steps,
)
from ._session import _Session


async def _connect_async(conninfo: str, deadline: float | None
                         ) -> tuple[psycopg.AsyncConnection[Any], float | None]:
    """``_link._connect_pgconn`` for a task: each host's attempt is psycopg's async connect
    to it (``conninfo_attempts_async`` resolves the hosts without blocking the loop), given
    up at its ``_connect_by``."""
    failure: BaseException | None = None
    for attempt in await conninfo_attempts_async(conninfo_to_dict(conninfo)):
        if failure is not None and deadline is not None and time.monotonic() >= deadline:
            break
        host = make_conninfo("", **attempt)
        by = _connect_by(host, deadline)
        try:  # (the loop's clock is time.monotonic: see _ready)
            async with asyncio.timeout(None if by is None else by - time.monotonic()):
                return await psycopg.AsyncConnection.connect(host, autocommit=True), by
        except TimeoutError:
            failure = _NotConnectedInTime(_NOT_CONNECTED_IN_TIME)
        except psycopg.OperationalError as error:
            failure = error
    assert failure is not None  # (conninfo_attempts_async gives one attempt, or raises)
    raise failure


class _AsyncLink(_Link):
    """A ``_Link`` whose round trips await the socket on the running event loop.

    Only its owner task talks on it; ``talking`` keeps other threads' checks off it while
    it does, as for a thread's link."""

    __slots__ = ()

    @classmethod
    async def connect_async(cls, dsn: str, connect_kwargs: dict[str, Any],
                            statements: dict[bytes, bytes],
                            deadline: float | None = None) -> _AsyncLink:
        """``_Link.connect`` on the event loop (psycopg's async connect, which never blocks
        the loop, host by host as ``_connect_pgconn``)."""
        try:
            conn, by = await _connect_async(make_conninfo(dsn, **connect_kwargs), deadline)
        except psycopg.Error as error:
            raise _not_connected(error) from error
        link = cls(conn, statements)  # type: ignore[arg-type]  # only its pgconn and cancel_safe are used
        try:
            await _drive_async(_set_up_steps(link, by))
        except BaseException as error:
            link.close()
            if isinstance(error, psycopg.Error):
                raise _not_connected(error) from error
            raise
        return link

    def _finish(self) -> None:
        self.pgconn.finish()  # AsyncConnection.close() is a coroutine; this is all it does here

    async def run_async(self, sql: str, deadline: float | None | bool = True) -> Any:
        return (await self.run_all_async(sql, deadline))[-1]

    async def run_all_async(self, sql: str, deadline: float | None | bool = True) -> list[Any]:
        return await _drive_async(_run_all_steps(self, sql, deadline))

    async def _round_trip_async(self, deadline: float | None, send: Callable[..., None],
                                *args: Any) -> list[Any]:
        """Send, then read every result (past ``deadline``, as ``_Link._round_trip``). A
        cancellation leaves the statement running, and the connection ``talking`` (other
        threads' and tasks' checks keep off it): the clean-up task ends the statement on
        the server (``abort``), then the talk."""
        pgconn = self.pgconn
        results: list[Any] = []
        self.cancelled_late = False
        with self.guard:
            previous, self.talking = self.talking, True
        try:
            send(*args)
            while pgconn.flush():
                while not await self._ready(writing=True, deadline=deadline):
                    deadline = await self._past_deadline_async()
            while True:
                if pgconn.is_busy():
                    while not await self._ready(writing=False, deadline=deadline):
                        deadline = await self._past_deadline_async()
                    pgconn.consume_input()
                    continue
                result = pgconn.get_result()
                if result is None:
                    break
                results.append(result)
        except BaseException:
            if pgconn.transaction_status != TransactionStatus.ACTIVE:
                self.talking = previous
            raise  # else still talking: see above
        self.talking = previous  # (True within a clean-up)
        return _checked(results, self.conn, self.cancelled_late)

    async def _past_deadline_async(self) -> float:
        """``_Link._past_deadline`` on the event loop."""
        grace = self._cancelling()
        conn: psycopg.AsyncConnection[Any] = self.conn  # type: ignore[assignment]
        try:
            await conn.cancel_safe(timeout=_CANCEL_GRACE)
        except psycopg.Error:
            pass  # no answer to the cancel either: the grace ends with the close
        return grace

    async def _ready(self, writing: bool, deadline: float | None = None) -> bool:
        """Until the socket is ready (True) or ``deadline`` passed (False)."""
        if deadline is not None and deadline <= time.monotonic():  # an answer there counts
            return False if writing else bool(_poll(self.poller, 0))
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.pgconn.socket
        if writing:
            loop.add_writer(fd, _set_once, ready)
        else:
            loop.add_reader(fd, _set_once, ready)
        # the loop's clock is time.monotonic (asyncio's default): the timer wakes this
        # wait at the deadline, and the next call ends the round trip
        timer = (None if deadline is None
                 else loop.call_later(deadline - time.monotonic(), _set_late, ready))
        try:
            return await ready is not False
        finally:
            if timer is not None:
                timer.cancel()
            if writing:
                loop.remove_writer(fd)
            else:
                loop.remove_reader(fd)

    async def abort(self) -> None:
        """A cancelled round trip left a statement running: cancel it on the server and read
        it to its end, so that the connection is idle again; if that fails, close it."""
        if self.pgconn.transaction_status != TransactionStatus.ACTIVE:
            return
        try:
            conn: psycopg.AsyncConnection[Any] = self.conn  # type: ignore[assignment]
            await conn.cancel_safe(timeout=_ABORT_SECONDS)
            await asyncio.wait_for(self._drain(), _ABORT_SECONDS)
        except BaseException:
            self.close()
            raise

    async def _drain(self) -> None:
        pgconn = self.pgconn
        while pgconn.flush():  # a message cut short by the cancellation: the rest first
            await self._ready(writing=True)
        while True:
            if pgconn.is_busy():
                await self._ready(writing=False)
                pgconn.consume_input()
            elif pgconn.get_result() is None:
                return


async def _drive_async(steps: _Steps[_T],
                       attach: Callable[[Any, float | None, float | None], Awaitable[Any]]
                       | None = None,
                       lose: Callable[[Any], None] | None = None,
                       drop: Callable[[Any, list[Any]], Awaitable[None]] | None = None) -> _T:
    """``_link._drive`` for a task: each need answered by an awaited round trip (or
    ``attach``, ``lose``, ``drop``), its exception (a cancellation too) thrown back into
    the steps."""
    answer: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                need = steps.send(answer) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            try:
                if isinstance(need, _RoundTrip):
                    link = need.link
                    assert isinstance(link, _AsyncLink)
                    answer = await link._round_trip_async(need.deadline, need.send, *need.args)
                elif isinstance(need, _Attach):
                    assert attach is not None
                    answer = await attach(need.session, need.deadline, need.connect_by)
                elif isinstance(need, _Lose):
                    assert lose is not None
                    answer = lose(need.session)
                else:
                    assert drop is not None
                    await drop(need.session, need.items)
                    answer = None
                error = None
            except BaseException as failure:
                answer, error = None, failure
    finally:
        answer = error = None  # no cycle through a traceback keeps a link alive


async def _clean_up_done(cleaning: asyncio.Task[Any], deadline: float | bool) -> None:
    """Wait for a clean-up task without cancelling it: until ``deadline`` if it is a time
    (then ``_Overdue``, the clean-up going on), else however long it takes."""
    if deadline is True:
        await asyncio.shield(cleaning)
        return
    try:
        await asyncio.wait_for(asyncio.shield(cleaning), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise _Overdue("an earlier call's clean-up has not ended in time") from None


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set_late(future: asyncio.Future[bool | None]) -> None:
    if not future.done():
        future.set_result(False)


class _TaskSession(_Session):
    """One task's standing with one manager (a ``_Session``, the task as its owner)."""

    __slots__ = ("cleaning", "ended", "losses")
    link: _AsyncLink | None

    def __init__(self) -> None:
        super().__init__()
        # How many times its connection was lost (_Tasks.lose, the owner or its clean-up):
        # a release under way when one came cannot say whether its keys went first.
        self.losses = 0
        # Set once the task's session ended (_Tasks.end): a block's exit releases nothing.
        self.ended = False
        # The clean-up task giving back what a cancelled call may hold (set by the owner,
        # cleared by the clean-up when it ends): the owner's next call waits for it.
        self.cleaning: asyncio.Task[Any] | None = None  # (or a release's: ``_Tasks.give``)
