"""Across processes and hosts: PostgreSQL advisory locks behind the lockmgr API.

``PgLockManager`` and ``PgRWLockManager`` offer the methods of ``LockManager`` and
``RWLockManager``. Within a process, threads are ordered by the in-process engine
(reentrancy per thread, FIFO, deadlock detection); across processes, by PostgreSQL's lock
manager (its FIFO queue, its deadlock detector, and release of everything a session held
when the session ends — no lease that can expire under a paused holder).

The rules that keep it correct:

- **Keys** (str, bytes, int and tuples of them) map to one 64-bit advisory key by blake2b of
  a canonical encoding keyed with the namespace: the same key is the same lock from every
  process, Python version and host. A hash collision can only make two keys wait for each
  other; it can never let two holders in.
- **Connections**: a thread's session-level locks live on a connection that thread owns
  until it holds nothing (then the connection goes back to the manager's idle list, and is
  checked before it is used again). Each new connection pins the settings locks depend on
  and refuses a standby and a pooler (``_setup_sql``, ``_refusal``). A forked child never uses (nor closes) a connection
  of its parent's: it opens its own, and keys the parent held are not the child's.
- **A lost connection is a lost lock**: the holder gets ``LockLost`` at each release of
  that key (and at an acquire of it), ``lost_keys()`` and the ``on_lost`` callback (once per
  key) tell the application, and the manager no longer claims to hold the key. Keys taken
  later go on a new connection. Connections use TCP keepalives so a dead peer is noticed.
- **One round trip** per first acquire and per last release: each is one message (a
  single-key call is a statement prepared once per connection), fences included. A wait with a timeout takes
  transaction-level locks first, so that a timeout racing the grant (PostgreSQL may report
  the timeout and grant all the same) rolls the grant back, and takes the session locks,
  which then no longer wait, in the same message: no extra round trip, where checking for
  a raced grant after each timeout would cost one per timeout. A wait without a timeout
  takes the session locks directly; after a cancel or Ctrl-C (rare) one more round trip
  releases whatever of the call the server may have granted.
- **Timeouts** end on time via ``lock_timeout``; 0 uses ``pg_try_advisory_*lock*``;
  Ctrl-C cancels the server-side wait; PostgreSQL's deadlock error becomes
  ``DeadlockError``. After any of them, and after a cancelled statement, nothing the call
  took is left held; where that cannot be made sure (the connection is not idle), the
  connection is closed and the keys held on it are lost. A second Ctrl-C that lands before
  that clean-up (or a release's round trip) has started leaves it to the thread's next call
  on the manager, which does it first (``_Session.unsure``).
- ``xact_lock(conn, key)`` takes a transaction-scoped lock in the caller's own transaction,
  so the lock and the caller's writes commit or roll back together.
- **Deadlines**: every round trip has one on the client (``_ANSWER_WITHIN``,
  ``_WAIT_MARGIN``); past it the statement is cancelled, and if the cancel goes
  unanswered too (``_CANCEL_GRACE``) the connection is closed and its keys are lost.
- **Fencing tokens** (``fencing=True``): the first level of each write acquisition takes
  the key's next fence — its row of the fence table (``_FenceTable``), keyed by advisory key, incremented
  — in the lock's own message, after the lock and only if it was granted; a timed wait
  takes it under its transaction locks, so that a timeout rolls it back too. The increment
  commits with ``synchronous_commit`` on before the fence is handed out: a crash never
  hands one out twice. Session locks outlive a failed statement, so an increment that
  fails after the grant (table dropped, no privilege) leaves the lock to the call's usual
  clean-up. The fence lives in the thread's ``_Session`` while the key is held, and goes
  with the last release, a loss or a fork. Reads take none. A manager's first fenced
  acquisition makes sure the table exists first, in a round trip of its own, so that its
  creation is committed before any wait (in the lock's transaction, it would hold back
  every other session's first use — timed ones too — until the lock was granted).
- ``aio``: asyncio tasks as owners, under the same rules (``lockmgr._pg_aio`` says what the
  event loop adds).
"""

from __future__ import annotations

import collections
import datetime
import decimal
import hashlib
import os
import select
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, ParamSpec, TypeVar

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg.pq import ConnStatus, ExecStatus, TransactionStatus
except ImportError as exc:  # tested in a subprocess without psycopg
    raise ImportError(
        "lockmgr.postgres needs psycopg 3: pip install 'lockmgr[postgres]'"
    ) from exc

from . import LockManager, RWLockManager
from ._observe import KeyState, LockMetrics
from ._common import (
    READ,
    WRITE,
    DeadlockError,
    LockError,
    LockLost,
    MAIN_THREAD_SLICE,
    LockStats,
    hold_seconds,
    many_items,
    not_owned,
    restored_count,
    rw_items,
    synchronized,
    timed_out,
    wait_seconds,
)

if TYPE_CHECKING:
    from ._contract import Engine, LockEngine, RWLockEngine
    from ._pg_aio import PgAsyncLockManager, PgAsyncRWLockManager, _Tasks

__all__ = ["Lease", "LockLost", "PgKeyLock", "PgLockManager", "PgRWLockManager", "UnsafeServerError",
           "advisory_key"]

K = TypeVar("K", bound=Hashable)
P = ParamSpec("P")  # a synchronized function's parameters
T = TypeVar("T")  # and its result
_Manager = TypeVar("_Manager", bound="_PgEngine[Any]")

# pg_locks rows of granted advisory locks (bigint keys use objsubid 1 and split the key into
# classid, the high half, and objid, the low half), then "= key" ends the condition.
_KEY_IS = "((classid::bigint << 32) | objid::bigint) ="
_GRANTED_ADVISORY = f"pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND {_KEY_IS}"
# ... and this session's own, the key still to be named.
_MINE = "pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND pid = pg_backend_pid()"
_MODE_NAMES = {READ: "ShareLock", WRITE: "ExclusiveLock"}

def _kind(mode: int) -> str:
    return "_shared" if mode == READ else ""


# Fencing: one counter per advisory key (which includes the namespace; a hash collision
# makes two keys share a counter, which still only increases), in one table named with its
# schema: every role, search_path and connection finds the same counters. Made at a
# manager's first fenced acquisition if missing. The check comes first because CREATE
# TABLE IF NOT EXISTS needs the CREATE privilege even when the table exists: a role
# without it can use a table an administrator made.
DEFAULT_FENCE_TABLE = "public.lockmgr_fences"
_MADE_MEANWHILE = (pg_errors.UniqueViolation, pg_errors.DuplicateObject, pg_errors.DuplicateTable)

# The single-key calls, prepared on each connection at first use.
_STATEMENTS = {
    f"lockmgr_{function}".encode(): f"SELECT {function}($1::bigint)".encode()
    for function in ("pg_advisory_lock", "pg_advisory_lock_shared", "pg_try_advisory_lock",
                     "pg_try_advisory_lock_shared", "pg_advisory_unlock",
                     "pg_advisory_unlock_shared")
}


class _FenceTable:
    """The fence table of a manager (``fence_table``, "schema.table"), and the statements
    that use it."""

    __slots__ = ("create_sql", "exists_sql", "name", "statements")

    def __init__(self, qualified: str) -> None:
        if not isinstance(qualified, str):
            raise TypeError(f"fence_table must be a str, not {type(qualified).__name__}")
        parts = qualified.split(".")
        if len(parts) != 2 or not all(parts) or "\0" in qualified:
            raise ValueError(f"fence_table must name a schema and a table, as"
                             f" {DEFAULT_FENCE_TABLE!r}, not {qualified!r}")
        self.name = ".".join('"' + part.replace('"', '""') + '"' for part in parts)
        literal = "'" + self.name.replace("'", "''") + "'"
        self.exists_sql = f"SELECT to_regclass({literal}) IS NOT NULL"
        self.create_sql = (f"CREATE TABLE IF NOT EXISTS {self.name}"
                           " (key bigint PRIMARY KEY, fence bigint NOT NULL)")
        self.statements = _STATEMENTS | {
            b"lockmgr_fenced_lock": self.next_fences_sql(
                ["$1"], "SELECT pg_advisory_lock($1::bigint), true AS granted").encode(),
            b"lockmgr_fenced_try_lock": self.next_fences_sql(
                ["$1"], "SELECT pg_try_advisory_lock($1::bigint) AS granted").encode(),
        }

    def next_fences_sql(self, idents: Sequence[str], got: str = "SELECT true AS granted") -> str:
        """One statement: ``got`` (a query of one row with a boolean ``granted``, run
        first) and, if granted, the next fence of each of ``idents`` (advisory keys, as
        SQL), in rows (key, fence). Committed durably whatever synchronous_commit the
        session has: a server crash must never hand out a fence again."""
        values = ", ".join(f"({ident}::bigint)" for ident in idents)
        return (f"WITH got AS ({got}),"
                " durable AS (SELECT set_config('synchronous_commit', 'on', true))"
                f" INSERT INTO {self.name} AS f (key, fence)"
                f" SELECT key, 1 FROM got, durable, (VALUES {values}) AS bumped(key) WHERE granted"
                " ON CONFLICT (key) DO UPDATE SET fence = f.fence + 1 RETURNING f.key, f.fence")


_LOCK = {mode: f"lockmgr_pg_advisory_lock{_kind(mode)}".encode() for mode in (READ, WRITE)}
_TRY_LOCK = {mode: f"lockmgr_pg_try_advisory_lock{_kind(mode)}".encode() for mode in (READ, WRITE)}
_FENCED_LOCK = {"wait": b"lockmgr_fenced_lock", "try": b"lockmgr_fenced_try_lock"}
_UNLOCK = {mode: f"lockmgr_pg_advisory_unlock{_kind(mode)}".encode() for mode in (READ, WRITE)}
_REMEMBERED_KEYS = 1024
_FATAL_ERROR = int(ExecStatus.FATAL_ERROR)
_MAX_LOCK_TIMEOUT = 2**31 - 1  # lock_timeout's ceiling, in milliseconds (about 24.8 days)
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
_ANSWER_WITHIN = 10.0
_WAIT_MARGIN = 0.25
_CANCEL_GRACE = 0.25
_ABORT_SECONDS = 5.0  # how long an interrupted round trip waits for its cancelled statement
_POLLIN = getattr(select, "POLLIN", 1)  # Windows has no poll(), nor its constants
_POLLOUT = getattr(select, "POLLOUT", 4)

# Run first on every connection, one message: what the session is (``_refusal`` reads
# the first row), then every setting correctness depends on, pinned for the session
# whatever the server's, the role's or the database's defaults say:
# - lock_timeout, statement_timeout: a wait without a timeout waits for ever (timed waits
#   set a transaction-local lock_timeout of their own);
# - idle_session_timeout (14+), idle_in_transaction_session_timeout: a session holding
#   locks sits idle between calls; a server ending it would turn held locks into leases;
# - default_transaction_isolation: a queued fenced wait reads the fence row after its
#   wait, which under repeatable read or serializable would use a snapshot from before
#   the wait and fail; default_transaction_read_only: fences are written;
# - transaction_timeout (17+): a wait is one statement in one transaction;
# - standard_conforming_strings: the fence table's name is quoted in a literal.
# A session-level SET outranks every default, and a later ALTER ROLE or ALTER SYSTEM
# changes only new sessions (which are set up again).
_WHO_IS_THIS = "SELECT pg_is_in_recovery(), pg_backend_pid()"
_PINNED = ("lock_timeout = 0", "statement_timeout = 0", "idle_in_transaction_session_timeout = 0",
           "default_transaction_isolation = 'read committed'",
           "default_transaction_read_only = off", "standard_conforming_strings = on")
# A backend waiting for a lock notices its client has gone (a process killed while it
# waits, a connection closed under a wait) only when granted, and keeps every lock of the
# session until then: PostgreSQL 14+ can check the socket while a statement runs, on the
# systems that can tell (Linux, macOS, the BSDs, illumos; elsewhere setting it is an error
# and the server keeps its default).
_CHECKING_CLIENT = "client_connection_check_interval = 1000"
_CHECK_UNSUPPORTED = (pg_errors.InvalidParameterValue, pg_errors.UndefinedObject)


def _setup_sql(server_version: int, check_client: bool = True) -> str:
    """What sets up a new connection (again with ``check_client`` false if it fails with
    ``_CHECK_UNSUPPORTED``)."""
    pinned = list(_PINNED)
    if server_version >= 170000:
        pinned.append("transaction_timeout = 0")
    if server_version >= 140000:
        pinned.append("idle_session_timeout = 0")
        if check_client:
            pinned.append(_CHECKING_CLIENT)
    return "; ".join([_WHO_IS_THIS, *(f"SET {setting}" for setting in pinned)])


def _answer_by() -> float:
    """The deadline of a round trip that waits for no lock."""
    return time.monotonic() + _ANSWER_WITHIN


class _Unanswered(psycopg.OperationalError):
    """A round trip passed its deadline, and its cancel went unanswered: the connection was
    closed."""


class _Overdue(psycopg.OperationalError):
    """A round trip passed its deadline and was cancelled: the statement ended (it may have
    taken locks before the cancel: the caller drops them); the connection lives."""


_CLIENT_TIMEOUTS = (_Unanswered, _Overdue)


class UnsafeServerError(LockError):
    """The DSN reaches a server on which session locks would not exclude: a standby, or a
    pooler between this process and the server. Raised by the call that connected; the
    connection is closed and nothing is held."""


def _refusal(first_row: Any, client_pid: int) -> UnsafeServerError | None:
    """Why a session (``_WHO_IS_THIS``'s answer, and the backend pid libpq was given at
    connect) cannot hold locks, or None."""
    in_recovery = first_row.get_value(0, 0) == b"t"
    backend_pid = int(first_row.get_value(0, 1))
    if backend_pid != client_pid:
        return UnsafeServerError(
            f"the DSN reaches PostgreSQL through a connection pooler (the server's backend is"
            f" pid {backend_pid}, the connection was told {client_pid}): a pooler may run the"
            " next statement on another server session, which would not hold this session's"
            " locks and might hold another client's. Point the DSN at the server itself")
    if in_recovery:
        return UnsafeServerError(
            "the DSN reaches a standby (pg_is_in_recovery() is true): a standby's advisory"
            " locks are its own, so a process on the primary could hold the same key. Point"
            " the DSN at the primary (with several hosts: target_session_attrs=read-write)")
    return None


_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
               "keepalives_count": 3, "tcp_user_timeout": 10_000}


def _encode(key: object) -> bytes:
    """A canonical, type-tagged encoding: equal keys (1 == True) encode alike."""
    if isinstance(key, int):
        return b"i" + _decimal(int(key)).encode()
    if isinstance(key, str):
        return b"s" + key.encode("utf-8", "surrogatepass")
    if isinstance(key, bytes):
        return b"b" + key
    if isinstance(key, tuple):
        parts = [_encode(part) for part in key]
        return b"t" + b"".join(len(part).to_bytes(4, "big") + part for part in parts)
    raise TypeError(
        f"PostgreSQL lock keys are str, bytes, int or tuples of them, not {type(key).__name__}"
    )


def _decimal(number: int) -> str:
    """``str(number)``, however many digits: ``sys.set_int_max_str_digits`` limits int to
    str conversions (4,300 digits by default), not Decimal's, and a key must map to one
    advisory key whatever the process set."""
    try:
        return str(number)
    except ValueError:
        return str(decimal.Decimal(number))


def advisory_key(key: Hashable, namespace: str = "") -> int:
    """The signed 64-bit PostgreSQL advisory key of ``key`` in ``namespace``."""
    return _salted_key(key, _salt(namespace))


def _salt(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=32).digest()


def _salted_key(key: Hashable, salt: bytes) -> int:
    digest = hashlib.blake2b(_encode(key), digest_size=8, key=salt).digest()
    return int.from_bytes(digest, "big", signed=True)


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

    __slots__ = ("cancelled_late", "conn", "guard", "pgconn", "pid", "poller", "prepared",
                 "statements", "talking")

    def __init__(self, conn: psycopg.Connection[Any], statements: dict[bytes, bytes]) -> None:
        self.pid = os.getpid()  # a forked child must never speak on its parent's connection
        self.guard = threading.RLock()  # see the class docstring
        self.talking = False  # the owner is in a round trip: checks keep off
        self.cancelled_late = False  # the owner's round trip passed its deadline: cancelled
        self.prepared: set[bytes] = set()  # names of the statements prepared on this session
        self.statements = statements  # what each name prepares: its manager's (_FenceTable)
        self.conn = conn  # last but two: close() needs what comes before
        self.pgconn = conn.pgconn
        self.poller = select.poll() if hasattr(select, "poll") else _SelectPoller()
        self.poller.register(self.pgconn.socket, _POLLIN)

    @classmethod
    def connect(cls, dsn: str, connect_kwargs: dict[str, Any],
                statements: dict[bytes, bytes]) -> _Link:
        """A new connection, set up and checked (``_setup_sql``, ``_refusal``): closed
        again if that fails or it is refused."""
        link = cls(psycopg.connect(dsn, autocommit=True, **connect_kwargs), statements)
        try:
            try:
                results = link.run_all(_setup_sql(link.pgconn.server_version))
            except _CHECK_UNSUPPORTED:
                results = link.run_all(_setup_sql(link.pgconn.server_version, False))
            refusal = _refusal(results[0], link.pgconn.backend_pid)
            if refusal is not None:
                raise refusal
        except BaseException:
            link.close()
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
        return self._round_trip(_deadline(deadline), self.pgconn.send_query, sql.encode())

    def call(self, statement: bytes, ident: int, deadline: float | None | bool = True) -> Any:
        """Run one of the single-key ``statements`` (prepared once per session: no parsing
        or planning on the server after that) for the advisory key ``ident``."""
        answer_by = _deadline(deadline)
        if statement not in self.prepared:
            try:  # waits for no lock but the fence table's: the call's deadline, or soon
                self._round_trip(_answer_by() if answer_by is None else answer_by,
                                 self.pgconn.send_prepare, statement, self.statements[statement])
            except pg_errors.DuplicatePreparedStatement:
                pass  # an interrupt came after the server prepared it, before we noted it
            self.prepared.add(statement)
        return self._round_trip(answer_by, self.pgconn.send_query_prepared, statement,
                                [b"%d" % ident])[-1]

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
                        while not self._wait(_POLLIN, deadline):
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
            encoding = self.conn.info.encoding
        finally:
            self.talking = False  # no call before it: nothing can skip it
        for result in results:
            if result.status == _FATAL_ERROR:
                error = pg_errors.error_from_result(result, encoding=encoding)
                if self.cancelled_late and isinstance(error, pg_errors.QueryCanceled):
                    raise _Overdue("PostgreSQL did not answer in time: the statement was"
                                   " cancelled") from error
                raise error
        return results

    def _past_deadline(self) -> float:
        """The round trip passed its deadline: cancel its statement, and give the cancel
        _CANCEL_GRACE (the new deadline); passed again, close the connection."""
        if self.cancelled_late:
            self.close()
            raise _Unanswered("PostgreSQL did not answer in time, nor to a cancel: the"
                              " connection was closed")
        self.cancelled_late = True
        grace = time.monotonic() + _CANCEL_GRACE
        try:
            self.conn.cancel_safe(timeout=_CANCEL_GRACE)
        except psycopg.Error:
            pass  # no answer to the cancel either: the grace ends with the close
        return grace

    def _wait(self, event: int, deadline: float | None) -> bool:
        """Until the socket is ready for ``event`` (True) or ``deadline`` passed (False), in
        slices: Python runs signal handlers in the main thread only, and a signal the
        kernel gave another thread does not end a poll."""
        if event != _POLLIN:
            self.poller.modify(self.pgconn.socket, event)
        try:
            while True:
                milliseconds = _SLICE_MS
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:  # an answer already there still counts
                        return bool(_poll(self.poller, 0)) if event == _POLLIN else False
                    milliseconds = min(_SLICE_MS, int(left * 1000) + 1)
                if _poll(self.poller, milliseconds):
                    return True
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
        """Alive, ours and between statements: a server that ends a session sends an error
        and closes the socket, which turns it readable, and reading that breaks it."""
        if self.pid != os.getpid():
            return False
        with self.guard:
            return self._idle()

    def _idle(self) -> bool:
        pgconn = self.pgconn
        if pgconn.status != ConnStatus.OK:
            return False
        for _ in range(3):  # the goodbye message first, the end of the stream next
            if not _poll(self.poller, 0):
                break
            try:
                pgconn.consume_input()
            except psycopg.OperationalError:
                return False
        return pgconn.status == ConnStatus.OK and pgconn.transaction_status == TransactionStatus.IDLE

    def broken(self) -> bool:
        return self.pgconn.status != ConnStatus.OK

    def close(self) -> None:
        """End the session (and so every lock it holds). In a forked child, the socket is
        the parent's: it is first replaced by /dev/null, so the child's goodbye goes
        nowhere and the parent's session lives on."""
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


class _Session:
    """One thread's standing with one manager: the connection it holds keys on, and keys
    lost with an earlier connection that the thread has not yet released."""

    __slots__ = ("dead", "fences", "giving", "ident", "levels", "link", "lost", "reported",
                 "taking", "unsure")

    def __init__(self) -> None:
        self.ident = threading.get_ident()
        self.link: _Link | None = None
        self.levels: dict[tuple[Hashable, int], int] = {}  # (key, mode) -> levels held on link
        # (key, WRITE) -> the fence it was taken under (fencing managers), while in levels
        self.fences: dict[tuple[Hashable, int], int] = {}
        self.lost: dict[tuple[Hashable, int], int] = {}  # (key, mode) -> levels not yet released
        self.reported: set[Hashable] = set()  # lost keys already given to on_lost
        self.dead = False  # another thread found the link dead; the owner settles it
        # (key, mode) pairs a call may hold on the link that no count records: set before a
        # release, or on entering a failed call's clean-up, and cleared once the server has
        # answered (or the link is gone); a clean-up interrupted again leaves them to the
        # owner's next call (_settle), so they are never left held.
        self.unsure: list[tuple[Hashable, int]] = []
        # An acquisition's (levels before, fresh items), from before its round trip until it
        # is counted or undone: an undo that an interrupt kept from running (at its entry)
        # is finished by the owner's next call (_settle).
        self.taking: tuple[dict[tuple[Hashable, int], int], list[tuple[Hashable, int]]] | None = None
        # A release's items until their levels are counted down (``given``): one an
        # interrupt kept from counting down is finished by the owner's next call.
        self.giving: list[tuple[Hashable, int]] | None = None

    def holds_anything(self) -> bool:
        return bool(self.levels or self.lost or self.unsure)

    def forget_levels(self) -> None:
        """The connection's keys are no longer held on it (moved to ``lost``, or released)."""
        self.levels.clear()
        self.fences.clear()

    def lose_levels(self) -> None:
        """The connection is gone: what it held is lost (under the manager's ``_guard``)."""
        for item, levels in self.levels.items():
            self.lost[item] = self.lost.get(item, 0) + levels
        self.forget_levels()
        self.dead = False

    def refuse_lost(self, items: Sequence[tuple[Hashable, int]]) -> None:
        """LockLost for an acquisition of keys still lost (their holder must release them)."""
        lost = sorted({key for key, mode in items if self.lost.get((key, mode))}, key=repr)
        if lost:
            raise _lost_error(lost)

    def granted(self, items: Sequence[tuple[Hashable, int]],
                fences: dict[tuple[Hashable, int], int]) -> None:
        """One more level of each of ``items``; ``fences``: those its fresh keys were taken
        under."""
        self.fences.update(fences)
        for item in items:
            self.levels[item] = self.levels.get(item, 0) + 1

    def undo_take(self, before: dict[tuple[Hashable, int], int],
                  fresh: list[tuple[Hashable, int]]) -> None:
        """A failed or interrupted acquisition: the levels as ``before`` it, and its fresh
        keys ``unsure`` (first, before any check point) until the server has dropped them."""
        if fresh:
            self.unsure = fresh
        for item in fresh:
            self.fences.pop(item, None)
        for item, levels in before.items():
            if item in self.levels:
                self.levels[item] = levels
                if not levels:
                    del self.levels[item]
        self.taking = None

    def given(self, items: Sequence[tuple[Hashable, int]]) -> list[Hashable]:
        """One level of each of ``items`` released (or, if lost, acknowledged); the keys of
        those that had been lost. Works through ``giving`` (``items`` if unset), each item
        counted down and taken off it with no check point in between: an interrupt leaves
        exactly the items still to count, for the owner's next call (``_settle``)."""
        if self.giving is None:
            self.giving = list(items)
        giving = self.giving
        lost = []
        while giving:
            item = giving[-1]
            counts = self.levels if self.levels.get(item) else self.lost
            if counts is self.lost:
                lost.append(item[0])
            left = counts[item] - 1
            if left:
                counts[item] = left
            else:
                del counts[item]
            giving.pop()
            if not left and counts is self.levels:
                self.fences.pop(item, None)  # the last level takes its fence with it
        if self.reported:
            self.reported &= {key for key, _ in self.lost}
        self.giving = None
        return lost


class _ThreadEnd:
    """In the thread's local storage: when the thread ends, its connection closes, which
    ends its session and so releases its PostgreSQL locks at once."""

    __slots__ = ("manager", "pid", "session")

    def __init__(self, manager: _PgEngine[Any]) -> None:
        self.manager = weakref.ref(manager)
        self.pid = os.getpid()
        self.session = _Session()

    def __del__(self) -> None:
        manager = self.manager()
        if self.pid != os.getpid():  # a thread of the parent, cleared in a forked child
            if self.session.link is not None:
                self.session.link.close()
        elif manager is not None:
            manager._thread_ended(self.session)


_MANAGERS: weakref.WeakSet[_PgEngine[Any]] = weakref.WeakSet()


def _forget_parent_sessions() -> None:
    for manager in list(_MANAGERS):
        manager._forget_parent_sessions()


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_forget_parent_sessions)


class _PgEngine(Generic[K]):
    """What both PostgreSQL managers share: sessions, the advisory-lock calls, loss."""

    _engine: Engine  # the in-process manager (lockmgr._contract)

    def __init__(
        self,
        dsn: str,
        *,
        namespace: str = "",
        on_lost: Callable[[list[Hashable]], None] | None = None,
        connect_kwargs: dict[str, Any] | None = None,
        fencing: bool = False,
        fence_table: str = DEFAULT_FENCE_TABLE,
    ) -> None:
        self._dsn = dsn
        self._namespace = namespace
        self._fencing = fencing
        self._fence_table = _FenceTable(fence_table)
        self._fence_table_made = False  # set once this manager has made sure it exists
        self._salt = _salt(namespace)
        self._str_idents: dict[str, int] = {}
        self._on_lost = on_lost
        self._connect_kwargs = {**_KEEPALIVES, **(connect_kwargs or {})}
        self._local = threading.local()
        self._guard = threading.Lock()  # guards _idle, _sessions and loss reports
        self._idle: list[_Link] = []  # connections holding nothing
        self._sessions: set[_Session] = set()  # sessions with a connection or lost keys
        self._tasks: _Tasks | None = None  # the asyncio tasks' sessions, from the first ``aio``
        _MANAGERS.add(self)

    def __repr__(self) -> str:
        return f"<lockmgr.{type(self).__name__} namespace={self._namespace!r} at {id(self):#x}>"

    def close(self) -> None:
        """Close the idle connections (those of threads and tasks holding keys stay theirs)."""
        with self._guard:
            idle, self._idle = self._idle, []
        for link in idle:
            link.close()
        if self._tasks is not None:
            self._tasks.close()

    def __enter__(self: _Manager) -> _Manager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_idle"):  # __init__ may have failed
            self.close()

    def _task_sessions(self) -> _Tasks:
        from ._pg_aio import _Tasks

        with self._guard:
            if self._tasks is None:
                self._tasks = _Tasks(self)
            return self._tasks

    def advisory_key(self, key: Hashable) -> int:
        """The advisory key ``key`` uses in this manager's namespace."""
        if type(key) is not str:
            return _salted_key(key, self._salt)
        # Each call hashes its keys more than once: recent str keys are remembered, in a
        # table that is emptied when full (so memory stays bounded).
        ident = self._str_idents.get(key)
        if ident is None:
            if len(self._str_idents) >= _REMEMBERED_KEYS:
                self._str_idents.clear()
            ident = self._str_idents[key] = _salted_key(key, self._salt)
        return ident

    def stats(self) -> LockStats:
        """The in-process engine's counters (this process's threads)."""
        stats: LockStats = self._engine.stats()
        return stats

    @property
    def log_waits_after(self) -> float | None:
        """Seconds after which a thread waiting for another thread of this process logs a
        WARNING (None: never); waits on the server are PostgreSQL's ``log_lock_waits``."""
        after: float | None = self._engine.log_waits_after
        return after

    def snapshot(self) -> list[KeyState]:
        """The in-process engine's keys held or waited on by this process's threads and
        tasks (other processes' locks are in PostgreSQL's ``pg_locks``)."""
        states: list[KeyState] = self._engine.snapshot()
        return states

    def metrics(self) -> LockMetrics:
        """The in-process engine's metrics (waits between this process's threads)."""
        metrics: LockMetrics = self._engine.metrics()
        return metrics

    def __len__(self) -> int:
        """Keys held by this process's threads and tasks (lost ones are not held)."""
        held: int = len(self._engine)
        lost = self._lost_items()
        # (two reads: a key taken and lost between them must not make it negative)
        return max(0, held - sum(1 for key in {key for key, _ in lost} if self._only_lost(key, lost)))

    def _only_lost(self, key: Hashable,
                   lost: collections.Counter[tuple[Hashable, int]]) -> bool:
        """Whether every holder of ``key`` in process lost it (``lost``: ``_lost_items``)."""
        return bool(lost[key, WRITE])

    def lost_keys(self) -> set[Hashable]:
        """Keys whose session was lost and that their holders (living threads of this
        process) have not yet released.

        Checks first, without waiting, the connection of every thread holding keys."""
        session = self._session_or_none()
        if session is not None:
            self._settle(session)
        with self._guard:
            others = [other for other in self._sessions if other is not session]
        for other in others:
            link = other.link
            if link is not None and link.idle_unless_busy() is False:
                self._report(other, dead_link=link)
        if self._tasks is not None:
            self._tasks.sweep_closed_loops()
            self._tasks.check_others(None)
        return {key for key, _ in self._lost_items()}

    def release_all(self) -> int:
        """Release every key the calling thread holds, all levels; returns how many.

        Raises LockLost, after releasing everything, if some of them had been lost."""
        session = self._session_or_none()
        try:
            if session is not None:
                self._settle(session)
                if session.levels:
                    session.unsure = list(session.levels)
                    self._unlock(session, session.unsure)
        finally:  # interrupted or not, the thread holds nothing afterwards
            lost: list[Hashable] = []
            if session is not None:
                lost = sorted({key for key, _ in session.lost}, key=repr)
                session.forget_levels()
                session.lost.clear()
                session.reported.clear()
                self._return_if_idle(session)
            released: int = self._engine.release_all()
        if lost:
            raise _lost_error(lost)
        return released

    def fence(self, key: K) -> int:
        """The fence under which the calling thread holds ``key`` for writing: the one its
        first acquisition took, kept by reentrant ones (``lease.fence`` of ``hold``).

        LockError without ``fencing=True`` or for a key only read, NotOwnedError if the
        thread does not hold it, LockLost if its session was lost."""
        self.advisory_key(key)  # a key PostgreSQL cannot take fails before anything else
        if not self._fencing:
            raise _no_fencing()
        session = self._session_or_none()
        if session is not None:
            self._settle(session)  # a connection found dead loses its keys first
            if session.lost.get((key, WRITE)):
                raise _lost_error([key])
            if session.levels.get((key, WRITE)):
                return session.fences[key, WRITE]
            if session.levels.get((key, READ)) or session.lost.get((key, READ)):
                raise _read_has_no_fence(key)
        raise not_owned(key)

    def _fences_of(self, fresh: list[tuple[Hashable, int]],
                   fences: dict[int, int]) -> dict[tuple[Hashable, int], int]:
        """What ``_lock`` answered (fences by advisory key) for the fresh written items."""
        if not self._fencing:
            return {}
        return {(key, mode): fences[self.advisory_key(key)] for key, mode in fresh if mode == WRITE}

    def _lease(self, items: Sequence[tuple[Hashable, int]]) -> Lease:
        """The calling thread's lease on ``items``, which it has just acquired."""
        keys = tuple(key for key, _ in items)
        if not self._fencing:
            return Lease(keys, None)
        session = self._session()
        return Lease(keys, {key: session.fences[key, mode] for key, mode in items if mode == WRITE})

    @contextmanager
    def xact_lock(
        self, conn: psycopg.Connection[Any], key: K, *, shared: bool = False,
        timeout: float | None = None,
    ) -> Iterator[None]:
        """Lock ``key`` inside ``conn``'s open transaction (``pg_advisory_xact_lock*``).

        The same key and namespace are the same lock as the managers' session-level ones.
        Leaving the block does **not** release it: the end of the transaction does, so the
        lock and the transaction's writes commit or roll back together. A timeout raises
        LockTimeout with nothing held and the caller's transaction intact.
        """
        seconds = hold_seconds(timeout)
        ident = self.advisory_key(key)
        self._refuse_own_session_lock(key, shared)
        if conn.info.transaction_status != TransactionStatus.INTRANS:
            raise LockError("xact_lock needs an open transaction on conn: "
                            "use it inside `with conn.transaction():`")
        kind = "_shared" if shared else ""
        if seconds == 0:
            row = conn.execute(f"SELECT pg_try_advisory_xact_lock{kind}(%s), now()",
                               (ident,)).fetchone()
            if not row or not row[0]:
                raise timed_out(key, seconds)
        else:
            deadline = None if seconds < 0 else time.monotonic() + seconds
            previous = conn.execute("SELECT current_setting('lock_timeout')").fetchone()
            try:
                while True:
                    left = 0 if deadline is None else _milliseconds(deadline - time.monotonic())
                    try:
                        with conn.transaction():  # a savepoint: a timeout leaves the caller's intact
                            conn.execute(f"SET LOCAL lock_timeout = {left}")
                            row = conn.execute(f"SELECT pg_advisory_xact_lock{kind}(%s), now()",
                                               (ident,)).fetchone()
                        break
                    except pg_errors.LockNotAvailable:
                        # lock_timeout's ceiling (about 24.8 days) is below threading's
                        if deadline is None or deadline - time.monotonic() <= 0:
                            raise timed_out(key, seconds) from None
            except pg_errors.DeadlockDetected as error:
                raise DeadlockError(f"PostgreSQL: {error}", []) from None
            finally:
                if previous and conn.info.transaction_status == TransactionStatus.INTRANS:
                    conn.execute("SELECT set_config('lock_timeout', %s, true)", (previous[0],))
        assert row is not None
        self._note_xact_lock(conn, ident, shared, row[1])
        yield

    def _refuse_own_session_lock(self, key: Hashable, shared: bool) -> None:
        """``xact_lock`` runs on the caller's connection, another server session than the
        calling thread's: a session lock of that thread's on ``key`` in a conflicting mode
        would make it wait for itself for ever."""
        session = self._session_or_none()
        if session is None:
            return
        self._settle(session)
        modes = (WRITE,) if shared else (WRITE, READ)
        if any(session.levels.get((key, mode)) for mode in modes):
            raise DeadlockError(
                f"the calling thread holds {key!r} through this manager: xact_lock on"
                " another connection would wait for that lock, and so for itself, for ever",
                [(threading.get_ident(), key)])

    def _note_xact_lock(self, conn: psycopg.Connection[Any], ident: int, shared: bool,
                        started: datetime.datetime) -> None:
        """Remember, for the calling thread, an xact_lock taken in ``conn``'s transaction
        that ``started`` (``_refuse_own_xact_lock``). Records of ended transactions go: the
        list holds at most the keys of the transactions still open."""
        records: list[_XactLock] | None = getattr(self._local, "xact_locks", None)
        if records is None:
            records = self._local.xact_locks = []
        record = _XactLock(weakref.ref(conn), conn.info.backend_pid, started, ident, shared)
        records[:] = [kept for kept in records if kept.may_hold() and kept != record
                      and (kept.conn() is not conn or kept.started == started)]
        records.append(record)

    def _refuse_own_xact_lock(self, items: Sequence[tuple[Hashable, int]]) -> None:
        """The other order of ``_refuse_own_session_lock``: the calling thread took ``key``
        with xact_lock in a transaction still open on another connection, so a session lock
        of it in a conflicting mode would wait for itself. The server says whether that
        transaction still holds it (one round trip, only for such a key)."""
        records: list[_XactLock] | None = getattr(self._local, "xact_locks", None)
        if not records:
            return
        records[:] = [record for record in records if record.may_hold()]
        for key, mode in items:
            ident = self.advisory_key(key)
            for record in records:
                if (record.ident == ident and (mode == WRITE or not record.shared)
                        and self._held_in_transaction(record)):
                    raise DeadlockError(
                        f"the calling thread holds {key!r} with xact_lock in a transaction"
                        " still open: a session lock of it would wait for that transaction,"
                        " and so for itself, for ever", [(threading.get_ident(), key)])

    # -- taking and giving back ---------------------------------------------------------------

    def _take(self, items: Sequence[tuple[Hashable, int]], seconds: float,
              local_acquire: Callable[[float], bool],
              local_release: Callable[[], None]) -> bool:
        """Take ``items`` ((key, mode) pairs) in-process, then in PostgreSQL, within
        ``seconds``: all of them, or none."""
        started = time.monotonic()
        if self._tasks is not None:
            self._tasks.sweep_closed_loops()  # a stranded task may hold one of the keys in process
        session = self._session()
        self._settle(session, _call_deadline(started, seconds))
        session.refuse_lost(items)
        self._refuse_own_xact_lock(items)
        before = {item: session.levels.get(item, 0) for item in items}
        fresh = [item for item, levels in before.items() if not levels]
        acquired = taken = False
        try:
            acquired = local_acquire(seconds)
            if not acquired:
                return False
            session.taking = (before, fresh)
            left = seconds if seconds <= 0 else max(0.0, seconds - (time.monotonic() - started))
            fences = self._lock(session, fresh, left) if fresh else {}
            # A connection lost on the way lost the keys this call re-entered too: the
            # call fails, whatever a fresh connection then gave (the clean-up drops it).
            session.refuse_lost(items)
            if fences is not None:
                session.granted(items, self._fences_of(fresh, fences))
            # No check point from the last call to the end of the block: answered, counted.
            session.unsure, session.taking = [], None
            taken = fences is not None  # last: an interrupt before it finds the counts undone below
        except BaseException as error:
            if not acquired:
                # An interrupt as the in-process acquisition returned (CPython checks for
                # signals right after a call) finds it done all the same.
                acquired = self._acquired_in_process(session, items)
                raise
            # Wherever the failure or interrupt came, the call failed: nothing it took stays
            # held (a connection lost on the way already moved what it held to ``lost``).
            session.undo_take(before, fresh)
            client_timeout = seconds >= 0 and isinstance(error, _CLIENT_TIMEOUTS)
            if fresh:
                self._drop_or_lose(session, fresh, time.monotonic() + _CANCEL_GRACE
                                   if client_timeout else True)
            if not client_timeout:
                raise
            # A timed call that passed its deadline on the client timed out.
            session.refuse_lost(items)
            return False
        finally:
            # Timed out, failed or interrupted: the in-process acquisition goes back, from
            # this one place only (an interrupt right after it must not give it back twice).
            if acquired and not taken:
                try:
                    local_release()
                finally:
                    self._return_if_idle(session)
        return taken

    def _acquired_in_process(self, session: _Session, items: Sequence[tuple[Hashable, int]]) -> bool:
        """Whether the in-process engine holds every one of ``items`` for the calling
        thread one level above what ``session`` records: an acquisition (all or none of
        them: one call) whose result an interrupt took. Asked only then (a snapshot of
        every key)."""
        me = threading.get_ident()
        counts: collections.Counter[tuple[Hashable, str]] = collections.Counter()
        for state in self._engine.snapshot():
            for holder in state.holders:
                if holder.kind == "thread" and holder.owner == me:
                    counts[state.key, holder.mode] += holder.count
        return all(counts[key, "read" if mode == READ else "write"]
                   > session.levels.get((key, mode), 0) + session.lost.get((key, mode), 0)
                   for key, mode in items)

    def _give(self, items: Sequence[tuple[Hashable, int]],
              local_release: Callable[[], None]) -> None:
        """Undo one ``_take`` of ``items``; LockLost (after undoing it) if any was lost."""
        session = _holding(self._session_or_none(), items)
        last = [item for item in items if session.levels.get(item) == 1]
        # No round trip to the server will tell whether the connection lives, or an earlier
        # clean-up was interrupted: settle first.
        if (not last or session.unsure or session.link is None or session.taking is not None
                or session.giving is not None):
            self._settle(session)
            last = [item for item in items if session.levels.get(item) == 1]
        session.giving = list(items)
        try:
            if last:
                session.unsure = last  # counted down below whatever happens
                self._unlock(session, last)  # a connection lost on the way moves them to lost
        finally:
            # Each step however the one before ended: an interrupt at the count-down's entry
            # leaves it to the next call (``giving``), never the in-process release undone.
            try:
                lost = session.given(items)
            finally:
                try:
                    local_release()
                finally:
                    self._return_if_idle(session)
        if lost:
            raise _lost_error(sorted(set(lost), key=repr))

    def _lock(self, session: _Session, items: list[tuple[Hashable, int]],
              seconds: float) -> dict[int, int] | None:
        """Take PostgreSQL locks for ``items`` in ascending advisory-key order (so that two
        processes taking overlapping sets never deadlock), all within ``seconds``, and with
        fencing the written keys' next fences: one message, one round trip. None if not
        granted in time, else the fences by advisory key."""
        ordered = sorted(((self.advisory_key(key), mode) for key, mode in items))
        fencing = self._fencing and any(mode == WRITE for _, mode in ordered)
        deadline = None if seconds <= 0 else time.monotonic() + seconds
        retried = False
        while True:
            link, fresh_link = (session.link, False) if session.link else self._attach(session)
            # Unsure before the server can take them (a lost connection clears it): an
            # interrupt after the grant, then another at the clean-up's first check point
            # (undo_take's entry), would leave them held on the connection, recorded nowhere.
            session.unsure = items
            try:
                left = 0 if deadline is None else int((deadline - time.monotonic()) * 1000 + 0.999)
                trying = seconds == 0 or (deadline is not None and left <= 0)
                how = "try" if trying else "wait" if deadline is None else "timed"
                answer_by = _round_trip_deadline(how, deadline)
                if fencing and not self._fence_table_made:
                    _make_fence_table(link, self._fence_table, answer_by or True)
                    self._fence_table_made = True
                if how != "timed" and len(ordered) == 1:
                    ident, mode = ordered[0]
                    statement = (_FENCED_LOCK[how] if fencing
                                 else _TRY_LOCK[mode] if trying else _LOCK[mode])
                    results = [link.call(statement, ident, answer_by)]
                else:
                    results = link.run_all(_lock_sql(ordered, how, left,
                                                     self._fence_table if fencing else None),
                                           answer_by)
            except pg_errors.LockNotAvailable:
                # Only timed waits set a lock_timeout, and they wait with transaction locks:
                # the error rolled the wait back, a grant that raced it and fences included.
                if deadline is not None and deadline - time.monotonic() > 0:
                    continue  # lock_timeout's ceiling (about 24.8 days) is below threading's
                return None
            except pg_errors.DeadlockDetected as error:
                raise DeadlockError(f"PostgreSQL: {error}", []) from None
            except _Overdue:
                # A step before a wait without a timeout (the prepare, the fence table's
                # check) was cancelled at its deadline: the server is slow (a migration
                # holds the fence table), and the wait waits, steps again included. A timed
                # call times out (the caller drops what it may have taken).
                if seconds >= 0:
                    raise
                continue
            except psycopg.OperationalError as error:
                if not link.broken():
                    raise  # a cancelled statement: the caller drops what it may have taken
                # The connection died: the keys held on it are lost, and so is this
                # attempt; a connection that had been idle is replaced once. Unanswered
                # by a timed call's deadline: the caller times out.
                self._lose(session)
                if fresh_link or retried or (seconds >= 0 and isinstance(error, _Unanswered)):
                    raise
                retried = True
                continue
            return _fences_from(results, ordered, how, fencing)

    def _unlock(self, session: _Session, items: list[tuple[Hashable, int]]) -> None:
        """Release the PostgreSQL locks of ``items``. A lost connection moves every key held
        on it to ``lost``; an interrupted release still releases."""
        link = session.link
        assert link is not None
        try:
            if len(items) == 1:
                key, mode = items[0]
                result = link.call(_UNLOCK[mode], self.advisory_key(key))
            else:
                result = link.run(_unlock_sql(items, self.advisory_key))
        except psycopg.OperationalError as error:
            if link.broken():
                self._lose(session)
                return
            self._drop_or_lose(session, items)
            if isinstance(error, _Overdue):
                return  # released by the drop (or lost with the connection: LockLost)
            raise
        except BaseException:
            self._drop_or_lose(session, items)
            raise
        session.unsure = []
        gone = _not_released(result, items)
        if gone:  # the server no longer had it: lost, though the connection lives
            self._report(session, items=gone)

    def _drop_or_lose(self, session: _Session, items: Sequence[tuple[Hashable, int]],
                      deadline: float | None | bool = True) -> None:
        """After a failed or interrupted call: release on the server whichever of ``items``
        this call may have taken (the levels it recorded before are not among them), by
        ``deadline`` (``_Link.run``). If that cannot be done, end the session: its keys
        are lost, nothing stays held. ``items`` are the session's ``unsure``, cleared once
        done."""
        link = session.link
        if link is None:
            session.unsure = []
            return
        try:
            if not link.idle():
                raise psycopg.OperationalError("the connection is not idle after an interrupt")
            link.run(_drop_sql(items, self.advisory_key), deadline)
            session.unsure = []
        except Exception:
            self._lose(session)  # the original failure is what the caller re-raises
        except BaseException:
            self._lose(session)
            raise

    # -- sessions and loss ----------------------------------------------------------------------

    def _session_or_none(self) -> _Session | None:
        end: _ThreadEnd | None = getattr(self._local, "end", None)
        return None if end is None else end.session

    def _session(self) -> _Session:
        end: _ThreadEnd | None = getattr(self._local, "end", None)
        if end is None:
            end = self._local.end = _ThreadEnd(self)
        return end.session

    def _attach(self, session: _Session) -> tuple[_Link, bool]:
        """Give the session a connection: an idle one that is still alive, or a new one."""
        if self._tasks is not None:
            self._tasks.sweep_closed_loops()  # their connections may hold what we wait for
        while True:
            with self._guard:
                link = self._idle.pop() if self._idle else None
            if link is None:
                link, fresh = _Link.connect(self._dsn, self._connect_kwargs, self._fence_table.statements), True
                break
            if link.idle():
                fresh = False
                break
            link.close()
        session.link = link
        with self._guard:
            self._sessions.add(session)
        return link, fresh

    def _return_if_idle(self, session: _Session) -> None:
        """A thread that holds nothing gives its connection back."""
        if session.holds_anything():
            return
        link, session.link = session.link, None
        with self._guard:
            self._sessions.discard(session)
            session.reported.clear()
            if link is not None and not session.dead and not link.broken():
                self._idle.append(link)  # checked again before its next use
                link = None
        session.dead = False
        if link is not None:
            link.close()

    def _settle(self, session: _Session, deadline: float | None | bool = True) -> None:
        """The owner's check at every call: a dead connection loses what it held, and keys
        an interrupted clean-up left unsure are released now (by ``deadline``)."""
        if session.taking is not None:  # an interrupt kept a failed acquisition's undo from running
            session.undo_take(*session.taking)
        if session.giving is not None:  # ... or a release's count-down
            session.given(session.giving)
        link = session.link
        if link is None:
            if session.levels or session.unsure:  # a _lose interrupted half-way: finish it
                self._lose(session)
            return
        if session.unsure:
            self._drop_or_lose(session, session.unsure, deadline)
            link = session.link
            if link is None:
                return
        if session.dead or not link.idle():
            self._lose(session)

    def _lose(self, session: _Session) -> None:
        """The session's connection is gone, and with it every lock it held (owner only)."""
        link, session.link = session.link, None
        session.unsure = []
        with self._guard:
            session.lose_levels()
        if link is not None:
            link.close()
        self._report(session)
        if not session.lost:
            self._return_if_idle(session)

    def _report(self, session: _Session, *, dead_link: _Link | None = None,
                items: list[tuple[Hashable, int]] | None = None) -> None:
        """Tell ``on_lost`` once about each key newly lost by ``session``: all it holds
        (from another thread, which found ``dead_link`` dead), or just ``items`` (the
        owner)."""
        with self._guard:
            if items is not None:
                for item in items:
                    session.lost[item] = session.lost.get(item, 0) + session.levels.pop(item)
                    session.fences.pop(item, None)
            if dead_link is not None:
                # Checked under the guard, and probed before it: the owner may have handled
                # that loss meanwhile and moved on to a new connection, which lives.
                if session.link is not dead_link:
                    return
                session.dead = True
            held = {key for key, _ in list(session.lost)}
            if session.dead:
                held |= {key for key, _ in list(session.levels)}
            news = sorted(held - session.reported, key=repr)
            session.reported |= held
        if news and self._on_lost is not None:
            self._on_lost(news)

    def _lost_items(self) -> collections.Counter[tuple[Hashable, int]]:
        """(key, mode) of every living thread's lost, unreleased keys: how many threads."""
        lost: collections.Counter[tuple[Hashable, int]] = collections.Counter()
        with self._guard:
            for session in self._sessions:
                lost.update(set(session.lost) | (set(session.levels) if session.dead else set()))
            if self._tasks is not None:
                lost.update(self._tasks.lost_items())
        return lost

    def _lost_here(self, key: Hashable, mode: int) -> bool:
        session = self._session_or_none()
        if session is None:
            return False
        self._settle(session)
        return bool(session.lost.get((key, mode)))

    def _thread_ended(self, session: _Session) -> None:
        """A thread ended: its session goes, and with it its locks and lost keys."""
        with self._guard:
            self._sessions.discard(session)
        if session.link is not None:
            session.link.close()

    def _forget_parent_sessions(self) -> None:
        """In a forked child: no connection of the parent's is ever used or closed here.
        Keys the forking thread held belong to the parent: they are lost to the child."""
        self._guard = threading.Lock()  # another thread of the parent may have held it
        me = threading.get_ident()
        links = list(self._idle)
        self._idle = []
        for session in list(self._sessions):
            if session.link is not None:
                links.append(session.link)
                session.link = None
            session.unsure, session.taking, session.giving = [], None, None  # the parent's
            if session.ident == me:
                for item, levels in session.levels.items():
                    session.lost[item] = session.lost.get(item, 0) + levels
                session.forget_levels()
                session.reported = {key for key, _ in session.lost}
            else:
                self._sessions.discard(session)
        for link in links:
            link.close()
        if self._tasks is not None:
            self._tasks.forget_parent_sessions()

    def _borrow(self) -> tuple[_Link, bool]:
        """A connection for a question: the calling thread's, or one from the idle list."""
        session = self._session_or_none()
        if session is not None and session.link is not None and session.link.idle():
            return session.link, False
        with self._guard:
            link = self._idle.pop() if self._idle else None
        if link is None or not link.idle():
            if link is not None:
                link.close()
            link = _Link.connect(self._dsn, self._connect_kwargs, self._fence_table.statements)
        return link, True

    def _held_on_server(self, key: Hashable, mode: str | None) -> bool:
        return self._ask(
            f"SELECT EXISTS (SELECT 1 FROM {_GRANTED_ADVISORY} {self.advisory_key(key)}"
            f" AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            + ("" if mode is None else f" AND mode = '{mode}'") + ")")

    def _held_in_transaction(self, record: _XactLock) -> bool:
        """Whether the transaction of ``record`` is still open and holds its lock."""
        pid = int(record.backend_pid)
        return self._ask(
            f"SELECT EXISTS (SELECT 1 FROM {_GRANTED_ADVISORY} {record.ident} AND pid = {pid}"
            f" AND mode = '{_MODE_NAMES[READ if record.shared else WRITE]}'"
            f" AND {pid} IN (SELECT pid FROM pg_stat_activity WHERE xact_start ="
            f" '{record.started.isoformat()}'::timestamptz))")

    def _ask(self, question: str) -> bool:
        """A yes-or-no ``question`` to the server, on a connection ``_borrow`` gives."""
        link, borrowed = self._borrow()
        try:
            result = link.run(question)
        except BaseException:
            if borrowed:
                link.close()
            raise
        if borrowed:
            with self._guard:
                self._idle.append(link)
        return bool(result.get_value(0, 0) == b"t")


class _XactLock(NamedTuple):
    """An xact_lock a thread took: in the transaction open on ``conn`` (its backend
    ``backend_pid``) since ``started``, the advisory key ``ident``, shared or not."""

    conn: weakref.ref[psycopg.Connection[Any]]
    backend_pid: int
    started: datetime.datetime
    ident: int
    shared: bool

    def may_hold(self) -> bool:
        """Whether the transaction it was taken in may still be open."""
        conn = self.conn()
        return conn is not None and not conn.closed and conn.info.transaction_status in (
            TransactionStatus.INTRANS, TransactionStatus.INERROR)



def _lost_error(keys: list[Hashable]) -> LockLost:
    return LockLost(f"the lock on {', '.join(map(repr, keys))} was lost with its connection")


def _holding(session: _Session | None, items: Sequence[tuple[Hashable, int]]) -> _Session:
    """The session of a release, which must hold (or have lost) each of ``items``."""
    for key, mode in items:
        if session is None or not (session.levels.get((key, mode)) or session.lost.get((key, mode))):
            raise not_owned(key)
    assert session is not None
    return session


def _unlock_sql(items: Sequence[tuple[Hashable, int]], advisory_key: Callable[[Hashable], int]) -> str:
    """Release ``items`` in one statement: a boolean column each (false: not held)."""
    return "SELECT " + ", ".join(f"pg_advisory_unlock{_kind(mode)}({advisory_key(key)})"
                                 for key, mode in items)


def _not_released(result: Any, items: list[tuple[Hashable, int]]) -> list[tuple[Hashable, int]]:
    """The ``items`` an unlock's ``result`` says the session no longer held."""
    released = [result.get_value(0, column) == b"t" for column in range(len(items))]
    return [item for item, done in zip(items, released, strict=True) if not done]


def _drop_sql(items: Sequence[tuple[Hashable, int]], advisory_key: Callable[[Hashable], int]) -> str:
    """Release whichever of ``items`` the session holds (after a failed or cancelled call,
    which may or may not have taken them)."""
    return "; ".join(f"SELECT pg_advisory_unlock{_kind(mode)}({ident}) FROM {_MINE} AND"
                     f" {_KEY_IS} {ident} AND mode = '{_MODE_NAMES[mode]}'"
                     for ident, mode in ((advisory_key(key), mode) for key, mode in items))


def _no_fencing() -> LockError:
    return LockError("this manager takes no fences: create it with fencing=True")


def _read_has_no_fence(key: Hashable) -> LockError:
    return LockError(f"key {key!r} is held for reading: only a write takes a fence")


def _make_fence_table(link: _Link, table: _FenceTable, deadline: float | bool) -> None:
    """Make sure the fence table exists (its own transaction: committed before any wait),
    by ``deadline`` (``_Link.run``)."""
    for attempt in range(2):
        if link.run(table.exists_sql, deadline).get_value(0, 0) == b"t":
            return
        try:
            link.run(table.create_sql, deadline)
            return
        except _MADE_MEANWHILE:
            if attempt:  # a lasting conflict (a type of that name)
                raise


def _lock_sql(ordered: list[tuple[int, int]], how: str, milliseconds: int,
              fences: _FenceTable | None) -> str:
    """The one message taking ``ordered`` ((advisory key, mode) pairs, ascending) ``how``:
    "wait" as long as it takes, "try" once, or "timed" (within ``milliseconds``). With a
    ``fences`` table, the same message gives each written key its next fence
    (``_fences_from`` reads the answer)."""
    fenced = _fenced(ordered) if fences is not None else []
    if not fenced or fences is None:
        fences = None
    if how == "try":
        return _try_lock_sql(ordered, fenced, fences)
    if how == "timed":
        return _timed_lock_sql(ordered, milliseconds, fenced, fences)
    return _wait_lock_sql(ordered, fenced, fences)


def _fences_from(results: Sequence[Any], ordered: list[tuple[int, int]], how: str,
                 fencing: bool) -> dict[int, int] | None:
    """What a ``_lock_sql`` message (or a single-key statement: its one result) answered:
    None if a try was refused, else each fenced advisory key's new fence (none without
    fencing)."""
    if fencing and _fenced(ordered):
        # A timed message takes its session locks after the fences: one statement later.
        rows = results[-2] if how == "timed" else results[-1]
        fences = {int(rows.get_value(row, 0)): int(rows.get_value(row, 1))
                  for row in range(rows.ntuples)}
        # A refused try has no row; a granted call, one per fenced key. Only a try can be
        # refused: a wait missing its rows fails in the caller, whose clean-up releases.
        return None if how == "try" and not fences else fences
    if how == "try" and results[-1].get_value(0, 0) != b"t":
        return None
    return {}


def _fenced(ordered: list[tuple[int, int]]) -> list[str]:
    """The advisory keys of ``ordered`` that take a fence: the written ones, once each (two
    keys of one call that collide share a counter, and so one fence)."""
    return [str(ident) for ident in dict.fromkeys(ident for ident, mode in ordered
                                                  if mode == WRITE)]


def _wait_lock_sql(ordered: list[tuple[int, int]], fenced: list[str],
                   fences: _FenceTable | None) -> str:
    """Wait as long as it takes: session locks, one statement each, in order; then the
    fences (a failure there leaves the locks to the caller's clean-up)."""
    waits = "; ".join(f"SELECT pg_advisory_lock{_kind(mode)}({ident})" for ident, mode in ordered)
    return f"{waits}; {fences.next_fences_sql(fenced)}" if fences else waits


def _try_lock_sql(ordered: list[tuple[int, int]], fenced: list[str],
                  fences: _FenceTable | None) -> str:
    """Try once: all or nothing (transaction locks first, released at the statement's end);
    the fences only if granted, in the same statement."""
    trial = " AND ".join(f"pg_try_advisory_xact_lock{_kind(mode)}({ident})" for ident, mode in ordered)
    taking = " AND ".join(f"pg_try_advisory_lock{_kind(mode)}({ident})" for ident, mode in ordered)
    granted = f"CASE WHEN {trial} THEN {taking} ELSE false END"
    if fences is None:
        return f"SELECT {granted}"
    return fences.next_fences_sql(fenced, f"SELECT {granted} AS granted")


def _timed_lock_sql(ordered: list[tuple[int, int]], milliseconds: int, fenced: list[str],
                    fences: _FenceTable | None) -> str:
    """Wait at most ``milliseconds`` in all, for transaction locks (so a timeout or cancel
    rolls back a grant that raced it), then take the fences, still under the timeout (so
    it rolls them back too), and the session locks (which no longer wait). One implicit
    transaction: statement_timestamp() is when the message arrived."""
    elapsed = "(extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000)::bigint"
    left = f"greatest(1, least({_MAX_LOCK_TIMEOUT}, {milliseconds} - {elapsed}))::text"
    time_left = f"SELECT set_config('lock_timeout', {left}, true)"
    waits = "; ".join(f"{time_left}; SELECT pg_advisory_xact_lock{_kind(mode)}({ident})"
                      for ident, mode in ordered)
    fencing = f"; {time_left}; {fences.next_fences_sql(fenced)}" if fences else ""
    taking = ", ".join(f"pg_advisory_lock{_kind(mode)}({ident})" for ident, mode in ordered)
    return f"{waits}{fencing}; SELECT {taking}"


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


def _milliseconds(seconds: float) -> int:
    return min(_MAX_LOCK_TIMEOUT, max(1, int(seconds * 1000 + 0.999)))


class PgLockManager(_PgEngine[K]):
    """``LockManager`` across processes and hosts, on PostgreSQL advisory locks."""

    _engine: LockEngine[Hashable]

    def __init__(self, dsn: str, *, namespace: str = "", fair: bool = True,
                 on_lost: Callable[[list[Hashable]], None] | None = None,
                 connect_kwargs: dict[str, Any] | None = None,
                 log_waits_after: float | None = None, fencing: bool = False,
                 fence_table: str = DEFAULT_FENCE_TABLE) -> None:
        engine: LockManager[Hashable] = LockManager(fair=fair, log_waits_after=log_waits_after)
        super().__init__(dsn, namespace=namespace, on_lost=on_lost,
                         connect_kwargs=connect_kwargs, fencing=fencing,
                         fence_table=fence_table)
        self._engine = engine

    @property
    def aio(self) -> PgAsyncLockManager[K]:
        """This manager with the current asyncio task as owner (see ``lockmgr._pg_aio``):
        tasks and threads of this process exclude each other per key."""
        from ._pg_aio import PgAsyncLockManager

        return PgAsyncLockManager(self, self._task_sessions())

    def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` across every process using this database and namespace."""
        seconds = wait_seconds(blocking, timeout)
        self.advisory_key(key)  # a key PostgreSQL cannot take fails before anything changes
        return self._take([(key, WRITE)], seconds,
                          lambda left: self._engine.acquire(key, timeout=left),
                          lambda: self._engine.release(key))

    def release(self, key: K) -> None:
        """Undo one ``acquire``; NotOwnedError if the caller does not hold it, LockLost if
        its session was lost (the key is then no longer held)."""
        self._give([(key, WRITE)], lambda: self._engine.release(key))

    def hold(self, key: K, timeout: float | None = None) -> _Held:
        """A context manager holding ``key`` for its block (LockTimeout if not acquired);
        ``as`` gives its ``Lease``."""
        seconds = hold_seconds(timeout)
        return _Held(self, [(key, WRITE)], lambda: self.acquire(key, timeout=seconds),
                     lambda: self.release(key), seconds)

    def synchronized(
        self, key_func: Callable[..., K]
    ) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """Decorator: the call holds the key ``key_func(*args, **kwargs)`` while it runs.

        The decorated function keeps its signature for type checkers.
        """
        return synchronized(self, key_func)

    def __getitem__(self, key: K) -> PgKeyLock[K]:
        """One key seen as a ``threading.RLock`` (across processes)."""
        return PgKeyLock(self, key)

    def acquire_many(self, keys: Iterable[K], blocking: bool = True, timeout: float = -1) -> bool:
        """Lock every key of ``keys`` at once, or none (see ``LockManager.acquire_many``)."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_items(many_items(keys, _same), seconds)

    def release_many(self, keys: Iterable[K]) -> None:
        self._release_items(many_items(keys, _same))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> _Held:
        seconds = hold_seconds(timeout)
        items = many_items(keys, _same)
        return _Held(self, items, lambda: self._acquire_items(items, seconds),
                     lambda: self._release_items(items), seconds)

    def _acquire_items(self, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        keys = [key for key, _ in items]
        for key in keys:
            self.advisory_key(key)
        return self._take(items, seconds,
                          lambda left: self._engine.acquire_many(keys, timeout=left),
                          lambda: self._engine.release_many(keys))

    def _release_items(self, items: list[tuple[Hashable, int]]) -> None:
        keys = [key for key, _ in items]
        self._give(items, lambda: self._engine.release_many(keys))

    def owned(self, key: K) -> bool:
        """Whether the calling thread holds ``key`` (a lost key is not held)."""
        return bool(self._engine.owned(key)) and not self._lost_here(key, WRITE)

    def owner(self, key: K) -> int | None:
        """The ident of the thread of *this process* holding ``key``, or None."""
        owner: int | None = self._engine.owner(key)
        return None if owner is None or self._lost_items()[key, WRITE] else owner

    def recursion_count(self, key: K) -> int:
        count: int = self._engine.recursion_count(key)
        return 0 if count and self._lost_here(key, WRITE) else count

    def locked(self, key: K) -> bool:
        """Whether any session of any process holds ``key`` in this manager's database
        (asks the server)."""
        return self._held_on_server(key, None)

    def __contains__(self, key: object) -> bool:
        """Whether a thread of this process holds ``key``."""
        return bool(self._engine.locked(key)) and not self._lost_items()[key, WRITE]


class PgRWLockManager(_PgEngine[K]):
    """``RWLockManager`` across processes and hosts, on PostgreSQL advisory locks."""

    _engine: RWLockEngine[Hashable]

    def __init__(self, dsn: str, *, namespace: str = "",
                 on_lost: Callable[[list[Hashable]], None] | None = None,
                 connect_kwargs: dict[str, Any] | None = None,
                 log_waits_after: float | None = None, fencing: bool = False,
                 fence_table: str = DEFAULT_FENCE_TABLE) -> None:
        engine: RWLockManager[Hashable] = RWLockManager(log_waits_after=log_waits_after)
        super().__init__(dsn, namespace=namespace, on_lost=on_lost,
                         connect_kwargs=connect_kwargs, fencing=fencing,
                         fence_table=fence_table)
        self._engine = engine

    @property
    def aio(self) -> PgAsyncRWLockManager[K]:
        """This manager with the current asyncio task as owner (see ``PgLockManager.aio``)."""
        from ._pg_aio import PgAsyncRWLockManager

        return PgAsyncRWLockManager(self, self._task_sessions())

    def acquire_read(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        seconds = wait_seconds(blocking, timeout)
        self.advisory_key(key)
        return self._take([(key, READ)], seconds,
                          lambda left: self._engine.acquire_read(key, timeout=left),
                          lambda: self._engine.release_read(key))

    def acquire_write(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        seconds = wait_seconds(blocking, timeout)
        self.advisory_key(key)
        return self._take([(key, WRITE)], seconds,
                          lambda left: self._engine.acquire_write(key, timeout=left),
                          lambda: self._engine.release_write(key))

    def release_read(self, key: K) -> None:
        self._give([(key, READ)], lambda: self._engine.release_read(key))

    def release_write(self, key: K) -> None:
        self._give([(key, WRITE)], lambda: self._engine.release_write(key))

    def read(self, key: K, timeout: float | None = None) -> _Held:
        seconds = hold_seconds(timeout)
        return _Held(self, [(key, READ)], lambda: self.acquire_read(key, timeout=seconds),
                     lambda: self.release_read(key), seconds)

    def write(self, key: K, timeout: float | None = None) -> _Held:
        seconds = hold_seconds(timeout)
        return _Held(self, [(key, WRITE)], lambda: self.acquire_write(key, timeout=seconds),
                     lambda: self.release_write(key), seconds)

    def acquire_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                     blocking: bool = True, timeout: float = -1) -> bool:
        """Read ``reads`` and write ``writes`` at once, or none (a key in both is written)."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_items(rw_items(reads, writes, _same), seconds)

    def release_many(self, reads: Iterable[K] = (), writes: Iterable[K] = ()) -> None:
        self._release_items(rw_items(reads, writes, _same))

    def hold_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                  timeout: float | None = None) -> _Held:
        seconds = hold_seconds(timeout)
        items = rw_items(reads, writes, _same)
        return _Held(self, items, lambda: self._acquire_items(items, seconds),
                     lambda: self._release_items(items), seconds)

    def _acquire_items(self, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        for key, _ in items:
            self.advisory_key(key)
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        return self._take(items, seconds,
                          lambda left: self._engine.acquire_many(reading, writing, timeout=left),
                          lambda: self._engine.release_many(reading, writing))

    def _release_items(self, items: list[tuple[Hashable, int]]) -> None:
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        self._give(items, lambda: self._engine.release_many(reading, writing))

    def _only_lost(self, key: Hashable,
                   lost: collections.Counter[tuple[Hashable, int]]) -> bool:
        written = lost[key, WRITE] or not self._engine.write_locked(key)
        return bool(written and lost[key, READ] >= self._engine.readers(key))

    def readers(self, key: K) -> int:
        """Threads of *this process* reading ``key`` (lost reads are not counted)."""
        readers: int = self._engine.readers(key)
        return readers - self._lost_items()[key, READ] if readers else 0

    def write_locked(self, key: K) -> bool:
        """Whether any session of any process writes ``key`` in this manager's database
        (asks the server)."""
        return self._held_on_server(key, _MODE_NAMES[WRITE])

    def __contains__(self, key: object) -> bool:
        """Whether a thread of this process reads or writes ``key``."""
        if key not in self._engine:
            return False
        lost = self._lost_items()
        writing = bool(self._engine.write_locked(key)) and not lost[key, WRITE]
        return writing or self._engine.readers(key) > lost[key, READ]


class PgKeyLock(Generic[K]):
    """``locks[key]`` of a PgLockManager: ``acquire``, ``release``, ``locked``, ``with``."""

    __slots__ = ("key", "manager")

    def __init__(self, manager: PgLockManager[K], key: K) -> None:
        manager.advisory_key(key)  # a key PostgreSQL cannot take fails here
        self.manager = manager
        self.key = key

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self.manager.acquire(self.key, blocking, timeout)

    def release(self) -> None:
        self.manager.release(self.key)

    def locked(self) -> bool:
        return self.manager.locked(self.key)

    def _is_owned(self) -> bool:
        return self.manager.owned(self.key)

    def _recursion_count(self) -> int:
        return self.manager.recursion_count(self.key)

    def _release_save(self) -> tuple[int, int]:
        """For ``threading.Condition``: give the key up entirely, remembering the level."""
        count = self.manager.recursion_count(self.key)
        if not count:
            raise not_owned(self.key)
        for _ in range(count):
            self.manager.release(self.key)
        return count, threading.get_ident()

    def _acquire_restore(self, state: tuple[int, int]) -> None:
        self.manager.acquire(self.key)
        for _ in range(restored_count(state) - 1):
            self.manager.acquire(self.key)

    def __enter__(self) -> bool:
        return self.manager.acquire(self.key)

    def __exit__(self, *exc_info: object) -> None:
        self.manager.release(self.key)


class Lease:
    """What ``with locks.hold(key) as lease:`` (``write``, ``read``, ``hold_many``) gives:
    truthy, like the ``True`` it stands for, with the ``keys`` held and, from a manager
    made with ``fencing=True``, the fence each written key was taken under.

    A fence strictly increases for its key across every process, connection and server
    restart: pass it with each write to storage that refuses a fence lower than one it
    has seen, and a holder whose lock was lost under it (a long pause, a dead session) can
    no longer overwrite the work of the one that took the key next."""

    __slots__ = ("_fences", "_keys")

    def __init__(self, keys: tuple[Hashable, ...], fences: dict[Hashable, int] | None) -> None:
        self._keys = keys
        self._fences = fences  # written key -> fence; None: the manager takes no fences

    @property
    def keys(self) -> tuple[Hashable, ...]:
        return self._keys

    @property
    def fence(self) -> int:
        """The fence of a single-key lease (LockError for a read, or several keys)."""
        fences = self.fences
        if len(self._keys) != 1:
            raise LockError(f"a lease on {len(self._keys)} keys has a fence for each: "
                            "use lease.fences")
        key = self._keys[0]
        if key not in fences:
            raise _read_has_no_fence(key)
        return fences[key]

    @property
    def fences(self) -> dict[Hashable, int]:
        """Each written key's fence (read keys have none): a copy."""
        if self._fences is None:
            raise _no_fencing()
        return dict(self._fences)

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<Lease {', '.join(map(self._describe, self._keys))}>"

    def _describe(self, key: Hashable) -> str:
        if self._fences is None:
            return repr(key)
        return f"{key!r} fence={self._fences[key]}" if key in self._fences else f"{key!r} (read)"


class _Held:
    """What ``hold()``, ``read()``, ``write()`` and ``hold_many()`` return."""

    __slots__ = ("_acquire", "_items", "_manager", "_release", "_seconds")

    def __init__(self, manager: _PgEngine[Any], items: list[tuple[Hashable, int]],
                 acquire: Callable[[], bool], release: Callable[[], None],
                 seconds: float) -> None:
        self._manager = manager
        self._items = items
        self._acquire = acquire
        self._release = release
        self._seconds = seconds

    def __enter__(self) -> Lease:
        if not self._acquire():
            keys = [key for key, _ in self._items]
            raise timed_out(keys[0] if len(keys) == 1 else tuple(keys), self._seconds)
        return self._manager._lease(self._items)

    def __exit__(self, *exc_info: object) -> None:
        self._release()


def _same(key: Hashable) -> Hashable:
    """The multi-key argument rules' key mapping: PostgreSQL managers lock keys as given."""
    return key
