"""The public host managers: ``HostLockManager``, ``HostRWLockManager`` and ``HostKeyLock``."""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from .. import LockManager, RWLockManager
from .._args import READ, WRITE, hold_seconds, many_items, rw_items, wait_seconds
from .._layered import Held, LayeredKeyLock
from .._views import synchronized
from ._engine import _HostEngine
from ._tasks import _HostTasks

if TYPE_CHECKING:
    from ._aio import HostAsyncLockManager, HostAsyncRWLockManager

K = TypeVar("K", bound=Hashable)
P = ParamSpec("P")  # a synchronized function's parameters
T = TypeVar("T")  # and its result

_Item = tuple[Hashable, int]


def _same(key: Hashable) -> Hashable:
    """The multi-key argument rules' key mapping: host managers lock keys as given."""
    return key


class HostLockManager(_HostEngine[K]):
    """``LockManager`` across the processes of one host: every process making a manager
    on the same ``directory`` and ``namespace`` shares its locks.

    Within a process, an in-process ``LockManager`` orders the threads (reentrancy per
    thread, FIFO, deadlock detection); across processes, the kernel's record locks on the
    directory's files decide, and the kernel releases them when a process ends, however it
    ends. See ``docs/host.md``.

    - ``directory``: a directory on a local filesystem (created ``0700`` if missing); see
      ``open_lock_directory`` for what is refused.
    - ``namespace``: keeps these keys apart from other managers' of the directory.
    - ``fair``, ``log_waits_after``: as ``LockManager``'s, for the threads of this process.
    - ``mechanism``: ``"ofd"`` (Linux's open file description locks, the default there) or
      ``"posix"`` (POSIX record locks, the default elsewhere); every manager of a directory
      in one process uses one.
    - ``shared_with_group``: the directory may be the group's (group-writable, of a group
      of this process), for processes of several users of one group.
    - ``fencing``: each first write acquisition takes a fencing token (``Lease.fence``,
      ``fence()``), strictly increasing per key across every process and restart, made
      durable before it is handed out (a ``fdatasync`` per acquisition).

    Making one raises TypeError or ValueError for bad arguments, and UnsafeDirectoryError
    for a directory that cannot hold locks safely.
    """

    def __init__(self, directory: str | os.PathLike[str], *, namespace: str = "",
                 fair: bool = True, log_waits_after: float | None = None,
                 mechanism: str | None = None, shared_with_group: bool = False,
                 fencing: bool = False) -> None:
        engine: LockManager[Hashable] = LockManager(fair=fair, log_waits_after=log_waits_after)
        super().__init__(directory, engine, namespace=namespace, mechanism=mechanism,
                         shared_with_group=shared_with_group, fencing=fencing)
        self._locks = engine
        self._tasks = _HostTasks(self)

    @property
    def aio(self) -> HostAsyncLockManager[K]:
        """This manager with the current asyncio task as owner: the same methods, acquiring
        awaited (a wait for another process runs in a thread: the loop runs on), releasing
        done at the call; tasks and threads of this process exclude each other per key
        (``lockmgr.host._aio``)."""
        from ._aio import HostAsyncLockManager

        return HostAsyncLockManager(self, self._tasks, self._locks.aio)

    def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` across every process using this directory and namespace; as
        ``LockManager.acquire``: True once held, False if not within ``timeout``.

        Raises, with nothing taken: TypeError/ValueError for bad ``blocking``/``timeout``,
        TypeError for a key that is not str, bytes, int or a tuple of them,
        DeadlockError if waiting would close a cycle of this process's threads."""
        seconds = wait_seconds(blocking, timeout)
        return self._take([(key, WRITE)], seconds,
                          lambda left: self._locks.acquire(key, timeout=-1 if left < 0 else left),
                          lambda: self._locks.release(key))

    def release(self, key: K) -> None:
        """Undo one ``acquire`` (the last level releases it across processes). Raises
        NotOwnedError if the calling thread does not hold ``key``."""
        self._give([(key, WRITE)], lambda: self._locks.release(key))

    def hold(self, key: K, timeout: float | None = None) -> Held:
        """A context manager holding ``key`` for its block; ``as`` gives its ``Lease``.
        Entering raises LockTimeout if not acquired within ``timeout`` (None or -1: no
        limit), and what ``acquire`` raises."""
        seconds = hold_seconds(timeout)
        return Held(self, [(key, WRITE)], lambda: self.acquire(key, timeout=seconds),
                    lambda: self.release(key), seconds)

    def synchronized(
        self, key_func: Callable[..., K]
    ) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """Decorator: the call holds the key ``key_func(*args, **kwargs)`` while it runs
        (as ``LockManager.synchronized``)."""
        return synchronized(self, key_func)

    def __getitem__(self, key: K) -> HostKeyLock[K]:
        """One key seen as a ``threading.RLock`` (across processes)."""
        return HostKeyLock(self, key)

    def acquire_many(self, keys: Iterable[K], blocking: bool = True,
                     timeout: float = -1) -> bool:
        """Lock every key of ``keys`` at once, or none, within one deadline (see
        ``LockManager.acquire_many``). Raises what ``acquire`` raises."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_items(many_items(keys, _same), seconds)

    def release_many(self, keys: Iterable[K]) -> None:
        """Undo one ``acquire_many`` of ``keys``. Raises NotOwnedError, with nothing
        released, if the thread does not hold them all."""
        self._release_items(many_items(keys, _same, True))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> Held:
        """A context manager holding every key of ``keys`` for its block."""
        seconds = hold_seconds(timeout)
        items = many_items(keys, _same)
        return Held(self, items, lambda: self._acquire_items(items, seconds),
                    lambda: self._release_items(items), seconds)

    def _acquire_items(self, items: list[_Item], seconds: float) -> bool:
        keys = [key for key, _ in items]
        return self._take(items, seconds,
                          lambda left: self._locks.acquire_many(keys, timeout=-1 if left < 0 else left),
                          lambda: self._locks.release_many(keys))

    def _release_items(self, items: list[_Item]) -> None:
        keys = [key for key, _ in items]
        self._give(items, lambda: self._locks.release_many(keys))

    def owned(self, key: K) -> bool:
        """Whether the calling thread holds ``key``. Raises nothing."""
        return bool(self._levels().held.get((key, WRITE)))

    def owner(self, key: K) -> int | None:
        """The ident of the thread of *this process* holding ``key``, or None."""
        owner: int | None = self._locks.owner(key)
        return owner

    def recursion_count(self, key: K) -> int:
        """How many levels of ``key`` the calling thread holds."""
        return self._levels().held.get((key, WRITE), 0)

    def locked(self, key: K) -> bool:
        """Whether any process holds ``key`` (this one through any manager, or another).
        Raises TypeError for a key that is not str, bytes, int or a tuple of them."""
        return self._shared.locked(self._check_key(key))

    def __contains__(self, key: object) -> bool:
        """Whether a thread of this process holds ``key`` through this manager."""
        return key in self._engine


class HostRWLockManager(_HostEngine[K]):
    """``RWLockManager`` across the processes of one host: shared (read) and exclusive
    (write) keys. A writer waiting in one process keeps new readers of every process out
    until the readers present when it arrived have left. Arguments as
    ``HostLockManager``'s (without ``fair``: readers and writers queue FIFO)."""

    _rw = True

    def __init__(self, directory: str | os.PathLike[str], *, namespace: str = "",
                 log_waits_after: float | None = None, mechanism: str | None = None,
                 shared_with_group: bool = False, fencing: bool = False) -> None:
        engine: RWLockManager[Hashable] = RWLockManager(log_waits_after=log_waits_after)
        super().__init__(directory, engine, namespace=namespace, mechanism=mechanism,
                         shared_with_group=shared_with_group, fencing=fencing)
        self._rwlocks = engine
        self._tasks = _HostTasks(self)

    @property
    def aio(self) -> HostAsyncRWLockManager[K]:
        """This manager with the current asyncio task as owner (see
        ``HostLockManager.aio``)."""
        from ._aio import HostAsyncRWLockManager

        return HostAsyncRWLockManager(self, self._tasks, self._rwlocks.aio)

    def acquire_read(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Read-lock ``key`` across processes (shared with other readers); as
        ``RWLockManager.acquire_read``. Raises what ``HostLockManager.acquire`` raises."""
        seconds = wait_seconds(blocking, timeout)
        return self._take([(key, READ)], seconds,
                          lambda left: self._rwlocks.acquire_read(key, timeout=-1 if left < 0 else left),
                          lambda: self._rwlocks.release_read(key))

    def acquire_write(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Write-lock ``key`` across processes; a reader of it in this thread upgrades, as
        ``RWLockManager.acquire_write``. Raises what ``HostLockManager.acquire`` raises."""
        seconds = wait_seconds(blocking, timeout)
        return self._take([(key, WRITE)], seconds,
                          lambda left: self._rwlocks.acquire_write(key, timeout=-1 if left < 0 else left),
                          lambda: self._rwlocks.release_write(key))

    def release_read(self, key: K) -> None:
        """Undo one ``acquire_read``. Raises NotOwnedError if not held for reading."""
        self._give([(key, READ)], lambda: self._rwlocks.release_read(key))

    def release_write(self, key: K) -> None:
        """Undo one ``acquire_write`` (a thread that still reads ``key`` goes back to
        reading it). Raises NotOwnedError if not held for writing."""
        self._give([(key, WRITE)], lambda: self._rwlocks.release_write(key))

    def read(self, key: K, timeout: float | None = None) -> Held:
        """A context manager read-holding ``key`` for its block."""
        seconds = hold_seconds(timeout)
        return Held(self, [(key, READ)], lambda: self.acquire_read(key, timeout=seconds),
                    lambda: self.release_read(key), seconds)

    def write(self, key: K, timeout: float | None = None) -> Held:
        """A context manager write-holding ``key`` for its block."""
        seconds = hold_seconds(timeout)
        return Held(self, [(key, WRITE)], lambda: self.acquire_write(key, timeout=seconds),
                    lambda: self.release_write(key), seconds)

    def acquire_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                     blocking: bool = True, timeout: float = -1) -> bool:
        """Read-lock ``reads`` and write-lock ``writes`` at once, or none, within one
        deadline (a key in both is written)."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_items(rw_items(reads, writes, _same), seconds)

    def release_many(self, reads: Iterable[K] = (), writes: Iterable[K] = ()) -> None:
        """Undo one ``acquire_many``. Raises NotOwnedError, with nothing released, if the
        thread does not hold them all in those modes."""
        self._release_items(rw_items(reads, writes, _same, True))

    def hold_many(self, reads: Iterable[K] = (), writes: Iterable[K] = (),
                  timeout: float | None = None) -> Held:
        """A context manager holding ``reads`` and ``writes`` for its block."""
        seconds = hold_seconds(timeout)
        items = rw_items(reads, writes, _same)
        return Held(self, items, lambda: self._acquire_items(items, seconds),
                    lambda: self._release_items(items), seconds)

    def _acquire_items(self, items: list[_Item], seconds: float) -> bool:
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        return self._take(items, seconds,
                          lambda left: self._rwlocks.acquire_many(reading, writing,
                                                                  timeout=-1 if left < 0 else left),
                          lambda: self._rwlocks.release_many(reading, writing))

    def _release_items(self, items: list[_Item]) -> None:
        reading = [key for key, mode in items if mode == READ]
        writing = [key for key, mode in items if mode == WRITE]
        self._give(items, lambda: self._rwlocks.release_many(reading, writing))

    def readers(self, key: K) -> int:
        """Threads of *this process* reading ``key`` through this manager."""
        readers: int = self._rwlocks.readers(key)
        return readers

    def write_locked(self, key: K) -> bool:
        """Whether any process writes ``key``. Raises TypeError for a key that is not str,
        bytes, int or a tuple of them."""
        return self._shared.write_locked(self._check_key(key))

    def __contains__(self, key: object) -> bool:
        """Whether a thread of this process reads or writes ``key`` through this manager."""
        return key in self._engine


class HostKeyLock(LayeredKeyLock[K]):
    """``locks[key]`` of a HostLockManager: ``acquire``, ``release``, ``locked``, ``with``,
    and ``threading.Condition(locks[key])``.

    Making one raises TypeError for a key that is not str, bytes, int or a tuple of them."""

    __slots__ = ()
