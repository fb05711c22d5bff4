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
  until it holds nothing (then the connection goes back to the manager's idle list). Never
  give the manager a DSN that goes through a *transaction* pooler (PgBouncer in transaction
  mode): session locks would land on a server session other clients share.
- **A lost connection is a lost lock**: the holder gets ``LockLost`` at its next call on
  that key or at release, ``lost_keys()`` and the ``on_lost`` callback tell the
  application, and the manager never believes it still holds the key. Connections use TCP
  keepalives so a dead peer is noticed.
- **Timeouts** end on time via ``lock_timeout``; 0 uses ``pg_try_advisory_lock*``; Ctrl-C
  cancels the server-side wait; PostgreSQL's deadlock error becomes ``DeadlockError``.
  Nothing is left held after any of them.
- ``xact_lock(conn, key)`` takes a transaction-scoped lock in the caller's own transaction,
  so the lock and the caller's writes commit or roll back together.
"""

from __future__ import annotations

import hashlib
import select
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg.pq import TransactionStatus
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
_Manager = TypeVar("_Manager", bound="_PgEngine[Any]")

# pg_locks rows of granted advisory locks on one 64-bit key (bigint keys use objsubid 1 and
# split the key into classid, the high half, and objid, the low half).
_GRANTED_ADVISORY = ("pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
                     " AND ((classid::bigint << 32) | objid::bigint) = %s::bigint")

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
    salt = hashlib.blake2b(namespace.encode(), digest_size=32).digest()
    digest = hashlib.blake2b(_encode(key), digest_size=8, key=salt).digest()
    return int.from_bytes(digest, "big", signed=True)


class _Session:
    """One thread's connection while it holds anything through it."""

    __slots__ = ("conn", "levels", "lost")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.levels: dict[tuple[Hashable, int], int] = {}  # (key, mode) -> levels held
        self.lost: set[Hashable] = set()  # keys held here when the connection died


class _ThreadEnd:
    """In the thread's local storage: when the thread ends, its connection closes, which
    ends its session and so releases its PostgreSQL locks at once."""

    __slots__ = ("session",)

    def __init__(self) -> None:
        self.session: _Session | None = None

    def __del__(self) -> None:
        if self.session is not None:
            self.session.conn.close()


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
        self._on_lost = on_lost
        self._connect_kwargs = {**_KEEPALIVES, **(connect_kwargs or {})}
        self._local = threading.local()
        self._guard = threading.Lock()  # guards _idle and _lost
        self._idle: list[psycopg.Connection[Any]] = []  # connections holding nothing
        self._sessions: set[_Session] = set()  # sessions of threads holding keys
        self._lost: set[Hashable] = set()  # lost and not yet released by their holders

    def __repr__(self) -> str:
        return f"<lockmgr.{type(self).__name__} namespace={self._namespace!r} at {id(self):#x}>"

    def close(self) -> None:
        """Close the idle connections (those of threads holding keys stay theirs)."""
        with self._guard:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __enter__(self: _Manager) -> _Manager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_idle"):  # __init__ may have failed
            self.close()

    def advisory_key(self, key: Hashable) -> int:
        """The advisory key ``key`` uses in this manager's namespace."""
        return advisory_key(key, self._namespace)

    def stats(self) -> LockStats:
        """The in-process engine's counters (this process's threads)."""
        stats: LockStats = self._engine.stats()
        return stats

    def __len__(self) -> int:
        """Keys held by this process's threads."""
        return len(self._engine)

    def lost_keys(self) -> set[Hashable]:
        """Keys whose session was lost and that their holders have not yet released.

        Checks first, without waiting, the connection of every thread holding keys."""
        with self._guard:
            sessions = list(self._sessions)
        for session in sessions:
            if not session.conn.lock.locked():  # busy: its thread will notice itself
                self._probe(session)
        with self._guard:
            return set(self._lost)

    def release_all(self) -> int:
        """Release every key the calling thread holds, all levels; returns how many.

        Raises LockLost, after releasing everything, if some of them had been lost."""
        session = self._session_or_none()
        lost: LockLost | None = None
        if session is not None:
            try:
                self._unlock(session, [item for item in session.levels
                                       if item[0] not in session.lost], forget=True)
            except LockLost as error:
                lost = error
            lost_keys = set(session.lost)
            session.levels.clear()
            session.lost.clear()
            with self._guard:
                self._lost -= lost_keys
            self._return_if_idle(session)
            if lost_keys and lost is None:
                lost = LockLost(f"the lock on {sorted(map(repr, lost_keys))} was lost with its connection")
        released: int = self._engine.release_all()
        if lost is not None:
            raise lost
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
            previous = conn.execute("SELECT current_setting('lock_timeout')").fetchone()
            try:
                with conn.transaction():  # a savepoint: a timeout leaves the caller's intact
                    conn.execute(f"SET LOCAL lock_timeout = {_milliseconds(seconds)}")
                    conn.execute(f"SELECT pg_advisory_xact_lock{kind}(%s)", (ident,))
            except pg_errors.LockNotAvailable:
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
        session = self._session_or_none()
        if session is not None:
            self._raise_if_lost(session, [key for key, _ in items])
        if not local_acquire(seconds):
            return False
        try:
            session = self._session()
            fresh = [item for item in items if not session.levels.get(item)]
            remaining = seconds if seconds <= 0 else max(0.0, seconds - (time.monotonic() - started))
            taken = self._lock(session, fresh, seconds if seconds == 0 else remaining)
        except BaseException:
            local_release()
            raise
        if not taken:
            local_release()
            self._return_if_idle(session)
            return False
        for item in items:
            session.levels[item] = session.levels.get(item, 0) + 1
        return True

    def _give(self, items: Sequence[tuple[Hashable, int]],
              local_release: Callable[[], None]) -> None:
        """Undo one ``_take`` of ``items``."""
        session = self._session_or_none()
        if session is None or any(not session.levels.get(item) for item in items):
            missing = next(key for key, mode in items
                           if session is None or not session.levels.get((key, mode)))
            raise not_owned(missing)
        if session.lost & {key for key, _ in items}:
            self._forget_lost(session, items, local_release)
        last = [item for item in items if session.levels[item] == 1]
        try:
            self._unlock(session, last, forget=False)
        except LockLost:
            self._forget_lost(session, items, local_release)
        for item in items:
            session.levels[item] -= 1
            if not session.levels[item]:
                del session.levels[item]
        local_release()
        self._return_if_idle(session)

    def _lock(self, session: _Session, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        """Take PostgreSQL locks for ``items`` in ascending advisory-key order (so that two
        processes taking overlapping sets never deadlock), all within ``seconds``."""
        conn = session.conn
        deadline = None if seconds < 0 else time.monotonic() + seconds
        ordered = sorted(items, key=lambda item: (self.advisory_key(item[0]), item[1]))
        taken: list[tuple[Hashable, int]] = []
        try:
            for key, mode in ordered:
                ident, kind = self.advisory_key(key), "_shared" if mode == READ else ""
                if deadline is None:
                    acquired = self._wait_lock(conn, kind, ident, 0)
                else:
                    left = deadline - time.monotonic()
                    if seconds == 0 or left <= 0:
                        row = conn.execute(f"SELECT pg_try_advisory_lock{kind}(%s)",
                                           (ident,)).fetchone()
                        acquired = bool(row and row[0])
                    else:
                        acquired = self._wait_lock(conn, kind, ident, _milliseconds(left))
                if not acquired:
                    self._unlock(session, taken, forget=False)
                    return False
                taken.append((key, mode))
            return True
        except pg_errors.DeadlockDetected as error:
            self._unlock(session, taken, forget=False)
            raise DeadlockError(f"PostgreSQL: {error}", []) from None
        except psycopg.OperationalError as error:
            if not session.conn.broken:
                raise
            self._lose(session)
            raise LockLost(f"the database connection was lost: {error}") from None
        except BaseException:  # Ctrl-C: psycopg cancelled the wait; undo a grant that raced it
            if not conn.closed:
                self._unlock(session, taken, forget=False)
                self._drop_unrecorded(session, ordered[len(taken):])
            raise

    @staticmethod
    def _wait_lock(conn: psycopg.Connection[Any], kind: str, ident: int, milliseconds: int) -> bool:
        try:
            with conn.transaction():  # SET LOCAL: the timeout ends with this transaction
                conn.execute(f"SET LOCAL lock_timeout = {milliseconds}")
                conn.execute(f"SELECT pg_advisory_lock{kind}(%s)", (ident,))
        except pg_errors.LockNotAvailable:
            return False
        return True

    def _drop_unrecorded(self, session: _Session, items: list[tuple[Hashable, int]]) -> None:
        """After an interrupted wait: release a lock the server granted that we never
        recorded (the session holds it more often than ``levels`` says)."""
        for key, mode in items:
            if session.levels.get((key, mode)):
                continue
            kind = "_shared" if mode == READ else ""
            row = session.conn.execute(
                f"SELECT count(*) FROM {_GRANTED_ADVISORY}"
                " AND pid = pg_backend_pid() AND mode = %s",
                (self.advisory_key(key), "ShareLock" if mode == READ else "ExclusiveLock"),
            ).fetchone()
            if row and row[0]:
                session.conn.execute(f"SELECT pg_advisory_unlock{kind}(%s)",
                                     (self.advisory_key(key),))

    def _unlock(self, session: _Session, items: list[tuple[Hashable, int]], *, forget: bool) -> None:
        try:
            for key, mode in items:
                kind = "_shared" if mode == READ else ""
                session.conn.execute(f"SELECT pg_advisory_unlock{kind}(%s)", (self.advisory_key(key),))
                if forget:
                    session.levels.pop((key, mode), None)
        except psycopg.OperationalError as error:
            if not session.conn.broken:
                raise
            self._lose(session)
            raise LockLost(f"the database connection was lost: {error}") from None

    # -- sessions and loss ----------------------------------------------------------------------

    def _session_or_none(self) -> _Session | None:
        end: _ThreadEnd | None = getattr(self._local, "end", None)
        return None if end is None else end.session

    def _session(self) -> _Session:
        end: _ThreadEnd | None = getattr(self._local, "end", None)
        if end is None:
            end = self._local.end = _ThreadEnd()
        if end.session is None:
            with self._guard:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = psycopg.connect(self._dsn, autocommit=True, **self._connect_kwargs)
            end.session = _Session(conn)
            with self._guard:
                self._sessions.add(end.session)
        return end.session

    def _return_if_idle(self, session: _Session) -> None:
        """A thread that holds nothing gives its connection back."""
        if session.levels or session.lost:
            return
        end: _ThreadEnd = self._local.end
        end.session = None
        with self._guard:
            self._sessions.discard(session)
            if not (session.conn.closed or session.conn.broken):
                self._idle.append(session.conn)

    def _probe(self, session: _Session) -> None:
        """Notice a dead connection: a server that ends a session closes its socket, which
        turns readable; a query then fails."""
        if session.conn.closed:
            return
        readable, _, _ = select.select([session.conn.fileno()], [], [], 0)
        if readable:
            try:
                session.conn.execute("SELECT 1")
            except psycopg.OperationalError:
                self._lose(session)

    def _raise_if_lost(self, session: _Session, keys: list[Hashable]) -> None:
        self._probe(session)
        lost = session.lost.intersection(keys)
        if lost:
            raise LockLost(f"the lock on {sorted(map(repr, lost))} was lost with its connection")

    def _lose(self, session: _Session) -> None:
        """The session is gone, and with it every lock it held."""
        keys = sorted({key for key, _ in session.levels}, key=repr)
        session.lost.update(keys)
        with self._guard:
            self._lost.update(keys)
            self._sessions.discard(session)
        session.conn.close()
        if keys and self._on_lost is not None:
            self._on_lost(keys)

    def _forget_lost(self, session: _Session, items: Sequence[tuple[Hashable, int]],
                     local_release: Callable[[], None]) -> None:
        """A call on a lost key: release it in-process, all levels, then raise LockLost."""
        keys = {key for key, _ in items} & session.lost
        for item in [item for item in session.levels if item[0] in keys]:
            for _ in range(session.levels.pop(item)):
                self._release_local(item)
        session.lost -= keys
        with self._guard:
            self._lost -= keys
        if not session.levels:
            session.lost.clear()
            self._return_if_idle(session)
        raise LockLost(f"the lock on {sorted(map(repr, keys))} was lost with its connection")

    def _release_local(self, item: tuple[Hashable, int]) -> None:
        raise NotImplementedError


def _milliseconds(seconds: float) -> int:
    return max(1, int(seconds * 1000 + 0.999))


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

    def synchronized(self, key_func: Any) -> Any:
        """Decorator: the call holds the key ``key_func(*args, **kwargs)`` while it runs."""
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
        """Whether the calling thread holds ``key``."""
        return self._engine.owned(key)

    def owner(self, key: K) -> int | None:
        """The ident of the thread of *this process* holding ``key``, or None."""
        return self._engine.owner(key)

    def recursion_count(self, key: K) -> int:
        return self._engine.recursion_count(key)

    def locked(self, key: K) -> bool:
        """Whether any session of any process holds ``key`` (asks the server)."""
        return _locked_on_server(self._dsn, self.advisory_key(key), None, self._connect_kwargs)

    def __contains__(self, key: object) -> bool:
        return self._engine.owned(key) or self._engine.locked(key)

    def _release_local(self, item: tuple[Hashable, int]) -> None:
        self._engine.release(item[0])


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
        """Threads of *this process* reading ``key``."""
        return self._engine.readers(key)

    def write_locked(self, key: K) -> bool:
        """Whether any session of any process writes ``key`` (asks the server)."""
        return _locked_on_server(self._dsn, self.advisory_key(key), "ExclusiveLock",
                                 self._connect_kwargs)

    def __contains__(self, key: object) -> bool:
        return key in self._engine

    def _release_local(self, item: tuple[Hashable, int]) -> None:
        if item[1] == READ:
            self._engine.release_read(item[0])
        else:
            self._engine.release_write(item[0])


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


def _locked_on_server(dsn: str, ident: int, mode: str | None, connect_kwargs: dict[str, Any]) -> bool:
    with psycopg.connect(dsn, autocommit=True, **connect_kwargs) as conn:
        row = conn.execute(
            f"SELECT EXISTS (SELECT 1 FROM {_GRANTED_ADVISORY}"
            " AND (%s::text IS NULL OR mode = %s::text))",
            (ident, mode, mode),
        ).fetchone()
    return bool(row and row[0])
