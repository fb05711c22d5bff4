"""The pure twin's managers (the compiled core's ``_c/managers.pxi``): ``LockManager``,
``RWLockManager``, their ``with`` holdings and ``KeyLock``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, final

from .._aio import AsyncKeyLock, AsyncLockManager, AsyncRWLockManager, AsyncSemaphoreManager
from .._args import hold_seconds, many_items, restored_count, rw_items, slot_limit, wait_seconds
from .._errors import timed_out
from .._views import PICKLE_ERROR, KeySemaphore, key_lock_repr, semaphore_repr, synchronized
from ._state import K, _NOT_OWNED, P, _PINNED, _READ, T, _WRITE, _Entry, _Token, _failure
from ._runtime import _existing_token
from ._table import (
    _has_holder,
    _holders_and_limit,
    _owner_and_count,
    _read_level,
    _reader_count,
    _write_level,
    _written,
    _written_by,
)
from ._engine import _Engine


@final
class LockManager(_Engine, Generic[K]):
    """Exclusive, reentrant, FIFO-fair locks on any hashable key, in one table.

    Memory grows only with the keys currently held or waited on.
    """

    __slots__ = ()

    def __init__(self, *, fair: bool = True, stripes: int | None = None,
                 log_waits_after: float | None = None) -> None:
        super().__init__(stripes, log_waits_after)
        self._fair = bool(fair)

    @property
    def fair(self) -> bool:
        """True for strict FIFO hand-off, False for eventual fairness."""
        return self._fair

    @property
    def aio(self) -> AsyncLockManager[K]:
        """This manager's table for asyncio tasks: the current task owns what it acquires."""
        return AsyncLockManager(self)

    def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` for the calling thread, like ``threading.RLock.acquire``.

        Returns True once held (reentrant: a holder always succeeds at once), False if
        ``blocking`` is false or ``timeout`` (seconds, -1 = forever) ran out first.

        Raises, with nothing taken: TypeError/ValueError for bad ``blocking``/``timeout``
        (as ``threading.Lock.acquire``; OverflowError past ``threading.TIMEOUT_MAX``),
        TypeError for an unhashable key, DeadlockError if waiting would close a cycle of
        threads and tasks, NestedWaitError if the thread would wait while already waiting
        for a key (a signal handler or finalizer running inside that wait), OverflowError
        past ``sys.maxsize`` levels.
        """
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_write(self._table_key(key), seconds, 1)

    def release(self, key: K) -> None:
        """Undo one ``acquire`` of ``key``. Raises NotOwnedError if the calling thread does
        not hold it, TypeError for an unhashable key."""
        self._release_write(self._table_key(key))

    def hold(self, key: K, timeout: float | None = None) -> KeyLock[K]:
        """A context manager holding ``key`` for its block.

        ``timeout``: None or -1 waits forever, 0 tries once. Raises TypeError/ValueError for a
        bad ``timeout``, TypeError for an unhashable key; entering raises LockTimeout if not
        acquired in time and what ``acquire`` raises; leaving, what ``release`` raises.
        """
        seconds = hold_seconds(timeout)
        view = KeyLock(self, key)
        view._seconds = seconds
        return view

    def _task_key_lock(self, key: K) -> AsyncKeyLock[K]:
        """``aio[key]`` (the engine's task operations are in ``_Engine``)."""
        hash(key)  # an unhashable key fails here, as it does in the core
        return AsyncKeyLock(self, key)

    def __getitem__(self, key: K) -> KeyLock[K]:
        """The per-key lock view: behaves like a ``threading.RLock`` for this one key."""
        return KeyLock(self, key)

    def synchronized(
        self, key_func: Callable[..., K]
    ) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """Decorator: the call holds the key ``key_func(*args, **kwargs)`` while it runs.

        Write it with its key function: ``@locks.synchronized(lambda user_id: user_id)``.
        Written bare (``@locks.synchronized``), it raises TypeError saying so: at once over
        a coroutine function, else when the function is called. A ``key_func`` that is not
        callable, and decorating a coroutine function, raise TypeError; each call raises
        what ``hold`` raises around the function's own errors.

        The decorated function keeps its signature for type checkers.
        """
        return synchronized(self, key_func)

    def acquire_many(self, keys: Iterable[K], blocking: bool = True, timeout: float = -1) -> bool:
        """Lock every key of ``keys`` at once, or none: True, or False on timeout.

        Duplicates count once; keys the caller holds are re-entered. The request queues
        FIFO on every key it needs and keeps its place there, so it cannot starve, and it
        never deadlocks against other multi-key calls, whatever the order of the keys.
        Raises what ``acquire`` raises, nothing taken, and TypeError if ``keys`` is a str
        or bytes.
        """
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_many(many_items(keys, self._table_key), seconds)

    def release_many(self, keys: Iterable[K]) -> None:
        """Undo one ``acquire_many(keys)``. Raises, nothing released: NotOwnedError if one is
        not held, TypeError if ``keys`` is a str or bytes, an iterator already consumed, or
        holds an unhashable key."""
        self._release_many(many_items(keys, self._table_key, True))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> _HoldingMany:
        """A context manager holding every key of ``keys`` for its block. Raises TypeError for
        bad ``keys`` (as ``acquire_many``) and TypeError/ValueError for a bad ``timeout``;
        entering raises LockTimeout if not acquired in time and what ``acquire_many``
        raises; leaving, what ``release_many`` raises."""
        return _HoldingMany(self, many_items(keys, self._table_key), hold_seconds(timeout))

    def locked(self, key: K) -> bool:
        """Whether any thread or task holds ``key``. Raises TypeError for an unhashable key."""
        return self._run_on_key(_written, self._table_key(key))

    def owned(self, key: K) -> bool:
        """Whether the calling thread holds ``key``. Raises TypeError for an unhashable key."""
        return self._run_on_key(
            _written_by, self._table_key(key), _existing_token())

    def owner(self, key: K) -> int | None:
        """The ``threading.get_ident()`` of the thread holding ``key`` (the task, for a task),
        or None. Raises TypeError for an unhashable key."""
        return self._owner_and_count(key)[0]

    def recursion_count(self, key: K) -> int:
        """How many times the calling thread holds ``key`` (0 if it does not). Raises
        TypeError for an unhashable key."""
        return self._run_on_key(
            _write_level, self._table_key(key), _existing_token())

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is currently held (by any thread)."""
        return self._run_on_key(_written, self._table_key(key))

    def _owner_and_count(self, key: K) -> tuple[int | None, int]:
        return self._run_on_key(
            _owner_and_count, self._table_key(key))

    def _release_save(self, key: K) -> tuple[int, int]:
        verdict = self._run_on_key(self._release_save_on, self._table_key(key), _existing_token())
        if type(verdict) is not tuple:
            raise _failure(verdict, key)
        return verdict

    def _release_save_on(
        self, entry: _Entry | None, key: Hashable, key_hash: int, plain: bool,
        token: _Token | None,
    ) -> object:
        if entry is None or token is None or entry.owner is not token:
            return _NOT_OWNED
        if self._pinned(token, entry, _WRITE):
            return _PINNED
        saved = (entry.count, token.ident)
        self._disown(entry)
        self._pass_on(entry)
        return saved

    def _acquire_restore(self, key: K, state: tuple[int, int]) -> None:
        self._acquire_write(self._table_key(key), -1.0, restored_count(state))


@final
class RWLockManager(_Engine, Generic[K]):
    """Per-key reader/writer locks: many readers or one writer, reentrant, FIFO without
    writer starvation, upgrades and downgrades within a thread."""

    __slots__ = ()

    def __init__(self, *, stripes: int | None = None, log_waits_after: float | None = None) -> None:
        super().__init__(stripes, log_waits_after)

    @property
    def aio(self) -> AsyncRWLockManager[K]:
        """This manager's table for asyncio tasks: the current task owns what it acquires."""
        return AsyncRWLockManager(self)

    def acquire_read(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Take ``key`` for reading; the same arguments, result and errors as
        ``LockManager.acquire``: raises what it raises."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_read(self._table_key(key), seconds)

    def acquire_write(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Take ``key`` for writing (an upgrade if the caller reads it); as
        ``LockManager.acquire``: raises what it raises (DeadlockError for the second of two
        readers upgrading at once)."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_write(self._table_key(key), seconds, 1)

    def release_read(self, key: K) -> None:
        """Undo one ``acquire_read``. Raises NotOwnedError if the calling thread does not read
        ``key``, TypeError for an unhashable key."""
        self._release_read(self._table_key(key))

    def release_write(self, key: K) -> None:
        """Undo one ``acquire_write``. Raises NotOwnedError if the calling thread does not
        write ``key``, TypeError for an unhashable key."""
        self._release_write(self._table_key(key))

    def read(self, key: K, timeout: float | None = None) -> _Holding:
        """A context manager reading ``key`` for its block; raises what ``LockManager.hold``
        raises."""
        seconds = hold_seconds(timeout)
        return _Holding(self, self._table_key(key), seconds, _READ)

    def write(self, key: K, timeout: float | None = None) -> _Holding:
        """A context manager writing ``key`` for its block; raises what ``LockManager.hold``
        raises."""
        seconds = hold_seconds(timeout)
        return _Holding(self, self._table_key(key), seconds, _WRITE)

    def acquire_many(
        self, reads: Iterable[K] = (), writes: Iterable[K] = (), blocking: bool = True,
        timeout: float = -1,
    ) -> bool:
        """Read every key of ``reads`` and write every key of ``writes`` at once, or none
        (a key in both is written); see ``LockManager.acquire_many``, whose errors it raises
        (TypeError if ``reads`` or ``writes`` is a str or bytes)."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_many(rw_items(reads, writes, self._table_key), seconds)

    def release_many(self, reads: Iterable[K] = (), writes: Iterable[K] = ()) -> None:
        """Undo one ``acquire_many`` with the same arguments; raises what
        ``LockManager.release_many`` raises."""
        self._release_many(rw_items(reads, writes, self._table_key, True))

    def hold_many(
        self, reads: Iterable[K] = (), writes: Iterable[K] = (), timeout: float | None = None
    ) -> _HoldingMany:
        """A context manager holding ``reads`` and ``writes`` for its block; raises what
        ``LockManager.hold_many`` raises."""
        return _HoldingMany(self, rw_items(reads, writes, self._table_key), hold_seconds(timeout))

    def readers(self, key: K) -> int:
        """How many threads and tasks hold ``key`` for reading. Raises TypeError for an
        unhashable key."""
        return self._run_on_key(_reader_count, self._table_key(key))

    def write_locked(self, key: K) -> bool:
        """Whether a thread or task holds ``key`` for writing. Raises TypeError for an
        unhashable key."""
        return self._run_on_key(_written, self._table_key(key))

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has any holder."""
        return self._run_on_key(_has_holder, self._table_key(key))

    def _read_count(self, key: K) -> int:
        """How many times the calling thread reads ``key``."""
        return self._run_on_key(
            _read_level, self._table_key(key), _existing_token())


@final
class SemaphoreManager(_Engine, Generic[K]):
    """At most ``limit`` slots per key held at once (by threads or tasks), FIFO, in one table.

    Each ``acquire`` takes one more slot, also by an owner holding slots of the key (no
    re-entry); each ``release`` gives back one of the caller's. A wait only the caller's
    own release could end (every slot of the key is its own) is a DeadlockError. A limit
    of 1 is ``LockManager``'s exclusive lock; above it, each owner has a read hold of the
    key counting its slots, admitted while fewer than ``limit`` slots are taken and nobody
    is queued ahead (``fair=False``: past a queue too).
    Memory grows only with the keys currently held or waited on.
    """

    __slots__ = ("_mode",)

    def __init__(self, limit: int | Callable[[K], int], *, fair: bool = True,
                 log_waits_after: float | None = None) -> None:
        limit_of = limit if callable(limit) else None
        checked = 0 if limit_of is not None else slot_limit(limit)
        super().__init__(None, log_waits_after)
        self._fair = bool(fair)
        self._mode = _WRITE if checked == 1 else _READ
        self._slot_limit = 0 if checked == 1 else checked
        self._limit_of = limit_of
        self._counts_slots = True

    @property
    def _slot_mode(self) -> int:
        """How a slot is held: WRITE (a limit of 1: the exclusive lock) or READ."""
        return self._mode

    @property
    def limit(self) -> int | Callable[[K], int]:
        """Holders admitted per key at once, or the ``limit(key)`` that says so for each key
        (called at each acquisition: its answer for a key that enters the table is that
        key's limit while it is in use)."""
        return self._limit_of or self._slot_limit or 1

    @property
    def fair(self) -> bool:
        """True: no waiter is overtaken; False: a free slot goes to whoever asks first."""
        return self._fair

    @property
    def aio(self) -> AsyncSemaphoreManager[K]:
        """This manager's table for asyncio tasks: the current task owns what it acquires."""
        return AsyncSemaphoreManager(self)

    def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Take one more slot of ``key`` for the calling thread: True once held, False if
        ``blocking`` is false or ``timeout`` (seconds, -1 = forever) ran out first. Raises
        what ``LockManager.acquire`` raises, and DeadlockError (without waiting) if every
        slot of ``key`` is the caller's own, nothing taken."""
        seconds = wait_seconds(blocking, timeout)
        if self._mode == _WRITE:
            return self._acquire_write(key, seconds, 1)
        return self._acquire_read(key, seconds)

    def release(self, key: K) -> None:
        """Undo one ``acquire`` of ``key``. Raises NotOwnedError if the calling thread holds
        no slot of it, TypeError for an unhashable key."""
        if self._mode == _WRITE:
            self._release_write(key)
        else:
            self._release_read(key)

    def hold(self, key: K, timeout: float | None = None) -> _Holding:
        """A context manager holding a slot of ``key`` for its block; raises what
        ``LockManager.hold`` raises."""
        seconds = hold_seconds(timeout)
        hash(key)
        return _Holding(self, key, seconds, self._mode)

    def __getitem__(self, key: K) -> KeySemaphore[K]:
        """The per-key view: ``acquire``/``release`` and ``with`` for this one key."""
        hash(key)
        return KeySemaphore(self, key)

    def synchronized(
        self, key_func: Callable[..., K]
    ) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """Decorator: the call holds a slot of ``key_func(*args, **kwargs)`` while it runs;
        raises what ``LockManager.synchronized`` raises."""
        return synchronized(self, key_func)

    def _items(self, keys: Iterable[K], releasing: bool = False) -> list[tuple[Hashable, int]]:
        if self._mode == _WRITE:
            return many_items(keys, self._table_key, releasing)
        return rw_items(keys, (), self._table_key, releasing)

    def acquire_many(self, keys: Iterable[K], blocking: bool = True, timeout: float = -1) -> bool:
        """A slot of every key of ``keys`` at once, or none: True, or False on timeout; raises
        what ``LockManager.acquire_many`` raises, nothing taken."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_many(self._items(keys), seconds)

    def release_many(self, keys: Iterable[K]) -> None:
        """Undo one ``acquire_many(keys)``; raises what ``LockManager.release_many`` raises,
        nothing released."""
        self._release_many(self._items(keys, True))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> _HoldingMany:
        """A context manager holding a slot of every key of ``keys`` for its block; raises
        what ``LockManager.hold_many`` raises."""
        return _HoldingMany(self, self._items(keys), hold_seconds(timeout))

    def holders(self, key: K) -> int:
        """How many slots of ``key`` are held (an owner holding two counts twice). Raises
        TypeError for an unhashable key."""
        if self._mode == _WRITE:  # a limit of 1's holder has its one slot
            return int(self._run_on_key(_written, self._table_key(key)))
        slots: int = self._run_on_key(_holders_and_limit, self._table_key(key))[0]
        return slots

    def available(self, key: K) -> int:
        """How many slots of ``key`` are free now (``limit - holders(key)``; waiters queued
        ahead aside). Raises
        TypeError for an unhashable key, and what ``limit(key)`` raises for a key not in
        the table."""
        if self._mode == _WRITE:
            return 1 - self.holders(key)
        holders, limit = self._run_on_key(_holders_and_limit, self._table_key(key))
        return (limit or self._limit_for(key) or self._slot_limit) - holders

    def owned(self, key: K) -> bool:
        """Whether the calling thread holds a slot of ``key``. Raises TypeError for an
        unhashable key."""
        token = _existing_token()
        if self._mode == _WRITE:
            return self._run_on_key(_written_by, self._table_key(key), token)
        return self._run_on_key(_read_level, self._table_key(key), token) > 0

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has any holder."""
        return self._run_on_key(_has_holder, self._table_key(key))

    def __repr__(self) -> str:
        return semaphore_repr(self, self.limit, self._fair, self._held, self._waiting)


@final
class _Holding:
    """What ``RWLockManager.read()`` and ``write()`` return: holds the key for a block."""

    __slots__ = ("_key", "_manager", "_mode", "_seconds")

    def __init__(self, manager: _Engine, key: Hashable, seconds: float, mode: int) -> None:
        self._manager = manager
        self._key = key
        self._seconds = seconds
        self._mode = mode

    def __enter__(self) -> bool:
        if self._mode == _READ:
            acquired = self._manager._acquire_read(self._key, self._seconds)
        else:
            acquired = self._manager._acquire_write(self._key, self._seconds, 1)
        if not acquired:
            raise timed_out(self._key, self._seconds)
        return True

    def __exit__(self, *exc_info: object) -> None:
        if self._mode == _READ:
            self._manager._release_read(self._key)
        else:
            self._manager._release_write(self._key)


@final
class _HoldingMany:
    """What ``hold_many()`` returns: holds a set of keys for a block."""

    __slots__ = ("_items", "_manager", "_seconds")

    def __init__(self, manager: _Engine, items: list[tuple[Hashable, int]], seconds: float) -> None:
        self._manager = manager
        self._items = items
        self._seconds = seconds

    def __enter__(self) -> bool:
        if not self._manager._acquire_many(self._items, self._seconds):
            raise timed_out(tuple(key for key, _ in self._items), self._seconds)
        return True

    def __exit__(self, *exc_info: object) -> None:
        self._manager._release_many(self._items)


@final
class KeyLock(Generic[K]):
    """One key of a manager seen as a ``threading.RLock``.

    Views are cheap and not cached: two views of one key of one manager are the same lock
    (and compare equal). A view keeps its manager alive; the manager does not keep views.
    """

    __slots__ = ("_key", "_lock_key", "_manager", "_seconds", "__weakref__")

    def __init__(self, manager: LockManager[K], key: K) -> None:
        self._lock_key = manager._table_key(key)  # the table's key: ``key``, or its stripe
        self._manager = manager
        self._key = key
        self._seconds = -1.0  # how long ``with`` waits: -1 forever (hold() sets it)

    @property
    def key(self) -> K:
        return self._key

    @property
    def manager(self) -> LockManager[K]:
        return self._manager

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """``manager.acquire(key, ...)``: raises what it raises."""
        return self._manager._acquire_write(self._lock_key, wait_seconds(blocking, timeout), 1)

    def release(self) -> None:
        """``manager.release(key)``: raises what it raises."""
        self._manager._release_write(self._lock_key)

    def locked(self) -> bool:
        """``manager.locked(key)``: whether any thread or task holds the key. Raises nothing."""
        return self._manager.locked(self._key)

    def __enter__(self) -> bool:
        if not self._manager._acquire_write(self._lock_key, self._seconds, 1):
            raise timed_out(self._key, self._seconds)
        return True

    def __exit__(self, *exc_info: object) -> None:
        self._manager._release_write(self._lock_key)

    def _is_owned(self) -> bool:
        return self._manager.owned(self._key)

    def _release_save(self) -> tuple[int, int]:
        return self._manager._release_save(self._key)

    def _acquire_restore(self, state: tuple[int, int]) -> None:
        self._manager._acquire_restore(self._key, state)

    def _recursion_count(self) -> int:
        return self._manager.recursion_count(self._key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyLock):
            return NotImplemented
        return self._manager is other._manager and bool(self._key == other._key)

    def __hash__(self) -> int:
        return hash((id(self._manager), self._key))

    def __reduce__(self) -> Any:
        raise TypeError(PICKLE_ERROR)

    def __repr__(self) -> str:
        owner, count = self._manager._owner_and_count(self._key)
        return key_lock_repr(self, self._key, owner, count)
