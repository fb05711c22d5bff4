"""The pure twin's table (the compiled core's ``_c/table.pxi``): finding, adding and dropping
entries, their holders, and what the contended path measures inside sections.

``_Table`` is the bottom of ``_Engine`` (``lockmgr._pure._engine``): each concern's methods
are a class over the one below it, ``_Table`` < ``_Operations`` < ``_Tasks`` < ``_Engine``.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, final

from .._args import Stripe, slot_limit, stripe_index
from .._observe import (
    HISTOGRAM_BOUNDS,
    HOT_KEY_SLOTS,
    bucket_of,
    build_snapshot,
    log_slow_wait,
    log_wait_end,
)
from ._state import (
    _DROP_ROOM,
    R,
    _READ,
    _WRITE,
    _Entry,
    _Request,
    _TaskToken,
    _Token,
    _get_ident,
    _is_plain,
    _mutex,
    _retired,
    _section,
)

if TYPE_CHECKING:
    from ._engine import _Engine


# -- what the contended path measures (lockmgr._observe), inside sections ------------------------

def _entry_state(entry: _Entry) -> tuple[Any, ...]:
    """An entry as lockmgr._observe.build_snapshot takes it: the writer, then the readers
    oldest first, then the queue."""
    holders = []
    if entry.owner is not None:
        holders.append((entry.owner.ident, type(entry.owner) is _TaskToken, _WRITE, entry.count,
                        entry.since))
    read_since = entry.read_since or {}
    for token, level in entry.readers.items():
        holders.append((token.ident, type(token) is _TaskToken, _READ, level,
                        read_since.get(token, 0.0)))
    waiters = [(request.token.ident, type(request.token) is _TaskToken, request.mode,
                (request.lead or request).since) for request in entry.queue]
    return entry.key, holders, waiters


def _place_in(queue: deque[_Request], request: _Request) -> int:
    """How many requests are ahead of ``request`` in ``queue`` (all of them if it left)."""
    for place, queued in enumerate(queue):
        if queued is request:
            return place
    return len(queue)


_LONG_LONG = range(-(1 << 63), 1 << 63)


def _equal_without_code(a: object, b: object, depth: int = 0) -> bool:
    """Whether the core's lockmgr_key_equal would call ``a`` and ``b`` equal: exact str,
    bytes, ints of a long long and tuples of them (nested less than 16 deep). The hot-key
    summary matches keys this way on both engines."""
    return _compared_in_c(a, b, depth) == 1


def _compared_in_c(a: object, b: object, depth: int) -> int:
    """1 equal, 0 unequal, -1 unknown, as lockmgr_key_equal_at answers."""
    if a is b:
        return 1
    kind = type(a)
    exact = (str, bytes, int, tuple)
    if kind is not type(b):
        return 0 if kind in exact and type(b) in exact else -1
    if kind is str or kind is bytes:
        return int(a == b)
    if kind is int:
        return int(a == b) if a in _LONG_LONG and b in _LONG_LONG else -1
    if kind is tuple and depth < 16:
        if len(a) != len(b):  # type: ignore[arg-type]
            return 0
        unknown = False
        for x, y in zip(a, b):  # type: ignore[call-overload]
            item = _compared_in_c(x, y, depth + 1)
            if item == 0:
                return -1 if unknown else 0
            unknown = unknown or item < 0
        return -1 if unknown else 1
    return -1


def _time_grant(entry: _Entry, request: _Request) -> None:
    """A request that waited was granted: its hold is timed from now, unless it re-entered
    a hold timed already."""
    if request.mode == _WRITE:
        if not entry.since:
            entry.since = time.monotonic()
        return
    if entry.read_since is None:
        entry.read_since = {}
    entry.read_since.setdefault(request.token, time.monotonic())


def _time_holds(entry: _Entry, since: float) -> None:
    """A request queued on ``entry`` at ``since``: holds not timed yet are timed from then."""
    if entry.owner is not None and not entry.since:
        entry.since = since
    if entry.readers:
        if entry.read_since is None:
            entry.read_since = {}
        for token in entry.readers:
            entry.read_since.setdefault(token, since)


def _new_histogram() -> list[Any]:
    return [[0] * (len(HISTOGRAM_BOUNDS) + 1), 0, 0.0, 0.0]


def _count_in(histogram: list[Any], seconds: float) -> None:
    histogram[0][bucket_of(seconds)] += 1
    histogram[1] += 1
    histogram[2] += seconds
    if seconds > histogram[3]:
        histogram[3] = seconds


def _histogram_copy(histogram: list[Any]) -> tuple[Any, ...]:
    return tuple(histogram[0]), histogram[1], histogram[2], histogram[3]


@final
class _Unsure:
    """A section's verdict: these entries' keys hash like the caller's and must be compared
    with it outside the section. ``first`` was their chain's first entry then: entries join
    a chain at its front, so while it still is, no entry joined since the comparison."""

    __slots__ = ("entries", "first")

    def __init__(self, first: _Entry, entries: list[_Entry]) -> None:
        self.first = first
        self.entries = entries

    def settle(self, key: Hashable) -> tuple[_Entry, _Entry | None]:
        """Compare (may run the keys' ``__eq__``): what the next section may trust."""
        for entry in self.entries:
            if entry.key == key:  # the stored key first, as a dict compares
                return self.first, entry
        return self.first, None


class _Table:
    """The table and what it keeps: a manager's entries and their holders, its counters
    and what the contended path measures (the bottom of ``_Engine``, see ``_engine``)."""

    __slots__ = (
        "_acquisitions",
        "_contended",
        "_counts_slots",
        "_deadlocks",
        "_fair",
        "_held",
        "_holds",
        "_hot",
        "_limit_of",
        "_log_after",
        "_observers",
        "_ref",
        "_slot_limit",
        "_stripe_keys",
        "_table",
        "_timeouts",
        "_waiting",
        "_waits",
        "__weakref__",
    )

    # Set by _Engine.__init__ (lockmgr._pure._engine), which makes every manager.
    _log_after: float
    _observers: tuple[Callable[[float], object], ...]
    _stripe_keys: tuple[Stripe, ...] | None
    _fair: bool
    _slot_limit: int  # a SemaphoreManager's limit per key (0: none, or ``_limit_of``'s)
    _limit_of: Callable[[Any], int] | None  # a SemaphoreManager's limit(key)
    _counts_slots: bool  # a SemaphoreManager's: each acquire takes one more slot (no re-entry)
    _table: dict[int, _Entry]
    _held: int
    _waiting: int
    _acquisitions: int
    _contended: int
    _timeouts: int
    _deadlocks: int
    _waits: list[Any]
    _holds: list[Any]
    _hot: list[list[Any]]
    _ref: weakref.ref[_Engine]

    def __del__(self) -> None:
        # Nobody waits here (a waiter's call keeps the manager alive), but keys may be held.
        # __init__ may have failed. A collection that runs inside a section of this thread
        # cannot take the mutex: the tokens then keep dead references until their thread
        # ends (they skip managers that are gone).
        if _mutex is None:  # a late finalization cleared this module: nothing runs a table now
            return
        if getattr(self, "_table", None) and _mutex.get(0) != _get_ident():
            _section(self._unlink_section)

    def _unlink_section(self) -> None:
        for first in self._table.values():
            entry: _Entry | None = first
            while entry is not None:
                if entry.owner is not None:
                    entry.owner.held.pop(entry, None)
                for reader in entry.readers:
                    reader.reads.pop(entry, None)
                _retired.append(entry)
                entry = entry.same_hash
        self._table.clear()

    def _table_key(self, key: Hashable) -> Hashable:
        """The key the table uses for ``key``: the key itself, or its stripe."""
        if self._stripe_keys is None:
            hash(key)  # an unhashable key fails here, as on the exact path
            return key
        return self._stripe_keys[stripe_index(hash(key), len(self._stripe_keys))]

    # -- seeing contention (lockmgr._observe) ---------------------------------------------------

    def _record_wait(self, request: _Request, granted: bool) -> None:
        """A wait ended (in its section): measure it, and charge it to the keys it queued on."""
        waited = max(request.ended - request.since, 0.0)
        if granted:
            _count_in(self._waits, waited)
        evicted = 0
        for node in request.members():
            if node.queued:
                evicted += self._charge(node.entry, waited, evicted < _DROP_ROOM)

    def _charge(self, entry: _Entry, waited: float, may_evict: bool) -> bool:
        """Space-Saving: add ``waited`` to the key's slot, or take a free slot, or replace
        the least-charged key (whose charge becomes this slot's error); True if it evicted
        one. Slots match by identity, or by value where comparing runs no Python code."""
        key = entry.key
        for slot in self._hot:
            if slot[0] is key or _equal_without_code(slot[0], key):
                slot[1] += waited
                return False
        if len(self._hot) < HOT_KEY_SLOTS:
            self._hot.append([key, waited, 0.0])
            return False
        if not may_evict:
            return False
        least = self._hot[0]
        for slot in self._hot:
            if slot[1] < least[1]:
                least = slot
        _retired.append(least[0])  # its reference goes after the section
        least[0], least[2] = key, least[1]
        least[1] += waited
        return True

    def _count_hold(self, since: float, entry: _Entry) -> None:
        """A timed hold ends: count it if someone waits for the key."""
        if since and entry.queue:
            _count_in(self._holds, max(time.monotonic() - since, 0.0))

    def _describe_wait(self, request: _Request) -> tuple[float, list[Any], list[int]]:
        """For the slow-wait log: the state of every key ``request`` queued on, and how many
        requests are ahead of it in each queue."""
        return _section(self._describe_wait_section, request)

    def _describe_wait_section(self, request: _Request) -> tuple[float, list[Any], list[int]]:
        raw, ahead = [], []
        for node in request.members():
            if node.queued:
                raw.append(_entry_state(node.entry))
                ahead.append(_place_in(node.entry.queue, node))
        return time.monotonic(), raw, ahead

    def _log_slow_wait(self, request: _Request) -> None:
        now, raw, ahead = self._describe_wait(request)
        log_slow_wait(request.token.ident, max(now - request.since, 0.0),
                      build_snapshot(raw, now), ahead)

    def _add_wait_observer(self, observer: Callable[[float], object]) -> None:
        """Call ``observer(seconds)`` after every wait that was granted (lockmgr.otel), in
        the waiting thread or task, before its acquisition returns; what it raises ends the
        acquisition (the key is given back)."""
        self._observers += (observer,)

    def _remove_wait_observer(self, observer: Callable[[float], object]) -> None:
        self._observers = tuple(other for other in self._observers if other is not observer)

    def _observe_wait(self, request: _Request) -> None:
        waited = max(request.ended - request.since, 0.0)
        for observer in self._observers:
            observer(waited)

    def _log_wait_end(self, request: _Request, granted: bool) -> None:
        keys = [node.entry.key for node in request.members() if node.queued]
        log_wait_end(request.token.ident, keys, max(request.ended - request.since, 0.0),
                     granted)

    # -- finding entries ---------------------------------------------------------------------

    def _find(
        self, key: Hashable, key_hash: int, plain: bool, known: tuple[_Entry, _Entry | None] | None
    ) -> _Entry | _Unsure | None:
        """In a section: the entry of ``key``, None, or the entries to compare it with
        (``known``: the outcome of that comparison, trusted if it is still current)."""
        first = self._table.get(key_hash)
        trusted = known is not None and known[0] is first
        unsure = None
        entry = first
        while entry is not None:
            stored = entry.key
            if stored is key or (plain and entry.plain and stored == key):
                return entry
            if not (plain and entry.plain):
                if trusted:
                    if entry is known[1]:  # type: ignore[index]
                        return entry
                elif unsure is None:
                    unsure = [entry]
                else:
                    unsure.append(entry)
            entry = entry.same_hash
        return None if unsure is None else _Unsure(first, unsure)  # type: ignore[arg-type]

    def _refuse_own_wait(self, key: Hashable, token: _Token, seconds: float) -> object:
        """A semaphore's key whose every slot ``token`` holds: only its own release could
        give it one more, so a try gives up (False) and a wait is refused as the cycle of
        one step it would be, nothing changed (the core's ``refuse_own_wait``)."""
        if seconds == 0:
            self._timeouts += 1
            return False
        self._deadlocks += 1
        return key, [(token.ident, key)]

    def _refuse_own_waits(self, items: list[tuple[Hashable, int]],
                          entries: list[_Entry | None], token: _Token,
                          seconds: float) -> object:
        """``_refuse_own_wait`` for the first key of a set whose every slot ``token`` holds:
        False (a try) or ``(its index, the cycle)``; None: no such key."""
        for index, ((key, mode), entry) in enumerate(zip(items, entries, strict=True)):
            if entry is not None and (
                    (mode == _WRITE and entry.owner is token and self._counts_slots)
                    or (mode == _READ and _holds_every_slot(entry, token))):
                refused = self._refuse_own_wait(key, token, seconds)
                return refused if refused is False else (index, [(token.ident, key)])
        return None

    def _limit_for(self, key: Hashable) -> int:
        """Outside sections: the limit a semaphore's ``key`` gets if it enters the table now,
        from the manager's ``limit(key)`` (checked: ValueError/TypeError, nothing changed);
        0: the table's own (``_slot_limit``)."""
        if self._limit_of is None:
            return 0
        return slot_limit(self._limit_of(key), key, computed=True)

    def _new_entry(self, key: Hashable, key_hash: int, plain: bool, limit: int = 0) -> _Entry:
        entry = _Entry(key, key_hash, plain)
        entry.limit = limit or self._slot_limit
        entry.same_hash = self._table.get(key_hash)
        self._table[key_hash] = entry
        return entry

    def _drop_entry(self, entry: _Entry) -> None:
        """Unlink ``entry`` from its chain, unless it is gone already (a request whose grant
        is undone may find its entry released and dropped by a handler meanwhile)."""
        table = self._table
        first = table.get(entry.hash)
        if first is entry:
            if entry.same_hash is None:
                del table[entry.hash]
                if not table:
                    table.clear()  # dicts never shrink on delete; this frees a grown one
            else:
                table[entry.hash] = entry.same_hash
        else:
            while first is not None and first.same_hash is not entry:
                first = first.same_hash
            if first is None:
                return
            first.same_hash = entry.same_hash
        _retired.append(entry)

    def _run_on_key(self, run: Callable[..., R], key: Hashable, *args: Any) -> R:
        """``run(entry, *args)`` in a section, with ``key``'s entry (or None) found for it."""
        key_hash = hash(key)
        kind = type(key)
        plain = kind is str or kind is int or kind is bytes or _is_plain(key)
        known = None
        on_key: Callable[..., R | _Unsure] = self._on_key_section
        while True:
            verdict = _section(on_key, run, key, key_hash, plain, known, args)
            if type(verdict) is not _Unsure:
                return verdict
            known = verdict.settle(key)

    def _on_key_section(
        self, run: Callable[..., R], key: Hashable, key_hash: int, plain: bool,
        known: tuple[_Entry, _Entry | None] | None, args: tuple[Any, ...],
    ) -> R | _Unsure:
        entry: _Entry | _Unsure | None = self._table.get(key_hash)
        if entry is not None and entry.key is not key:  # type: ignore[union-attr]
            entry = self._find(key, key_hash, plain, known)  # else: the common cases, at once
            if isinstance(entry, _Unsure):
                return entry
        return run(entry, key, key_hash, plain, *args)

    # -- holders -----------------------------------------------------------------------------

    def _own(self, entry: _Entry, token: _Token, count: int) -> None:
        """An immediate write acquisition."""
        if entry.queue:  # past a queue (an upgrade, a barge with fair=False): timed
            entry.since = time.monotonic()
        if not entry.readers:
            self._held += 1
        entry.owner = token
        entry.count = count
        token.held[entry] = self._ref
        self._acquisitions += 1

    def _own_levels(self, entry: _Entry, token: _Token, count: int) -> None:
        if entry.queue:
            entry.since = time.monotonic()
        if not entry.readers:
            self._held += 1
        entry.owner = token
        entry.count = count
        token.held[entry] = self._ref

    # In these two, the call that frees a grown dict comes last: a signal handler raising at
    # the check point after it (see "Asynchronous exceptions") finds the hold fully undone.

    def _disown(self, entry: _Entry) -> None:
        owner = entry.owner
        assert owner is not None
        del owner.held[entry]
        since, entry.since = entry.since, 0.0
        entry.owner = None
        entry.count = 0
        if not entry.readers:
            self._held -= 1
        self._count_hold(since, entry)
        if not owner.held:
            owner.held.clear()  # dicts never shrink on delete; this frees a grown one

    def _add_read(self, entry: _Entry, token: _Token, count: int) -> None:
        """A new read hold; the caller counts the acquisition."""
        if entry.owner is None and not entry.readers:
            self._held += 1
        entry.readers[token] = count
        entry.slots += count
        token.reads[entry] = self._ref
        if entry.queue:  # past a queue (a writer's re-entry, a downgrade): timed
            if entry.read_since is None:
                entry.read_since = {}
            entry.read_since[token] = time.monotonic()

    def _read(self, entry: _Entry, token: _Token, count: int) -> None:
        """``count`` read levels more: a new read hold, or on top of ``token``'s own."""
        if token in entry.readers:
            _read_more(entry, token, count)
        else:
            self._add_read(entry, token, count)

    def _drop_read(self, entry: _Entry, token: _Token) -> None:
        entry.slots -= entry.readers.pop(token)
        del token.reads[entry]
        if entry.owner is None and not entry.readers:
            self._held -= 1
        if entry.read_since is not None:
            self._count_hold(entry.read_since.pop(token, 0.0), entry)
        if not token.reads:
            token.reads.clear()  # dicts never shrink on delete; this frees a grown one


def _has_slot(entry: _Entry) -> bool:
    """Whether ``entry`` admits one more read level: a semaphore's key with a free slot."""
    return not entry.limit or entry.slots < entry.limit


def _read_more(entry: _Entry, token: _Token, count: int) -> None:
    """``count`` more read levels for a reader of ``entry`` (a semaphore's: more slots)."""
    entry.readers[token] += count
    entry.slots += count


def _holds_every_slot(entry: _Entry, token: _Token) -> bool:
    """Whether ``token`` holds every slot of a semaphore's ``entry`` (only its own release
    could give it one more)."""
    return bool(entry.limit) and not _has_slot(entry) and entry.readers.get(token) == entry.slots


# Questions about one entry (or None), asked inside a section by ``_Engine._run_on_key``.

def _levels_of(entry: _Entry | None, key: object, key_hash: int, plain: bool,
               token: _Token | None) -> tuple[int, int]:
    if entry is None or token is None:
        return 0, 0
    return entry.count if entry.owner is token else 0, entry.readers.get(token, 0)


def _written(entry: _Entry | None, *_: object) -> bool:
    return entry is not None and entry.owner is not None


def _has_holder(entry: _Entry | None, *_: object) -> bool:
    return entry is not None and (entry.owner is not None or bool(entry.readers))


def _written_by(entry: _Entry | None, key: object, key_hash: int, plain: bool,
                token: _Token | None) -> bool:
    return entry is not None and token is not None and entry.owner is token


def _write_level(entry: _Entry | None, key: object, key_hash: int, plain: bool,
                 token: _Token | None) -> int:
    return entry.count if entry is not None and token is not None and entry.owner is token else 0


def _read_level(entry: _Entry | None, key: object, key_hash: int, plain: bool,
                token: _Token | None) -> int:
    return 0 if entry is None or token is None else entry.readers.get(token, 0)


def _holders_and_limit(entry: _Entry | None, *_: object) -> tuple[int, int]:
    return (0, 0) if entry is None else (entry.slots, entry.limit)


def _reader_count(entry: _Entry | None, *_: object) -> int:
    return 0 if entry is None else len(entry.readers)


def _owner_and_count(entry: _Entry | None, *_: object) -> tuple[int | None, int]:
    if entry is None or entry.owner is None:
        return None, 0
    return entry.owner.ident, entry.count
