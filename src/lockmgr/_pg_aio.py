"""asyncio tasks on the PostgreSQL managers: ``PgLockManager.aio`` and ``PgRWLockManager.aio``.

A task is an owner as a thread is: reentrant per task, ordered against the process's other
tasks and threads by the manager's in-process engine (its ``aio`` view, the same table as
the threads'), and across processes by PostgreSQL. The rules of ``lockmgr.postgres`` hold
for tasks too, with these for the event loop:

- **Connections**: a task holding keys has a connection of its own (keys are session
  locks, and a waiting statement occupies its connection). It talks libpq directly, one
  message and one round trip per first acquire and per last release, and waits for the
  socket with the loop's readers, so other tasks run meanwhile. A task that ends still
  holding keys has its connection closed at once (its server locks go with it; the
  in-process engine releases its keys with an AbandonedLockWarning).
- **Cancellation** (``task.cancel()``, ``asyncio.timeout``, Ctrl-C under ``asyncio.run``):
  whatever the cancelled call may have taken on the server is given back by a *clean-up*
  task — cancel the statement, read it to its end, release what this call may hold
  (``_Session.unsure``) — that a second cancellation cannot interrupt (the caller waits for
  it under ``asyncio.shield``; if cancelled again, the task's next call on the manager
  waits for it first). Where it fails, the connection is closed: its keys are lost, never
  left held. A cancelled release still releases.
- **Releasing** talks to the server, so ``release`` is a coroutine here (the in-process
  ``aio`` views release synchronously).
- **A coroutine closed unrun** (``GeneratorExit``: the garbage collector finishing a task
  whose loop was closed) can await nothing: what it may hold on the server goes with its
  connection, closed at once.
- **A loop closed with tasks pending** (asyncio.run's shutdown interrupted by another
  Ctrl-C) leaves sessions nobody can talk on: the manager's next acquisition (from a task
  or a thread), ``lost_keys()`` or ``close()`` closes their connections and ends their
  tasks in process (``_Tasks.sweep_closed_loops``); a wait still queued there ends within a
  second on PostgreSQL 14+ (``client_connection_check_interval``, set by every link).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, cast

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus

from ._common import (
    READ,
    WRITE,
    DeadlockError,
    block_in_use,
    current_task_or_none,
    current_task_or_raise,
    hold_seconds,
    many_items,
    not_owned,
    not_entered,
    not_owned_block,
    rw_items,
    timed_out,
    wait_seconds,
)
from .postgres import (
    _FATAL_ERROR,
    _GRANTED_ADVISORY,
    _FENCED_LOCK,
    _LOCK,
    _MADE_MEANWHILE,
    _MODE_NAMES,
    _TRY_LOCK,
    _UNLOCK,
    _ABORT_SECONDS,
    _answer_by,
    _call_deadline,
    _CANCEL_GRACE,
    _CLIENT_TIMEOUTS,
    _deadline,
    _drop_sql,
    _FenceTable,
    _fences_from,
    _holding,
    _Link,
    _lock_sql,
    _lost_error,
    _no_fencing,
    _not_released,
    _read_has_no_fence,
    _same,
    _CHECK_UNSUPPORTED,
    _Session,
    _refusal,
    _round_trip_deadline,
    _Overdue,
    _poll,
    _Unanswered,
    _setup_sql,
    _unlock_sql,
    Lease,
)

if TYPE_CHECKING:
    from ._contract import EngineModule
    from .postgres import PgLockManager, PgRWLockManager, _PgEngine

K = TypeVar("K", bound=Hashable)
P = ParamSpec("P")
T = TypeVar("T")

__all__ = ["PgAsyncKeyLock", "PgAsyncLockManager", "PgAsyncRWLockManager"]



class _AsyncLink(_Link):
    """A ``_Link`` whose round trips await the socket on the running event loop.

    Only its owner task talks on it; ``talking`` keeps other threads' checks off it while
    it does, as for a thread's link."""

    __slots__ = ()

    @classmethod
    async def connect_async(cls, dsn: str, connect_kwargs: dict[str, Any],
                            statements: dict[bytes, bytes]) -> _AsyncLink:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, **connect_kwargs)
        link = cls(conn, statements)  # type: ignore[arg-type]  # only its pgconn and cancel_safe are used
        try:
            try:
                results = await link.run_all_async(_setup_sql(link.pgconn.server_version))
            except _CHECK_UNSUPPORTED:
                results = await link.run_all_async(_setup_sql(link.pgconn.server_version, False))
            refusal = _refusal(results[0], link.pgconn.backend_pid)
            if refusal is not None:
                raise refusal
        except BaseException:
            link.close()
            raise
        return link

    def _finish(self) -> None:
        self.pgconn.finish()  # AsyncConnection.close() is a coroutine; this is all it does here

    async def run_async(self, sql: str, deadline: float | None | bool = True) -> Any:
        return (await self.run_all_async(sql, deadline))[-1]

    async def run_all_async(self, sql: str, deadline: float | None | bool = True) -> list[Any]:
        return await self._round_trip_async(_deadline(deadline), self.pgconn.send_query,
                                            sql.encode())

    async def call_async(self, statement: bytes, ident: int,
                         deadline: float | None | bool = True) -> Any:
        answer_by = _deadline(deadline)
        if statement not in self.prepared:
            try:
                await self._round_trip_async(_answer_by() if answer_by is None else answer_by,
                                             self.pgconn.send_prepare, statement,
                                             self.statements[statement])
            except pg_errors.DuplicatePreparedStatement:
                pass  # a clean-up after a cancellation drained the answer we never read
            self.prepared.add(statement)
        results = await self._round_trip_async(answer_by, self.pgconn.send_query_prepared,
                                               statement, [b"%d" % ident])
        return results[-1]

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
        encoding = self.conn.info.encoding
        for result in results:
            if result.status == _FATAL_ERROR:
                error = pg_errors.error_from_result(result, encoding=encoding)
                if self.cancelled_late and isinstance(error, pg_errors.QueryCanceled):
                    raise _Overdue("PostgreSQL did not answer in time: the statement was"
                                   " cancelled") from error
                raise error
        return results

    async def _past_deadline_async(self) -> float:
        """``_Link._past_deadline`` on the event loop."""
        if self.cancelled_late:
            self.close()
            raise _Unanswered("PostgreSQL did not answer in time, nor to a cancel: the"
                              " connection was closed")
        self.cancelled_late = True
        grace = time.monotonic() + _CANCEL_GRACE
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


async def _make_fence_table(link: _AsyncLink, table: _FenceTable,
                            deadline: float | bool) -> None:
    """``postgres._make_fence_table`` on a task's connection."""
    for attempt in range(2):
        if (await link.run_async(table.exists_sql, deadline)).get_value(0, 0) == b"t":
            return
        try:
            await link.run_async(table.create_sql, deadline)
            return
        except _MADE_MEANWHILE:
            if attempt:
                raise


async def _clean_up_done(cleaning: asyncio.Task[None], deadline: float | bool) -> None:
    """Wait for a clean-up task without cancelling it: until ``deadline`` if it is a time
    (then ``_Overdue``, the clean-up going on), else however long it takes."""
    if deadline is True:
        await asyncio.shield(cleaning)
        return
    try:
        await asyncio.wait_for(asyncio.shield(cleaning), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise _Overdue("an earlier call's clean-up has not ended in time") from None


def _retrieve(task: asyncio.Task[None]) -> None:
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

    __slots__ = ("cleaning", "ended")
    link: _AsyncLink | None

    def __init__(self) -> None:
        super().__init__()
        # Set once the task's session ended (_Tasks.end): a block's exit releases nothing.
        self.ended = False
        # The clean-up task giving back what a cancelled call may hold (set by the owner,
        # cleared by the clean-up when it ends): the owner's next call waits for it.
        self.cleaning: asyncio.Task[None] | None = None


class _Tasks:
    """The sessions of a PostgreSQL manager's tasks, and their calls to the server. Runs
    on the event loops of the tasks; the lists it shares with other threads (``idle``,
    ``sessions``) are changed under the manager's ``_guard``."""

    def __init__(self, manager: _PgEngine[Any]) -> None:
        self.manager = manager
        # The in-process engine's module (the compiled core or the pure twin): its tasks.
        self.engine = cast("EngineModule", sys.modules[type(manager._engine).__module__])
        self.idle: list[_AsyncLink] = []  # connections holding nothing
        self.sessions: dict[asyncio.Task[Any], _TaskSession] = {}  # running tasks' sessions
        # The loops those tasks run on (and ran on: a closed one leaves at the next sweep),
        # so that the sweep before every acquisition costs a look at each loop, not each task.
        self.loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()

    # -- taking and giving back ---------------------------------------------------------------

    async def take(self, items: Sequence[tuple[Hashable, int]], seconds: float,
                   local_acquire: Callable[[float], Awaitable[bool]],
                   local_release: Callable[[], None]) -> bool:
        """``_PgEngine._take`` for the current task: in-process first, then on the server,
        all of ``items`` within ``seconds`` or none."""
        started = time.monotonic()
        self.sweep_closed_loops()  # a stranded task may hold one of the keys in process
        session = self.session()
        try:
            await self.settle(session, _call_deadline(started, seconds))
        except _CLIENT_TIMEOUTS:
            if seconds < 0:
                raise
            return False  # an earlier call's clean-up still runs: timed out
        session.refuse_lost(items)
        if not await local_acquire(seconds):
            return False
        before = {item: session.levels.get(item, 0) for item in items}
        fresh = [item for item, levels in before.items() if not levels]
        taken = unrun = False
        try:
            left = seconds if seconds <= 0 else max(0.0, seconds - (time.monotonic() - started))
            fences = await self.lock(session, fresh, left) if fresh else {}
            # A connection lost on the way lost the keys this call re-entered too: the
            # call fails, whatever a fresh connection then gave (the clean-up drops it).
            session.refuse_lost(items)
            if fences is not None:
                session.granted(items, self.manager._fences_of(fresh, fences))
                taken = True
        except BaseException as error:
            session.undo_take(before, fresh)
            unrun = isinstance(error, GeneratorExit)
            client_timeout = seconds >= 0 and isinstance(error, _CLIENT_TIMEOUTS)
            try:
                if fresh and not unrun:
                    await self.clean_up(session, time.monotonic() + _CANCEL_GRACE
                                        if client_timeout else True)
            except GeneratorExit:  # closed while it cleaned up: unrun all the same
                unrun = True
                raise
            except _CLIENT_TIMEOUTS:
                pass  # the clean-up goes on; the next call waits for it (settle)
            finally:
                if unrun:
                    _close_link(session)
            if not client_timeout:
                raise
            # A timed call that passed its deadline on the client timed out.
            session.refuse_lost(items)
            return False
        finally:
            if not taken:
                try:
                    if not unrun:
                        local_release()
                finally:
                    self.return_if_idle(session)
        return taken

    async def give(self, items: Sequence[tuple[Hashable, int]],
                   local_release: Callable[[], None]) -> None:
        """``_PgEngine._give`` for the current task."""
        session = _holding(self.session_or_none(), items)
        assert isinstance(session, _TaskSession)
        last = [item for item in items if session.levels.get(item) == 1]
        unrun = False
        try:
            if not last or session.unsure or session.cleaning is not None or session.link is None:
                await self.settle(session)
                last = [item for item in items if session.levels.get(item) == 1]
            if last:
                session.unsure = last
                await self.unlock(session, last)  # its failures go to the clean-up
        except BaseException as error:
            unrun = isinstance(error, GeneratorExit)
            try:
                if not unrun:
                    await self.hand_over(session, last)  # cancelled before the unlock: released
            except GeneratorExit:
                unrun = True
                raise
            finally:
                if unrun:
                    _close_link(session)
            raise
        finally:
            lost = session.given(items)
            if not unrun:
                local_release()
            self.return_if_idle(session)
        if lost:
            raise _lost_error(sorted(set(lost), key=repr))

    async def release_all(self, local_release_all: Callable[[], int]) -> int:
        session = self.session_or_none()
        unrun = False
        try:
            if session is not None:
                await self.settle(session)
                if session.levels:
                    session.unsure = list(session.levels)
                    await self.unlock(session, session.unsure)
        except BaseException as error:
            unrun = isinstance(error, GeneratorExit)
            try:
                if session is not None and not unrun:
                    await self.hand_over(session, list(session.levels))
            except GeneratorExit:
                unrun = True
                raise
            finally:
                if session is not None and unrun:
                    _close_link(session)
            raise
        finally:
            lost: list[Hashable] = []
            if session is not None:
                lost = sorted({key for key, _ in session.lost}, key=repr)
                session.forget_levels()
                session.lost.clear()
                session.reported.clear()
                self.return_if_idle(session)
            released = 0 if unrun else local_release_all()
        if lost:
            raise _lost_error(lost)
        return released

    async def lock(self, session: _TaskSession, items: list[tuple[Hashable, int]],
                   seconds: float) -> dict[int, int] | None:
        """``_PgEngine._lock`` on the task's connection: the same statements, one message;
        None if not granted in time, else the fences by advisory key."""
        manager = self.manager
        ordered = sorted(((manager.advisory_key(key), mode) for key, mode in items))
        fencing = manager._fencing and any(mode == WRITE for _, mode in ordered)
        deadline = None if seconds <= 0 else time.monotonic() + seconds
        retried = False
        while True:
            if session.link is not None:
                link, fresh_link = session.link, False
            else:
                link, fresh_link = await self.attach(session)
            try:
                left = 0 if deadline is None else int((deadline - time.monotonic()) * 1000 + 0.999)
                trying = seconds == 0 or (deadline is not None and left <= 0)
                how = "try" if trying else "wait" if deadline is None else "timed"
                answer_by = _round_trip_deadline(how, deadline)
                if fencing and not manager._fence_table_made:
                    await _make_fence_table(link, manager._fence_table, answer_by or True)
                    manager._fence_table_made = True
                if how != "timed" and len(ordered) == 1:
                    ident, mode = ordered[0]
                    statement = (_FENCED_LOCK[how] if fencing
                                 else _TRY_LOCK[mode] if trying else _LOCK[mode])
                    results = [await link.call_async(statement, ident, answer_by)]
                else:
                    results = await link.run_all_async(
                        _lock_sql(ordered, how, left, manager._fence_table if fencing else None),
                        answer_by)
            except pg_errors.LockNotAvailable:
                if deadline is not None and deadline - time.monotonic() > 0:
                    continue
                return None
            except pg_errors.DeadlockDetected as error:
                raise DeadlockError(f"PostgreSQL: {error}", []) from None
            except _Overdue:  # as in _PgEngine._lock
                if seconds >= 0:
                    raise
                continue
            except psycopg.OperationalError as error:
                if not link.broken():
                    raise
                self.lose(session)
                if fresh_link or retried or (seconds >= 0 and isinstance(error, _Unanswered)):
                    raise
                retried = True
                continue
            return _fences_from(results, ordered, how, fencing)

    async def unlock(self, session: _TaskSession, items: list[tuple[Hashable, int]]) -> None:
        """``_PgEngine._unlock`` on the task's connection."""
        link = session.link
        assert link is not None
        advisory_key = self.manager.advisory_key
        try:
            if len(items) == 1:
                key, mode = items[0]
                result = await link.call_async(_UNLOCK[mode], advisory_key(key))
            else:
                result = await link.run_async(_unlock_sql(items, advisory_key))
        except psycopg.OperationalError as error:
            if link.broken():
                self.lose(session)
                return
            await self.clean_up(session)
            if isinstance(error, _Overdue):
                return  # released by the clean-up (or lost with the connection: LockLost)
            raise
        except BaseException as error:
            if isinstance(error, GeneratorExit):
                _close_link(session)
            else:
                await self.clean_up(session)
            raise
        session.unsure = []
        gone = _not_released(result, items)
        if gone:
            self.manager._report(session, items=gone)

    async def clean_up(self, session: _TaskSession, deadline: float | bool = True) -> None:
        """Give back, in a task of its own that a cancellation cannot stop halfway, what a
        failed call may hold (``session.unsure``); wait for it unless cancelled again, or
        until ``deadline`` (True: however long it takes): then ``_Overdue``, and it goes on."""
        if session.cleaning is None:
            session.cleaning = asyncio.get_running_loop().create_task(self.drop_or_lose(session))
            # Whoever still waits for it gets its exception (an on_lost that raised); if
            # nobody does any more, it must not be reported as never retrieved.
            session.cleaning.add_done_callback(_retrieve)
        await _clean_up_done(session.cleaning, deadline)

    async def hand_over(self, session: _TaskSession, items: list[tuple[Hashable, int]]) -> None:
        """A release interrupted before its unlock was sent: the clean-up releases ``items``
        (still on the connection, if it lives) with whatever it gives back already."""
        if session.link is None:
            return
        session.unsure = [*session.unsure, *(item for item in items if item not in session.unsure)]
        if session.unsure:
            await self.clean_up(session)

    async def drop_or_lose(self, session: _TaskSession) -> None:
        """``_PgEngine._drop_or_lose`` for a task: end a statement still running, release
        whichever of ``session.unsure`` this session holds (items added meanwhile too);
        failing that, close the connection (its keys are lost)."""
        talking = session.link
        if talking is not None:
            with talking.guard:
                talking.talking = True  # others' checks keep off until the end of the clean-up
        try:
            try:
                while session.unsure:
                    link = session.link
                    if link is None:
                        session.unsure = []
                        return
                    dropping = list(session.unsure)
                    await link.abort()
                    if not link.idle():
                        raise psycopg.OperationalError("the connection is not idle after a cancel")
                    await link.run_async(_drop_sql(dropping, self.manager.advisory_key))
                    session.unsure = [item for item in session.unsure if item not in dropping]
            except Exception:
                self.lose(session)  # the caller re-raises what made it clean up
            except BaseException:
                self.lose(session)  # cancelled itself: the loop is closing
                raise
        finally:
            if talking is not None:
                talking.talking = False
            session.cleaning = None
            self.return_if_idle(session)

    # -- sessions and loss ----------------------------------------------------------------------

    def session_or_none(self) -> _TaskSession | None:
        return self.sessions.get(current_task_or_raise())

    def session(self) -> _TaskSession:
        task = current_task_or_raise()
        session = self.sessions.get(task)
        if session is None:
            with self.manager._guard:
                session = self.sessions[task] = _TaskSession()
                self.loops.add(task.get_loop())
            task.add_done_callback(self.task_done)
        return session

    def task_done(self, task: asyncio.Task[Any]) -> None:
        """A task ended: its session goes, and its connection closes (ending its server
        locks) once a clean-up still running on it is over; the in-process engine releases
        what the task held with a warning."""
        session = self.sessions.get(task)
        if session is not None and session.cleaning is not None:
            # Until then the session stays listed: a loop closed meanwhile is swept.
            session.cleaning.add_done_callback(lambda _: self.end(task))
        else:
            self.end(task)

    def end(self, task: asyncio.Task[Any]) -> None:
        with self.manager._guard:
            session = self.sessions.pop(task, None)
        if session is not None:
            session.ended = True
            _close_link(session)

    async def settle(self, session: _TaskSession, deadline: float | bool = True) -> None:
        """``_PgEngine._settle`` for the task: first wait for a clean-up still running (by
        ``deadline``: ``clean_up``)."""
        if session.cleaning is not None:
            await _clean_up_done(session.cleaning, deadline)
        link = session.link
        if link is None:
            if session.levels or session.unsure:  # a lose() interrupted half-way: finish it
                self.lose(session)
            return
        if session.unsure:
            await self.clean_up(session, deadline)
            link = session.link
            if link is None:
                return
        if session.dead or not link.idle():
            self.lose(session)

    async def attach(self, session: _TaskSession) -> tuple[_AsyncLink, bool]:
        """Give the session a connection: an idle one still alive (False), or a new one."""
        manager = self.manager
        self.sweep_closed_loops()  # their connections may hold what this one will wait for
        while True:
            with manager._guard:
                link = self.idle.pop() if self.idle else None
            if link is None:
                link = await _AsyncLink.connect_async(
                    manager._dsn, manager._connect_kwargs, manager._fence_table.statements)
                fresh = True
                break
            if link.idle():
                fresh = False
                break
            link.close()
        session.link = link
        return link, fresh

    def return_if_idle(self, session: _TaskSession) -> None:
        if session.holds_anything() or session.cleaning is not None:
            return
        link, session.link = session.link, None
        with self.manager._guard:
            session.reported.clear()
            if link is not None and not session.dead and not link.broken():
                self.idle.append(link)
                link = None
        session.dead = False
        if link is not None:
            link.close()

    def lose(self, session: _TaskSession) -> None:
        """The session's connection is gone, and with it every lock it held."""
        link, session.link = session.link, None
        session.unsure = []
        with self.manager._guard:
            session.lose_levels()
        if link is not None:
            link.close()
        self.manager._report(session)
        if not session.lost:
            self.return_if_idle(session)

    def check_others(self, mine: _TaskSession | None) -> None:
        """Mark dead the sessions of other tasks whose connection died (their owners
        settle them), as ``lost_keys()`` does for threads."""
        with self.manager._guard:
            # A session with a clean-up pending is using its connection (or about to).
            others = [session for session in self.sessions.values() if session is not mine
                      and session.cleaning is None and not session.unsure]
        for other in others:
            link = other.link
            if link is not None and link.idle_unless_busy() is False:
                self.manager._report(other, dead_link=link)

    def lease(self, items: Sequence[tuple[Hashable, int]]) -> Lease:
        """The current task's lease on ``items``, which it has just acquired."""
        keys = tuple(key for key, _ in items)
        if not self.manager._fencing:
            return Lease(keys, None)
        session = self.session()
        return Lease(keys, {key: session.fences[key, mode] for key, mode in items if mode == WRITE})

    def fence(self, key: Hashable) -> int:
        manager = self.manager
        manager.advisory_key(key)  # a key PostgreSQL cannot take fails before anything else
        if not manager._fencing:
            raise _no_fencing()
        session = self.session_or_none()
        if session is not None:
            self.check(session)
            if session.lost.get((key, WRITE)):
                raise _lost_error([key])
            if session.levels.get((key, WRITE)):
                return session.fences[key, WRITE]
            if session.levels.get((key, READ)) or session.lost.get((key, READ)):
                raise _read_has_no_fence(key)
        raise not_owned(key)

    def check(self, session: _TaskSession) -> None:
        """What ``settle`` can find without waiting: a dead connection loses its keys (and a
        loss interrupted half-way is finished)."""
        link = session.link
        if session.cleaning is not None or session.unsure and link is not None:
            return
        if link is None and session.levels or link is not None and (session.dead or not link.idle()):
            self.lose(session)

    def lost_here(self, key: Hashable, mode: int) -> bool:
        session = self.session_or_none()
        if session is None:
            return False
        self.check(session)
        return bool(session.lost.get((key, mode)))

    def lost_items(self) -> list[tuple[Hashable, int]]:
        """(key, mode) of every running task's lost, unreleased keys (under ``_guard``)."""
        return [item for session in self.sessions.values()
                for item in {*session.lost, *(session.levels if session.dead else ())}]

    def sweep_closed_loops(self) -> None:
        """Sessions of tasks whose event loop was closed with them pending (a shutdown
        interrupted by another Ctrl-C): nobody can talk on their connections any more,
        and a wait queued there would be granted to nobody. Close them, and end the tasks
        in the in-process engine too, one at a time: ending one runs Python code (its
        AbandonedLockWarning) that may raise, and the others stay listed for the next
        sweep whatever it raises."""
        while True:
            with self.manager._guard:
                closed = [loop for loop in self.loops if loop.is_closed()]
                if not closed:
                    return
                task = next((task for task in self.sessions if task.get_loop().is_closed()), None)
                if task is None:  # none left: the closed loops need no more looking at
                    for loop in closed:
                        self.loops.discard(loop)
                    return
                session = self.sessions[task]
            session.ended = True  # a block's exit releases nothing from now on
            try:
                _close_link(session)
                self.engine.end_stranded_task(task)  # and in process: what it held goes to others
            finally:  # ended or not: a task ends once (end_stranded_task is a no-op after)
                with self.manager._guard:
                    self.sessions.pop(task, None)

    def close(self) -> None:
        self.sweep_closed_loops()
        with self.manager._guard:
            idle, self.idle = self.idle, []
        for link in idle:
            link.close()

    def forget_parent_sessions(self) -> None:
        """In a forked child: the parent's tasks and connections are not the child's."""
        links = [*self.idle, *(s.link for s in self.sessions.values() if s.link is not None)]
        self.idle = []
        self.sessions = {}
        self.loops = weakref.WeakSet()
        for link in links:
            link.close()

    async def held_on_server(self, key: Hashable, mode: str | None) -> bool:
        """``_PgEngine._held_on_server`` on an idle connection of the tasks'."""
        manager = self.manager
        with manager._guard:
            link = self.idle.pop() if self.idle else None
        if link is None or not link.idle():
            if link is not None:
                link.close()
            link = await _AsyncLink.connect_async(
                manager._dsn, manager._connect_kwargs, manager._fence_table.statements)
        try:
            result = await link.run_async(
                f"SELECT EXISTS (SELECT 1 FROM {_GRANTED_ADVISORY} {manager.advisory_key(key)}"
                f" AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                + ("" if mode is None else f" AND mode = '{mode}'") + ")")
        except BaseException:
            link.close()
            raise
        with manager._guard:
            self.idle.append(link)
        return bool(result.get_value(0, 0) == b"t")


class _PgBlockRecord:
    """Which task is inside a PostgreSQL ``async with`` object, and how many times (the
    rule of lockmgr._aio): written once ``__aenter__`` holds the keys, read back by
    ``__aexit__``. The task is kept by a weak reference, its session strongly (an ended
    session keeps no connection). A task that is done counts as ended at once: its
    session's end (its done-callback) may still be queued behind the task awaiting it.
    Changed under a lock of its own (the collector may close a coroutine inside a block
    on another thread); reentrant, as a collection inside may run another exit."""

    __slots__ = ("_depth", "_lock", "_session", "_task")

    def __init__(self) -> None:
        self._task: weakref.ref[asyncio.Task[Any]] | None = None
        self._session: _TaskSession | None = None
        self._depth = 0
        self._lock = threading.RLock()

    def enter(self, tasks: _Tasks) -> None:
        """The current task holds the block's keys: it is inside (RuntimeError, and nothing
        changed, if another task is)."""
        task = current_task_or_raise()
        with self._lock:
            session, inside = self._session, None if self._task is None else self._task()
            if session is None:
                self._task, self._session = weakref.ref(task), tasks.sessions[task]
            if session is None or inside is task:
                self._depth += 1
                return
        raise block_in_use(inside, _ended(session, inside))

    def leave(self) -> asyncio.Task[Any] | None:
        """One block exits: its task, or None if that task has ended (its end released, or
        releases, its keys). RuntimeError if no block is inside."""
        with self._lock:
            session, task = self._session, None if self._task is None else self._task()
            if session is None:
                raise not_entered()
            self._depth -= 1
            if not self._depth:
                self._task = self._session = None
        return None if _ended(session, task) else task


def _ended(session: _TaskSession, task: asyncio.Task[Any] | None) -> bool:
    return session.ended or task is None or task.done()


async def _exit_block(record: _PgBlockRecord, key: Hashable,
                      release: Callable[[], Awaitable[None]]) -> None:
    """The exit of a block gives back the hold of the task that entered it, in that task;
    nothing if that task's session has ended. Run by another task (an async generator
    asyncio finalizes in a task of its own), it cannot use that task's connection:
    NotOwnedError, and the key stays held until that task releases it or ends."""
    task = record.leave()
    if task is None:
        return
    if task is not current_task_or_none():
        raise not_owned_block(key, task)
    await release()


async def _enter_record(record: _PgBlockRecord, tasks: _Tasks,
                        release: Callable[[], Awaitable[None]]) -> None:
    """The block enters ``record`` now that its task holds the keys; if another task
    entered meanwhile (two readers), they go back first (RuntimeError)."""
    try:
        record.enter(tasks)
    except RuntimeError:
        await release()
        raise


def _close_link(session: _TaskSession) -> None:
    link, session.link = session.link, None
    if link is not None:
        link.close()


class _AsyncHeld:
    """What the ``aio`` views' ``hold()``, ``read()``, ``write()`` and ``hold_many()`` return:
    ``async with`` gives the ``Lease``."""

    __slots__ = ("_acquire", "_items", "_record", "_release", "_seconds", "_tasks")

    def __init__(self, tasks: _Tasks, items: list[tuple[Hashable, int]],
                 acquire: Callable[[], Awaitable[bool]],
                 release: Callable[[], Awaitable[None]], seconds: float) -> None:
        self._tasks = tasks
        self._items = items
        self._acquire = acquire
        self._release = release
        self._seconds = seconds
        self._record = _PgBlockRecord()

    async def __aenter__(self) -> Lease:
        if not await self._acquire():
            keys = [key for key, _ in self._items]
            raise timed_out(keys[0] if len(keys) == 1 else tuple(keys), self._seconds)
        await _enter_record(self._record, self._tasks, self._release)
        return self._tasks.lease(self._items)

    async def __aexit__(self, kind: type[BaseException] | None, *exc_info: object) -> None:
        await _exit_block(self._record, self._items[0][0], self._release)


class _PgAsyncView(Generic[K]):
    """What both ``aio`` views share."""

    __slots__ = ("_manager", "_tasks")

    def __init__(self, manager: _PgEngine[K], tasks: _Tasks) -> None:
        self._manager = manager
        self._tasks = tasks

    @property
    def manager(self) -> _PgEngine[K]:
        return self._manager

    async def release_all(self) -> int:
        """Release every key the current task holds, all levels; how many (LockLost, after
        releasing everything, if some had been lost)."""
        return await self._tasks.release_all(self._manager._engine.aio.release_all)

    async def lost_keys(self) -> set[Hashable]:
        """``PgLockManager.lost_keys()`` from a task: keys lost with their session that
        their holders (threads and tasks of this process) have not yet released; checks
        the current task's connection first, and the others' without waiting."""
        tasks = self._tasks
        session = tasks.session_or_none()
        if session is not None:
            await tasks.settle(session)
        tasks.check_others(session)
        return self._manager.lost_keys()

    def fence(self, key: K) -> int:
        """``PgLockManager.fence`` for the current task: the fence it holds ``key`` under."""
        return self._tasks.fence(key)

    def __repr__(self) -> str:
        return f"<lockmgr.{type(self).__name__} of {self._manager!r}>"


class PgAsyncLockManager(_PgAsyncView[K]):
    """``PgLockManager.aio``: the manager with the current asyncio task as owner.

    Names, arguments and errors are those of ``PgLockManager``; acquiring *and releasing*
    are coroutines (a release talks to the server). A cancelled acquire leaves nothing
    held, here or on the server."""

    __slots__ = ()
    _manager: PgLockManager[K]

    async def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` for the current task across every process using this database and
        namespace: True once held, False if ``blocking`` is false or ``timeout`` ran out."""
        seconds = wait_seconds(blocking, timeout)
        self._manager.advisory_key(key)  # a key PostgreSQL cannot take fails first
        local = self._manager._engine.aio
        return await self._tasks.take([(key, WRITE)], seconds,
                                      lambda left: local.acquire(key, timeout=left),
                                      lambda: local.release(key))

    async def release(self, key: K) -> None:
        """Undo one ``acquire`` (NotOwnedError if the task does not hold ``key``; LockLost,
        the key then no longer held, if its session was lost)."""
        local = self._manager._engine.aio
        await self._tasks.give([(key, WRITE)], lambda: local.release(key))

    def hold(self, key: K, timeout: float | None = None) -> _AsyncHeld:
        """``async with aio.hold(key, timeout=...)``: LockTimeout if not acquired in time."""
        seconds = hold_seconds(timeout)
        return _AsyncHeld(self._tasks, [(key, WRITE)], lambda: self.acquire(key, timeout=seconds),
                          lambda: self.release(key), seconds)

    def __getitem__(self, key: K) -> PgAsyncKeyLock[K]:
        return PgAsyncKeyLock(self, key)

    async def acquire_many(self, keys: Iterable[K], blocking: bool = True,
                           timeout: float = -1) -> bool:
        """Lock every key of ``keys`` at once, or none."""
        seconds = wait_seconds(blocking, timeout)
        return await self._acquire_items(many_items(keys, _same), seconds)

    async def release_many(self, keys: Iterable[K]) -> None:
        await self._release_items(many_items(keys, _same))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> _AsyncHeld:
        seconds = hold_seconds(timeout)
        items = many_items(keys, _same)
        return _AsyncHeld(self._tasks, items, lambda: self._acquire_items(items, seconds),
                          lambda: self._release_items(items), seconds)

    async def _acquire_items(self, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        keys = [key for key, _ in items]
        for key in keys:
            self._manager.advisory_key(key)
        local = self._manager._engine.aio
        return await self._tasks.take(items, seconds,
                                      lambda left: local.acquire_many(keys, timeout=left),
                                      lambda: local.release_many(keys))

    async def _release_items(self, items: list[tuple[Hashable, int]]) -> None:
        keys = [key for key, _ in items]
        local = self._manager._engine.aio
        await self._tasks.give(items, lambda: local.release_many(keys))

    def owned(self, key: K) -> bool:
        """Whether the current task holds ``key`` (a lost key is not held)."""
        return bool(self._manager._engine.aio.owned(key)) and not self._tasks.lost_here(key, WRITE)

    def recursion_count(self, key: K) -> int:
        count = int(self._manager._engine.aio.recursion_count(key))
        return 0 if count and self._tasks.lost_here(key, WRITE) else count

    async def locked(self, key: K) -> bool:
        """Whether any session of any process holds ``key`` (asks the server)."""
        return await self._tasks.held_on_server(key, None)

    def synchronized(self, key_func: Callable[..., K]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """Decorator for coroutine functions: each call holds ``key_func(*args, **kwargs)``
        for the current task while it runs."""
        return _synchronized(self.hold, key_func)


class PgAsyncRWLockManager(_PgAsyncView[K]):
    """``PgRWLockManager.aio``: shared/exclusive keys with the current task as owner (see
    ``PgAsyncLockManager``)."""

    __slots__ = ()
    _manager: PgRWLockManager[K]

    async def acquire_read(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        return await self._acquire_one(key, READ, wait_seconds(blocking, timeout))

    async def acquire_write(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        return await self._acquire_one(key, WRITE, wait_seconds(blocking, timeout))

    async def _acquire_one(self, key: K, mode: int, seconds: float) -> bool:
        self._manager.advisory_key(key)
        local = self._manager._engine.aio
        acquire = local.acquire_read if mode == READ else local.acquire_write
        release = local.release_read if mode == READ else local.release_write
        return await self._tasks.take([(key, mode)], seconds,
                                      lambda left: acquire(key, timeout=left),
                                      lambda: release(key))

    async def release_read(self, key: K) -> None:
        local = self._manager._engine.aio
        await self._tasks.give([(key, READ)], lambda: local.release_read(key))

    async def release_write(self, key: K) -> None:
        local = self._manager._engine.aio
        await self._tasks.give([(key, WRITE)], lambda: local.release_write(key))

    def read(self, key: K, timeout: float | None = None) -> _AsyncHeld:
        seconds = hold_seconds(timeout)
        return _AsyncHeld(self._tasks, [(key, READ)],
                          lambda: self.acquire_read(key, timeout=seconds),
                          lambda: self.release_read(key), seconds)

    def write(self, key: K, timeout: float | None = None) -> _AsyncHeld:
        seconds = hold_seconds(timeout)
        return _AsyncHeld(self._tasks, [(key, WRITE)],
                          lambda: self.acquire_write(key, timeout=seconds),
                          lambda: self.release_write(key), seconds)

    async def acquire_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                           blocking: bool = True, timeout: float = -1) -> bool:
        """Read ``reads`` and write ``writes`` at once, or none (a key in both is written)."""
        seconds = wait_seconds(blocking, timeout)
        return await self._acquire_items(rw_items(reads, writes, _same), seconds)

    async def release_many(self, reads: Iterable[K] = (), writes: Iterable[K] = ()) -> None:
        await self._release_items(rw_items(reads, writes, _same))

    def hold_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                  timeout: float | None = None) -> _AsyncHeld:
        seconds = hold_seconds(timeout)
        items = rw_items(reads, writes, _same)
        return _AsyncHeld(self._tasks, items, lambda: self._acquire_items(items, seconds),
                          lambda: self._release_items(items), seconds)

    async def _acquire_items(self, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        for key, _ in items:
            self._manager.advisory_key(key)
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        local = self._manager._engine.aio
        return await self._tasks.take(
            items, seconds, lambda left: local.acquire_many(reading, writing, timeout=left),
            lambda: local.release_many(reading, writing))

    async def _release_items(self, items: list[tuple[Hashable, int]]) -> None:
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        local = self._manager._engine.aio
        await self._tasks.give(items, lambda: local.release_many(reading, writing))

    def owned(self, key: K) -> bool:
        """Whether the current task reads or writes ``key`` (a lost key is not held)."""
        write, read = self._manager._engine._task_levels(key)
        return bool(write and not self._tasks.lost_here(key, WRITE)
                    or read and not self._tasks.lost_here(key, READ))

    def recursion_count(self, key: K) -> int:
        """How many times the current task writes ``key`` (0 if it does not)."""
        count = int(self._manager._engine.aio.recursion_count(key))
        return 0 if count and self._tasks.lost_here(key, WRITE) else count

    async def write_locked(self, key: K) -> bool:
        """Whether any session of any process writes ``key`` (asks the server)."""
        return await self._tasks.held_on_server(key, _MODE_NAMES[WRITE])

    def synchronized(self, key_func: Callable[..., K]
                     ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                   Callable[P, Coroutine[Any, Any, T]]]:
        """As ``PgAsyncLockManager.synchronized``, holding the key for writing."""
        return _synchronized(self.write, key_func)


class PgAsyncKeyLock(Generic[K]):
    """``locks.aio[key]``: one key as an asyncio lock of the current task, across processes
    (``async with``, or ``await acquire()`` / ``await release()``)."""

    __slots__ = ("_key", "_record", "_view")

    def __init__(self, view: PgAsyncLockManager[K], key: K) -> None:
        view.manager.advisory_key(key)  # a key PostgreSQL cannot take fails here
        self._view = view
        self._key = key
        self._record = _PgBlockRecord()

    @property
    def key(self) -> K:
        return self._key

    async def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return await self._view.acquire(self._key, blocking, timeout)

    async def release(self) -> None:
        await self._view.release(self._key)

    async def locked(self) -> bool:
        return await self._view.locked(self._key)

    async def __aenter__(self) -> bool:
        got = await self._view.acquire(self._key)
        await _enter_record(self._record, self._view._tasks,
                            lambda: self._view.release(self._key))
        return got

    async def __aexit__(self, kind: type[BaseException] | None, *exc_info: object) -> None:
        await _exit_block(self._record, self._key, lambda: self._view.release(self._key))

    def __repr__(self) -> str:
        return f"<lockmgr.PgAsyncKeyLock key={self._key!r}>"


def _synchronized(hold: Callable[[Any], _AsyncHeld], key_func: Callable[..., Hashable]
                  ) -> Callable[[Callable[P, Coroutine[Any, Any, T]]],
                                Callable[P, Coroutine[Any, Any, T]]]:
    if not callable(key_func):
        raise TypeError(f"key_func must be callable, not {type(key_func).__name__}")

    def decorate(func: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(f"aio.synchronized() wraps coroutine functions; "
                            f"{getattr(func, '__qualname__', func)!r} is not one")

        @functools.wraps(func)
        async def locked_call(*args: P.args, **kwargs: P.kwargs) -> T:
            async with hold(key_func(*args, **kwargs)):
                return await func(*args, **kwargs)

        return locked_call

    return decorate
