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
  checked before it is used again). Never give the manager a DSN that goes through a
  *transaction* pooler (PgBouncer in transaction mode): session locks would land on a
  server session other clients share. A forked child never uses (nor closes) a connection
  of its parent's: it opens its own, and keys the parent held are not the child's.
- **A lost connection is a lost lock**: the holder gets ``LockLost`` at each release of
  that key (and at an acquire of it), ``lost_keys()`` and the ``on_lost`` callback (once per
  key) tell the application, and the manager no longer claims to hold the key. Keys taken
  later go on a new connection. Connections use TCP keepalives so a dead peer is noticed.
- **One round trip** per first acquire and per last release: each is one message (a
  single-key call is a statement prepared once per connection). A wait with a timeout takes
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
  connection is closed and the keys held on it are lost.
- ``xact_lock(conn, key)`` takes a transaction-scoped lock in the caller's own transaction,
  so the lock and the caller's writes commit or roll back together.
"""

from __future__ import annotations

import collections
import hashlib
import os
import select
import signal
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, ParamSpec, TypeVar

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg.pq import ConnStatus, ExecStatus, TransactionStatus
except ImportError as exc:  # tested in a subprocess without psycopg
    raise ImportError(
        "lockmgr.postgres needs psycopg 3: pip install 'lockmgr[postgres]'"
    ) from exc

from . import LockManager, RWLockManager
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

__all__ = ["LockLost", "PgKeyLock", "PgLockManager", "PgRWLockManager", "advisory_key"]

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


# The single-key calls, prepared on each connection at first use.
_STATEMENTS = {
    f"lockmgr_{function}".encode(): f"SELECT {function}($1::bigint)".encode()
    for function in ("pg_advisory_lock", "pg_advisory_lock_shared", "pg_try_advisory_lock",
                     "pg_try_advisory_lock_shared", "pg_advisory_unlock",
                     "pg_advisory_unlock_shared")
}

_LOCK = {mode: f"lockmgr_pg_advisory_lock{_kind(mode)}".encode() for mode in (READ, WRITE)}
_TRY_LOCK = {mode: f"lockmgr_pg_try_advisory_lock{_kind(mode)}".encode() for mode in (READ, WRITE)}
_UNLOCK = {mode: f"lockmgr_pg_advisory_unlock{_kind(mode)}".encode() for mode in (READ, WRITE)}
_REMEMBERED_KEYS = 1024
_FATAL_ERROR = int(ExecStatus.FATAL_ERROR)
_MAX_LOCK_TIMEOUT = 2**31 - 1  # lock_timeout's ceiling, in milliseconds (about 24.8 days)
_SLICE_MS = int(MAIN_THREAD_SLICE * 1000)
_POLLIN = getattr(select, "POLLIN", 1)  # Windows has no poll(), nor its constants
_POLLOUT = getattr(select, "POLLOUT", 4)

_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
               "keepalives_count": 3, "tcp_user_timeout": 10_000}


def _encode(key: object) -> bytes:
    """A canonical, type-tagged encoding: equal keys (1 == True) encode alike."""
    if isinstance(key, int):
        return b"i" + str(int(key)).encode()
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


def advisory_key(key: Hashable, namespace: str = "") -> int:
    """The signed 64-bit PostgreSQL advisory key of ``key`` in ``namespace``."""
    return _salted_key(key, _salt(namespace))


def _salt(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=32).digest()


def _salted_key(key: Hashable, salt: bytes) -> int:
    digest = hashlib.blake2b(_encode(key), digest_size=8, key=salt).digest()
    return int.from_bytes(digest, "big", signed=True)


_set_signal_mask = getattr(signal, "pthread_sigmask", None)  # None: Windows
_HANDLED_SIGNALS = frozenset(signal.valid_signals()) - {
    getattr(signal, name) for name in ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE",
                                       "SIGILL", "SIGABRT") if hasattr(signal, name)}


@contextmanager
def _handlers_held_back() -> Iterator[None]:
    """Python signal handlers run only on the main thread: there, hold back the signals that
    may have one for the block (blocking runs those already pending first)."""
    if threading.current_thread() is not threading.main_thread() or _set_signal_mask is None:
        yield
        return
    mask = _set_signal_mask(signal.SIG_BLOCK, _HANDLED_SIGNALS)
    try:
        yield
    finally:
        _set_signal_mask(signal.SIG_SETMASK, mask)


class _Link:
    """One server connection. Lock calls drive libpq directly (one message, one round trip,
    no cursor), waiting in ``poll`` so that Ctrl-C and other signal handlers run."""

    __slots__ = ("busy", "conn", "pgconn", "pid", "poller", "prepared")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.pgconn = conn.pgconn
        self.pid = os.getpid()  # a forked child must never speak on its parent's connection
        self.busy = threading.Lock()  # held by the owner while it talks to the server
        self.poller = select.poll() if hasattr(select, "poll") else _SelectPoller()
        self.poller.register(self.pgconn.socket, _POLLIN)
        self.prepared: set[bytes] = set()  # names of the statements prepared on this session

    @classmethod
    def connect(cls, dsn: str, connect_kwargs: dict[str, Any]) -> _Link:
        link = cls(psycopg.connect(dsn, autocommit=True, **connect_kwargs))
        # Waits without a timeout wait forever, whatever the DSN or the role's defaults say;
        # timed waits set a transaction-local lock_timeout of their own.
        link.run("SET lock_timeout = 0")
        return link

    def run(self, sql: str) -> Any:
        """Send ``sql`` (one or more statements: one implicit transaction) and return the
        last result; an error result raises its psycopg exception once all are read."""
        return self._round_trip(self.pgconn.send_query, sql.encode())

    def call(self, statement: bytes, ident: int) -> Any:
        """Run one of the single-key ``_STATEMENTS`` (prepared once per session: no parsing
        or planning on the server after that) for the advisory key ``ident``."""
        if statement not in self.prepared:
            try:
                self._round_trip(self.pgconn.send_prepare, statement, _STATEMENTS[statement])
            except pg_errors.DuplicatePreparedStatement:
                pass  # an interrupt came after the server prepared it, before we noted it
            self.prepared.add(statement)
        return self._round_trip(self.pgconn.send_query_prepared, statement, [b"%d" % ident])

    def _round_trip(self, send: Callable[..., None], *args: Any) -> Any:
        pgconn = self.pgconn
        results: list[Any] = []
        with self.busy:
            send(*args)
            try:
                while pgconn.flush():
                    self._wait(_POLLOUT)
                while True:
                    if pgconn.is_busy():
                        # In slices: Python runs signal handlers in the main thread only,
                        # and a signal the kernel gave another thread does not end a poll.
                        while not self.poller.poll(_SLICE_MS):
                            pass
                        pgconn.consume_input()
                        continue
                    result = pgconn.get_result()
                    if result is None:
                        break
                    results.append(result)
            except BaseException:
                self._abort_query()
                raise
        for result in results:
            if result.status == _FATAL_ERROR:
                raise pg_errors.error_from_result(result, encoding=self.conn.info.encoding)
        return results[-1]

    def _wait(self, event: int) -> None:
        self.poller.modify(self.pgconn.socket, event)
        try:
            while not self.poller.poll(_SLICE_MS):
                pass
        finally:
            self.poller.modify(self.pgconn.socket, _POLLIN)

    def _abort_query(self) -> None:
        """Interrupted mid-query: cancel it on the server and read what is left, so that the
        connection is idle again; if that fails or is interrupted too, close it."""
        if self.pgconn.transaction_status != TransactionStatus.ACTIVE:
            return
        try:
            self.conn.cancel_safe(timeout=5.0)
            deadline = time.monotonic() + 5.0
            while True:
                if self.pgconn.is_busy():
                    if not self.poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                        raise TimeoutError("the cancelled query did not end")
                    self.pgconn.consume_input()
                elif self.pgconn.get_result() is None:
                    return
        except BaseException:
            self.close()
            raise

    def idle_unless_busy(self) -> bool | None:
        """``idle()``, or None if another thread is talking on this connection now. The
        try-lock and its release happen with signal handlers held back (main thread): a
        handler that raises (Ctrl-C) between them would leave ``busy`` taken for good."""
        with _handlers_held_back():
            if not self.busy.acquire(blocking=False):
                return None
            try:
                return self.idle()
            finally:
                self.busy.release()

    def idle(self) -> bool:
        """Alive, ours and between statements: a server that ends a session sends an error
        and closes the socket, which turns it readable, and reading that breaks it."""
        pgconn = self.pgconn
        if self.pid != os.getpid() or pgconn.status != ConnStatus.OK:
            return False
        for _ in range(3):  # the goodbye message first, the end of the stream next
            if not self.poller.poll(0):
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
        if self.pid != os.getpid():
            devnull = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(devnull, self.pgconn.socket)
            finally:
                os.close(devnull)
        self.conn.close()

    def __del__(self) -> None:
        if hasattr(self, "conn"):
            self.close()


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

    __slots__ = ("dead", "ident", "levels", "link", "lost", "reported")

    def __init__(self) -> None:
        self.ident = threading.get_ident()
        self.link: _Link | None = None
        self.levels: dict[tuple[Hashable, int], int] = {}  # (key, mode) -> levels held on link
        self.lost: dict[tuple[Hashable, int], int] = {}  # (key, mode) -> levels not yet released
        self.reported: set[Hashable] = set()  # lost keys already given to on_lost
        self.dead = False  # another thread found the link dead; the owner settles it

    def holds_anything(self) -> bool:
        return bool(self.levels or self.lost)


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

    _engine: Any

    def __init__(
        self,
        dsn: str,
        *,
        namespace: str = "",
        on_lost: Callable[[list[Hashable]], None] | None = None,
        connect_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._dsn = dsn
        self._namespace = namespace
        self._salt = _salt(namespace)
        self._str_idents: dict[str, int] = {}
        self._on_lost = on_lost
        self._connect_kwargs = {**_KEEPALIVES, **(connect_kwargs or {})}
        self._local = threading.local()
        self._guard = threading.Lock()  # guards _idle, _sessions and loss reports
        self._idle: list[_Link] = []  # connections holding nothing
        self._sessions: set[_Session] = set()  # sessions with a connection or lost keys
        _MANAGERS.add(self)

    def __repr__(self) -> str:
        return f"<lockmgr.{type(self).__name__} namespace={self._namespace!r} at {id(self):#x}>"

    def close(self) -> None:
        """Close the idle connections (those of threads holding keys stay theirs)."""
        with self._guard:
            idle, self._idle = self._idle, []
        for link in idle:
            link.close()

    def __enter__(self: _Manager) -> _Manager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_idle"):  # __init__ may have failed
            self.close()

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

    def __len__(self) -> int:
        """Keys held by this process's threads (lost ones are not held)."""
        held: int = len(self._engine)
        return held - sum(1 for _, mode in self._lost_items() if mode == WRITE)

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
                self._report(other, mark_dead=True)
        return {key for key, _ in self._lost_items()}

    def release_all(self) -> int:
        """Release every key the calling thread holds, all levels; returns how many.

        Raises LockLost, after releasing everything, if some of them had been lost."""
        session = self._session_or_none()
        try:
            if session is not None:
                self._settle(session)
                if session.levels:
                    self._unlock(session, list(session.levels))
        finally:  # interrupted or not, the thread holds nothing afterwards
            lost: list[Hashable] = []
            if session is not None:
                lost = sorted({key for key, _ in session.lost}, key=repr)
                session.levels.clear()
                session.lost.clear()
                session.reported.clear()
                self._return_if_idle(session)
            released: int = self._engine.release_all()
        if lost:
            raise _lost_error(lost)
        return released

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
        if conn.info.transaction_status != TransactionStatus.INTRANS:
            raise LockError("xact_lock needs an open transaction on conn: "
                            "use it inside `with conn.transaction():`")
        kind = "_shared" if shared else ""
        if seconds == 0:
            row = conn.execute(f"SELECT pg_try_advisory_xact_lock{kind}(%s)", (ident,)).fetchone()
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
                            conn.execute(f"SELECT pg_advisory_xact_lock{kind}(%s)", (ident,))
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
        yield

    # -- taking and giving back ---------------------------------------------------------------

    def _take(self, items: Sequence[tuple[Hashable, int]], seconds: float,
              local_acquire: Callable[[float], bool],
              local_release: Callable[[], None]) -> bool:
        """Take ``items`` ((key, mode) pairs) in-process, then in PostgreSQL, within
        ``seconds``: all of them, or none."""
        started = time.monotonic()
        session = self._session()
        self._settle(session)
        lost = sorted({key for key, mode in items if session.lost.get((key, mode))}, key=repr)
        if lost:
            raise _lost_error(lost)
        if not local_acquire(seconds):
            return False
        before = {item: session.levels.get(item, 0) for item in items}
        fresh = [item for item, levels in before.items() if not levels]
        try:
            left = seconds if seconds <= 0 else max(0.0, seconds - (time.monotonic() - started))
            if fresh and not self._lock(session, fresh, left):
                local_release()
                self._return_if_idle(session)
                return False
            for item in items:
                session.levels[item] = session.levels.get(item, 0) + 1
        except BaseException:
            # Wherever the failure or interrupt came, the call failed: nothing it took stays
            # held (a connection lost on the way already moved what it held to ``lost``).
            try:
                for item, levels in before.items():
                    if item in session.levels:
                        session.levels[item] = levels
                        if not levels:
                            del session.levels[item]
                if fresh:
                    self._drop_or_lose(session, fresh)
            finally:
                local_release()
                self._return_if_idle(session)
            raise
        return True

    def _give(self, items: Sequence[tuple[Hashable, int]],
              local_release: Callable[[], None]) -> None:
        """Undo one ``_take`` of ``items``; LockLost (after undoing it) if any was lost."""
        session = self._session_or_none()
        missing = [key for key, mode in items if session is None
                   or not (session.levels.get((key, mode)) or session.lost.get((key, mode)))]
        if missing:
            raise not_owned(missing[0])
        assert session is not None
        last = [item for item in items if session.levels.get(item) == 1]
        if not last:  # no round trip to the server will tell whether the connection lives
            self._settle(session)
            last = [item for item in items if session.levels.get(item) == 1]
        try:
            if last:
                self._unlock(session, last)  # a connection lost on the way moves them to lost
        finally:
            lost = []
            for item in items:
                if session.levels.get(item):
                    _count_down(session.levels, item)
                else:
                    lost.append(item[0])
                    _count_down(session.lost, item)
            if session.reported:
                session.reported &= {key for key, _ in session.lost}
            local_release()
            self._return_if_idle(session)
        if lost:
            raise _lost_error(sorted(set(lost), key=repr))

    def _lock(self, session: _Session, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        """Take PostgreSQL locks for ``items`` in ascending advisory-key order (so that two
        processes taking overlapping sets never deadlock), all within ``seconds``: one
        message, one round trip."""
        ordered = sorted(((self.advisory_key(key), mode) for key, mode in items))
        deadline = None if seconds <= 0 else time.monotonic() + seconds
        retried = False
        while True:
            link, fresh_link = (session.link, False) if session.link else self._attach(session)
            left = 0 if deadline is None else int((deadline - time.monotonic()) * 1000 + 0.999)
            trying = seconds == 0 or (deadline is not None and left <= 0)
            try:
                if deadline is not None and not trying:
                    result = link.run(_timed_lock_sql(ordered, left))
                elif len(ordered) == 1:
                    ident, mode = ordered[0]
                    result = link.call(_TRY_LOCK[mode] if trying else _LOCK[mode], ident)
                else:
                    result = link.run(_try_lock_sql(ordered) if trying else _wait_lock_sql(ordered))
            except pg_errors.LockNotAvailable:
                # Only timed waits set a lock_timeout, and they wait with transaction locks:
                # the error rolled the wait back, a grant that raced it included.
                if deadline is not None and deadline - time.monotonic() > 0:
                    continue  # lock_timeout's ceiling (about 24.8 days) is below threading's
                return False
            except pg_errors.DeadlockDetected as error:
                raise DeadlockError(f"PostgreSQL: {error}", []) from None
            except psycopg.OperationalError:
                if not link.broken():
                    raise  # a cancelled statement: the caller drops what it may have taken
                # The connection died: the keys held on it are lost, and so is this
                # attempt; a connection that had been idle is replaced once.
                self._lose(session)
                if fresh_link or retried:
                    raise
                retried = True
                continue
            return not trying or result.get_value(0, 0) == b"t"

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
                result = link.run("SELECT " + ", ".join(
                    f"pg_advisory_unlock{_kind(mode)}({self.advisory_key(key)})"
                    for key, mode in items))
        except psycopg.OperationalError:
            if link.broken():
                self._lose(session)
                return
            self._drop_or_lose(session, items)
            raise
        except BaseException:
            self._drop_or_lose(session, items)
            raise
        released = [result.get_value(0, column) == b"t" for column in range(len(items))]
        gone = [item for item, done in zip(items, released, strict=True) if not done]
        if gone:  # the server no longer had it: lost, though the connection lives
            self._report(session, items=gone)

    def _drop_or_lose(self, session: _Session, items: Sequence[tuple[Hashable, int]]) -> None:
        """After a failed or interrupted call: release on the server whichever of ``items``
        this call may have taken (the levels it recorded before are not among them). If
        that cannot be done, end the session: its keys are lost, nothing stays held."""
        link = session.link
        if link is None:
            return
        try:
            if not link.idle():
                raise psycopg.OperationalError("the connection is not idle after an interrupt")
            link.run("; ".join(
                f"SELECT pg_advisory_unlock{_kind(mode)}({ident}) FROM {_MINE} AND"
                f" {_KEY_IS} {ident} AND mode = '{_MODE_NAMES[mode]}'"
                for ident, mode in ((self.advisory_key(key), mode) for key, mode in items)))
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
        while True:
            with self._guard:
                link = self._idle.pop() if self._idle else None
            if link is None:
                link, fresh = _Link.connect(self._dsn, self._connect_kwargs), True
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

    def _settle(self, session: _Session) -> None:
        """The owner's check at every call: a dead connection loses what it held."""
        link = session.link
        if link is None:
            return
        if session.dead or link.idle_unless_busy() is False:  # None: another thread checks it
            self._lose(session)

    def _lose(self, session: _Session) -> None:
        """The session's connection is gone, and with it every lock it held (owner only)."""
        link, session.link = session.link, None
        with self._guard:
            for item, levels in session.levels.items():
                session.lost[item] = session.lost.get(item, 0) + levels
            session.levels.clear()
            session.dead = False
        if link is not None:
            link.close()
        self._report(session)
        if not session.lost:
            self._return_if_idle(session)

    def _report(self, session: _Session, *, mark_dead: bool = False,
                items: list[tuple[Hashable, int]] | None = None) -> None:
        """Tell ``on_lost`` once about each key newly lost by ``session``: all it holds
        (from another thread: ``mark_dead``), or just ``items`` (the owner)."""
        with self._guard:
            if items is not None:
                for item in items:
                    session.lost[item] = session.lost.get(item, 0) + session.levels.pop(item)
            if mark_dead:
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
            if session.ident == me:
                for item, levels in session.levels.items():
                    session.lost[item] = session.lost.get(item, 0) + levels
                session.levels.clear()
                session.reported = {key for key, _ in session.lost}
            else:
                self._sessions.discard(session)
        for link in links:
            link.close()

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
            link = _Link.connect(self._dsn, self._connect_kwargs)
        return link, True

    def _held_on_server(self, key: Hashable, mode: str | None) -> bool:
        link, borrowed = self._borrow()
        try:
            result = link.run(
                f"SELECT EXISTS (SELECT 1 FROM {_GRANTED_ADVISORY} {self.advisory_key(key)}"
                f" AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                + ("" if mode is None else f" AND mode = '{mode}'") + ")")
        except BaseException:
            if borrowed:
                link.close()
            raise
        if borrowed:
            with self._guard:
                self._idle.append(link)
        return bool(result.get_value(0, 0) == b"t")


def _count_down(levels: dict[tuple[Hashable, int], int], item: tuple[Hashable, int]) -> None:
    levels[item] -= 1
    if not levels[item]:
        del levels[item]


def _lost_error(keys: list[Hashable]) -> LockLost:
    return LockLost(f"the lock on {', '.join(map(repr, keys))} was lost with its connection")


def _wait_lock_sql(ordered: list[tuple[int, int]]) -> str:
    """Wait as long as it takes: session locks, one statement each, in order."""
    return "; ".join(f"SELECT pg_advisory_lock{_kind(mode)}({ident})" for ident, mode in ordered)


def _try_lock_sql(ordered: list[tuple[int, int]]) -> str:
    """Try once: all or nothing (transaction locks first, released at the statement's end)."""
    trial = " AND ".join(f"pg_try_advisory_xact_lock{_kind(mode)}({ident})" for ident, mode in ordered)
    taking = " AND ".join(f"pg_try_advisory_lock{_kind(mode)}({ident})" for ident, mode in ordered)
    return f"SELECT CASE WHEN {trial} THEN {taking} ELSE false END"


def _timed_lock_sql(ordered: list[tuple[int, int]], milliseconds: int) -> str:
    """Wait at most ``milliseconds`` in all, for transaction locks (so a timeout or cancel
    rolls back a grant that raced it), then take the session locks (which no longer wait).
    One implicit transaction: statement_timestamp() is when the message arrived."""
    elapsed = "(extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000)::bigint"
    left = f"greatest(1, least({_MAX_LOCK_TIMEOUT}, {milliseconds} - {elapsed}))::text"
    waits = "; ".join(f"SELECT set_config('lock_timeout', {left}, true);"
                      f" SELECT pg_advisory_xact_lock{_kind(mode)}({ident})"
                      for ident, mode in ordered)
    taking = ", ".join(f"pg_advisory_lock{_kind(mode)}({ident})" for ident, mode in ordered)
    return f"{waits}; SELECT {taking}"


def _milliseconds(seconds: float) -> int:
    return min(_MAX_LOCK_TIMEOUT, max(1, int(seconds * 1000 + 0.999)))


class PgLockManager(_PgEngine[K]):
    """``LockManager`` across processes and hosts, on PostgreSQL advisory locks."""

    def __init__(self, dsn: str, *, namespace: str = "", fair: bool = True,
                 on_lost: Callable[[list[Hashable]], None] | None = None,
                 connect_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(dsn, namespace=namespace, on_lost=on_lost, connect_kwargs=connect_kwargs)
        self._engine: LockManager[Hashable] = LockManager(fair=fair)

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
        """A context manager holding ``key`` for its block (LockTimeout if not acquired)."""
        seconds = hold_seconds(timeout)
        return _Held(lambda: self.acquire(key, timeout=seconds), lambda: self.release(key),
                     (key,), seconds)

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
        return _Held(lambda: self._acquire_items(items, seconds),
                     lambda: self._release_items(items), tuple(key for key, _ in items), seconds)

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

    def __init__(self, dsn: str, *, namespace: str = "",
                 on_lost: Callable[[list[Hashable]], None] | None = None,
                 connect_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(dsn, namespace=namespace, on_lost=on_lost, connect_kwargs=connect_kwargs)
        self._engine: RWLockManager[Hashable] = RWLockManager()

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
        return _Held(lambda: self.acquire_read(key, timeout=seconds),
                     lambda: self.release_read(key), (key,), seconds)

    def write(self, key: K, timeout: float | None = None) -> _Held:
        seconds = hold_seconds(timeout)
        return _Held(lambda: self.acquire_write(key, timeout=seconds),
                     lambda: self.release_write(key), (key,), seconds)

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
        return _Held(lambda: self._acquire_items(items, seconds),
                     lambda: self._release_items(items), tuple(key for key, _ in items), seconds)

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


class _Held:
    """What ``hold()``, ``read()``, ``write()`` and ``hold_many()`` return."""

    __slots__ = ("_acquire", "_keys", "_release", "_seconds")

    def __init__(self, acquire: Callable[[], bool], release: Callable[[], None],
                 keys: tuple[Hashable, ...], seconds: float) -> None:
        self._acquire = acquire
        self._release = release
        self._keys = keys
        self._seconds = seconds

    def __enter__(self) -> bool:
        if not self._acquire():
            raise timed_out(self._keys[0] if len(self._keys) == 1 else self._keys, self._seconds)
        return True

    def __exit__(self, *exc_info: object) -> None:
        self._release()


def _same(key: Hashable) -> Hashable:
    """The multi-key argument rules' key mapping: PostgreSQL managers lock keys as given."""
    return key
