"""A thread's connection (``_Link``) and its round trips, each with a deadline on the client."""

from __future__ import annotations

import functools
import os
import select
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, NamedTuple, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.conninfo import conninfo_attempts, conninfo_to_dict, make_conninfo
from psycopg.pq import ConnStatus, ExecStatus, PollingStatus, TransactionStatus

from .._tuning import MAIN_THREAD_SLICE
from ._server import (
    _CHECK_UNSUPPORTED,
    _WHO_IS_THIS_AT,
    PgConnectionError,
    _connect_limit,
    _refusal,
    _setup_sql,
)


_FATAL_ERROR = int(ExecStatus.FATAL_ERROR)
# (as ints: compared on every round trip and check, without an enum member's lookup)
_CONNECTION_OK = int(ConnStatus.OK)
_IDLE = int(TransactionStatus.IDLE)
_SLICE_MS = int(MAIN_THREAD_SLICE * 1000)
# Every round trip has a client-side deadline, whatever the server does (a stopped backend,
# a stuck proxy, a half-open network, a table locked by a migration): a round trip that
# waits for a lock without a timeout waits for ever (None); a timed call's (and a try's)
# ends _WAIT_MARGIN after the call's deadline; any other's after _ANSWER_WITHIN. At the
# deadline the statement is cancelled: a server that is only slow ends it and the
# connection lives (``_Overdue``). A cancel unanswered for _CANCEL_GRACE closes the
# connection (``_Unanswered``): its session's locks are lost, and nothing is left that
# could be granted to it later. A timed call so returns by its deadline plus at most
# _WAIT_MARGIN + _CANCEL_GRACE, and _CANCEL_GRACE for the release of what it may have taken.
# Connecting has a deadline as well: a timed call's (and a try's) is its round trips'; and
# each host's attempt has ``connect_timeout`` of the DSN or connect_kwargs, else
# _server._CONNECT_WITHIN (``_connect_by``). A new connection's set-up round trip shares
# its attempt's.
_ANSWER_WITHIN = 10.0
# A try (timeout 0) that has to open a connection first gives its connect this long: a
# connect says nothing about the key, and a loaded host (or a far server, over TLS) may take
# longer than _WAIT_MARGIN to fork a backend and answer; a try still returns in bounded time.
_TRY_CONNECTS_WITHIN = 2.0
_WAIT_MARGIN = 0.25
_CANCEL_GRACE = 0.25
_ABORT_SECONDS = 5.0  # how long an interrupted round trip waits for its cancelled statement
_POLLIN = getattr(select, "POLLIN", 1)  # Windows has no poll(), nor its constants
_POLLOUT = getattr(select, "POLLOUT", 4)


def _answer_by() -> float:
    """The deadline of a round trip that waits for no lock."""
    return time.monotonic() + _ANSWER_WITHIN


class _Unanswered(psycopg.OperationalError):
    """A round trip passed its deadline, and its cancel went unanswered: the connection was
    closed."""


class _Overdue(psycopg.OperationalError):
    """A round trip passed its deadline and was cancelled: the statement ended (it may have
    taken locks before the cancel: the caller drops them); the connection lives."""


class _NotConnectedInTime(PgConnectionError):
    """A new connection was not complete, or not set up, by its deadline: given up (and
    closed). A timed call times out; any other raises it."""


_CLIENT_TIMEOUTS = (_Unanswered, _Overdue, _NotConnectedInTime)
_T = TypeVar("_T")



# -- the protocol's steps, once for threads and tasks ------------------------------------------
# A step of the protocol (a round trip's statements, a lock call's choices and retries) is a
# generator: it yields what it needs done, a need, and gets back the answer, or the exception
# that doing it raised (thrown in where it yielded). It does no I/O itself: ``_drive`` answers
# its needs for a thread, blocking; ``_drive_async`` (``_aio_link``) for a task, awaiting. So
# a fix to the protocol lands once, for both. (psycopg drives libpq the same way, one level
# down.)

class _RoundTrip(NamedTuple):
    """A need: one round trip on ``link``: ``send(*args)``, then every result, by
    ``deadline`` (``_Link._round_trip``)."""

    link: _Link
    deadline: float | None
    send: Callable[..., None]
    args: tuple[Any, ...]


class _Attach(NamedTuple):
    """A need: a connection for ``session`` (the driver's ``attach``): (link, fresh). A new
    one waits for a free place under ``max_connections`` until ``deadline`` (None: however
    long it takes), and is connected by ``connect_by`` (None: ``_connect_by``'s bound)."""

    session: Any
    deadline: float | None = None
    connect_by: float | None = None


class _Lose(NamedTuple):
    """A need: ``session``'s connection is gone, and with it its keys (the driver's
    ``lose``)."""

    session: Any


class _Drop(NamedTuple):
    """A need: a failed or interrupted call may hold ``items`` on ``session``'s connection
    (they are its ``unsure``): release them, or end the connection (the driver's
    ``drop``)."""

    session: Any
    items: list[Any]


_Need = _RoundTrip | _Attach | _Lose | _Drop
_Steps = Generator[_Need, Any, _T]


def _drive(steps: _Steps[_T],
           attach: Callable[[Any, float | None, float | None], Any] | None = None,
           lose: Callable[[Any], None] | None = None,
           drop: Callable[[Any, list[Any]], None] | None = None,
           tried: BaseException | None = None) -> _T:
    """Run ``steps`` in the calling thread: each need answered by a blocking round trip (or
    ``attach``, ``lose``, ``drop``), its exception thrown back into the steps. ``tried``:
    the exception of the steps' first need, a round trip the caller made itself (a call
    made at once, ``_protocol``), thrown in where they ask for it."""
    answer: Any = None
    error: BaseException | None = None
    try:
        if tried is not None:
            need = steps.send(None)
            assert isinstance(need, _RoundTrip)
            error, tried = tried, None
        while True:
            try:
                need = steps.send(answer) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            try:
                if isinstance(need, _RoundTrip):
                    answer = need.link._round_trip(need.deadline, need.send, *need.args)
                elif isinstance(need, _Attach):
                    assert attach is not None
                    answer = attach(need.session, need.deadline, need.connect_by)
                elif isinstance(need, _Lose):
                    assert lose is not None
                    answer = lose(need.session)
                else:
                    assert drop is not None
                    drop(need.session, need.items)
                    answer = None
                error = None
            except BaseException as failure:
                answer, error = None, failure
    finally:
        answer = error = tried = None  # no cycle through a traceback keeps a link alive


def _run_all_steps(link: _Link, sql: str, deadline: float | None | bool) -> _Steps[list[Any]]:
    """Run ``sql`` (one or more statements: one implicit transaction): the result of each;
    an error result raises its psycopg exception once all are read."""
    results: list[Any] = yield _RoundTrip(link, _deadline(deadline), link.pgconn.send_query,
                                          (sql.encode(),))
    return results


def _call_steps(link: _Link, statement: bytes, ident: int,
                deadline: float | None | bool) -> _Steps[Any]:
    """Run one of the single-key ``statements`` (prepared once per session: no parsing or
    planning on the server after that) for the advisory key ``ident``."""
    answer_by = _deadline(deadline)
    if statement not in link.prepared:
        try:  # waits for no lock but the fence table's: the call's deadline, or soon
            yield _RoundTrip(link, _answer_by() if answer_by is None else answer_by,
                             link.pgconn.send_prepare, (statement, link.statements[statement]))
        except pg_errors.DuplicatePreparedStatement:
            # an interrupt came after the server prepared it, before we noted it (or, for
            # a task, a clean-up after a cancellation drained the answer we never read)
            pass
        link.prepared.add(statement)
    results: list[Any] = yield _prepared_call(link, statement, ident, answer_by)
    return results[-1]


def _prepared_call(link: _Link, statement: bytes, ident: int,
                   answer_by: float | None) -> _RoundTrip:
    """The round trip of ``_call_steps`` once ``statement`` is prepared on ``link``: a step
    may yield it itself (its result list, of one), saving a step of its own on every call."""
    return _RoundTrip(link, answer_by, link.pgconn.send_query_prepared,
                      (statement, [b"%d" % ident]))


def _set_up_steps(link: _Link, deadline: float | None) -> _Steps[None]:
    """A new connection's one message: its settings pinned, and the server checked
    (``_setup_sql``, ``_refusal``), by ``deadline`` (its connect's; None: soon)."""
    version = link.pgconn.server_version
    answer_by = True if deadline is None else deadline
    try:
        results = yield from _run_all_steps(link, _setup_sql(version), answer_by)
    except _CHECK_UNSUPPORTED:
        results = yield from _run_all_steps(link, _setup_sql(version, False), answer_by)
    who = results[_WHO_IS_THIS_AT]
    refusal = _refusal(who, link.pgconn.backend_pid)
    if refusal is not None:
        raise refusal
    link.server = bytes(who.get_value(0, 2))


def _checked(results: list[Any], conn: psycopg.BaseConnection[Any],
             cancelled_late: bool) -> list[Any]:
    """``results``, unless one is an error: then its psycopg exception (``_Overdue`` for
    the cancel the deadline sent), its text decoded as ``conn``'s."""
    for result in results:
        if result.status == _FATAL_ERROR:
            error = pg_errors.error_from_result(result, encoding=conn.info.encoding)
            try:
                if cancelled_late and isinstance(error, pg_errors.QueryCanceled):
                    raise _Overdue("PostgreSQL did not answer in time: the statement was"
                                   " cancelled") from error
                raise error
            finally:
                del error  # no cycle (error -> traceback -> this frame -> error)
    return results


class _Link:
    """One server connection. Lock calls drive libpq directly (one message, one round trip,
    no cursor), waiting in ``poll`` so that Ctrl-C and other signal handlers run.

    Its owner talks on it; another thread may only check it (``idle_unless_busy``), never
    while the owner talks. ``guard`` is held for short spans that never wait, and only by
    ``with`` (which cannot be split by a signal handler's exception): the checks, closing,
    and setting ``talking``. A try-lock would not do: a handler can raise between a
    successful try-lock and the ``try`` that releases it (CPython checks for signals right
    after a call returns, and without a GIL the signal can come at any moment), which
    left the lock taken and the next round trip waiting for it forever; blocking the
    signals on the main thread does not prevent that (CPython runs the handler on the main
    thread whichever thread the kernel gave the signal to). ``guard`` is reentrant: a
    finalizer that closes the link (a thread's end, collected late) may run inside a check
    of it on the same thread."""

    __slots__ = ("backend", "cancelled_late", "conn", "ended", "guard", "pgconn", "pid",
                 "poller", "prepared", "server", "slot", "statements", "talking", "warned")

    def __init__(self, conn: psycopg.Connection[Any], statements: dict[bytes, bytes]) -> None:
        self.pid = os.getpid()  # a forked child must never speak on its parent's connection
        self.slot: Any = None  # its place under max_connections (_capacity), given back at close
        self.guard = threading.RLock()  # see the class docstring
        self.talking = False  # the owner is in a round trip: checks keep off
        self.cancelled_late = False  # the owner's round trip passed its deadline: cancelled
        self.prepared: set[bytes] = set()  # names of the statements prepared on this session
        self.statements = statements  # what each name prepares: its manager's (_FenceTable)
        # The server's FATAL notices: it sends one as it ends the session, before it gives up
        # the session's locks and long before the socket closes. (The handler holds this
        # list, not the link, so the connection keeps no cycle through it.)
        self.ended: list[str] = []
        conn.add_notice_handler(functools.partial(_note_ending, self.ended))
        # The last warning the server sent (``_note_warning``): a fenced lock call clears it
        # before its round trip, and hands out no fence if one came (``_lock_steps``).
        self.warned: list[str] = []
        conn.add_notice_handler(functools.partial(_note_warning, self.warned))
        self.conn = conn  # last but two: close() needs what comes before
        self.pgconn = conn.pgconn
        self.backend = self.pgconn.backend_pid  # the server's pid for this session
        self.server = b""  # which server (_WHO_IS_THIS): pids of one server are comparable
        self.poller = select.poll() if hasattr(select, "poll") else _SelectPoller()
        self.poller.register(self.pgconn.socket, _POLLIN)

    @classmethod
    def connect(cls, dsn: str, connect_kwargs: dict[str, Any],
                statements: dict[bytes, bytes], deadline: float | None = None) -> _Link:
        """A new connection, set up and checked (``_setup_sql``, ``_refusal``) by
        ``deadline`` and its host's bound (``_connect_pgconn``): closed again if that fails
        or it is refused.
        Raises ``PgConnectionError`` (``_NotConnectedInTime`` past the deadline),
        ``UnsafeServerError``."""
        try:
            pgconn, by = _connect_pgconn(make_conninfo(dsn, **connect_kwargs), deadline)
            conn = psycopg.Connection(pgconn)
        except psycopg.Error as error:
            raise _not_connected(error) from error
        conn.autocommit = True  # (no round trip: the session is idle)
        link = cls(conn, statements)
        try:
            _drive(_set_up_steps(link, by))
        except BaseException as error:
            link.close()
            if isinstance(error, psycopg.Error):
                raise _not_connected(error) from error
            raise
        return link

    def run(self, sql: str, deadline: float | None | bool = True) -> Any:
        """Send ``sql`` (one or more statements: one implicit transaction) and return the
        last result; an error result raises its psycopg exception once all are read.
        ``deadline``: a monotonic time, None (for ever: a wait for a lock) or True (soon:
        ``_answer_by``); past it, ``_Unanswered``."""
        return self.run_all(sql, deadline)[-1]

    def run_all(self, sql: str, deadline: float | None | bool = True) -> list[Any]:
        """``run``, returning the result of each statement."""
        return _drive(_run_all_steps(self, sql, deadline))

    def _round_trip(self, deadline: float | None, send: Callable[..., None],
                    *args: Any) -> list[Any]:
        pgconn = self.pgconn
        results: list[Any] = []
        self.cancelled_late = False
        try:  # whatever is interrupted after ``talking`` is set, the finally clears it
            with self.guard:  # waits out another thread's check
                self.talking = True
            try:
                send(*args)  # inside: a handler raising once the query is sent cancels it
                while pgconn.flush():
                    while not self._wait(_POLLOUT, deadline):
                        deadline = self._past_deadline()
                while True:
                    if pgconn.is_busy():
                        # (``_wait`` for reading, one call less: the usual round trip's wait;
                        # its first slice without ``_ready_by`` when the deadline is further)
                        if not ((deadline is None or deadline - time.monotonic() > MAIN_THREAD_SLICE)
                                and _poll(self.poller, _SLICE_MS)):
                            while not _ready_by(self.poller, deadline, True):
                                deadline = self._past_deadline()
                        pgconn.consume_input()
                        continue
                    result = pgconn.get_result()
                    if result is None:
                        break
                    results.append(result)
            except BaseException:
                self._abort_query(deadline)
                raise
        finally:
            self.talking = False  # no call before it: nothing can skip it
        for result in results:  # (the usual: no error, and no call to ``_checked``)
            if result.status == _FATAL_ERROR:
                return _checked(results, self.conn, self.cancelled_late)
        return results

    def _past_deadline(self) -> float:
        """The round trip passed its deadline: cancel its statement, and give the cancel
        _CANCEL_GRACE (the new deadline); passed again, close the connection."""
        grace = self._cancelling()
        try:
            self.conn.cancel_safe(timeout=_CANCEL_GRACE)
        except psycopg.Error:
            pass  # no answer to the cancel either: the grace ends with the close
        return grace

    def _cancelling(self) -> float:
        """``_past_deadline``'s decision: the first time, note the cancel and return its
        grace's end; the second, close the connection (``_Unanswered``)."""
        if self.cancelled_late:
            self.close()
            raise _Unanswered("PostgreSQL did not answer in time, nor to a cancel: the"
                              " connection was closed")
        self.cancelled_late = True
        return time.monotonic() + _CANCEL_GRACE

    def _wait(self, event: int, deadline: float | None) -> bool:
        """Until the socket is ready for ``event`` (True) or ``deadline`` passed (False), in
        slices: Python runs signal handlers in the main thread only, and a signal the
        kernel gave another thread does not end a poll."""
        if event != _POLLIN:
            self.poller.modify(self.pgconn.socket, event)
        try:
            return _ready_by(self.poller, deadline, event == _POLLIN)
        finally:
            if event != _POLLIN:
                self.poller.modify(self.pgconn.socket, _POLLIN)

    def _abort_query(self, deadline: float | None) -> None:
        """Interrupted mid-query: cancel it on the server and read what is left, so that the
        connection is idle again, within _ABORT_SECONDS and the round trip's ``deadline``
        (plus _CANCEL_GRACE); if that fails, close it. The caller re-raises what
        interrupted it; only a second interrupt here replaces it."""
        if self.pgconn.transaction_status != TransactionStatus.ACTIVE:
            return
        ends = time.monotonic() + _ABORT_SECONDS
        if deadline is not None:
            ends = min(ends, max(deadline, time.monotonic()) + _CANCEL_GRACE)
        try:
            self.conn.cancel_safe(timeout=max(0.0, ends - time.monotonic()))
            while True:
                if self.pgconn.is_busy():
                    if not self._wait(_POLLIN, ends):
                        self.close()
                        return
                    self.pgconn.consume_input()
                elif self.pgconn.get_result() is None:
                    return
        except Exception:
            self.close()
        except BaseException:
            self.close()
            raise

    def idle_unless_busy(self) -> bool | None:
        """``idle()`` from a thread other than the owner: None if the owner is talking on
        this connection now (it will find out itself)."""
        if self.pid != os.getpid():  # a parent's thread may have held the guard at the fork
            return False
        with self.guard:
            return None if self.talking else self._idle()

    def idle(self) -> bool:
        """Alive, ours and between statements: a server that ends a session sends a FATAL
        error, gives up the session's locks, then closes the socket. The error turns the
        socket readable; reading and parsing it (libpq hands an error between statements
        to the notice handler) tells the session ended even before the socket closes."""
        # (asked, not remembered at a fork: an application's at-fork handler registered
        # before lockmgr's, or a fork from C code, runs before any handler of lockmgr's)
        if self.pid != os.getpid():
            return False
        with self.guard:
            return self._idle()

    def _idle(self) -> bool:
        pgconn = self.pgconn
        if pgconn.status != _CONNECTION_OK:
            return False
        for _ in range(3):  # the goodbye message first, the end of the stream next
            if not _poll(self.poller, 0):
                break
            try:
                pgconn.consume_input()
            except psycopg.OperationalError:
                return False
            pgconn.is_busy()  # parses what arrived: a FATAL error goes to _note_ending
        return (not self.ended and pgconn.status == _CONNECTION_OK
                and pgconn.transaction_status == _IDLE)

    def broken(self) -> bool:
        return self.pgconn.status != _CONNECTION_OK

    def close(self) -> None:
        """End the session (and so every lock it holds). In a forked child, the socket is
        the parent's: it is first replaced by /dev/null, so the child's goodbye goes
        nowhere and the parent's session lives on."""
        slot, self.slot = self.slot, None
        if slot is not None and self.pid == os.getpid():  # first: a server that ended it too
            slot.free()
        if self.conn.closed:
            return
        if self.pid != os.getpid():  # no guard: a thread of the parent's may have held it
            devnull = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(devnull, self.pgconn.socket)
            finally:
                os.close(devnull)
            self._finish()
            return
        with self.guard:  # not while another thread checks it
            self._finish()

    def _finish(self) -> None:
        self.conn.close()

    def __del__(self) -> None:
        if hasattr(self, "conn"):
            self.close()


def _note_ending(ended: list[str], notice: pg_errors.Diagnostic) -> None:
    """A link's notice handler: keeps the FATAL (or PANIC) errors that end its session."""
    if notice.severity_nonlocalized in ("FATAL", "PANIC"):
        ended.append(notice.message_primary or "")


def _note_warning(warned: list[str], notice: pg_errors.Diagnostic) -> None:
    """A link's notice handler: keeps the last WARNING, known by its untranslated severity
    or, from a server that does not send that, its SQLSTATE's warning class (01) — never by
    its text, which lc_messages may translate."""
    if notice.severity_nonlocalized == "WARNING" or (notice.sqlstate or "").startswith("01"):
        warned[:] = [notice.message_primary or ""]


def _ready_by(poller: Any, deadline: float | None, reading: bool) -> bool:
    """Until ``poller``'s socket is ready (True) or ``deadline`` passed (False), in slices
    (``_Link._wait``)."""
    while True:
        milliseconds = _SLICE_MS
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:  # an answer already there still counts
                return bool(_poll(poller, 0)) if reading else False
            milliseconds = min(_SLICE_MS, int(left * 1000) + 1)
        if _poll(poller, milliseconds):
            return True


def _connect_by(conninfo: str, deadline: float | None) -> float | None:
    """When a connect to ``conninfo`` (one host's attempt) gives up: at ``deadline`` (a
    timed call's or a try's), and at the end of ``_connect_limit`` (None: never)."""
    limit = _connect_limit(conninfo)
    if limit is not None:
        limit += time.monotonic()
        deadline = limit if deadline is None else min(deadline, limit)
    return deadline


def _connect_pgconn(conninfo: str, deadline: float | None
                    ) -> tuple[pq.abc.PGconn, float | None]:
    """A connection to ``conninfo`` and its attempt's bound, host by host as libpq's
    blocking connect and psycopg do (``conninfo_attempts``: one single-host conninfo an
    address, psycopg's order): each attempt given up at its ``_connect_by`` (the host's
    ``connect_timeout``, and ``deadline``), the next host tried after a failure until
    ``deadline``, the last failure raised. (One non-blocking connect to several hosts would
    spend the whole bound on the first.)"""
    failure: BaseException | None = None
    for attempt in conninfo_attempts(conninfo_to_dict(conninfo)):
        if failure is not None and deadline is not None and time.monotonic() >= deadline:
            break
        host = make_conninfo("", **attempt)
        by = _connect_by(host, deadline)
        try:
            return _connect_host(host, by), by
        except (psycopg.OperationalError, _NotConnectedInTime) as error:
            failure = error
    assert failure is not None  # (conninfo_attempts gives one attempt at least, or raises)
    raise failure


def _connect_host(conninfo: str, by: float | None) -> pq.abc.PGconn:
    """A connection to ``conninfo`` (one host) by ``by``: libpq's non-blocking connect
    (``target_session_attrs`` and the rest are libpq's own), waiting as round trips do
    (``_ready_by``). psycopg.connect cannot end its wait sooner than 2 s."""
    pgconn = pq.PGconn.connect_start(conninfo.encode())
    try:
        while True:
            status = (PollingStatus.FAILED if pgconn.status == ConnStatus.BAD
                      else pgconn.connect_poll())
            if status == PollingStatus.OK:
                pgconn.nonblocking = 1  # as psycopg.connect leaves it
                return pgconn
            if status == PollingStatus.FAILED:
                raise psycopg.OperationalError(pgconn.get_error_message().strip())
            poller = select.poll() if hasattr(select, "poll") else _SelectPoller()
            reading = status == PollingStatus.READING
            poller.register(pgconn.socket, _POLLIN if reading else _POLLOUT)  # (it may change)
            if not _ready_by(poller, by, reading):
                raise _NotConnectedInTime(_NOT_CONNECTED_IN_TIME)
    except BaseException:
        pgconn.finish()
        raise


_NOT_CONNECTED_IN_TIME = ("PostgreSQL did not complete a new connection in time (by the"
                          " call's deadline, else connect_timeout, else 10 s): given up")


def _not_connected(error: psycopg.Error) -> PgConnectionError:
    """What a connect that failed with ``error`` raises (``error`` as its cause)."""
    if isinstance(error, (_Unanswered, _Overdue, pg_errors.ConnectionTimeout)):
        return _NotConnectedInTime(_NOT_CONNECTED_IN_TIME)
    return PgConnectionError(f"could not connect to PostgreSQL: {str(error).strip()}")


def _poll(poller: Any, milliseconds: float) -> list[tuple[int, int]]:
    """``poller.poll(milliseconds)``, a signal handler's exception raised as itself. On
    CPython 3.13t with the GIL off, poll() can come back with its result and the handler's
    exception both set (SystemError "... returned a result with an exception set", the
    exception as its cause): re-attaching the thread after the call may wait out another
    thread's stop-the-world pause, a signal interrupts that wait and leaves errno at EINTR,
    and poll then runs the handlers as if it had been interrupted itself. The result is
    gone: it is the handler's interrupt, landing right after poll returned."""
    try:
        result: list[tuple[int, int]] = poller.poll(milliseconds)
    except SystemError as error:
        interrupt = error.__cause__
        if interrupt is None or "returned a result with an exception set" not in str(error):
            raise
        error.__cause__ = None
    else:
        return result
    raise interrupt  # out of the handler: no chain (nor cycle) keeping frames and links alive


def _deadline(deadline: float | None | bool) -> float | None:
    return _answer_by() if deadline is True else deadline


class _SelectPoller:
    """``select.poll``'s few methods used here, on ``select.select``: for Windows, which has
    no poll (and whose select has no limit on descriptor numbers)."""

    def __init__(self) -> None:
        self.fd = -1
        self.event = 0

    def register(self, fd: int, event: int) -> None:
        self.fd, self.event = fd, event

    def modify(self, fd: int, event: int) -> None:
        self.fd, self.event = fd, event

    def poll(self, milliseconds: float | None = None) -> list[tuple[int, int]]:
        reading = [self.fd] if self.event == _POLLIN else []
        writing = [self.fd] if self.event != _POLLIN else []
        seconds = None if milliseconds is None else milliseconds / 1000
        readable, writable, _ = select.select(reading, writing, [], seconds)
        return [(self.fd, self.event)] if readable or writable else []


def _call_deadline(started: float, seconds: float) -> float | bool:
    """The deadline of the round trips a call starting at ``started`` makes before it
    waits: a timed call's own, plus _WAIT_MARGIN; for a call without a timeout, soon."""
    return True if seconds < 0 else started + seconds + _WAIT_MARGIN


def _round_trip_deadline(how: str, deadline: float | None) -> float | None:
    """When a lock call's round trip gives up (``_Link.run``): a wait for ever never, a
    timed one or a try _WAIT_MARGIN after the call's deadline."""
    if how == "wait":
        return None
    return (time.monotonic() if deadline is None else deadline) + _WAIT_MARGIN
