"""Keys the calling owner holds through the process's other managers.

Each manager has its own in-process engine and its own connections: a thread (or task)
holding a key through one manager and asking another for it (a ``PgLockManager`` and a
``PgRWLockManager`` of one namespace, two managers of one DSN) passes the second one's
in-process engine, which knows nothing of the first's, and waits on the server for its
own session, for ever. What the calls of a thread or task own on the server is known
here, by the other managers' sessions of that owner: a call asking for a key its owner
holds so, in a conflicting mode, on the same server and database, is refused at once
(``DeadlockError``) before it changes anything.

Compared are advisory keys, not keys: two namespaces whose keys collide are one lock too.
The server is its postmaster's start and port (``_Link.server``: one running server) and
the database (advisory locks of two databases never conflict). A forked child's managers
hold none of the parent's keys (``_forget_parent_sessions``), so none are found."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from .._args import READ, WRITE
from .._errors import DeadlockError
from .._owners import current_task_or_none
from ._deadlock import Owner, alone, live_managers
from ._link import _round_trip_deadline
from ._session import _owner_kind

if TYPE_CHECKING:
    import asyncio

    from ._engine import _PgEngine
    from ._link import _Link
    from ._session import _Session


def refuse_own_locks_elsewhere(manager: _PgEngine[Any], session: _Session,
                               items: Sequence[tuple[Hashable, int]], deadline: float | None,
                               connect_by: float | None) -> None:
    """DeadlockError if the calling thread, or a task of the event loop it runs (none of
    which can run while the thread waits), holds one of ``items`` it does not hold through
    ``manager`` (its ``session``) through another manager, on this call's server and
    database: a wait for it would wait for itself. Without a connection yet, the session
    takes one to learn the server, as the call would (``attach_bounds``: a timed call's
    client timeout past them)."""
    if alone():
        return  # (the usual: no other manager in this process)
    fresh = [item for item in items if not session.levels.get(item)]
    if not fresh:
        return  # re-entered: no wait on the server
    task = current_task_or_none()
    owners = [(threading.get_ident(), False)] + ([] if task is None else [(task, True)])
    found = held_elsewhere(manager, owners, fresh, None if task is None else task.get_loop())
    if not found:
        return
    try:
        link = session.link if session.link is not None else manager._attach(session, deadline, connect_by)[0]
        refuse_waiting_for_oneself(found, link)
    finally:
        manager._return_if_idle(session)


def attach_bounds(started: float, seconds: float) -> tuple[float | None, float | None]:
    """How long a call started at ``started`` with ``seconds`` (a timed call or a wait)
    waits for a place under ``max_connections`` and when its connect gives up, as
    ``_lock_steps``: a timed call its deadline and its round trips'; a wait for ever, and
    its connect by its own bound."""
    if seconds < 0:
        return None, None
    deadline = started + seconds
    return deadline, _round_trip_deadline("timed", deadline)


def held_elsewhere(manager: _PgEngine[Any], owners: Sequence[tuple[Owner, bool]],
                   items: Sequence[tuple[Hashable, int]],
                   loop: asyncio.AbstractEventLoop | None = None
                   ) -> list[tuple[Hashable, Owner, _Link]]:
    """Of ``items`` ((key, mode) pairs ``manager`` is asked for), those that one of
    ``owners`` (the calling thread's ident and the current task, each with whether it is
    a task), or a task of ``loop``, holds, in a conflicting mode, on a connection of
    another manager of this process: (key, owner, that connection) each, whatever server
    it reaches."""
    if not items:
        return []
    others = [other for other in live_managers() if other is not manager]
    if not others:
        return []
    wanted = [(manager.advisory_key(key), key, mode) for key, mode in items]
    found = []
    for other in others:
        for owner, is_task in [*owners, *_tasks_of(other, loop, owners)]:
            session = _session_of(other, owner, is_task)
            link = None if session is None else session.link
            if session is None or link is None or not session.levels:
                continue
            held = {(other.advisory_key(key), mode) for (key, mode), levels
                    in list(session.levels.items()) if levels}
            found += [(key, owner, link) for ident, key, mode in wanted
                      if (ident, WRITE) in held or (mode == WRITE and (ident, READ) in held)]
    return found


def _tasks_of(manager: _PgEngine[Any], loop: asyncio.AbstractEventLoop | None,
              owners: Sequence[tuple[Owner, bool]]) -> list[tuple[Owner, bool]]:
    """The tasks of ``loop`` with a session of ``manager``'s, but ``owners``."""
    tasks = None if loop is None else manager._tasks
    if tasks is None:
        return []
    named = {owner for owner, _ in owners}
    return [(task, True) for task in list(tasks.sessions)
            if task.get_loop() is loop and task not in named]


def _session_of(manager: _PgEngine[Any], owner: Any, is_task: bool) -> _Session | None:
    """``owner``'s session with ``manager``: the calling thread's (its ident), or a task's."""
    if not is_task:
        return manager._session_or_none()
    tasks = manager._tasks
    return None if tasks is None else tasks.sessions.get(owner)


def refuse_waiting_for_oneself(found: list[tuple[Hashable, Owner, _Link]], link: _Link) -> None:
    """DeadlockError if a connection of ``found`` (``held_elsewhere``) reaches the server
    and database of ``link``, the connection the call would wait on, and lives: one the
    server ended holds nothing there any more (its owner finds the loss at its next call;
    busy, a task's release under way on it, it still holds)."""
    here = server_of(link)
    for key, owner, other in found:
        if here is not None and server_of(other) == here and other.idle_unless_busy() is not False:
            raise DeadlockError(
                f"the calling {_owner_kind(owner)} holds {key!r} through another manager of"
                " this process on the same server and database: waiting for it here would"
                " wait for that lock, and so for itself, for ever", [(owner, key)])


def server_of(link: _Link) -> tuple[bytes, bytes] | None:
    """The running server and the database ``link`` reaches (None once it is closed)."""
    try:
        database = link.pgconn.db
    except psycopg.Error:
        return None
    return (link.server, database) if database else None
