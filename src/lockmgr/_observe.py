"""Seeing contention: what both engines report about their tables, built and logged here.

An engine reads its table in one section and hands over plain tuples (the keys, the owners'
idents, modes, counts and monotonic times, and the section's own reading of the clock);
everything that runs Python code for the caller — building these records, naming tasks,
logging — happens here, after the section. So both engines give the same records, and no
``repr`` of a key, logging handler or formatter ever runs inside a section.

Times are measured only where an engine reads the clock already (a request that queues, a
grant to a waiting request), so the uncontended path pays nothing for them:

- a hold granted to a request that waited is timed from that grant;
- a hold taken at once is timed from the moment the first request queued behind it (so
  its ``held_for`` is a lower bound), and is not timed at all if nobody ever waited for it.
"""

from __future__ import annotations

import reprlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ._args import READ
from ._errors import describe_owner
from ._owners import CONTEXT_TASK
from ._views import LockStats

__all__ = [
    "HISTOGRAM_BOUNDS",
    "HOT_KEY_SLOTS",
    "HOT_KEYS_SHOWN",
    "Histogram",
    "Holder",
    "HotKey",
    "KeyState",
    "LockMetrics",
    "Waiter",
    "bucket_of",
    "build_metrics",
    "build_snapshot",
    "log_slow_wait",
    "log_wait_end",
    "log_waits_after_seconds",
]

#: Upper bounds (seconds, inclusive) of the wait- and hold-time histograms' buckets: 1, 2, 5
#: per decade from 10 microseconds to 100 seconds; one more bucket counts what lies above.
HISTOGRAM_BOUNDS: tuple[float, ...] = tuple(
    [float(f"{m}e{e}") for e in range(-5, 2) for m in (1, 2, 5)] + [100.0]
)

#: Slots of the hot-key summary (Space-Saving: memory does not grow with the keys seen).
HOT_KEY_SLOTS = 32
#: How many of them ``metrics().hot_keys`` shows, hottest first.
HOT_KEYS_SHOWN = 10

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60

Kind = Literal["thread", "task"]
ModeName = Literal["read", "write"]


@dataclass(frozen=True)
class Holder:
    """One owner holding a key (``snapshot()``)."""

    owner: Any
    """The thread's ident, or the asyncio task."""
    kind: Kind
    """``"thread"`` or ``"task"``."""
    mode: ModeName
    """``"read"`` or ``"write"``."""
    count: int
    """Its recursion level."""
    held_for: float | None
    """Seconds it has held the key: since the grant if it waited for it, else since the first
    request queued behind it (a lower bound); None if nobody has waited for this hold."""


@dataclass(frozen=True)
class Waiter:
    """One request waiting for a key (``snapshot()``), in queue order."""

    owner: Any
    """The thread's ident, or the asyncio task."""
    kind: Kind
    mode: ModeName
    waited: float
    """Seconds since it queued."""


@dataclass(frozen=True)
class KeyState:
    """A key held or waited on, as ``snapshot()`` saw it (with stripes: a stripe)."""

    key: Hashable
    holders: tuple[Holder, ...]
    waiters: tuple[Waiter, ...]
    """Oldest first: the order they will be served in."""


@dataclass(frozen=True)
class Histogram:
    """Durations in fixed log-scale buckets (``HISTOGRAM_BOUNDS``)."""

    bounds: tuple[float, ...] = field(repr=False)
    """Upper bound (seconds, inclusive) of each bucket but the last."""
    counts: tuple[int, ...]
    """How many durations fell in each bucket: ``len(bounds) + 1`` of them, the last for
    those above ``bounds[-1]``."""
    count: int
    sum: float
    """Seconds, in total."""
    max: float
    """The longest, in seconds (0.0 if none)."""

    @property
    def mean(self) -> float | None:
        """The mean duration in seconds, None if nothing was measured."""
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """An upper estimate of the ``q`` quantile (0 < q <= 1): the bound of the bucket it
        falls in (``max`` for the last bucket), None if nothing was measured.

        Raises ValueError for a ``q`` outside (0, 1]."""
        if not 0 < q <= 1:
            raise ValueError("q must be in (0, 1]")
        if not self.count:
            return None
        rank = q * self.count
        seen = 0
        for bound, count in zip(self.bounds, self.counts):
            seen += count
            if seen >= rank:
                return min(bound, self.max)
        return self.max


@dataclass(frozen=True)
class HotKey:
    """A key with much total wait time (an approximate, bounded summary: Space-Saving)."""

    key: Hashable
    waited: float
    """Seconds requests spent waiting for it (granted or not), over-estimated by at most
    ``error``."""
    error: float
    """How much of ``waited`` may belong to keys this slot tracked before (0.0: exact)."""


@dataclass(frozen=True)
class LockMetrics(LockStats):
    """``stats()``'s counters and what the contended path measured (``metrics()``)."""

    wait_time: Histogram
    """Waits of contended acquisitions that were granted (``count == contended``)."""
    hold_time: Histogram
    """Holds that someone was waiting for when they ended."""
    hot_keys: tuple[HotKey, ...]
    """The keys with the most total wait time, hottest first (at most ``HOT_KEYS_SHOWN``)."""

    @property
    def stats(self) -> LockStats:
        """The counters alone, as ``stats()`` gives them."""
        return LockStats(self.held, self.waiting, self.acquisitions, self.contended,
                         self.timeouts, self.deadlocks)


def bucket_of(seconds: float) -> int:
    """The histogram bucket a duration falls in."""
    for index, bound in enumerate(HISTOGRAM_BOUNDS):
        if seconds <= bound:
            return index
    return len(HISTOGRAM_BOUNDS)


# -- from an engine's tuples to records ---------------------------------------------------------

# What a section hands over, per key: (key, holders, waiters), each holder
# (owner, is_task, mode, count, since) and each waiter (owner, is_task, mode, since); times
# are monotonic seconds (since 0.0: never timed), ``now`` is the section's clock. ``owner`` is
# a thread's ident, or the task.
RawHolder = tuple[Any, bool, int, int, float]
RawWaiter = tuple[Any, bool, int, float]
RawKey = tuple[Hashable, Sequence[RawHolder], Sequence[RawWaiter]]


def _mode(mode: int) -> ModeName:
    return "read" if mode == READ else "write"


def build_snapshot(raw: Iterable[RawKey], now: float) -> list[KeyState]:
    return [
        KeyState(
            key,
            tuple(Holder(owner, "task" if is_task else "thread", _mode(mode), count,
                         max(now - since, 0.0) if since > 0 else None)
                  for owner, is_task, mode, count, since in holders),
            tuple(Waiter(owner, "task" if is_task else "thread", _mode(mode),
                         max(now - since, 0.0))
                  for owner, is_task, mode, since in waiters),
        )
        for key, holders, waiters in raw
    ]


RawHistogram = tuple[Sequence[int], int, float, float]


def _histogram(raw: RawHistogram) -> Histogram:
    counts, count, total, longest = raw
    return Histogram(HISTOGRAM_BOUNDS, tuple(counts), count, total, longest)


def build_metrics(stats: Sequence[int], waits: RawHistogram, holds: RawHistogram,
                  hot: Iterable[tuple[Hashable, float, float]]) -> LockMetrics:
    """``hot``: the summary's slots, (key, waited, error). A key that came back after its
    entry was dropped may sit in two slots (slots match a key by identity, or by value for
    ``str``/``bytes``/``int``/tuples of them): they are merged here."""
    merged: dict[Any, list[Any]] = {}
    for key, waited, error in hot:
        try:
            slot = merged.get(key)
        except Exception:  # noqa: BLE001 - a key whose __eq__ fails stays on its own
            slot = None
            key = _Unmergeable(key)
        if slot is None:
            merged[key] = [key, waited, error]
        else:
            slot[1] += waited
            slot[2] += error
    ranked = sorted(merged.values(), key=lambda slot: slot[1], reverse=True)[:HOT_KEYS_SHOWN]
    held, waiting, acquisitions, contended, timeouts, deadlocks = stats
    return LockMetrics(
        held, waiting, acquisitions, contended, timeouts, deadlocks,
        wait_time=_histogram(waits), hold_time=_histogram(holds),
        hot_keys=tuple(HotKey(_unwrap(key), waited, error) for key, waited, error in ranked),
    )


class _Unmergeable:
    __slots__ = ("key",)

    def __init__(self, key: Any) -> None:
        self.key = key


def _unwrap(key: Any) -> Hashable:
    return key.key if type(key) is _Unmergeable else key  # type: ignore[no-any-return]


# -- the slow-wait log (PostgreSQL's log_lock_waits) -----------------------------------------------

def log_waits_after_seconds(value: float | None) -> float:
    """``log_waits_after=`` as seconds (-1.0: off); bad values raise as a timeout's would."""
    if value is None:
        return -1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"log_waits_after must be a number of seconds or None, not {type(value).__name__}")
    seconds = float(value)
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError("log_waits_after must be a finite number of seconds >= 0")
    return seconds


def _logger() -> Any:
    """The ``lockmgr`` logger; ``logging`` is imported only once a manager logs (it is the
    largest part of ``import lockmgr`` otherwise)."""
    import logging

    return logging.getLogger("lockmgr")


def _holder_text(holder: Holder) -> str:
    held = "" if holder.held_for is None else f", for {holder.held_for:.3f} s"
    return f"{describe_owner(holder.owner)} ({holder.mode} x{holder.count}{held})"


def _waiter_text(waiter: Waiter) -> str:
    return f"{describe_owner(waiter.owner)} ({waiter.mode}, {waiter.waited:.3f} s)"


def _keys_text(keys: Sequence[Hashable]) -> str:
    if len(keys) == 1:
        return f"key {_short.repr(keys[0])}"
    return "keys " + ", ".join(_short.repr(key) for key in keys)


def log_slow_wait(me: Any, waited: float, states: Sequence[KeyState],
                  ahead: Sequence[int]) -> None:
    """One WARNING for a request still waiting after ``log_waits_after``: ``states`` are the
    keys it is queued on, ``ahead[i]`` how many of ``states[i].waiters`` are before it (the
    next one is the request itself)."""
    parts = []
    for state, before in zip(states, ahead):
        mode = f" ({state.waiters[before].mode})" if before < len(state.waiters) else ""
        holders = ", ".join(map(_holder_text, state.holders))
        part = f"held by {holders}" if holders else "free"
        if before:
            queue = ", ".join(map(_waiter_text, state.waiters[:before]))
            part += f"; {before} ahead in the queue: {queue}"
        else:
            part += "; first in the queue"
        parts.append(f"{_short.repr(state.key)}{mode} {part}" if len(states) > 1 else f"{mode.strip()}: {part}")
    head = _keys_text([state.key for state in states])
    text = f"{head} {parts[0]}" if len(parts) == 1 else f"{head}: {' | '.join(parts)}"
    if isinstance(me, int):  # a thread: logs in its own context
        text += _context_task_text(states, ahead)
    _logger().warning(
        "%s has waited %.3f s for %s", describe_owner(me), waited, text,
        extra={"lockmgr_keys": tuple(state.key for state in states), "lockmgr_waited": waited,
               "lockmgr_states": tuple(states)},
    )


def _context_task_text(states: Sequence[KeyState], ahead: Sequence[int]) -> str:
    """Why a thread waiting for the task whose context it runs in may wait for itself (the
    engines refuse it at once only when that task is certainly awaiting it)."""
    task = CONTEXT_TASK.get()
    if task is None:
        return ""
    holds = any(holder.owner is task for state in states for holder in state.holders)
    goes_first = any(waiter.owner is task for state, before in zip(states, ahead)
                     for waiter in state.waiters[:before])
    if not (holds or goes_first):
        return ""
    return (f"; this thread runs in the context of {describe_owner(task)} (likely "
            f"asyncio.to_thread), which it waits for: if that task awaits this thread, "
            f"it waits for itself")


def log_wait_end(me: Any, keys: Sequence[Hashable], waited: float, granted: bool) -> None:
    """One INFO once a logged wait ends."""
    _logger().info(
        "%s %s %s after %.3f s", describe_owner(me), "got" if granted else "gave up on",
        _keys_text(keys), waited,
        extra={"lockmgr_keys": tuple(keys), "lockmgr_waited": waited, "lockmgr_granted": granted},
    )
