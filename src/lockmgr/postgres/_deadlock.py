"""Deadlocks through both layers.

A thread of this process waits *in process* for a key another owner here holds (a thread or
a task); that owner, or one it waits for in turn, waits *on the server* for another process,
which waits, perhaps through more processes, for a lock held on a connection of the first
thread. The in-process engine sees only the waits between this process's owners,
PostgreSQL's detector only the waits of connections: neither sees the whole cycle, and
without a timeout every member would wait for ever.

So a thread that has waited in process for ``LOOK_EVERY`` seconds looks for that cycle (its
wait check: ``lockmgr._owners.WAIT_CHECK``), and again every ``LOOK_EVERY`` seconds while it
waits. One question to the server does it: from the connections of the owners the thread
waits for (in process, directly or not), it follows ``pg_blocking_pids`` on the server and
the in-process waits of this process (handed over as pairs of backend pids) to a fixed
point, and asks whether a connection of the waiting thread is among those reached. A member
of any such cycle that waits in process finds it within ``LOOK_EVERY`` seconds of the cycle
closing, plus one round trip: the cycle's first in-process wait after a server wait that
leads into this process has its thread's connection at the end of the path. The question
is asked again to confirm (``SEEN_TWICE``).

What this does not see: a cycle that goes through the in-process waits of *two* processes
(each sees only its own), and an owner's wait in process of another engine than the PostgreSQL
managers' (a plain ``LockManager``). Give such calls a timeout.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from .._errors import DeadlockError

if TYPE_CHECKING:
    from .._observe import KeyState

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

Owner = Hashable  # a thread's ident or an asyncio task, as ``snapshot()`` names them


def waits_in_process(states: Iterable[KeyState]) -> dict[Owner, set[Owner]]:
    """Who waits for whom in process, from engines' ``snapshot()``: a waiter waits for the
    key's holders and for the requests queued ahead of it (they are served first)."""
    waits: dict[Owner, set[Owner]] = {}
    for state in states:
        ahead = [holder.owner for holder in state.holders]
        for waiter in state.waiters:
            waits.setdefault(waiter.owner, set()).update(
                owner for owner in ahead if owner != waiter.owner)
            ahead.append(waiter.owner)
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


def cycle_question(waiter: Owner, waits: dict[Owner, set[Owner]],
                   backends: dict[Owner, set[int]]) -> str | None:
    """The question whose answer is whether ``waiter`` is in a cycle through the server
    (``backends``: each owner's connections' backend pids), or None when it cannot be: it
    waits in process for no owner with a connection, or has none itself."""
    mine = backends.get(waiter, set())
    start = {pid for owner in reached(waits, waiter) for pid in backends.get(owner, ())}
    if not mine or not start:
        return None
    # The in-process waits as pairs of connections: an owner without one passes the waits
    # of those it waits for on to its own waiters (``reached``).
    pairs = sorted({(pid, other) for owner, pids in backends.items() if owner in waits
                    for ahead in reached(waits, owner) for other in backends.get(ahead, ())
                    for pid in pids})
    return (
        "WITH RECURSIVE here(waiter, holder) AS ("
        f"SELECT * FROM unnest({_ints(p for p, _ in pairs)}, {_ints(q for _, q in pairs)})),"
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
