"""``xact_lock`` beside the managers' session locks: one owner must never wait for itself.

A thread's or task's session locks live on its session's connection, its ``xact_lock`` keys
in the transaction of a connection of the caller's: two server sessions. Either one asking
for a key the other holds in a conflicting mode would wait for the owner itself, for ever.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus

from .._args import READ, WRITE
from .._errors import DeadlockError, timed_out
from .._owners import current_task_or_none
from ._session import _keep_open, _owner_kind, _xact_deadlock, _xact_question, _XactLock
from ._sql import _OWN_TRANSACTION, _milliseconds

if TYPE_CHECKING:
    from ._aio_link import _TaskSession
    from ._engine import _PgEngine
    from ._session import _Session


def refuse_own_session_lock(manager: _PgEngine[Any], key: Hashable, shared: bool) -> None:
    """``xact_lock`` runs on the caller's connection, another server session than the
    calling thread's or task's: a session lock of that owner's on ``key`` in a
    conflicting mode would make it wait for itself for ever (a task: its loop's thread
    blocked in xact_lock, the task never runs to release it)."""
    holders: list[tuple[_Session | _TaskSession, Hashable]] = []
    session = manager._session_or_none()
    if session is not None:
        manager._settle(session)
        holders.append((session, threading.get_ident()))
    task = current_task_or_none()
    tasks = None if task is None else manager._tasks
    if task is not None and tasks is not None:
        task_session = tasks.sessions.get(task)
        if task_session is not None:
            tasks.check(task_session)  # what needs no waiting
            holders.append((task_session, task))
    modes = (WRITE,) if shared else (WRITE, READ)
    for holder, owner in holders:
        if any(holder.levels.get((key, mode)) for mode in modes):
            raise DeadlockError(
                f"the calling {_owner_kind(owner)} holds {key!r} through this manager:"
                " xact_lock on another connection would wait for that lock, and so for"
                " itself, for ever", [(owner, key)])

def note_xact_lock(manager: _PgEngine[Any], conn: psycopg.Connection[Any], ident: int,
                   shared: bool, transaction: str) -> None:
    """Remember an xact_lock taken in ``conn``'s ``transaction`` (its virtual
    transaction id: ``_OWN_TRANSACTION``) (``xact_conflicts``), for the calling
    thread, and for the calling task if any:
    the thread blocked in a session lock would wait for that transaction whichever
    of its tasks took it, a task only for its own. Records of ended transactions go:
    a list holds at most the keys of the transactions still open."""
    record = _XactLock(weakref.ref(conn), conn.info.backend_pid, transaction, ident, shared)
    thread_records: list[_XactLock] | None = getattr(manager._local, "xact_locks", None)
    if thread_records is None:
        thread_records = manager._local.xact_locks = []
    manager._lookout.note_xact_locks(thread_records)  # (again: a fork made a new lookout)
    _keep_open(thread_records, record)
    task = current_task_or_none()
    if task is not None:
        with manager._guard:  # (the tasks of every loop share it)
            task_records = manager._task_xact_locks.setdefault(task, [])
        _keep_open(task_records, record)

def refuse_own_xact_lock(manager: _PgEngine[Any], items: Sequence[tuple[Hashable, int]]) -> None:
    """The other order of ``refuse_own_session_lock``, for the calling thread: the
    server says whether a transaction it took one of ``items`` in with xact_lock still
    holds it (one round trip, only for such a key; ``xact_conflicts``)."""
    records: list[_XactLock] | None = getattr(manager._local, "xact_locks", None)
    if not records:
        return  # (the usual: no xact_lock taken)
    for key, record in xact_conflicts(manager, records, items):
        if manager._ask(_xact_question(record)):
            raise _xact_deadlock(threading.get_ident(), key)

def xact_conflicts(manager: _PgEngine[Any], records: list[_XactLock] | None,
                   items: Sequence[tuple[Hashable, int]]) -> Iterator[tuple[Hashable, _XactLock]]:
    """Of an owner's xact_lock ``records``, those of ``items`` in a conflicting mode
    whose transaction may still be open: a session lock of that key would wait for
    that transaction, and so for itself, if it still holds it."""
    if not records:
        return
    records[:] = [record for record in records if record.may_hold()]
    for key, mode in items:
        ident = manager.advisory_key(key)
        for record in records:
            if record.ident == ident and (mode == WRITE or not record.shared):
                yield key, record


def wait_in_transaction(manager: _PgEngine[Any], conn: psycopg.Connection[Any], key: Hashable,
                        ident: int, kind: str, seconds: float) -> Any:
    """``xact_lock``'s wait (``seconds``: -1 for ever) for ``key`` (advisory ``ident``) in
    ``conn``'s open transaction, under savepoints so that a timeout leaves it intact, seen
    by the looks meanwhile: the row of the lock's statement (its transaction: the second
    column)."""
    deadline = None if seconds < 0 else time.monotonic() + seconds
    previous = conn.execute(
        "SELECT pg_catalog.current_setting('lock_timeout')").fetchone()
    waiting = manager._lookout.xact_waiting(conn)
    try:
        while True:
            left = 0 if deadline is None else _milliseconds(deadline - time.monotonic())
            try:
                with conn.transaction():  # a savepoint: a timeout leaves the caller's intact
                    conn.execute(f"SET LOCAL lock_timeout = {left}")
                    row = conn.execute(
                        f"SELECT pg_catalog.pg_advisory_xact_lock{kind}(%s),"
                        f" {_OWN_TRANSACTION}", (ident,)).fetchone()
                break
            except pg_errors.LockNotAvailable:
                # lock_timeout's ceiling (about 24.8 days) is below threading's
                if deadline is None or deadline - time.monotonic() <= 0:
                    raise timed_out(key, seconds) from None
    except pg_errors.DeadlockDetected as error:
        raise DeadlockError(f"PostgreSQL: {error}", []) from None
    finally:
        manager._lookout.xact_waited(waiting)
        if previous and conn.info.transaction_status == TransactionStatus.INTRANS:
            conn.execute("SELECT pg_catalog.set_config('lock_timeout', %s, true)",
                         (previous[0],))
    return row
