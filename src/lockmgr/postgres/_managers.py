"""The public managers: ``PgLockManager``, ``PgRWLockManager`` and ``PgKeyLock``."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from .. import LockManager, RWLockManager
from .._args import READ, WRITE, hold_seconds, many_items, restored_count, rw_items, wait_seconds
from .._errors import not_owned
from .._views import synchronized
from ._engine import _PgEngine
from ._fences import DEFAULT_FENCE_TABLE
from ._session import _Held, _same
from ._sql import _MODE_NAMES

if TYPE_CHECKING:
    from .._contract import LockEngine, RWLockEngine
    from ._aio import PgAsyncLockManager, PgAsyncRWLockManager

K = TypeVar("K", bound=Hashable)
P = ParamSpec("P")  # a synchronized function's parameters
T = TypeVar("T")  # and its result


class PgLockManager(_PgEngine[K]):
    """``LockManager`` across processes and hosts, on PostgreSQL advisory locks."""

    _engine: LockEngine[Hashable]

    def __init__(self, dsn: str, *, namespace: str = "", fair: bool = True,
                 on_lost: Callable[[list[Hashable]], None] | None = None,
                 connect_kwargs: dict[str, Any] | None = None,
                 log_waits_after: float | None = None, fencing: bool = False,
                 fence_table: str = DEFAULT_FENCE_TABLE) -> None:
        engine: LockManager[Hashable] = LockManager(fair=fair, log_waits_after=log_waits_after)
        super().__init__(dsn, engine, namespace=namespace, on_lost=on_lost,
                         connect_kwargs=connect_kwargs, fencing=fencing,
                         fence_table=fence_table)

    @property
    def aio(self) -> PgAsyncLockManager[K]:
        """This manager with the current asyncio task as owner (see ``lockmgr.postgres._aio``):
        tasks and threads of this process exclude each other per key."""
        from ._aio import PgAsyncLockManager

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

        Write it with its key function: ``@locks.synchronized(lambda user_id: user_id)``.
        Written bare (``@locks.synchronized``), it raises TypeError saying so: at once over
        a coroutine function, else when the function is called.

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
        self._release_items(many_items(keys, _same, True))

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
        super().__init__(dsn, engine, namespace=namespace, on_lost=on_lost,
                         connect_kwargs=connect_kwargs, fencing=fencing,
                         fence_table=fence_table)

    @property
    def aio(self) -> PgAsyncRWLockManager[K]:
        """This manager with the current asyncio task as owner (see ``PgLockManager.aio``)."""
        from ._aio import PgAsyncRWLockManager

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
        self._release_items(rw_items(reads, writes, _same, True))

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
