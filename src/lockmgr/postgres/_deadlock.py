"""Deadlocks through both layers.

A thread of this process waits *in process* for a key another owner here holds (a thread or
a task); that owner, or one it waits for in turn, waits *on the server* for another process,
which waits, perhaps through more processes, for a lock held on a connection of the first
thread. The in-process engine sees only the waits between this process's owners,
PostgreSQL's detector only the waits of connections: neither sees the whole cycle, and
without a timeout every member would wait for ever.

So a thread or task that has waited in process for ``LOOK_EVERY`` seconds looks for that
cycle (its wait check: ``lockmgr._owners.WAIT_CHECK``, ``TASK_WAIT_CHECK``), and again every
``LOOK_EVERY`` seconds while it waits. One round trip does it (``look_sql``), on its
manager's ``Lookout`` connection:

- It *publishes* the waiter's own in-process waits, as pairs of backend pids (its
  connections', those of the owners it waits for; an owner's connections include the
  transactions it took keys in with xact_lock, while open, and the one it waits in
  xact_lock on: ``xact_backends``), for the looks of other processes: each
  pair is a shared advisory lock of two int keys, ``(PUBLISHED + waiter's pid, the other
  pid)``, held by that connection until the waiter's wait ends; beside them, one more,
  ``(STAMPED, a number new at each publication)``, the publication's stamp.
- It *asks*: from the connections of the owners the waiter waits for (in process, directly
  or not), following ``pg_blocking_pids`` on the server, the in-process waits of this
  process (handed over as pairs) and those other processes published, to a fixed point, is a
  connection of the waiter's own reached?

Which publications a look follows (``cycle_question``): advisory locks need no privilege,
and any session can take keys of the reserved range. So only those of a session of the
manager's own database, logged in as the manager's own role or as one of its
``trusted_roles`` (``pg_stat_activity`` names every session's role to every role), taken
shared as lockmgr takes them, count. And a session can outlive the wait it published: a
lookout whose backend stopped answering is given up by its client, but the server keeps
the session, and its locks, until the backend notices. So a look after the first follows
only the publications of sessions that published anew since the last look answered (their
stamp changed): a session that no longer publishes (given up, or its process gone)
counts for one look at most, never for the two that make a deadlock (``Look``).

A member of any such cycle that waits in process finds it within ``LOOK_EVERY`` seconds of
the cycle closing and of the other processes' members having published their waits (their
first look), plus a round trip: the cycle's first in-process wait after a server wait
that leads into its process has its waiter's connection at the end of the path. The next
look confirms it (``Look``).

What this does not see: an owner's wait in process of another engine than the PostgreSQL
managers' (a plain ``LockManager``), and the waits of a backend whose pid is not below
``PUBLISHABLE_PIDS`` (Linux's highest). Give such calls a timeout.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from .._errors import DeadlockError, LockError
from .._owners import current_task_or_none

if TYPE_CHECKING:
    from .._observe import KeyState
    from ._engine import _PgEngine
    from ._link import _Link
    from ._session import _XactLock

#: Seconds of waiting in process before a thread first looks for a cycle through the server,
#: and between two looks (PostgreSQL's ``deadlock_timeout`` is 1 s by default).
LOOK_EVERY = 0.5

#: Seconds one question may take before the wait goes on without its answer (a timed wait's
#: look gives up at the wait's deadline too, its connect included: ``Look.deadline``).
LOOK_FOR = 1.0


#: The first of the two int advisory keys that publish a wait in process is this plus the
#: waiter's backend pid (below ``PUBLISHABLE_PIDS``); lockmgr takes such keys shared only.
PUBLISHED = 0x6C000000
PUBLISHABLE_PIDS = 0x400000

#: The first int key of a publication's stamp (the second is the stamp, below ``STAMPS``).
STAMPED = PUBLISHED + PUBLISHABLE_PIDS
STAMPS = 1 << 31

Owner = Hashable  # a thread's ident or an asyncio task, as ``snapshot()`` names them


class Look:
    """One wait's looks: what it waits for, when the next look is due, whether the last
    one found a cycle, and the ``Lookout`` its looks publish its waits through, with the
    owner they are published as (set before the first look; ``stop`` takes them back when
    the wait ends, and keeps a look still under way from publishing them). ``deadline``:
    the wait's (None: none), which its looks never pass by more than ``_CANCEL_GRACE``.

    A cycle must be found by two looks in a row, ``LOOK_EVERY`` apart. A look puts together
    the waits of this process of a moment before and the server's as they are, and other
    processes' as they published them, up to a look old: waits that moved on meanwhile
    could make a cycle that was never all there at once. A deadlock stays; by the next
    look every waiter of it has published again. ``stamps``: the stamps of the sessions
    that had published at the last look answered (each ``pid << 32 | stamp``); the next
    look follows only sessions that published since."""

    __slots__ = ("deadline", "due", "found", "items", "lookout", "owner", "stamps", "stopped")

    def __init__(self, items: Sequence[tuple[Hashable, int]],
                 deadline: float | None = None) -> None:
        self.items = items
        self.deadline = deadline
        self.due = time.monotonic() + LOOK_EVERY
        self.found = False
        self.lookout: Lookout | None = None
        self.owner: Owner = None
        self.stamps: tuple[int, ...] = ()
        self.stopped = False

    def confirms(self, found: bool | None) -> bool:
        """Whether this look's answer, ``found``, confirms the last one's: a deadlock. A
        look without an answer (None) neither confirms nor forgets."""
        if found is None:
            return False
        confirmed, self.found = found and self.found, found
        return confirmed

    def stop(self) -> None:
        self.stopped = True  # first: a look under way (a task's, in a thread) sees it
        if self.lookout is not None:
            self.lookout.leave(self.owner)


class Waiting:
    """One in-process acquisition's wait check (``_PgEngine._acquire_in_process``): its
    ``Look`` is made at the first check, once the thread waits (the engines check only
    then), so that an acquisition that does not wait, the usual one, sets up no look."""

    __slots__ = ("deadline", "items", "look", "manager")

    def __init__(self, manager: _PgEngine[Any], items: Sequence[tuple[Hashable, int]],
                 deadline: float | None) -> None:
        self.manager = manager
        self.items = items
        self.deadline = deadline  # the wait's, which its looks keep (``Look``)
        self.look: Look | None = None

    def check(self) -> None:
        if self.look is None:
            self.look = Look(self.items, self.deadline)
        self.manager._look_while_waiting(self.look)


class Lookout:
    """A manager's connection for the looks of its waiters, threads and tasks alike, which
    publishes the waits of those that hold keys on the server (the only ones that can be in
    a cycle): one connection, whatever the number of waiters. Borrowed from the manager's
    idle connections at the first look; closed once no waiter's waits are published,
    which takes them back.

    A look talks on it under ``lock``, for one round trip; a look that finds it taken
    comes again later. ``lock`` is taken only by ``with`` (a signal handler's exception
    cannot come between taking it and the block that gives it back). Whoever gives it
    back closes the connection if nothing is published any more (``_close_if_idle``):
    a wait that ended while the lock was taken took its waits out without it.

    It also keeps what the looks of the manager's waiters need to know besides its
    ``trusted_roles`` (``cycle_question``): each thread's xact_lock records (a thread's
    own are in its ``_local``; tasks' are the manager's), and the transaction each thread
    or task waits in xact_lock on (before its first grant, no record says so), under
    ``owners_guard``: ``xact_backends``."""

    def __init__(self, trusted_roles: Iterable[str] = ()) -> None:
        self.trusted_roles = trusted_roles_checked(trusted_roles)
        self.lock = threading.Lock()
        self.link: _Link | None = None  # changed under ``lock``
        # By owner; changed under ``lock``, or popped by a leaving waiter without it.
        self.published: dict[Owner, list[tuple[int, int]]] = {}
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None  # tasks' looks
        self.stamp = 0  # the last publication's stamp; changed under ``lock``
        self.owners_guard = threading.Lock()
        self.thread_xact_locks: dict[int, tuple[weakref.ref[threading.Thread],
                                                list[_XactLock]]] = {}
        self.xact_waits: dict[Owner, int] = {}

    def note_xact_locks(self, records: list[_XactLock]) -> None:
        """``records`` are the calling thread's xact_lock records."""
        with self.owners_guard:
            self.thread_xact_locks[threading.get_ident()] = (
                weakref.ref(threading.current_thread()), records)

    def xact_waiting(self, conn: psycopg.Connection[Any]) -> list[Owner]:
        """The calling thread, and task if any, wait in xact_lock on ``conn`` until
        ``xact_waited``: the owners."""
        owners: list[Owner] = [threading.get_ident()]
        task = current_task_or_none()
        if task is not None:
            owners.append(task)
        with self.owners_guard:
            for owner in owners:
                self.xact_waits[owner] = conn.info.backend_pid
        return owners

    def xact_waited(self, owners: list[Owner]) -> None:
        with self.owners_guard:
            for owner in owners:
                self.xact_waits.pop(owner, None)

    def look(self, manager: _PgEngine[Any], look: Look) -> bool | None:
        """One look of the wait ``look`` (of ``look.owner``, in ``manager``): its waits
        published anew and the question answered; whether it found a cycle, or None
        without an answer (another look under way, the server silent or refusing).
        Blocking: a task runs it in ``executor``."""
        if self.lock.locked():
            return None
        try:
            with self.lock:
                return self._look(manager, look)
        finally:
            self._close_if_idle()

    def _look(self, manager: _PgEngine[Any], look: Look) -> bool | None:
        answer_by = time.monotonic() + LOOK_FOR
        if look.deadline is not None:
            answer_by = min(answer_by, look.deadline)
        if look.stopped or answer_by <= time.monotonic():
            return None
        owner = look.owner
        found = look_sql(manager, owner, look.stamps)
        if found is None:
            self.published.pop(owner, None)
            self._publish(manager, None, answer_by)
            return None
        pairs, question = found
        self.published[owner] = pairs
        answer = self._publish(manager, question, answer_by)
        if look.stopped:  # its wait ended meanwhile (a task's, in another thread)
            self.published.pop(owner, None)
            return None
        if answer is None:
            return None
        found_cycle, look.stamps = answer
        return found_cycle

    def leave(self, owner: Owner) -> None:
        """``owner``'s wait ended: its waits are published no more (the next look
        publishes without them; with nobody's left, the connection closes now)."""
        self.published.pop(owner, None)
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        """Close the connection if nothing is published, unless a look has the lock: it
        checks again when it gives it back."""
        if self.published or self.link is None or self.lock.locked():
            return
        with self.lock:
            if not self.published:
                self._close()

    def _publish(self, manager: _PgEngine[Any], question: str | None,
                 answer_by: float) -> tuple[bool, tuple[int, ...]] | None:
        """Publish every waiter's waits, under a new stamp, and answer ``question`` (None:
        no question), in one round trip, under ``lock``, by ``answer_by`` (a connect first
        included): the answer and the publishers' stamps it saw, or None if there is none."""
        if not self.published:
            self._close()
            return None
        self.stamp = (self.stamp + 1) % STAMPS
        try:
            if self.link is None:
                self.link, _ = manager._borrow(own=False, deadline=answer_by)
            result = self.link.run(
                publish_sql(list(self.published.values()), self.stamp)
                + (question or " SELECT false, NULL"), answer_by)
        except (psycopg.Error, LockError):  # (LockError: no connection, PgConnectionError)
            self._close()  # unanswered: nothing published (the next look publishes again)
            return None
        stamps = result.get_value(0, 1)
        return (result.get_value(0, 0) == b"t",
                tuple(int(stamp) for stamp in stamps.split(b",")) if stamps else ())

    def _close(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            link.close()

    def task_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """Where tasks' looks run: a thread of this lookout's own (a look must not wait
        behind the loop's other blocking work, nor fail once the loop's default
        executor is shut down)."""
        executor = self.executor
        if executor is None:
            executor = self.executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="lockmgr-look")
        return executor


def waits_in_process(states: Iterable[KeyState]) -> dict[Owner, set[Owner]]:
    """Who waits for whom in process, from engines' ``snapshot()``. A waiter waits for the
    holders and the requests queued ahead of it (served first) whose mode conflicts with
    its own (a read waits for no read); only the nearest are listed: from it back to the
    first write, which waits for everything ahead of it in turn (so a queue of n writers is
    n waits, not n squared)."""
    waits: dict[Owner, set[Owner]] = {}
    for state in states:
        ahead = [(holder.owner, holder.mode) for holder in state.holders]
        for waiter in state.waiters:
            waited_for = waits.setdefault(waiter.owner, set())
            for owner, mode in reversed(ahead):
                if owner == waiter.owner:
                    continue  # (its own read, under an upgrade)
                if "write" in (mode, waiter.mode):
                    waited_for.add(owner)
                if mode == "write":
                    break
            ahead.append((waiter.owner, waiter.mode))
    return waits


def blocking_connections(waits: dict[Owner, set[Owner]], backends: dict[Owner, set[int]],
                         waiter: Owner) -> set[int]:
    """The connections of the owners ``waiter`` waits for in process; through an owner
    without a connection, those of the owners it waits for in turn."""
    found: set[int] = set()
    seen = {waiter}
    todo = list(waits.get(waiter, ()))
    while todo:
        owner = todo.pop()
        if owner in seen:
            continue
        seen.add(owner)
        if backends.get(owner):
            found |= backends[owner]
        else:
            todo.extend(waits.get(owner, ()))
    return found


def cycle_question(waiter: Owner, waits: dict[Owner, set[Owner]],
                   backends: dict[Owner, set[int]], trusted_roles: Iterable[str] = (),
                   stamps: Iterable[int] = ()) -> tuple[list[tuple[int, int]], str] | None:
    """The waiter's waits to publish (two int keys each), and the question whose answers
    are whether it is in a cycle through the server, and the stamps of the sessions that
    published (``backends``: the backend pids of each owner's connections and of its open
    xact_lock transactions, whose locks are its too). Publications count only from
    sessions of this database logged in as this session's role or one of
    ``trusted_roles``, and, given the ``stamps`` of the last look, only those published
    since. None when it cannot be (it waits in process for no owner with a connection, or
    has none itself): nothing to publish."""
    start = blocking_connections(waits, backends, waiter)
    published = sorted((PUBLISHED + pid, other) for pid in backends.get(waiter, ())
                       if pid < PUBLISHABLE_PIDS for other in start)
    mine = backends.get(waiter, set())
    if not mine or not start:
        return None
    # This process's waits in process as pairs of connections, as they are now; those it
    # published (up to a look old) are left out, other processes' are followed.
    pairs = sorted({(pid, other) for owner, pids in backends.items() if owner in waits
                    for other in blocking_connections(waits, backends, owner) for pid in pids})
    here = sorted({pid for pids in backends.values() for pid in pids})
    return published, (
        # The sessions that published as lockmgr does, by the roles it trusts, and their stamps.
        " WITH RECURSIVE publisher(pid, stamp) AS ("
        "SELECT taken.pid, taken.objid::bigint FROM pg_catalog.pg_locks AS taken"
        " JOIN pg_catalog.pg_stat_activity AS activity ON activity.pid = taken.pid"
        f" WHERE {_TAKEN_AS_LOCKMGR_DOES} AND taken.classid::bigint = {STAMPED}"
        " AND (activity.usename = session_user"
        f" OR activity.usename = ANY ({_names(trusted_roles)}))),"
        " here(waiter, holder) AS ("
        # (unnest of two arrays is grammar only unqualified: ROWS FROM pairs them up)
        f"SELECT * FROM ROWS FROM (pg_catalog.unnest({_ints(p for p, _ in pairs)}),"
        f" pg_catalog.unnest({_ints(q for _, q in pairs)}))"
        f" UNION SELECT (taken.classid::bigint - {PUBLISHED})::int, taken.objid::int"
        " FROM pg_catalog.pg_locks AS taken"
        f" WHERE {_TAKEN_AS_LOCKMGR_DOES} AND taken.classid::bigint >= {PUBLISHED}"
        f" AND taken.classid::bigint < {PUBLISHED + PUBLISHABLE_PIDS}"
        f" AND (taken.classid::bigint - {PUBLISHED})::int <> ALL ({_ints(here)})"
        " AND taken.pid IN (SELECT pid FROM publisher"
        f" WHERE (pid::bigint << 32 | stamp) <> ALL ({_bigints(sorted(stamps))}))),"
        f" reach(pid) AS (SELECT pg_catalog.unnest({_ints(sorted(start))}) UNION"
        " SELECT next FROM reach,"
        " LATERAL (SELECT pg_catalog.unnest(pg_catalog.pg_blocking_pids(reach.pid))"
        " UNION ALL SELECT holder FROM here WHERE here.waiter = reach.pid) AS step(next))"
        f" SELECT EXISTS (SELECT 1 FROM reach WHERE pid = ANY ({_ints(sorted(mine))})),"
        " (SELECT pg_catalog.string_agg((pid::bigint << 32 | stamp)::text, ',') FROM publisher)")


# Advisory locks (``taken``) of two int keys taken shared and held, in this session's
# database: of these only, the reserved range's can be lockmgr's publications.
_TAKEN_AS_LOCKMGR_DOES = (
    "taken.locktype = 'advisory' AND taken.objsubid = 2 AND taken.granted"
    " AND taken.mode = 'ShareLock' AND taken.database = (SELECT oid"
    " FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())")


def publish_sql(published: Iterable[list[tuple[int, int]]], stamp: int) -> str:
    """What publishes the waits ``published`` (of every waiter of a ``Lookout``) under
    ``stamp``, and takes back any published before."""
    pairs = sorted({pair for pairs in published for pair in pairs})
    return "SELECT pg_catalog.pg_advisory_unlock_all();" + (
        " SELECT pg_catalog.pg_try_advisory_lock_shared(waiter, holder) FROM (VALUES "
        + ", ".join(f"({int(p)}, {int(q)})" for p, q in [*pairs, (STAMPED, stamp)])
        + ") AS wait(waiter, holder);" if pairs else "")


def _ints(values: Iterable[int]) -> str:
    return "ARRAY[" + ",".join(str(int(value)) for value in values) + "]::int[]"


def _bigints(values: Iterable[int]) -> str:
    return "ARRAY[" + ",".join(str(int(value)) for value in values) + "]::bigint[]"


def _names(names: Iterable[str]) -> str:
    """An SQL array of ``names`` (standard_conforming_strings is on: only quotes are
    doubled)."""
    return "ARRAY[" + ",".join("'" + name.replace("'", "''") + "'" for name in names) + "]::name[]"


def trusted_roles_checked(roles: Iterable[str]) -> tuple[str, ...]:
    """A manager's ``trusted_roles``, checked: TypeError or ValueError."""
    if isinstance(roles, (str, bytes)):
        raise TypeError(f"trusted_roles must be an iterable of role names, not {roles!r}")
    checked = tuple(roles)
    for role in checked:
        if not isinstance(role, str):
            raise TypeError(f"trusted_roles must name roles as str, not {role!r}")
        if not role or "\x00" in role:
            raise ValueError(f"trusted_roles names no role: {role!r}")
    return checked


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


def alone() -> bool:
    """Whether one manager was ever registered and lives on (the caller's: every manager
    registers as it is made, before any use): no other can hold anything. Without the
    lock, for every acquisition's check (``_elsewhere``): a manager made meanwhile on
    another thread holds nothing of the calling thread's."""
    return len(_MANAGERS) == 1


def register(manager: _PgEngine[Any]) -> None:
    with _MANAGERS_LOCK:
        _MANAGERS[:] = [ref for ref in _MANAGERS if ref() is not None] + [weakref.ref(manager)]


def managers_after_fork() -> list[_PgEngine[Any]]:
    """In a forked child: the managers, with the lock made anew (another thread of the
    parent may have held it)."""
    global _MANAGERS_LOCK
    _MANAGERS_LOCK = threading.Lock()
    return live_managers()


def look_sql(manager: _PgEngine[Any], owner: Owner, stamps: Iterable[int] = ()
             ) -> tuple[list[tuple[int, int]], str] | None:
    """``cycle_question`` for ``owner`` (a thread's ident or a task), waiting in
    ``manager``: from the waits in process of every PostgreSQL manager of this process,
    the connections they have to ``manager``'s server (whatever their DSN says: the
    server's pids are its own) and the transactions their owners took keys in with
    xact_lock, the roles ``manager`` trusts and the ``stamps`` of the owner's last look."""
    waits: dict[Owner, set[Owner]] = {}
    connections = [(other, connections_of(other)) for other in live_managers()]
    server = next((server for other, links in connections if other is manager
                   for _, _, server in links), None)
    if server is None:
        return None  # no owner of it has a connection: no cycle goes through the server
    backends: dict[Owner, set[int]] = {}
    for other, links in connections:
        for waiter, ahead in waits_in_process(other._engine.snapshot()).items():
            waits.setdefault(waiter, set()).update(ahead)
        for holder, pid, on in links:
            if on == server:
                backends.setdefault(holder, set()).add(pid)
        if other is manager or any(on == server for _, _, on in links):
            for holder, pids in xact_backends(other).items():
                backends.setdefault(holder, set()).update(pids)
    return cycle_question(owner, waits, backends, manager._lookout.trusted_roles, stamps)


def connections_of(manager: _PgEngine[Any]) -> list[tuple[Owner, int, bytes]]:
    """(owner, backend pid, server) of each connection a thread or task of ``manager``
    has."""
    with manager._guard:
        # (each link read once: its owner may drop it meanwhile, outside the guard)
        links: list[tuple[Owner, int, bytes]] = [
            (session.ident, link.backend, link.server)
            for session in manager._sessions if (link := session.link) is not None]
        tasks = manager._tasks
        if tasks is not None:
            links += [(task, link.backend, link.server)
                      for task, session in tasks.sessions.items()
                      if (link := session.link) is not None]
    return links


def xact_backends(manager: _PgEngine[Any]) -> dict[Owner, set[int]]:
    """The backend pids of the transactions still open in which a thread (its ident) or a
    task of ``manager`` took keys with its xact_lock, or waits in it, by owner: their
    locks are that owner's too, and their waits. The records of threads that ended go."""
    lookout = manager._lookout
    with lookout.owners_guard:
        threads = lookout.thread_xact_locks
        for ident, (thread, _) in list(threads.items()):
            alive = thread()
            if alive is None or not alive.is_alive():
                del threads[ident]
        owned: list[tuple[Owner, list[_XactLock]]] = [
            (ident, list(records)) for ident, (_, records) in threads.items()]
        waiting = list(lookout.xact_waits.items())
    with manager._guard:
        owned += [(task, list(records)) for task, records in manager._task_xact_locks.items()]
    found: dict[Owner, set[int]] = {owner: {pid} for owner, pid in waiting}
    for owner, records in owned:
        pids = {record.backend_pid for record in records if record.may_hold()}
        if pids:
            found.setdefault(owner, set()).update(pids)
    return found
