"""The engine contract: what lockmgr's Python layers call on an engine.

An *engine* is ``lockmgr._core`` (compiled) or ``lockmgr._pure`` (its twin). The layers
above it — the selector in ``__init__``, the asyncio views in ``_aio``, the PostgreSQL
managers in ``postgres``, ``otel`` — use only what these protocols name:

- ``EngineModule``: the module's names (the four public classes the selector imports, and
  ``end_stranded_task``, which ``postgres._tasks`` calls when a task's PostgreSQL session ends);
- ``Engine``: what both managers share, the table-wide operations (``stats()``,
  ``snapshot()``, ``metrics()``, ``release_all()``, the wait observers ``otel`` adds) and
  the *task operations* ``_task_*`` that ``_aio`` calls (its docstring states their
  semantics);
- ``LockEngine`` and ``RWLockEngine``: a ``LockManager``'s and an ``RWLockManager``'s
  thread operations (the public ones, and the ``threading.Condition`` hooks
  ``_release_save``/``_acquire_restore``), with the task operations of ``Engine``;
- ``TaskWait``: the wait a task operation answers when its request queued, which
  ``_aio._wait_for_grant`` drives; ``BlockRecord``: which task is inside an ``async with``
  object (made by ``_task_record()``, handed back to ``_task_enter``/``_task_exit``).

How each engine is held to it: the pure twin by mypy (the end of this module assigns its
module and classes to these types; the views, typed by them, are made by the twin's
managers; ``make typecheck``); the compiled core by ``tests/engine/test_contract.py``, which
compares every member's name, kind (method or attribute) and parameters (names, kinds,
defaults) with these protocols, for both engines. The core's methods carry their
signatures (``embedsignature`` in ``lockmgr_core.pyx``); a core built without it fails
that test ("no signature to compare").

Keys are ``K`` in the public operations, as the managers are generic in it, and
``Hashable`` in the task operations (the views check nothing about keys: the engine does).
``Items`` is a list of distinct ``(key, mode)`` pairs (``_args.many_items``/``rw_items``);
``mode`` is ``_args.READ`` or ``_args.WRITE``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from ._aio import (
        AsyncKeyLock,
        AsyncLockManager,
        AsyncRWLockManager,
        AsyncSemaphoreManager,
        _AsyncEngineView,
    )
    from ._observe import KeyState, LockMetrics
    from ._owners import Waker
    from ._views import LockStats

    #: An ``async with`` object of ``_task_hold``/``_task_hold_many``: what ``aio.hold()``,
    #: ``read()``, ``write()`` and ``hold_many()`` answer.
    AsyncBlock = AbstractAsyncContextManager[bool]

__all__ = ["BlockRecord", "Engine", "EngineModule", "Items", "LockEngine", "RWLockEngine",
           "SemaphoreEngine", "TaskWait"]

K = TypeVar("K", bound=Hashable)

Items = list[tuple[Hashable, int]]


class TaskWait(Protocol):
    """A task's queued request (``lockmgr._aio`` states the protocol)."""

    @property
    def waker(self) -> Waker: ...
    @property
    def deadline(self) -> float: ...  # monotonic seconds when it times out; < 0: never
    @property
    def log_at(self) -> float: ...  # when the slow-wait log is due; < 0: never

    # True (granted), False (timed out), None (still waiting) or AWAIT_POST.
    def settle(self, consumed: bool, deadline: float) -> object: ...
    def complete(self) -> None: ...
    def timed_out(self) -> bool: ...
    def abandon(self) -> None: ...
    def log_slow(self) -> None: ...
    def log_end(self, granted: bool) -> None: ...
    def observe(self) -> None: ...


class BlockRecord(Protocol):
    """Which task is inside an ``async with`` object. Opaque to the views: each engine
    takes back only its own (TypeError otherwise)."""

    @property
    def _inside(self) -> tuple[object, int]: ...  # the task inside and its depth, for tests


class Engine(Protocol):
    """What both managers share: the table-wide and the task operations."""

    @property
    def stripes(self) -> int | None: ...
    def stripe_of(self, key: Hashable) -> int | None: ...
    @property
    def log_waits_after(self) -> float | None: ...
    @property
    def aio(self) -> _AsyncEngineView: ...  # the table with the current task as owner
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def _table_key(self, key: Hashable) -> Hashable: ...
    def stats(self) -> LockStats: ...
    def snapshot(self) -> list[KeyState]: ...
    def metrics(self) -> LockMetrics: ...
    def release_all(self) -> int: ...
    def _add_wait_observer(self, observer: Callable[[float], object]) -> None: ...
    def _remove_wait_observer(self, observer: Callable[[float], object]) -> None: ...

    # -- task operations: the current asyncio task is the owner -------------------------------
    def _task_enter(self, key: Hashable, mode: int, seconds: float, raises_timeout: bool,
                    record: BlockRecord | None = None) -> Awaitable[bool]: ...
    def _task_enter_many(self, items: Items, seconds: float, raises_timeout: bool,
                         record: BlockRecord | None = None) -> Awaitable[bool]: ...
    def _task_acquire(self, key: Hashable, blocking: bool = True,
                      timeout: float = -1) -> Coroutine[Any, Any, bool]: ...
    def _task_acquire_read(self, key: Hashable, blocking: bool = True,
                           timeout: float = -1) -> Coroutine[Any, Any, bool]: ...
    def _task_acquire_many(self, make_items: Callable[[], Items], blocking: bool = True,
                           timeout: float = -1) -> Coroutine[Any, Any, bool]: ...
    def _task_release(self, key: Hashable, mode: int) -> None: ...
    def _task_release_write(self, key: Hashable) -> Awaitable[None]: ...  # ready: done
    def _task_release_read(self, key: Hashable) -> Awaitable[None]: ...
    def _task_release_many(self, items: Items) -> Awaitable[None]: ...
    def _task_release_all(self) -> int: ...
    def _task_levels(self, key: Hashable) -> tuple[int, int]: ...
    def _task_abandon(self) -> None: ...
    def _task_record(self) -> BlockRecord: ...
    def _task_hold(self, key: Hashable, seconds: float, mode: int) -> AsyncBlock: ...
    def _task_hold_many(self, items: Items, seconds: float) -> AsyncBlock: ...
    def _task_exit(self, record: BlockRecord, key: Hashable, mode: int) -> Awaitable[None]: ...
    def _task_exit_many(self, record: BlockRecord, items: Items) -> Awaitable[None]: ...


class LockEngine(Engine, Protocol[K]):
    """A ``LockManager[K]``: exclusive keys."""

    @property
    def fair(self) -> bool: ...
    @property
    def aio(self) -> AsyncLockManager[K]: ...  # the PostgreSQL views' in-process part
    def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool: ...
    def release(self, key: K) -> None: ...
    def acquire_many(self, keys: Iterable[K], blocking: bool = True,
                     timeout: float = -1) -> bool: ...
    def release_many(self, keys: Iterable[K]) -> None: ...
    def locked(self, key: K) -> bool: ...
    def owned(self, key: K) -> bool: ...
    def owner(self, key: K) -> int | None: ...
    def recursion_count(self, key: K) -> int: ...
    def _owner_and_count(self, key: K) -> tuple[int | None, int]: ...
    def _release_save(self, key: K) -> tuple[int, int]: ...
    def _acquire_restore(self, key: K, state: tuple[int, int]) -> None: ...
    def _task_key_lock(self, key: K) -> AsyncKeyLock[K]: ...  # aio[key]


class RWLockEngine(Engine, Protocol[K]):
    """An ``RWLockManager[K]``: shared (read) and exclusive (write) keys."""

    @property
    def aio(self) -> AsyncRWLockManager[K]: ...

    def acquire_read(self, key: K, blocking: bool = True, timeout: float = -1) -> bool: ...
    def acquire_write(self, key: K, blocking: bool = True,
                      timeout: float = -1) -> bool: ...
    def release_read(self, key: K) -> None: ...
    def release_write(self, key: K) -> None: ...
    def acquire_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                     blocking: bool = True, timeout: float = -1) -> bool: ...
    def release_many(self, reads: Iterable[K] = (),
                     writes: Iterable[K] = ()) -> None: ...
    def readers(self, key: K) -> int: ...
    def write_locked(self, key: K) -> bool: ...
    def _read_count(self, key: K) -> int: ...


class SemaphoreEngine(Engine, Protocol[K]):
    """A ``SemaphoreManager[K]``: at most ``limit`` holders per key. ``_slot_mode`` is how
    its holders hold a key: WRITE for a fixed limit of 1 (the exclusive lock), READ above or
    with a ``limit(key)`` callable (read holds, at most the entry's limit of them, set when
    the key enters the table; the engine calls ``limit(key)`` before every section that may
    insert a semaphore's key)."""

    @property
    def aio(self) -> AsyncSemaphoreManager[K]: ...
    @property
    def limit(self) -> int | Callable[[K], int]: ...
    @property
    def fair(self) -> bool: ...
    @property
    def _slot_mode(self) -> int: ...
    def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool: ...
    def release(self, key: K) -> None: ...
    def acquire_many(self, keys: Iterable[K], blocking: bool = True,
                     timeout: float = -1) -> bool: ...
    def release_many(self, keys: Iterable[K]) -> None: ...
    def holders(self, key: K) -> int: ...
    def available(self, key: K) -> int: ...
    def owned(self, key: K) -> bool: ...


class MakesLockManager(Protocol):
    def __call__(self, *, fair: bool = True, stripes: int | None = None,
                 log_waits_after: float | None = None) -> LockEngine[Hashable]: ...


class MakesRWLockManager(Protocol):
    def __call__(self, *, stripes: int | None = None,
                 log_waits_after: float | None = None) -> RWLockEngine[Hashable]: ...


class MakesSemaphoreManager(Protocol):
    def __call__(self, limit: int | Callable[[Hashable], int], *, fair: bool = True,
                 log_waits_after: float | None = None) -> SemaphoreEngine[Hashable]: ...


class EngineModule(Protocol):
    """The engine module's names the Python layers use."""

    @property
    def LockManager(self) -> MakesLockManager: ...  # noqa: N802 - the module's class
    @property
    def RWLockManager(self) -> MakesRWLockManager: ...  # noqa: N802
    @property
    def SemaphoreManager(self) -> MakesSemaphoreManager: ...  # noqa: N802
    @property
    def KeyLock(self) -> type: ...  # noqa: N802
    @property
    def AsyncKeyLock(self) -> type: ...  # noqa: N802
    def end_stranded_task(self, task: object) -> None: ...


#: Which class of an engine module each protocol describes (tests/engine/test_contract.py).
IMPLEMENTED_BY: dict[str, type] = {
    "LockManager": LockEngine,
    "RWLockManager": RWLockEngine,
    "SemaphoreManager": SemaphoreEngine,
    "_TaskWait": TaskWait,
    "_BlockRecord": BlockRecord,
}


if TYPE_CHECKING:
    # The pure twin is an engine: mypy --strict holds its module and classes to the contract
    # here (the compiled core has no annotations: tests/engine/test_contract.py compares it).
    from . import _pure

    _TWIN: EngineModule = _pure

    def _twin_classes(locks: _pure.LockManager[K], rw: _pure.RWLockManager[K],
                      slots: _pure.SemaphoreManager[K], wait: _pure._TaskWait,
                      record: _pure._BlockRecord
                      ) -> tuple[LockEngine[K], RWLockEngine[K], SemaphoreEngine[K], TaskWait,
                                 BlockRecord]:
        return locks, rw, slots, wait, record
