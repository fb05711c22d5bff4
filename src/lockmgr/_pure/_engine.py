"""The pure twin's ``_Engine`` (the compiled core's ``_c/engine.pxi``): what every manager
shares, assembled from one class per concern (``_Table`` < ``_Operations`` < ``_Tasks``),
with its introspection (stats, snapshot, metrics) on top.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from .._args import Stripe, stripe_count, stripe_index
from .._observe import (
    KeyState,
    LockMetrics,
    build_metrics,
    build_snapshot,
    log_waits_after_seconds,
)
from .._views import PICKLE_ERROR, LockStats, manager_repr
from ._state import _LEFT, _WAITING, _WOKEN, _Entry, _Token, _section
from ._runtime import _existing_token, _managers
from ._table import _entry_state, _histogram_copy, _new_histogram
from ._tasks import _Tasks


class _Engine(_Tasks):
    """The table, holds, queues, grants and waits that every manager shares."""

    __slots__ = ()

    def __init__(self, stripes: int | None = None, log_waits_after: float | None = None) -> None:
        self._log_after = log_waits_after_seconds(log_waits_after)  # -1.0: off
        self._observers: tuple[Callable[[float], object], ...] = ()  # see _add_wait_observer
        count = stripe_count(stripes)
        # striped: one Stripe key per stripe; None: exact keys
        self._stripe_keys = None if count is None else tuple(map(Stripe, range(count)))
        self._fair = True
        self._slot_limit = 0
        self._limit_of = None
        self._counts_slots = False
        self._table: dict[int, _Entry] = {}  # key hash -> first entry of its chain
        self._held = 0  # entries with a write or read holder
        self._waiting = 0
        self._acquisitions = 0
        self._contended = 0
        self._timeouts = 0
        self._deadlocks = 0
        # What the contended path measures (lockmgr._observe): waits that were granted and
        # holds that ended with someone waiting, as [bucket counts, count, sum, max]; the
        # hot-key summary's slots, [key, waited, error].
        self._waits: list[Any] = _new_histogram()
        self._holds: list[Any] = _new_histogram()
        self._hot: list[list[Any]] = []
        self._ref = weakref.ref(self)  # what tokens keep: they must not keep the manager alive
        _managers.add(self)

    def __repr__(self) -> str:
        return manager_repr(self, self._fair, self._held, self._waiting)

    def __reduce__(self) -> Any:
        raise TypeError(PICKLE_ERROR)

    def __len__(self) -> int:
        """Keys currently held (with stripes: stripes)."""
        return self._held

    @property
    def stripes(self) -> int | None:
        """How many stripes keys map onto, or None: one lock per key."""
        return None if self._stripe_keys is None else len(self._stripe_keys)

    def stripe_of(self, key: Hashable) -> int | None:
        """The stripe ``key`` maps onto (None without stripes): keys that share one share a
        lock. Raises TypeError for an unhashable key (when striped: unstriped, it is not
        hashed)."""
        if self._stripe_keys is None:
            return None
        return stripe_index(hash(key), len(self._stripe_keys))

    def stats(self) -> LockStats:
        """A snapshot of this manager's counters (read at one instant). Raises nothing."""
        return LockStats(*_section(self._stats_section))

    def _stats_section(self) -> tuple[int, ...]:
        return (self._held, self._waiting, self._acquisitions, self._contended,
                self._timeouts, self._deadlocks)

    # -- seeing contention (lockmgr._observe) ---------------------------------------------------

    @property
    def log_waits_after(self) -> float | None:
        """Seconds after which a waiting request logs a WARNING (None: never)."""
        return None if self._log_after < 0 else self._log_after

    def snapshot(self) -> list[KeyState]:
        """Every key held or waited on, with its holders and its queue, at one instant.
        Raises nothing."""
        now, raw = _section(self._snapshot_section)
        return build_snapshot(raw, now)

    def _snapshot_section(self) -> tuple[float, list[Any]]:
        raw = []
        for first in self._table.values():
            entry: _Entry | None = first
            while entry is not None:
                if entry.owner is not None or entry.readers or entry.queue:
                    raw.append(_entry_state(entry))
                entry = entry.same_hash
        return time.monotonic(), raw

    def metrics(self) -> LockMetrics:
        """The ``stats()`` counters, wait- and hold-time histograms and the hot keys, read
        at one instant. Raises nothing."""
        return build_metrics(*_section(self._metrics_section))

    def _metrics_section(self) -> tuple[Any, ...]:
        hot = [(key, waited, error) for key, waited, error in self._hot]
        return self._stats_section(), _histogram_copy(self._waits), _histogram_copy(self._holds), hot

    def release_all(self) -> int:
        """Release every key of this manager the calling thread holds, all levels; returns how many.

        Levels that a waiting ``acquire_many`` of this thread took (only code running inside
        that wait can see them) stay until that call ends. Raises nothing.
        """
        token = _existing_token()
        return 0 if token is None else len(_section(self._release_held_section, token))

    # -- a forked child (the fork hooks in lockmgr._pure._runtime) ----------------------------

    def _keep_only(self, survivor: _Token | None) -> None:
        """In a forked child (see _after_fork_in_child): only ``survivor`` lives on."""
        entries = []
        for first in list(self._table.values()):
            entry: _Entry | None = first
            while entry is not None:
                entries.append(entry)
                entry = entry.same_hash
        self._waiting = 0
        for entry in entries:
            for request in entry.queue:
                if request.token is not survivor:
                    request.token.request = None
                    (request.lead or request).state = _LEFT  # a task's wait sees it ended
            entry.queue = deque(request for request in entry.queue if request.token is survivor)
            if entry.owner is not None and entry.owner is not survivor:
                self._disown(entry)
            for reader in [reader for reader in entry.readers if reader is not survivor]:
                self._drop_read(entry, reader)
        kept = None if survivor is None else survivor.request
        if kept is not None and kept.manager is self and kept.state in (_WAITING, _WOKEN):
            self._waiting = 1
        for entry in entries:
            # Nothing is passed on here: the kept request (the only one left) takes what
            # became free itself when it wakes next (_ready_by_itself), as in the core.
            if entry.owner is None and not entry.readers and not entry.queue:
                self._drop_entry(entry)
