"""The public managers: ``PgLockManager``, ``PgRWLockManager`` and ``PgKeyLock``."""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from .. import LockManager, RWLockManager
from .._args import READ, WRITE, hold_seconds, many_items, rw_items, wait_seconds
from .._layered import Held as _Held, LayeredKeyLock
from .._views import synchronized
from ._engine import _PgEngine
from ._fences import DEFAULT_FENCE_TABLE
from ._session import _same
from ._sql import _MODE_NAMES

if TYPE_CHECKING:
    from .._contract import LockEngine, RWLockEngine
    from ._aio import PgAsyncLockManager, PgAsyncRWLockManager

K = TypeVar("K", bound=Hashable)
P = ParamSpec("P")  # a synchronized function's parameters
T = TypeVar("T")  # and its result


class PgLockManager(_PgEngine[K]):
    """``LockManager`` across processes and hosts, on PostgreSQL advisory locks.

    Every process making a manager with the same database and ``namespace`` shares its
    locks; threads of this process are ordered by an in-process ``LockManager`` first.

    - ``dsn``: the database, as libpq takes it (a URL or ``"host=... dbname=..."``).
      Nothing connects yet: each thread connects when it first takes a key.
    - ``namespace``: keeps these keys apart from other managers' on the same database
      (the same key in two namespaces is two locks).
    - ``fair``: as ``LockManager(fair=...)``, for the threads of this process; across
      processes, PostgreSQL's queue is first come, first served.
    - ``on_lost``: called once with the keys a lost connection held (on the thread that
      noticed, so keep it short and let it not raise).
    - ``connect_kwargs``: more connection parameters, as libpq takes them
      (``connect_timeout``, ``sslmode``, ...); TCP keepalives are on unless these turn them
      off. A connect ends by a timed call's deadline; otherwise after ``connect_timeout``
      (0: no limit), else 10 s.
    - ``log_waits_after``: as ``LockManager(log_waits_after=...)``, for waits in process.
    - ``fencing``: each first write acquisition takes a fencing token (``Lease.fence``,
      ``fence()``), at the cost of a durable write per acquisition.
    - ``fence_table``: ``"schema.table"`` of the fence counters (made on first use).
    - ``max_connections``: at most this many connections of the threads and tasks holding
      keys (and idle ones kept for reuse) at once; beyond it, an acquisition that needs a
      new one waits in line, first come first served, within its ``timeout`` (a try does
      not wait). None (the default): no cap. Deadlock looks use one more, outside it.
    - ``trusted_roles``: names of roles besides the manager's own whose sessions' published
      waits its deadlock looks follow (those of other processes' managers logging in as
      another role); the sessions of any other role, and of other databases, are ignored.

    Making a manager raises TypeError for a ``dsn`` that is not a str, ValueError for one
    libpq cannot parse (or bad ``connect_kwargs``), and TypeError or ValueError for a bad
    ``fence_table``, ``max_connections`` or ``trusted_roles``; nothing connects. Connecting
    (at a thread's first acquisition, and for a question to the server) raises
    ``PgConnectionError`` when the server refuses (out of connections: "sorry, too many
    clients already"), cannot be reached or does not complete the connection in time,
    psycopg's error as its cause — a timed call, or a try, times out instead when the
    connection is not complete by its deadline — and ``UnsafeServerError`` for a standby
    or a pooler.
    """

    _engine: LockEngine[Hashable]

    def __init__(self, dsn: str, *, namespace: str = "", fair: bool = True,
                 on_lost: Callable[[list[Hashable]], None] | None = None,
                 connect_kwargs: dict[str, Any] | None = None,
                 log_waits_after: float | None = None, fencing: bool = False,
                 fence_table: str = DEFAULT_FENCE_TABLE,
                 max_connections: int | None = None,
                 trusted_roles: Iterable[str] = ()) -> None:
        engine: LockManager[Hashable] = LockManager(fair=fair, log_waits_after=log_waits_after)
        super().__init__(dsn, engine, namespace=namespace, on_lost=on_lost,
                         connect_kwargs=connect_kwargs, fencing=fencing,
                         fence_table=fence_table, max_connections=max_connections,
                         trusted_roles=trusted_roles)

    @property
    def aio(self) -> PgAsyncLockManager[K]:
        """This manager with the current asyncio task as owner: the same methods, acquiring
        awaited, releasing done at the call (its answer, awaited, tells when the server has
        released); tasks and threads of this process exclude each other per key."""
        from ._aio import PgAsyncLockManager

        return PgAsyncLockManager(self, self._task_sessions(), self._engine.aio)

    def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` across every process using this database and namespace; as
        ``LockManager.acquire``: True once held, False if not within ``timeout``.

        Raises, with nothing taken: TypeError/ValueError for bad ``blocking``/``timeout``
        (as ``threading.Lock.acquire``), TypeError for a key PostgreSQL cannot take (keys are str, bytes, int and tuples of them), DeadlockError if
        waiting would close a cycle (PostgreSQL's detector, or one through this process's
        threads), or at once if the thread holds ``key`` through another manager of this
        server and database (it would wait for itself), LockLost if the thread holds ``key``
        on a session that was lost; with ``fencing=True``, FenceNotDurableError if the
        server could not confirm the fence durable (a synchronous standby that did not
        answer by the deadline); connecting, PgConnectionError (refused, unreachable, out of
        connections, psycopg's error as its cause; a timed call or a try whose connect is
        not done by its deadline returns False instead) or UnsafeServerError (a standby, a
        pooler)."""
        seconds = wait_seconds(blocking, timeout)
        self._idents.of(key)  # a key PostgreSQL cannot take fails before anything changes
        return self._take([(key, WRITE)], seconds,
                          lambda left: self._engine.acquire(key, timeout=left),
                          lambda: self._engine.release(key))

    def release(self, key: K) -> None:
        """Undo one ``acquire`` (the last level releases it on the server).

        Raises NotOwnedError if the calling thread does not hold ``key``, and LockLost if
        its session was lost (the level is released all the same)."""
        self._give([(key, WRITE)], lambda: self._engine.release(key))

    def hold(self, key: K, timeout: float | None = None) -> _Held:
        """A context manager holding ``key`` for its block; ``as`` gives its ``Lease``.

        Entering raises LockTimeout if ``key`` is not acquired within ``timeout`` (None or
        -1: no limit), and what ``acquire`` raises; leaving, what ``release`` raises."""
        seconds = hold_seconds(timeout)
        return _Held(self, [(key, WRITE)], lambda: self.acquire(key, timeout=seconds),
                     lambda: self.release(key), seconds)

    def synchronized(
        self, key_func: Callable[..., K]
    ) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """Decorator: the call holds the key ``key_func(*args, **kwargs)`` while it runs.

        Write it with its key function: ``@locks.synchronized(lambda user_id: user_id)``.
        Written bare (``@locks.synchronized``), it raises TypeError saying so: at once over
        a coroutine function, else when the function is called.

        The decorated function keeps its signature for type checkers. A call raises what
        ``hold`` raises around the function's own errors.
        """
        return synchronized(self, key_func)

    def __getitem__(self, key: K) -> PgKeyLock[K]:
        """One key seen as a ``threading.RLock`` (across processes)."""
        return PgKeyLock(self, key)

    def acquire_many(self, keys: Iterable[K], blocking: bool = True, timeout: float = -1) -> bool:
        """Lock every key of ``keys`` at once, or none (see ``LockManager.acquire_many``):
        one round trip for the set.

        Raises what ``acquire`` raises (a key named twice counts once)."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_items(many_items(keys, _same), seconds)

    def release_many(self, keys: Iterable[K]) -> None:
        """Undo one ``acquire_many`` of ``keys``, in one round trip.

        Raises NotOwnedError, with nothing released, if the thread does not hold them all;
        LockLost if some were lost (the rest are released)."""
        self._release_items(many_items(keys, _same, True))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> _Held:
        """A context manager holding every key of ``keys`` for its block; ``as`` gives its
        ``Lease`` (a fence per key with ``fencing=True``).

        Entering raises LockTimeout if they are not acquired within ``timeout``, and what
        ``acquire_many`` raises; leaving, what ``release_many`` raises."""
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
        """Whether the calling thread holds ``key`` (a lost key is not held). Raises
        nothing (an unhashable key: TypeError)."""
        return bool(self._engine.owned(key)) and not self._lost_here(key, WRITE)

    def owner(self, key: K) -> int | None:
        """The ident of the thread of *this process* holding ``key``, or None. Raises
        nothing (an unhashable key: TypeError)."""
        owner: int | None = self._engine.owner(key)
        return None if owner is None or self._lost_items()[key, WRITE] else owner

    def recursion_count(self, key: K) -> int:
        """How many levels of ``key`` the calling thread holds (0 for a lost key). Raises
        nothing (an unhashable key: TypeError)."""
        count: int = self._engine.recursion_count(key)
        return 0 if count and self._lost_here(key, WRITE) else count

    def locked(self, key: K) -> bool:
        """Whether any session of any process holds ``key`` in this manager's database
        (asks the server, on a connection of the manager's).

        Raises TypeError for a key PostgreSQL cannot take (keys are str, bytes, int and tuples of them), and what connecting raises
        (PgConnectionError, UnsafeServerError: see ``acquire``)."""
        return self._held_on_server(key, None)

    def __contains__(self, key: object) -> bool:
        """Whether a thread of this process holds ``key``."""
        return bool(self._engine.locked(key)) and not self._lost_items()[key, WRITE]


class PgRWLockManager(_PgEngine[K]):
    """``RWLockManager`` across processes and hosts, on PostgreSQL advisory locks: shared
    (read) and exclusive (write) per key.

    The parameters are ``PgLockManager``'s but ``fair`` (readers and writers are queued
    in order, as in ``RWLockManager``); fences (``fencing=True``) are taken by writes only.
    """

    _engine: RWLockEngine[Hashable]

    def __init__(self, dsn: str, *, namespace: str = "",
                 on_lost: Callable[[list[Hashable]], None] | None = None,
                 connect_kwargs: dict[str, Any] | None = None,
                 log_waits_after: float | None = None, fencing: bool = False,
                 fence_table: str = DEFAULT_FENCE_TABLE,
                 max_connections: int | None = None,
                 trusted_roles: Iterable[str] = ()) -> None:
        engine: RWLockManager[Hashable] = RWLockManager(log_waits_after=log_waits_after)
        super().__init__(dsn, engine, namespace=namespace, on_lost=on_lost,
                         connect_kwargs=connect_kwargs, fencing=fencing,
                         fence_table=fence_table, max_connections=max_connections,
                         trusted_roles=trusted_roles)

    @property
    def aio(self) -> PgAsyncRWLockManager[K]:
        """This manager with the current asyncio task as owner (see ``PgLockManager.aio``)."""
        from ._aio import PgAsyncRWLockManager

        return PgAsyncRWLockManager(self, self._task_sessions(), self._engine.aio)

    def acquire_read(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` shared (read) across every process using this database and namespace:
        True once held, False if not within ``timeout``.

        Raises what ``PgLockManager.acquire`` raises."""
        seconds = wait_seconds(blocking, timeout)
        self.advisory_key(key)
        return self._take([(key, READ)], seconds,
                          lambda left: self._engine.acquire_read(key, timeout=left),
                          lambda: self._engine.release_read(key))

    def acquire_write(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` exclusive (write) across every process using this database and namespace:
        True once held, False if not within ``timeout``.

        Raises what ``PgLockManager.acquire`` raises."""
        seconds = wait_seconds(blocking, timeout)
        self.advisory_key(key)
        return self._take([(key, WRITE)], seconds,
                          lambda left: self._engine.acquire_write(key, timeout=left),
                          lambda: self._engine.release_write(key))

    def release_read(self, key: K) -> None:
        """Undo one ``acquire_read``.

        Raises NotOwnedError if the calling thread does not read ``key``, and LockLost if
        its session was lost (the level is released all the same)."""
        self._give([(key, READ)], lambda: self._engine.release_read(key))

    def release_write(self, key: K) -> None:
        """Undo one ``acquire_write``.

        Raises NotOwnedError if the calling thread does not write ``key``, and LockLost if
        its session was lost (the level is released all the same)."""
        self._give([(key, WRITE)], lambda: self._engine.release_write(key))

    def read(self, key: K, timeout: float | None = None) -> _Held:
        """A context manager holding ``key`` shared (read) for its block; ``as`` gives its
        ``Lease``.

        Entering raises LockTimeout if not acquired within ``timeout`` (None or -1: no
        limit), and what ``acquire_read`` raises; leaving, what ``release_read`` raises."""
        seconds = hold_seconds(timeout)
        return _Held(self, [(key, READ)], lambda: self.acquire_read(key, timeout=seconds),
                     lambda: self.release_read(key), seconds)

    def write(self, key: K, timeout: float | None = None) -> _Held:
        """A context manager holding ``key`` exclusive (write) for its block; ``as`` gives its
        ``Lease`` (its fence with ``fencing=True``).

        Entering raises LockTimeout if not acquired within ``timeout`` (None or -1: no
        limit), and what ``acquire_write`` raises; leaving, what ``release_write`` raises."""
        seconds = hold_seconds(timeout)
        return _Held(self, [(key, WRITE)], lambda: self.acquire_write(key, timeout=seconds),
                     lambda: self.release_write(key), seconds)

    def acquire_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                     blocking: bool = True, timeout: float = -1) -> bool:
        """Read ``reads`` and write ``writes`` at once, or none (a key in both is written),
        in one round trip.

        Raises what ``PgLockManager.acquire`` raises."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_items(rw_items(reads, writes, _same), seconds)

    def release_many(self, reads: Iterable[K] = (), writes: Iterable[K] = ()) -> None:
        """Undo one ``acquire_many`` of ``reads`` and ``writes``, in one round trip.

        Raises NotOwnedError, with nothing released, if the thread does not hold them all
        so; LockLost if some were lost (the rest are released)."""
        self._release_items(rw_items(reads, writes, _same, True))

    def hold_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                  timeout: float | None = None) -> _Held:
        """A context manager reading ``reads`` and writing ``writes`` for its block.

        Entering raises LockTimeout if they are not acquired within ``timeout``, and what
        ``acquire_many`` raises; leaving, what ``release_many`` raises."""
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
        """Threads of *this process* reading ``key`` (lost reads are not counted). Raises
        nothing (an unhashable key: TypeError)."""
        readers: int = self._engine.readers(key)
        return readers - self._lost_items()[key, READ] if readers else 0

    def write_locked(self, key: K) -> bool:
        """Whether any session of any process writes ``key`` in this manager's database
        (asks the server).

        Raises TypeError for a key PostgreSQL cannot take (keys are str, bytes, int and tuples of them), and what connecting raises
        (PgConnectionError, UnsafeServerError: see ``PgLockManager.acquire``)."""
        return self._held_on_server(key, _MODE_NAMES[WRITE])

    def __contains__(self, key: object) -> bool:
        """Whether a thread of this process reads or writes ``key``."""
        if key not in self._engine:
            return False
        lost = self._lost_items()
        writing = bool(self._engine.write_locked(key)) and not lost[key, WRITE]
        return writing or self._engine.readers(key) > lost[key, READ]


class PgKeyLock(LayeredKeyLock[K]):
    """``locks[key]`` of a PgLockManager: ``acquire``, ``release``, ``locked`` (asking the
    server), ``with``, and ``threading.Condition(locks[key])``.

    Making one raises TypeError for a key PostgreSQL cannot take (keys are str, bytes, int
    and tuples of them)."""

    __slots__ = ()
