"""What the backends across processes (``lockmgr.postgres``, ``lockmgr.host``) give their
users alike: the ``Lease`` of a block, the context manager that takes it, and the ``[key]``
view (their ``aio`` views: ``_layered_aio``). Each backend's manager has the lock manager's
methods (``acquire``, ``release``, ``owned``, ``recursion_count``, ``locked``), a
``_check_key`` that refuses a key it cannot lock, and a ``_lease`` of what a call holds."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, Protocol, TypeVar

from ._args import restored_count
from ._errors import LockError, not_owned, timed_out

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)


def _no_fencing() -> LockError:
    return LockError("this manager takes no fences: create it with fencing=True")


def _read_has_no_fence(key: Hashable) -> LockError:
    return LockError(f"key {key!r} is held for reading: only a write takes a fence")


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


class Leasing(Protocol):
    def _lease(self, items: Sequence[tuple[Hashable, int]]) -> Lease: ...


class Held:
    """What ``hold()``, ``read()``, ``write()`` and ``hold_many()`` return."""

    __slots__ = ("_acquire", "_items", "_manager", "_release", "_seconds")

    def __init__(self, manager: Leasing, items: list[tuple[Hashable, int]],
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


class ExclusiveManager(Protocol[K_contra]):
    def _check_key(self, key: K_contra) -> object: ...
    def acquire(self, key: K_contra, blocking: bool = True, timeout: float = -1) -> bool: ...
    def release(self, key: K_contra) -> None: ...
    def locked(self, key: K_contra) -> bool: ...
    def owned(self, key: K_contra) -> bool: ...
    def recursion_count(self, key: K_contra) -> int: ...


class LayeredKeyLock(Generic[K]):
    """``locks[key]`` of an exclusive manager across processes: ``acquire``, ``release``,
    ``locked``, ``with``, and ``threading.Condition(locks[key])``.

    Making one raises TypeError for a key the manager cannot take (keys are str, bytes,
    int and tuples of them)."""

    __slots__ = ("key", "manager")

    def __init__(self, manager: ExclusiveManager[K], key: K) -> None:
        manager._check_key(key)  # a key the manager cannot take fails here
        self.manager = manager
        self.key = key

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """``manager.acquire(key, ...)``: raises what it raises."""
        return self.manager.acquire(self.key, blocking, timeout)

    def release(self) -> None:
        """``manager.release(key)``: raises what it raises."""
        self.manager.release(self.key)

    def locked(self) -> bool:
        """``manager.locked(key)``: raises what it raises."""
        return self.manager.locked(self.key)

    def _is_owned(self) -> bool:
        return self.manager.owned(self.key)

    def _recursion_count(self) -> int:
        return self.manager.recursion_count(self.key)

    def _release_save(self) -> tuple[int, int]:
        """For ``threading.Condition``: give the key up entirely, remembering the level."""
        count = self.manager.recursion_count(self.key)
        if not count:
            raise not_owned(self.key, threading.get_ident())
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
