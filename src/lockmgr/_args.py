"""Argument rules both engines share: timeouts, stripes, read/write modes and the items of
a many-key call, saved counts."""

from __future__ import annotations

import math
import operator
import sys
import threading
from collections.abc import Callable, Hashable, Iterable


def wait_seconds(blocking: object, timeout: float) -> float:
    """Seconds to wait, under ``threading.Lock.acquire``'s argument rules.

    Returns -1.0 for "wait forever" and 0.0 for "try once". Raises the same exception
    types as ``threading.Lock.acquire`` for the same bad arguments.
    """
    if isinstance(timeout, float):
        if math.isnan(timeout):
            raise ValueError("timeout must not be NaN")
        seconds = timeout
    else:
        seconds = float(operator.index(timeout))
    if not blocking:
        if seconds != -1:
            raise ValueError("can't specify a timeout for a non-blocking call")
        return 0.0
    if seconds == -1:
        return -1.0
    if seconds < 0:
        raise ValueError("timeout value must be a non-negative number or -1")
    if seconds > threading.TIMEOUT_MAX:
        raise OverflowError("timeout value is too large")
    return seconds


def hold_seconds(timeout: float | None) -> float:
    """Seconds to wait for a ``hold()``: None or -1 wait forever, 0 tries once."""
    if timeout is None:
        return -1.0
    return wait_seconds(True, timeout)


MAX_STRIPES = 1 << 24


def stripe_count(stripes: int | None) -> int | None:
    """``stripes=`` checked and rounded up to a power of two (None: one lock per key)."""
    if stripes is None:
        return None
    count = operator.index(stripes)
    if not 1 <= count <= MAX_STRIPES:
        raise ValueError(f"stripes must be between 1 and {MAX_STRIPES}, not {count}")
    return 1 << (count - 1).bit_length()


class Stripe(int):
    """The one lock a striped manager uses for every key that maps to it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<stripe {int(self)}>"


def stripe_index(key_hash: int, count: int) -> int:
    """Which of ``count`` (a power of two) stripes a key hashing to ``key_hash`` uses.

    The compiled core computes the same in C: multiply by 2**64/phi modulo 2**64, fold the
    high half onto the low half, keep the low bits.
    """
    mixed = (key_hash * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    return (mixed ^ (mixed >> 32)) & (count - 1)


READ = 1  # a shared (read) request
WRITE = 2  # an exclusive (write) request


def _distinct_locks(
    keys: Iterable[Hashable], argument: str, lock_key: Callable[[Hashable], Hashable],
    releasing: bool,
) -> dict[Hashable, None]:
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"{argument} must be an iterable of keys, not a single {type(keys).__name__}")
    locks = dict.fromkeys(map(lock_key, keys))
    if releasing and not locks and iter(keys) is keys:
        # An empty list releases nothing, rightly; an empty iterator is most often the
        # generator the acquire_many already consumed, and releasing nothing would leave
        # every key held, silently.
        raise TypeError(
            f"{argument} is an iterator with nothing left in it (a generator that "
            "acquire_many already consumed?): nothing was released; pass the keys again as a "
            "collection (a list, a tuple, a set)")
    return locks


def many_items(
    keys: Iterable[Hashable], lock_key: Callable[[Hashable], Hashable], releasing: bool = False
) -> list[tuple[Hashable, int]]:
    """``LockManager.*_many``: each distinct lock (key, or stripe) once, for write.
    ``releasing`` (``release_many``): an empty iterator is refused (TypeError)."""
    return [(key, WRITE) for key in _distinct_locks(keys, "keys", lock_key, releasing)]


def rw_items(
    reads: Iterable[Hashable], writes: Iterable[Hashable], lock_key: Callable[[Hashable], Hashable],
    releasing: bool = False,
) -> list[tuple[Hashable, int]]:
    """``RWLockManager.*_many``: each distinct lock once; one named in both is written.
    ``releasing`` (``release_many``): an empty iterator is refused (TypeError)."""
    written = _distinct_locks(writes, "writes", lock_key, releasing)
    items = [(key, WRITE) for key in written]
    items += [(key, READ) for key in _distinct_locks(reads, "reads", lock_key, releasing)
              if key not in written]
    return items


def slot_limit(limit: object, key: object = None, computed: bool = False) -> int:
    """A ``SemaphoreManager``'s limit per key, checked: an int from 1 to ``sys.maxsize``
    (not a bool). ``computed``: what ``limit(key)`` returned for ``key``."""
    where = f"limit({key!r}) must return" if computed else "limit must be"
    if type(limit) is bool or not isinstance(limit, int):
        raise TypeError(f"SemaphoreManager: {where} an int >= 1 (holders per key at once)"
                        + ("" if computed else " or a callable(key) returning one")
                        + f", not {type(limit).__name__}")
    if not 1 <= limit <= MAX_COUNT:
        raise ValueError(f"SemaphoreManager: {where} an int from 1 to sys.maxsize (holders "
                         f"per key at once), not {limit!r}")
    return int(limit)


#: The highest recursion level of one key for one thread (a C ``Py_ssize_t`` in the core).
MAX_COUNT = sys.maxsize


def restored_count(state: tuple[int, int]) -> int:
    """The recursion level in a ``_release_save()`` state, checked before anything changes."""
    count = operator.index(state[0])
    if count < 1:
        raise ValueError(f"invalid saved recursion count {count!r}")
    if count > MAX_COUNT:
        raise OverflowError(f"saved recursion count {count!r} exceeds sys.maxsize")
    return count
