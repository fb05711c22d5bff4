"""What a thread (or a task) holds on its connection: ``_Session``, and the records and
helpers of a holding."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
from psycopg.pq import TransactionStatus

from .._args import READ, WRITE
from .._errors import DeadlockError, LockLost, not_owned
from ._sql import _GRANTED_ADVISORY, _MODE_NAMES

if TYPE_CHECKING:
    from ._engine import _PgEngine
    from ._link import _Link


class _Session:
    """One thread's standing with one manager: the connection it holds keys on, and keys
    lost with an earlier connection that the thread has not yet released."""

    __slots__ = ("dead", "fences", "giving", "ident", "levels", "link", "lost", "parked",
                 "reported", "taking", "unsure")

    def __init__(self) -> None:
        self.ident = threading.get_ident()
        self.link: _Link | None = None
        self.levels: dict[tuple[Hashable, int], int] = {}  # (key, mode) -> levels held on link
        # (key, WRITE) -> the fence it was taken under (fencing managers), while in levels
        self.fences: dict[tuple[Hashable, int], int] = {}
        self.lost: dict[tuple[Hashable, int], int] = {}  # (key, mode) -> levels not yet released
        self.reported: set[Hashable] = set()  # lost keys already given to on_lost
        self.dead = False  # another thread found the link dead; the owner settles it
        # It holds nothing, and keeps ``link`` for its next call, unless another thread
        # takes it first (the manager's ``_parked``, under its ``_guard``).
        self.parked = False
        # (key, mode) pairs a call may hold on the link that no count records: set before a
        # release, or on entering a failed call's clean-up, and cleared once the server has
        # answered (or the link is gone); a clean-up interrupted again leaves them to the
        # owner's next call (_settle), so they are never left held.
        self.unsure: list[tuple[Hashable, int]] = []
        # An acquisition's (levels before, fresh items), from before its round trip until it
        # is counted or undone: an undo that an interrupt kept from running (at its entry)
        # is finished by the owner's next call (_settle).
        self.taking: tuple[dict[tuple[Hashable, int], int], list[tuple[Hashable, int]]] | None = None
        # A release's items until their levels are counted down (``given``): one an
        # interrupt kept from counting down is finished by the owner's next call.
        self.giving: list[tuple[Hashable, int]] | None = None

    def holds_anything(self) -> bool:
        return bool(self.levels or self.lost or self.unsure)

    def forget_levels(self) -> None:
        """The connection's keys are no longer held on it (moved to ``lost``, or released)."""
        self.levels.clear()
        self.fences.clear()

    def lose_levels(self) -> None:
        """The connection is gone: what it held is lost (under the manager's ``_guard``)."""
        for item, levels in self.levels.items():
            self.lost[item] = self.lost.get(item, 0) + levels
        self.forget_levels()
        self.dead = False

    def refuse_lost(self, items: Sequence[tuple[Hashable, int]]) -> None:
        """LockLost for an acquisition of keys still lost (their holder must release them)."""
        if not self.lost:
            return
        lost = sorted({key for key, mode in items if self.lost.get((key, mode))}, key=repr)
        if lost:
            raise _lost_error(lost)

    def granted(self, items: Sequence[tuple[Hashable, int]],
                fences: dict[tuple[Hashable, int], int]) -> None:
        """One more level of each of ``items``; ``fences``: those its fresh keys were taken
        under."""
        self.fences.update(fences)
        for item in items:
            self.levels[item] = self.levels.get(item, 0) + 1

    def undo_take(self, before: dict[tuple[Hashable, int], int],
                  fresh: list[tuple[Hashable, int]]) -> None:
        """A failed or interrupted acquisition: the levels as ``before`` it, and its fresh
        keys ``unsure`` (first, before any check point) until the server has dropped them."""
        if fresh:
            self.unsure = fresh
        for item in fresh:
            self.fences.pop(item, None)
        for item, levels in before.items():
            if item in self.levels:
                self.levels[item] = levels
                if not levels:
                    del self.levels[item]
        self.taking = None

    def given(self, items: Sequence[tuple[Hashable, int]]) -> list[Hashable]:
        """One level of each of ``items`` released (or, if lost, acknowledged); the keys of
        those that had been lost. Works through ``giving`` (``items`` if unset), each item
        counted down and taken off it with no check point in between: an interrupt leaves
        exactly the items still to count, for the owner's next call (``_settle``)."""
        if self.giving is None:
            self.giving = list(items)
        giving = self.giving
        lost = []
        while giving:
            item = giving[-1]
            counts = self.levels if self.levels.get(item) else self.lost
            if counts is self.lost:
                lost.append(item[0])
            left = counts[item] - 1
            if left:
                counts[item] = left
            else:
                del counts[item]
            giving.pop()
            if not left and counts is self.levels:
                self.fences.pop(item, None)  # the last level takes its fence with it
        if self.reported:
            self.reported &= {key for key, _ in self.lost}
        self.giving = None
        return lost


class _ThreadEnd:
    """In the thread's local storage: when the thread ends, its connection closes, which
    ends its session and so releases its PostgreSQL locks at once."""

    __slots__ = ("manager", "pid", "session")

    def __init__(self, manager: _PgEngine[Any]) -> None:
        self.manager = weakref.ref(manager)
        self.pid = os.getpid()
        self.session = _Session()

    def __del__(self) -> None:
        session = getattr(self, "session", None)
        if session is None:  # an interrupt (Ctrl-C) in __init__: no connection yet
            return
        manager = self.manager()
        if self.pid != os.getpid():  # a thread of the parent, cleared in a forked child
            if session.link is not None:
                session.link.close()
        elif manager is not None:
            manager._thread_ended(session)


class _XactLock(NamedTuple):
    """An xact_lock a thread took: in the transaction open on ``conn`` (its backend
    ``backend_pid``) whose virtual transaction id is ``transaction``, the advisory key
    ``ident``, shared or not."""

    conn: weakref.ref[psycopg.Connection[Any]]
    backend_pid: int
    transaction: str
    ident: int
    shared: bool

    def may_hold(self) -> bool:
        """Whether the transaction it was taken in may still be open."""
        conn = self.conn()
        return conn is not None and not conn.closed and conn.info.transaction_status in (
            TransactionStatus.INTRANS, TransactionStatus.INERROR)


def _xact_question(record: _XactLock) -> str:
    """Whether the transaction of ``record`` is still open and holds its lock: its session's
    row of the lock names that transaction (pg_locks, which every role reads whole, gives
    each row its session's open transaction; a session lock of the key taken since, in a
    later transaction, names that one)."""
    pid = int(record.backend_pid)
    transaction = record.transaction.replace("'", "''")  # ("backend/local ids": no quote)
    return (f"SELECT EXISTS (SELECT 1 FROM {_GRANTED_ADVISORY} {record.ident} AND pid = {pid}"
            f" AND mode = '{_MODE_NAMES[READ if record.shared else WRITE]}'"
            f" AND virtualtransaction = '{transaction}')")


def _keep_open(records: list[_XactLock], record: _XactLock) -> None:
    """Add ``record`` to ``records``, dropping those of ended transactions and of earlier
    transactions on its connection."""
    conn = record.conn()
    records[:] = [kept for kept in records if kept.may_hold() and kept != record
                  and (kept.conn() is not conn or kept.transaction == record.transaction)]
    records.append(record)


def _owner_kind(owner: Hashable) -> str:
    """What ``owner`` is: a "thread" (its ident) or a "task"."""
    return "thread" if isinstance(owner, int) else "task"


def _xact_deadlock(owner: Hashable, key: Hashable) -> DeadlockError:
    return DeadlockError(
        f"the calling {_owner_kind(owner)} holds {key!r} with xact_lock in a transaction still open: a"
        " session lock of it would wait for that transaction, and so for itself, for ever",
        [(owner, key)])


def _lost_error(keys: list[Hashable]) -> LockLost:
    return LockLost(f"the lock on {', '.join(map(repr, keys))} was lost with its connection")


def _holding(session: _Session | None, items: Sequence[tuple[Hashable, int]],
             owner: Hashable) -> _Session:
    """The session of a release by ``owner`` (the calling thread's ident, or the current
    task), which must hold (or have lost) each of ``items``: NotOwnedError names it."""
    for key, mode in items:
        if session is None or not (session.levels.get((key, mode)) or session.lost.get((key, mode))):
            raise not_owned(key, owner)
    assert session is not None
    return session


def _same(key: Hashable) -> Hashable:
    """The multi-key argument rules' key mapping: PostgreSQL managers lock keys as given."""
    return key
