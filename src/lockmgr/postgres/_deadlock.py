"""Deadlocks through both layers.

A thread of this process waits *in process* for a key another owner here holds (a thread or
a task); that owner, or one it waits for in turn, waits *on the server* for another process,
which waits, perhaps through more processes, for a lock held on a connection of the first
thread. The in-process engine sees only the waits between this process's owners,
PostgreSQL's detector only the waits of connections: neither sees the whole cycle, and
without a timeout every member would wait for ever.

So a thread or task that has waited in process for ``LOOK_EVERY`` seconds looks for that
cycle (its wait check: ``lockmgr._owners.WAIT_CHECK``, ``TASK_WAIT_CHECK``), and again every
``LOOK_EVERY`` seconds while it waits. One round trip does it (``look_sql``), on a
connection the wait borrows for its looks and closes when it ends:

- It *publishes* the waiter's own in-process waits, as pairs of backend pids (its
  connections', those of the owners it waits for), for the looks of other processes: each
  pair is a shared advisory lock of two int keys, ``(PUBLISHED + waiter's pid, the other
  pid)``, held by that connection. The looks' connection closing takes them back.
- It *asks*: from the connections of the owners the waiter waits for (in process, directly
  or not), following ``pg_blocking_pids`` on the server, the in-process waits of this
  process (handed over as pairs) and those every process published, to a fixed point, is a
  connection of the waiter's own reached?

A member of any such cycle that waits in process finds it within ``LOOK_EVERY`` seconds of
the cycle closing and of the other processes' members having published their waits (their
first look), plus a round trip: the cycle's first in-process wait after a server wait
that leads into its process has its waiter's connection at the end of the path. The
question is asked again to confirm (``SEEN_TWICE``).

What this does not see: an owner's wait in process of another engine than the PostgreSQL
managers' (a plain ``LockManager``), and the waits of a backend whose pid is not below
``PUBLISHABLE_PIDS`` (Linux's highest). Give such calls a timeout.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import DeadlockError

if TYPE_CHECKING:
    from .._observe import KeyState
    from ._engine import _PgEngine
    from ._link import _Link
    from ._session import _XactLock

#: Seconds of waiting in process before a thread first looks for a cycle through the server,
#: and between two looks (PostgreSQL's ``deadlock_timeout`` is 1 s by default).
LOOK_EVERY = 0.5

#: Seconds one question may take before the wait goes on without its answer.
LOOK_FOR = 1.0

#: How many questions in a row must find the cycle. Each one puts together the waits in
#: process as they were a moment before it and the server's as they are: an owner of this
#: process that moved on in between could make a cycle of waits that never were all there
#: at once. A deadlock stays; such a picture does not come twice.
SEEN_TWICE = 2

#: The first of the two int advisory keys that publish a wait in process is this plus the
#: waiter's backend pid (below ``PUBLISHABLE_PIDS``); lockmgr takes such keys shared only.
PUBLISHED = 0x6C000000
PUBLISHABLE_PIDS = 0x400000

Owner = Hashable  # a thread's ident or an asyncio task, as ``snapshot()`` names them


class Look:
    """One wait's looks: what it waits for, when the next look is due, and the connection
    that asks and publishes (borrowed at the first look; closed when the wait ends, which
    takes back what it published)."""

    __slots__ = ("due", "items", "link")

    def __init__(self, items: Sequence[tuple[Hashable, int]]) -> None:
        self.items = items
        self.due = time.monotonic() + LOOK_EVERY
        self.link: _Link | None = None

    def stop(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            link.close()


def waits_in_process(states: Iterable[KeyState]) -> dict[Owner, set[Owner]]:
    """Who waits for whom in process, from engines' ``snapshot()``: a waiter waits for the
    key's holders and for the requests queued ahead of it (they are served first), those
    whose mode conflicts with its own (a read waits for no read)."""
    waits: dict[Owner, set[Owner]] = {}
    for state in states:
        ahead = [(holder.owner, holder.mode) for holder in state.holders]
        for waiter in state.waiters:
            waits.setdefault(waiter.owner, set()).update(
                owner for owner, mode in ahead
                if owner != waiter.owner and "write" in (mode, waiter.mode))
            ahead.append((waiter.owner, waiter.mode))
    return waits


def reached(waits: dict[Owner, set[Owner]], start: Owner) -> set[Owner]:
    """The owners ``start`` waits for in process, directly or through others."""
    seen: set[Owner] = set()
    todo = list(waits.get(start, ()))
    while todo:
        owner = todo.pop()
        if owner not in seen:
            seen.add(owner)
            todo.extend(waits.get(owner, ()))
    seen.discard(start)
    return seen


def look_sql(waiter: Owner, waits: dict[Owner, set[Owner]],
             backends: dict[Owner, set[int]]) -> str | None:
    """What one look sends (``backends``: each owner's connections' backend pids): the
    waiter's waits published anew, and the question whose answer (the last result) is
    whether it is in a cycle through the server. None when it cannot be (it waits in
    process for no owner with a connection, or has none itself): nothing to publish."""
    mine = backends.get(waiter, set())
    start = {pid for owner in reached(waits, waiter) for pid in backends.get(owner, ())}
    if not mine or not start:
        return None
    published = sorted((PUBLISHED + pid, other) for pid in mine if pid < PUBLISHABLE_PIDS
                       for other in start)
    publish = "SELECT pg_advisory_unlock_all();" + (
        " SELECT pg_try_advisory_lock_shared(waiter, holder) FROM (VALUES "
        + ", ".join(f"({int(p)}, {int(q)})" for p, q in published) + ") AS wait(waiter, holder);"
        if published else "")
    # The in-process waits as pairs of connections: an owner without one passes the waits
    # of those it waits for on to its own waiters (``reached``).
    pairs = sorted({(pid, other) for owner, pids in backends.items() if owner in waits
                    for ahead in reached(waits, owner) for other in backends.get(ahead, ())
                    for pid in pids})
    return publish + (
        " WITH RECURSIVE here(waiter, holder) AS ("
        f"SELECT * FROM unnest({_ints(p for p, _ in pairs)}, {_ints(q for _, q in pairs)})"
        f" UNION SELECT (classid::bigint - {PUBLISHED})::int, objid::int FROM pg_locks"
        " WHERE locktype = 'advisory' AND objsubid = 2 AND granted"
        f" AND classid::bigint >= {PUBLISHED}"
        f" AND classid::bigint < {PUBLISHED + PUBLISHABLE_PIDS}),"
        f" reach(pid) AS (SELECT unnest({_ints(sorted(start))}) UNION"
        " SELECT next FROM reach, LATERAL (SELECT unnest(pg_blocking_pids(reach.pid))"
        " UNION ALL SELECT holder FROM here WHERE here.waiter = reach.pid) AS step(next))"
        f" SELECT EXISTS (SELECT 1 FROM reach WHERE pid = ANY ({_ints(sorted(mine))}))")


def _ints(values: Iterable[int]) -> str:
    return "ARRAY[" + ",".join(str(int(value)) for value in values) + "]::int[]"


def deadlock_through_server(owner: Owner, items: Sequence[tuple[Hashable, int]]) -> DeadlockError:
    """The error that ends ``owner``'s wait in process for ``items``: it is in a cycle."""
    keys = [key for key, _ in items]
    what = f"key {keys[0]!r}" if len(keys) == 1 else f"keys {keys!r}"
    return DeadlockError(
        f"waiting for {what} would deadlock through PostgreSQL: an owner of this process"
        " that this one waits for waits, on the server or through others, for a lock this"
        " one holds", [(owner, keys[0])])


# -- the managers of this process --------------------------------------------------------------

# Every PostgreSQL manager of the process, made whole (the looks and the at-fork hook walk
# them), by weak reference: a list changed and read under _MANAGERS_LOCK only. No callback
# changes it (a WeakSet's removal callbacks run in whichever thread drops a manager, and
# race a copy on a free-threaded build); references to collected managers go at the next
# add or read.
_MANAGERS: list[weakref.ref[_PgEngine[Any]]] = []
_MANAGERS_LOCK = threading.Lock()


def live_managers() -> list[_PgEngine[Any]]:
    with _MANAGERS_LOCK:
        found = [(ref, ref()) for ref in _MANAGERS]
        _MANAGERS[:] = [ref for ref, manager in found if manager is not None]
    return [manager for _, manager in found if manager is not None]


def register(manager: _PgEngine[Any]) -> None:
    with _MANAGERS_LOCK:
        _MANAGERS[:] = [ref for ref in _MANAGERS if ref() is not None] + [weakref.ref(manager)]


def managers_after_fork() -> list[_PgEngine[Any]]:
    """In a forked child: the managers, with the lock made anew (another thread of the
    parent may have held it)."""
    global _MANAGERS_LOCK
    _MANAGERS_LOCK = threading.Lock()
    return live_managers()


def process_look_sql(manager: _PgEngine[Any], owner: Owner) -> str | None:
    """``look_sql`` for ``owner`` (the calling thread's ident or task), from the waits in
    process and the connections of every PostgreSQL manager of this process on
    ``manager``'s server, and the owner's xact_lock transactions."""
    waits: dict[Owner, set[Owner]] = {}
    backends: dict[Owner, set[int]] = {}
    for other in live_managers():
        if other._dsn != manager._dsn:
            continue  # (another server's backend pids are not this one's)
        for waiter, ahead in waits_in_process(other._engine.snapshot()).items():
            waits.setdefault(waiter, set()).update(ahead)
        for holder, pid in connections_of(other):
            backends.setdefault(holder, set()).add(pid)
        backends.setdefault(owner, set()).update(xact_backends(other, owner))
    return look_sql(owner, waits, backends)


def connections_of(manager: _PgEngine[Any]) -> list[tuple[Owner, int]]:
    """(owner, backend pid) of each connection a thread or task of ``manager`` has."""
    with manager._guard:
        pairs: list[tuple[Owner, int]] = [
            (session.ident, session.link.backend)
            for session in manager._sessions if session.link is not None]
        tasks = manager._tasks
        if tasks is not None:
            pairs += [(task, session.link.backend)
                      for task, session in tasks.sessions.items() if session.link is not None]
    return pairs


def xact_backends(manager: _PgEngine[Any], owner: Owner) -> list[int]:
    """The backend pids of the transactions still open in which ``owner``, the calling
    thread (its ident) or task, took keys with ``manager``'s xact_lock: its locks too."""
    if isinstance(owner, int):
        records: list[_XactLock] = getattr(manager._local, "xact_locks", None) or []
    else:
        with manager._guard:
            records = list(manager._task_xact_locks.get(owner, ()))
    return [record.backend_pid for record in records if record.may_hold()]
